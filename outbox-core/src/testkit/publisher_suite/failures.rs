//! Events that fail alone: bad events (too large, for a missing destination, the broker's own
//! poison) fail with a permanent error in their position, and a failed event holds back the rest
//! of its aggregate while another aggregate goes on.

use std::collections::HashSet;

use uuid::Uuid;

use super::common::{event, failure, receive_ours, sized, SIZE_LIMIT};
use crate::error::ErrorKind;
use crate::testkit::{BrokerFixture, Setup};

/// One batch holding healthy events around a too-large one, one for a destination the broker does
/// not have, and the broker's own poison: every bad event fails alone with a permanent error of its
/// kind, in its position; the healthy ones are acknowledged and received, the bad ones never; the
/// publisher takes the next batch as before.
pub async fn bad_events_fail_alone(fx: &dyn BrokerFixture) {
    let missing = fx.missing_destination();
    let p = fx
        .build(Setup {
            max_message_bytes: Some(SIZE_LIMIT),
            allowed_destinations: vec![missing.clone()],
            ..Setup::default()
        })
        .await
        .publisher;
    let first = event("healthy-1", 0);
    let too_large = sized("too-large", 2 * SIZE_LIMIT);
    let mut lost = event("lost", 0);
    lost.destination = Some(missing.clone());
    let mut batch = vec![first.clone(), too_large, lost];
    let limit = SIZE_LIMIT.to_string();
    let mut expected = vec![
        (
            ErrorKind::PayloadTooLarge,
            "a too-large event".to_string(),
            limit.as_str(),
        ),
        (
            ErrorKind::DestinationNotFound,
            format!("an event for the missing destination {missing}"),
            missing.as_str(),
        ),
    ];
    // Where each bad event sits in the batch; a healthy event follows each of the broker's poison
    // events, so that an outcome mapped to the wrong entry shows.
    let mut bad_at = vec![1, 2];
    let mut healthy = vec![first.id];
    let poison = fx.poison();
    for (n, (e, kind, text)) in poison.iter().enumerate() {
        expected.push((*kind, format!("poison {kind:?} ({})", e.aggregate_id), text));
        bad_at.push(batch.len());
        batch.push(e.clone());
        let between = event(&format!("healthy-after-poison-{n}"), 0);
        healthy.push(between.id);
        batch.push(between);
    }
    let last = event("healthy-2", 0);
    healthy.push(last.id);
    batch.push(last);
    let outcomes = p.publish(&batch).await;
    assert_eq!(
        outcomes.len(),
        batch.len(),
        "one outcome per event, in order"
    );
    for (i, (e, o)) in batch.iter().zip(&outcomes).enumerate() {
        if healthy.contains(&e.id) {
            assert!(
                o.is_ok(),
                "the healthy event #{i} of the batch is acknowledged: {outcomes:?}"
            );
        }
    }
    for ((kind, what, named), i) in expected.iter().zip(&bad_at) {
        let (got, retryable, text) = failure(&outcomes, *i);
        assert_eq!(
            (got, retryable),
            (*kind, false),
            "{what} fails alone with a permanent {kind:?} error: {text}"
        );
        assert!(
            text.contains(named),
            "the error of {what} says {named:?}: {text}"
        );
    }
    // The publisher survived the bad events: the next batch goes through.
    let after = event("healthy-3", 0);
    let out = p.publish(std::slice::from_ref(&after)).await;
    assert!(out[0].is_ok(), "the batch after the bad events: {out:?}");
    let ours: HashSet<Uuid> = batch.iter().chain([&after]).map(|e| e.id).collect();
    let healthy: HashSet<Uuid> = healthy.into_iter().chain([after.id]).collect();
    let got: HashSet<Uuid> = receive_ours(fx, &ours, &healthy)
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(got, healthy, "the healthy events arrive, and nothing else");
}

/// A batch whose first event of aggregate A fails: the later event of A in the same call is not
/// sent (a retryable failure, for the relay to publish after the failed one), while aggregate B's
/// event is acknowledged and received.
pub async fn a_failed_event_holds_back_its_aggregate(fx: &dyn BrokerFixture) {
    let p = fx
        .build(Setup {
            max_message_bytes: Some(SIZE_LIMIT),
            ..Setup::default()
        })
        .await
        .publisher;
    let aggregate = format!("fenced-{}", Uuid::now_v7().simple());
    let failed = sized(&aggregate, 2 * SIZE_LIMIT);
    let held = event(&aggregate, 1);
    let other = event("unfenced", 0);
    let batch = vec![failed, held.clone(), other.clone()];
    let outcomes = p.publish(&batch).await;
    assert_eq!(outcomes.len(), 3, "one outcome per event");
    let (kind, retryable, text) = failure(&outcomes, 0);
    assert_eq!(
        (kind, retryable),
        (ErrorKind::PayloadTooLarge, false),
        "{text}"
    );
    let (_, retryable, text) = failure(&outcomes, 1);
    assert!(
        retryable,
        "the event after a failed one of its aggregate is held back, retryably: {text}"
    );
    assert!(
        outcomes[2].is_ok(),
        "another aggregate goes on: {outcomes:?}"
    );
    let ours: HashSet<Uuid> = batch.iter().map(|e| e.id).collect();
    let got: Vec<Uuid> = receive_ours(fx, &ours, &[other.id].into())
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(
        got,
        vec![other.id],
        "the held-back event never reaches the broker"
    );
}
