//! What the suite's checks share: its time limits and size limit, the sample event, and helpers
//! that read back what a consumer received and what a failed event's outcome says.

use std::collections::HashSet;
use std::time::Duration;

use chrono::Utc;
use uuid::Uuid;

use crate::error::ErrorKind;
use crate::event::{header, Event, JSON_CONTENT_TYPE};
use crate::ports::PublishOutcome;
use crate::testkit::{PublisherFixture, Received};

/// How long the suite waits for messages to arrive at the consumer.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The message size limit the suite sets where it needs an event to be too large.
pub const SIZE_LIMIT: usize = 2048;

/// How long a broker that was brought back has to take events again.
pub const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// A ready-to-publish event, as the store would return it.
pub fn event(aggregate_id: &str, n: usize) -> Event {
    Event {
        id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "order.updated".into(),
        payload: serde_json::json!({"aggregate": aggregate_id, "n": n})
            .to_string()
            .into_bytes(),
        content_type: JSON_CONTENT_TYPE.into(),
        headers: [
            (
                header::TRACEPARENT.to_string(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
            ),
            ("x-tenant".to_string(), "acme".to_string()),
        ]
        .into_iter()
        .collect(),
        destination: None,
        created_at: Utc::now(),
        attempts: 0,
    }
}

/// Waits until every id of `expected` was received (at most [`RECEIVE_TIMEOUT`]), then for a quiet
/// second; returns what was received of `ours` (ids the check published), in arrival order.
pub(super) async fn receive_ours(
    fx: &dyn PublisherFixture,
    ours: &HashSet<Uuid>,
    expected: &HashSet<Uuid>,
) -> Vec<Received> {
    let deadline = tokio::time::Instant::now() + RECEIVE_TIMEOUT;
    loop {
        let got = fx.receive(0, Duration::ZERO).await;
        let seen: HashSet<Uuid> = got.iter().filter_map(|r| r.event_id).collect();
        if expected.is_subset(&seen) || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    crate::testkit::read_until_quiet(|| fx.receive(0, Duration::ZERO))
        .await
        .into_iter()
        .filter(|r| r.event_id.is_some_and(|id| ours.contains(&id)))
        .collect()
}

/// The error of outcome `i`, with its kind and whether it is retryable.
pub(super) fn failure(outcomes: &[PublishOutcome], i: usize) -> (ErrorKind, bool, String) {
    match &outcomes[i] {
        Ok(()) => panic!("event #{i} must fail, and was acknowledged: {outcomes:?}"),
        Err(e) => (e.kind(), e.is_retryable(), e.to_string()),
    }
}

/// An event of `aggregate` whose payload is `bytes` long.
pub(super) fn sized(aggregate: &str, bytes: usize) -> Event {
    let mut e = event(aggregate, 0);
    e.payload = vec![b'x'; bytes];
    e
}
