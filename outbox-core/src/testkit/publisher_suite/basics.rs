//! The checks any [`PublisherFixture`] supports: an empty batch, the readiness check, and a batch
//! acknowledged in order and received with everything the event carries.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::common::{event, RECEIVE_TIMEOUT};
use crate::event::header;
use crate::testkit::{PublisherFixture, Received};

/// An empty batch yields no outcome and publishes nothing.
pub async fn empty_batch_has_no_outcomes(fx: &dyn PublisherFixture) {
    let p = fx.publisher().await;
    assert!(
        p.publish(&[]).await.is_empty(),
        "an empty batch must yield no outcome"
    );
}

/// `check()` succeeds against a reachable broker.
pub async fn check_succeeds(fx: &dyn PublisherFixture) {
    let p = fx.publisher().await;
    p.check()
        .await
        .expect("check() must succeed against a reachable broker");
}

/// 60 events over 6 aggregates: one `Ok` per event in input order, every event received once with its
/// id, type, aggregate id, payload and headers, and each aggregate's events in order. `already` is
/// the number of messages the fixture received before this check. Returns the number published.
pub async fn batch_is_acknowledged_and_received_in_order(
    fx: &dyn PublisherFixture,
    already: usize,
) -> usize {
    let p = fx.publisher().await;
    let mut events = Vec::new();
    for n in 0..10 {
        for a in 0..6 {
            events.push(event(&format!("agg-{a}"), n));
        }
    }
    let outcomes = p.publish(&events).await;
    assert_eq!(outcomes.len(), events.len(), "one outcome per event");
    for (e, o) in events.iter().zip(&outcomes) {
        assert!(o.is_ok(), "event {} must be acknowledged: {:?}", e.id, o);
    }
    let received = fx.receive(already + events.len(), RECEIVE_TIMEOUT).await;
    let ours: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let mine: Vec<&Received> = received
        .iter()
        .filter(|r| r.event_id.is_some_and(|id| ours.contains(&id)))
        .collect();
    let by_id: HashMap<Uuid, &Received> = mine
        .iter()
        .map(|r| (r.event_id.unwrap_or_default(), *r))
        .collect();
    assert_eq!(
        by_id.len(),
        events.len(),
        "every acknowledged event must be received (got {} of {})",
        by_id.len(),
        events.len()
    );
    for e in &events {
        let r = by_id[&e.id];
        assert_eq!(r.payload, e.payload, "payload of {}", e.id);
        assert_eq!(
            r.event_type.as_deref(),
            Some(e.event_type.as_str()),
            "event type of {}",
            e.id
        );
        assert_eq!(
            r.aggregate_id.as_deref(),
            Some(e.aggregate_id.as_str()),
            "aggregate id of {}",
            e.id
        );
        assert_eq!(
            r.headers.get(header::TRACEPARENT),
            e.headers.get(header::TRACEPARENT),
            "traceparent of {}",
            e.id
        );
        assert_eq!(
            r.headers.get("x-tenant").map(String::as_str),
            Some("acme"),
            "custom header of {}",
            e.id
        );
    }
    let mut last: HashMap<String, usize> = HashMap::new();
    let index: HashMap<Uuid, usize> = events.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    for r in &mine {
        let i = index[&r.event_id.unwrap_or_default()];
        let agg = events[i].aggregate_id.clone();
        if let Some(prev) = last.insert(agg.clone(), i) {
            assert!(
                prev < i,
                "aggregate {agg}: event #{i} received after #{prev}"
            );
        }
    }
    events.len()
}
