//! What becomes of published, failing, back-pressured and timed-out events: retries, dead
//! letters, and an aggregate held back behind its failure while the others go on.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{assert_complete_and_ordered, config, fill};
use crate::testkit::{Behavior, EventStatus, MemoryStore, ScriptedPublisher};
use crate::{
    CancellationToken, Error, Event, OrderingPolicy, PublishOutcome, Publisher, Relay, RelayConfig,
};

#[tokio::test(start_paused = true)]
async fn drains_everything_in_aggregate_order() {
    let store = MemoryStore::new();
    let written = fill(&store, 7, 9);
    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.published, 63);
    assert_eq!(store.pending(), 0);
    let delivered = publisher.delivered();
    assert_eq!(
        delivered.len(),
        63,
        "each event exactly once when nothing fails"
    );
    assert_complete_and_ordered(&written, &delivered);
    assert!(publisher.calls() >= 7, "batches of at most 10 events");
}

#[tokio::test(start_paused = true)]
async fn retryable_failure_holds_back_only_its_aggregate() {
    let store = MemoryStore::new();
    let written = fill(&store, 3, 5);
    // Event #1 of aggregate a1 (index 1*3 + 1 = 4) fails twice, then succeeds.
    let failing = written[4];
    let publisher = ScriptedPublisher::new();
    publisher.on_event(failing, Behavior::FailRetryableTimes(2));
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();

    relay.drain().await;
    let delivered = publisher.delivered();
    let a1: Vec<&Event> = delivered
        .iter()
        .filter(|e| e.aggregate_id == "a1")
        .collect();
    assert_eq!(
        a1.len(),
        1,
        "only a1's first event may pass before the failing one"
    );
    assert_eq!(
        delivered.iter().filter(|e| e.aggregate_id != "a1").count(),
        10,
        "other aggregates are not delayed"
    );
    let st = store.get(failing).unwrap();
    assert_eq!((st.status, st.attempts), (EventStatus::Pending, 1));
    assert!(st
        .last_error
        .unwrap()
        .contains("scripted retryable failure"));

    tokio::time::advance(Duration::from_millis(1100)).await;
    relay.drain().await;
    assert_eq!(store.get(failing).unwrap().attempts, 2);
    tokio::time::advance(Duration::from_millis(2100)).await;
    relay.drain().await;
    assert_eq!(store.pending(), 0);
    let delivered = publisher.delivered();
    assert_eq!(delivered.len(), 15);
    assert_complete_and_ordered(&written, &delivered);
}

#[tokio::test(start_paused = true)]
async fn exhausted_attempts_dead_letter_with_last_error() {
    let store = MemoryStore::new();
    let written = fill(&store, 2, 3);
    let publisher = ScriptedPublisher::new();
    publisher.on_event(written[0], Behavior::FailRetryable);
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    for _ in 0..5 {
        relay.drain().await;
        tokio::time::advance(Duration::from_secs(11)).await;
    }
    assert_eq!(store.dead_letters(), vec![written[0]]);
    let st = store.get(written[0]).unwrap();
    assert_eq!(st.attempts, 3);
    let err = st.last_error.unwrap();
    assert!(
        err.starts_with("gave up after 3 attempts: connection (persistent)"),
        "{err}"
    );
    assert_eq!(publisher.tries(written[0]), 3);
    // a0's later events are held back behind the dead letter; a1 is complete.
    assert_eq!(store.pending(), 2);
    assert_eq!(
        publisher
            .delivered()
            .iter()
            .filter(|e| e.aggregate_id == "a1")
            .count(),
        3
    );
    // An operator retries the dead letter once the broker is fixed: everything flows, in order.
    publisher.clear_rules();
    store.retry_dead_letters();
    relay.drain().await;
    assert_eq!(store.pending(), 0);
    assert_complete_and_ordered(&written, &publisher.delivered());
}

#[tokio::test(start_paused = true)]
async fn permanent_failure_dead_letters_at_once() {
    let store = MemoryStore::new();
    let written = fill(&store, 4, 2);
    let publisher = ScriptedPublisher::new();
    publisher.on_aggregate("a2", Behavior::FailPermanent);
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.dead_lettered, 1);
    assert_eq!(store.dead_letters(), vec![written[2]]);
    assert_eq!(store.get(written[2]).unwrap().attempts, 1);
    assert_eq!(
        publisher.delivered().len(),
        6,
        "the other three aggregates are complete"
    );
}

#[tokio::test(start_paused = true)]
async fn unordered_mode_does_not_hold_back() {
    let store = MemoryStore::new();
    let written = fill(&store, 1, 4);
    let publisher = ScriptedPublisher::new();
    publisher.on_event(written[0], Behavior::FailRetryable);
    publisher.set_fencing(false);
    let cfg = RelayConfig {
        ordering: OrderingPolicy::Unordered,
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    relay.drain().await;
    assert_eq!(
        publisher.delivered().len(),
        3,
        "later events of the aggregate pass in unordered mode"
    );
}

/// Back-pressure is a reason to wait: the event goes back unchanged (no attempt, no error kept)
/// and claiming pauses, from 50 ms doubling to 1 s, instead of trying again at once.
#[tokio::test(start_paused = true)]
async fn backpressure_counts_no_attempt_and_pauses_claims() {
    let store = MemoryStore::new();
    let written = fill(&store, 1, 1);
    let publisher = ScriptedPublisher::new();
    publisher.on_event(written[0], Behavior::Backpressure);
    let relay = Arc::new(Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap());
    let shutdown = CancellationToken::new();
    let run = {
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        tokio::spawn(async move { relay.run(shutdown).await })
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let st = store.get(written[0]).unwrap();
    assert_eq!(
        (st.status, st.attempts, st.last_error),
        (EventStatus::Pending, 0, None),
        "the event is as it was written"
    );
    // Pauses of 50, 100, 200, 400, 800 ms, then 1 s: about 13 tries in 10 s; without the pause,
    // thousands.
    let tries = publisher.tries(written[0]);
    assert!((5..=20).contains(&tries), "{tries} tries in 10 s");
    publisher.clear_rules();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(store.pending(), 0);
    shutdown.cancel();
    let summary = run.await.unwrap();
    assert_eq!((summary.published, summary.retried), (1, 0), "{summary:?}");
}

struct WrongCount;

#[async_trait]
impl Publisher for WrongCount {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        vec![Ok(()); events.len().saturating_sub(1)]
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
    fn name(&self) -> &str {
        "wrong-count"
    }
}

#[tokio::test(start_paused = true)]
async fn a_publisher_returning_the_wrong_number_of_outcomes_loses_nothing() {
    let store = MemoryStore::new();
    let written = fill(&store, 2, 2);
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(WrongCount), config()).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.published, 0);
    assert_eq!(store.pending(), 4);
    let st = store.get(written[0]).unwrap();
    assert_eq!(st.attempts, 1);
    assert!(st
        .last_error
        .unwrap()
        .contains("returned 1 outcomes for 2 events"));
}

#[tokio::test(start_paused = true)]
async fn slow_publish_times_out_as_retryable() {
    let store = MemoryStore::new();
    let written = fill(&store, 1, 1);
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(Duration::from_secs(60));
    let cfg = RelayConfig {
        publish_timeout: Duration::from_secs(5),
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    relay.drain().await;
    let st = store.get(written[0]).unwrap();
    assert_eq!((st.status, st.attempts), (EventStatus::Pending, 1));
    assert!(st.last_error.unwrap().starts_with("timeout (temporary)"));
}
