//! How a batch is split into publish calls: one event per aggregate per call for a publisher that
//! does not keep order, whole runs for one that does, no call past `publish_timeout`, and a timeout
//! below the publisher's own limit refused at start.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use super::{config, fill, spawn};
use crate::testkit::{sample_event, Behavior, EventStatus, MemoryStore, ScriptedPublisher};
use crate::{Error, ErrorKind, Event, PublishOutcome, Publisher, Relay, RelayConfig};

/// A publisher whose events fail one by one (a RabbitMQ queue nacking one message and acking the
/// next): the relay hands it one event per aggregate per call, and the next event of an aggregate only
/// once the earlier one was acknowledged, so a later event is never acknowledged ahead of an earlier
/// one that failed.
#[tokio::test(start_paused = true)]
async fn a_publisher_that_fails_events_one_by_one_gets_each_aggregate_one_event_per_call() {
    let store = MemoryStore::new();
    let written = fill(&store, 2, 3); // a0#0 a1#0 a0#1 a1#1 a0#2 a1#2
    let publisher = ScriptedPublisher::new();
    publisher.set_fencing(false);
    publisher.on_event(written[2], Behavior::FailRetryable); // a0#1
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let (task, shutdown) = spawn(relay);
    let deadline = Instant::now() + Duration::from_secs(5);
    while publisher.delivered().len() < 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    // a0#2 was never handed to the broker while a0#1 was failing; a1 went through in three calls.
    assert_eq!(
        publisher.tries(written[4]),
        0,
        "a later event was sent with a failing one"
    );
    assert_eq!(publisher.tries(written[2]), 1);
    let delivered: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    assert_eq!(
        delivered,
        vec![written[0], written[1], written[3], written[5]]
    );
    assert_eq!(store.get(written[4]).unwrap().attempts, 0);
    assert_eq!(publisher.calls(), 3);
}

/// A publisher that keeps an aggregate's order within a call gets the whole run in one call.
#[tokio::test(start_paused = true)]
async fn a_publisher_that_keeps_order_gets_whole_runs_in_one_call() {
    let store = MemoryStore::new();
    fill(&store, 2, 3);
    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.published, 6);
    assert_eq!(publisher.calls(), 1);
}

/// A publisher that keeps an aggregate's order only among events of one destination (as Kafka does
/// within a topic): each call's events are recorded; the events in `fail` fail once, and a failure
/// stops the later events of its aggregate in the same call.
#[derive(Default)]
struct PerDestination {
    calls: std::sync::Mutex<Vec<Vec<Uuid>>>,
    fail: std::sync::Mutex<std::collections::HashSet<Uuid>>,
}

#[async_trait]
impl Publisher for PerDestination {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        self.calls
            .lock()
            .unwrap()
            .push(events.iter().map(|e| e.id).collect());
        let mut fence = crate::publishers::Fence::new();
        events
            .iter()
            .map(|e| {
                if fence.holds(e) {
                    Err(crate::publishers::Fence::not_sent("test"))
                } else if self.fail.lock().unwrap().remove(&e.id) {
                    fence.close(e);
                    Err(Error::new(ErrorKind::Connection, "refused once"))
                } else {
                    Ok(())
                }
            })
            .collect()
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
    fn name(&self) -> &str {
        "per-destination"
    }
    fn keeps_order(&self) -> bool {
        true
    }
    fn same_call(&self, earlier: &Event, later: &Event) -> bool {
        earlier.destination == later.destination
    }
}

/// An aggregate's run goes in one call while its events share a destination, and on in the next
/// call from the first event routed elsewhere; a failure there holds the rest of the run back
/// until it is published, in order.
#[tokio::test(start_paused = true)]
async fn a_run_is_split_into_calls_where_its_destination_changes() {
    let store = MemoryStore::new();
    let dests = ["a", "a", "b", "b", "a"];
    let mut events: Vec<_> = dests
        .iter()
        .enumerate()
        .map(|(n, d)| sample_event("x", n).with_destination(*d))
        .collect();
    events.extend((0..3).map(|n| sample_event("y", n)));
    let written = store.push(events).unwrap();
    let publisher = Arc::new(PerDestination::default());
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.published, 8);
    let calls = publisher.calls.lock().unwrap().clone();
    let w = &written;
    assert_eq!(
        calls,
        vec![
            vec![w[0], w[1], w[5], w[6], w[7]],
            vec![w[2], w[3]],
            vec![w[4]]
        ]
    );

    // The same, the first event for "b" failing once: neither it nor anything after it goes
    // before it is published.
    let store = MemoryStore::new();
    let mut events: Vec<_> = dests
        .iter()
        .enumerate()
        .map(|(n, d)| sample_event("x", n).with_destination(*d))
        .collect();
    events.truncate(5);
    let written = store.push(events).unwrap();
    let publisher = Arc::new(PerDestination::default());
    publisher.fail.lock().unwrap().insert(written[2]);
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let (task, shutdown) = spawn(relay);
    let deadline = Instant::now() + Duration::from_secs(60);
    while store.get(written[4]).map(|s| s.status) != Some(EventStatus::Processed)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    let calls = publisher.calls.lock().unwrap().clone();
    let w = &written;
    assert_eq!(
        calls,
        vec![
            vec![w[0], w[1]],
            vec![w[2], w[3]],
            vec![w[2], w[3]],
            vec![w[4]]
        ]
    );
}

/// Once `publish_timeout` has passed since a batch's first call, no further call starts: what is
/// left comes back as back-pressure, with no attempt counted, and is published later in order.
#[tokio::test(start_paused = true)]
async fn later_calls_of_a_batch_do_not_start_past_the_publish_timeout() {
    let store = MemoryStore::new();
    let written = fill(&store, 1, 3);
    let publisher = ScriptedPublisher::new();
    publisher.set_fencing(false);
    publisher.set_latency(Duration::from_secs(3));
    let cfg = RelayConfig {
        publish_timeout: Duration::from_secs(5),
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    let deadline = Instant::now() + Duration::from_secs(60);
    while publisher.delivered().len() < 3 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    let delivered: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    assert_eq!(delivered, written);
    for id in &written {
        assert_eq!(publisher.tries(*id), 1, "an event was sent twice");
        assert_eq!(store.get(*id).map(|s| s.attempts).unwrap_or(0), 0);
    }
}

struct Limited;

#[async_trait]
impl Publisher for Limited {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        vec![Ok(()); events.len()]
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
    fn name(&self) -> &str {
        "limited"
    }
    fn call_limit(&self) -> Option<crate::CallLimit> {
        Some(crate::CallLimit {
            limit: Duration::from_secs(40),
            settings: "limited.delivery_timeout 35s + 5s".into(),
        })
    }
}

/// A relay timeout that would cut a call short before the publisher's own limit is refused at start,
/// naming both settings; the defaults are coherent.
#[test]
fn a_publish_timeout_below_the_publishers_own_limit_is_refused() {
    let short = RelayConfig {
        publish_timeout: Duration::from_secs(30),
        ..RelayConfig::default()
    };
    let err = Relay::new(Arc::new(MemoryStore::new()), Arc::new(Limited), short).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(
        err.message().contains("relay.publish_timeout = 30s"),
        "{err}"
    );
    assert!(err.message().contains("limited.delivery_timeout"), "{err}");
    Relay::new(
        Arc::new(MemoryStore::new()),
        Arc::new(Limited),
        RelayConfig::default(),
    )
    .unwrap();
}
