//! Relay engine tests over the in-memory store and scripted publishers, on tokio's paused clock.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use crate::testkit::{sample_event, Behavior, EventStatus, MemoryStore, ScriptedPublisher};
use crate::{
    CancellationToken, Error, ErrorKind, Event, OrderingPolicy, PublishOutcome, Publisher, Relay,
    RelayConfig, RetryPolicy,
};

fn config() -> RelayConfig {
    RelayConfig {
        batch_size: 10,
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(10),
            multiplier: 2.0,
            jitter: 0.0,
        },
        ..RelayConfig::default()
    }
}

/// Runs `relay` in a task until the returned token is cancelled.
fn spawn(
    relay: Relay,
) -> (
    tokio::task::JoinHandle<crate::RelaySummary>,
    CancellationToken,
) {
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    (tokio::spawn(async move { relay.run(s).await }), shutdown)
}

fn fill(store: &MemoryStore, aggregates: usize, per: usize) -> Vec<Uuid> {
    let mut events = Vec::new();
    for n in 0..per {
        for a in 0..aggregates {
            events.push(sample_event(&format!("a{a}"), n));
        }
    }
    store.push(events).unwrap()
}

/// Asserts that, per aggregate, the delivered events keep insertion order (duplicates allowed only
/// as re-deliveries of a suffix) and that every written id was delivered.
fn assert_complete_and_ordered(written: &[Uuid], delivered: &[Event]) {
    let pos: HashMap<Uuid, usize> = written.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for e in delivered {
        let i = pos[&e.id];
        if let Some(prev) = last.insert(e.aggregate_id.as_str(), i) {
            assert!(
                prev < i,
                "aggregate {}: event #{i} delivered after #{prev}",
                e.aggregate_id
            );
        }
    }
    for id in written {
        assert!(
            delivered.iter().any(|e| e.id == *id),
            "event {id} never delivered"
        );
    }
}

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

#[tokio::test(start_paused = true)]
async fn backpressure_does_not_count_attempts() {
    let store = MemoryStore::new();
    let written = fill(&store, 1, 1);
    let publisher = ScriptedPublisher::new();
    publisher.on_event(written[0], Behavior::Backpressure);
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), config()).unwrap();
    for _ in 0..5 {
        relay.drain().await;
        tokio::time::advance(Duration::from_secs(2)).await;
    }
    let st = store.get(written[0]).unwrap();
    assert_eq!((st.status, st.attempts), (EventStatus::Pending, 0));
    assert!(publisher.tries(written[0]) >= 5);
    publisher.clear_rules();
    relay.drain().await;
    assert_eq!(store.pending(), 0);
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

#[tokio::test(start_paused = true)]
async fn wake_ends_the_idle_pause() {
    let store = MemoryStore::new();
    let publisher = ScriptedPublisher::new();
    let cfg = RelayConfig {
        poll_interval: Duration::from_secs(3600),
        min_poll_interval: Duration::from_secs(3600),
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let wake = relay.wake_handle();
    let (task, shutdown) = spawn(relay);
    tokio::time::sleep(Duration::from_secs(1)).await; // the relay is now in its one-hour pause
    let started = Instant::now();
    fill(&store, 1, 1);
    wake.wake();
    while publisher.delivered().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "woken relay must not wait for the poll interval: {:?}",
        started.elapsed()
    );
    shutdown.cancel();
    let summary = task.await.unwrap();
    assert_eq!(summary.published, 1);
}

/// A store that counts its claims.
#[derive(Clone)]
struct Counting(MemoryStore, Arc<AtomicUsize>);

/// Counts claims, and of them the probes of an unreachable broker (one event, flagged).
struct Probing(MemoryStore, Arc<AtomicUsize>, Arc<AtomicUsize>);

#[async_trait]
impl crate::Store for Probing {
    async fn claim(&self, r: crate::ClaimRequest) -> Result<crate::Batch, Error> {
        self.1.fetch_add(1, Ordering::SeqCst);
        if r.probe {
            assert_eq!(r.limit, 1, "a probe claims one event");
            self.2.fetch_add(1, Ordering::SeqCst);
        }
        self.0.claim(r).await
    }
    async fn stats(&self) -> Result<crate::StoreStats, Error> {
        self.0.stats().await
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[async_trait]
impl crate::Store for Counting {
    async fn claim(&self, r: crate::ClaimRequest) -> Result<crate::Batch, Error> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.claim(r).await
    }
    async fn stats(&self) -> Result<crate::StoreStats, Error> {
        self.0.stats().await
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn idle_polling_backs_off_to_the_poll_interval() {
    let claims = Arc::new(AtomicUsize::new(0));
    let store = Counting(MemoryStore::new(), claims.clone());
    let cfg = RelayConfig {
        poll_interval: Duration::from_secs(1),
        min_poll_interval: Duration::from_millis(10),
        ..config()
    };
    let relay = Relay::new(Arc::new(store), ScriptedPublisher::new(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    tokio::time::sleep(Duration::from_secs(60)).await;
    shutdown.cancel();
    task.await.unwrap();
    let n = claims.load(Ordering::SeqCst);
    // 10ms, 20ms, ... 640ms, then 1 s pauses: about 8 + 59 claims in a minute, never 6,000.
    assert!(
        (50..=80).contains(&n),
        "idle relay claimed {n} times in 60 s"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_in_flight_batches_finish_before_the_deadline() {
    let store = MemoryStore::new();
    fill(&store, 5, 1);
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(Duration::from_secs(10));
    let cfg = RelayConfig {
        shutdown_timeout: Duration::from_secs(30),
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.leased(), 5, "the batch is in flight");
    shutdown.cancel();
    let summary = task.await.unwrap();
    assert_eq!(summary.published, 5);
    assert_eq!(summary.aborted_batches, 0);
    assert_eq!(store.pending(), 0);
}

#[tokio::test(start_paused = true)]
async fn shutdown_deadline_releases_what_is_still_in_flight() {
    let store = MemoryStore::new();
    fill(&store, 5, 1);
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(Duration::from_secs(600));
    let cfg = RelayConfig {
        shutdown_timeout: Duration::from_secs(3),
        publish_timeout: Duration::from_secs(3600),
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = Instant::now();
    shutdown.cancel();
    let summary = task.await.unwrap();
    assert!(
        asked.elapsed() <= Duration::from_secs(4),
        "stopped after {:?}",
        asked.elapsed()
    );
    assert_eq!(summary.aborted_batches, 1);
    assert_eq!(store.leased(), 0, "aborted batches release their events");
    assert_eq!(store.pending(), 5, "nothing lost");
    let st = store.get(
        store
            .dead_letters()
            .first()
            .copied()
            .unwrap_or_else(Uuid::nil),
    );
    assert!(st.is_none());
}

/// Records how many calls are in flight at once, and every aggregate found in two calls in flight
/// at the same time.
#[derive(Default)]
struct Concurrency {
    now: AtomicUsize,
    max: AtomicUsize,
    in_flight: std::sync::Mutex<HashMap<String, usize>>,
    shared: std::sync::Mutex<Vec<String>>,
}

#[async_trait]
impl Publisher for Concurrency {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(n, Ordering::SeqCst);
        let aggregates: std::collections::BTreeSet<String> =
            events.iter().map(|e| e.aggregate_id.clone()).collect();
        {
            let mut in_flight = self.in_flight.lock().unwrap();
            for a in &aggregates {
                let calls = in_flight.entry(a.clone()).or_insert(0);
                if *calls > 0 {
                    self.shared.lock().unwrap().push(a.clone());
                }
                *calls += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        {
            let mut in_flight = self.in_flight.lock().unwrap();
            for a in &aggregates {
                if let Some(calls) = in_flight.get_mut(a) {
                    *calls -= 1;
                }
            }
        }
        self.now.fetch_sub(1, Ordering::SeqCst);
        vec![Ok(()); events.len()]
    }
    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
    fn name(&self) -> &str {
        "concurrency"
    }
}

#[tokio::test(start_paused = true)]
async fn batches_are_pipelined_without_sharing_an_aggregate() {
    let store = MemoryStore::new();
    fill(&store, 40, 3);
    let publisher = Arc::new(Concurrency::default());
    let cfg = RelayConfig {
        max_in_flight: 3,
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let summary = relay.drain().await;
    assert_eq!(summary.published, 120);
    assert_eq!(
        publisher.max.load(Ordering::SeqCst),
        3,
        "three batches in flight at once"
    );
    let shared = publisher.shared.lock().unwrap().clone();
    assert!(
        shared.is_empty(),
        "aggregates in two calls at once: {shared:?}"
    );

    // The check can see an overlap: unordered batches over four aggregates share them.
    let store = MemoryStore::new();
    fill(&store, 4, 30);
    let publisher = Arc::new(Concurrency::default());
    let cfg = RelayConfig {
        max_in_flight: 3,
        ordering: OrderingPolicy::Unordered,
        ..config()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    assert_eq!(relay.drain().await.published, 120);
    assert!(!publisher.shared.lock().unwrap().is_empty());
}

struct MemoryFixture;

#[async_trait]
impl crate::testkit::StoreFixture for MemoryFixture {
    async fn store(&self) -> Arc<dyn crate::testkit::TestStore> {
        Arc::new(MemoryStore::new())
    }
}

#[tokio::test]
async fn memory_store_passes_the_store_conformance_suite() {
    crate::testkit::store_suite::run_all(&MemoryFixture).await;
}

#[tokio::test]
async fn scripted_publisher_passes_the_publisher_conformance_suite() {
    crate::testkit::publisher_suite::run_all(&ScriptedPublisher::new()).await;
}

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

/// A store that fails on purpose: every `claim_every`-th claim fails (connection error), and every
/// `settle_every`-th settle fails after the publish succeeded, the way a settle fails when the
/// database session is lost: nothing of the batch is recorded, its events become claimable again.
struct FailingStore {
    inner: MemoryStore,
    claims: AtomicUsize,
    settles: Arc<AtomicUsize>,
    claim_every: usize,
    settle_every: usize,
    /// Ids of the batches whose settle failed.
    failed_settles: Arc<std::sync::Mutex<Vec<Uuid>>>,
}

struct FailingLease {
    inner: Box<dyn crate::Lease>,
    ids: Vec<Uuid>,
    settles: Arc<AtomicUsize>,
    settle_every: usize,
    failed_settles: Arc<std::sync::Mutex<Vec<Uuid>>>,
}

#[async_trait]
impl crate::Lease for FailingLease {
    async fn settle(self: Box<Self>, settlements: Vec<crate::Settlement>) -> Result<(), Error> {
        let n = self.settles.fetch_add(1, Ordering::SeqCst) + 1;
        if n.is_multiple_of(self.settle_every) {
            self.failed_settles.lock().unwrap().extend(&self.ids);
            // The session is gone: the claim ends unrecorded (the inner lease releases on drop).
            return Err(Error::new(
                ErrorKind::Connection,
                "injected settle failure: connection reset",
            ));
        }
        self.inner.settle(settlements).await
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.inner.release().await
    }
}

#[async_trait]
impl crate::Store for FailingStore {
    async fn claim(&self, r: crate::ClaimRequest) -> Result<crate::Batch, Error> {
        let n = self.claims.fetch_add(1, Ordering::SeqCst) + 1;
        if n.is_multiple_of(self.claim_every) {
            return Err(Error::new(
                ErrorKind::Connection,
                "injected claim failure: connection refused",
            ));
        }
        let batch = self.inner.claim(r).await?;
        let ids = batch.events.iter().map(|e| e.id).collect();
        Ok(crate::Batch {
            events: batch.events,
            lease: Box::new(FailingLease {
                inner: batch.lease,
                ids,
                settles: self.settles.clone(),
                settle_every: self.settle_every,
                failed_settles: self.failed_settles.clone(),
            }),
        })
    }

    async fn stats(&self) -> Result<crate::StoreStats, Error> {
        self.inner.stats().await
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_store_that_fails_claims_and_settles_loses_nothing_and_keeps_order() {
    let memory = MemoryStore::new();
    let written = fill(&memory, 6, 12);
    let failed_settles = Arc::new(std::sync::Mutex::new(Vec::new()));
    let store = FailingStore {
        inner: memory.clone(),
        claims: AtomicUsize::new(0),
        settles: Arc::default(),
        claim_every: 3,
        settle_every: 2,
        failed_settles: failed_settles.clone(),
    };
    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(Arc::new(store), publisher.clone(), config()).unwrap();
    let (task, shutdown) = spawn(relay);
    let deadline = Instant::now() + Duration::from_secs(600);
    while memory.pending() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} events never settled",
            memory.pending()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    let summary = task.await.unwrap();

    let delivered = publisher.delivered();
    let failed = failed_settles.lock().unwrap().clone();
    assert!(
        summary.settle_failures > 0 && !failed.is_empty(),
        "no settle failed: the test proved nothing"
    );
    // Every event arrives; the first delivery of each follows its aggregate's order.
    let pos: HashMap<Uuid, usize> = written.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    let mut first_seen: HashMap<Uuid, ()> = HashMap::new();
    let mut high: HashMap<&str, usize> = HashMap::new();
    for e in &delivered {
        if first_seen.insert(e.id, ()).is_some() {
            continue;
        }
        let i = pos[&e.id];
        let h = high.entry(e.aggregate_id.as_str()).or_insert(0);
        assert!(
            i >= *h,
            "aggregate {}: event #{i} first delivered after #{h}",
            e.aggregate_id
        );
        *h = i;
    }
    assert_eq!(first_seen.len(), written.len(), "every event delivered");
    // Duplicates come only from batches whose settle failed: published, not recorded, sent again.
    let duplicates = delivered.len() - written.len();
    assert!(duplicates > 0, "a failed settle sends its batch again");
    assert!(
        duplicates <= failed.len(),
        "{duplicates} duplicates, but only {} events were in batches whose settle failed",
        failed.len()
    );
    for e in &delivered {
        let sent = delivered.iter().filter(|d| d.id == e.id).count();
        assert!(
            sent == 1 || failed.contains(&e.id),
            "event {} sent {sent} times though its settle never failed",
            e.id
        );
    }
}

/// Fast polling, a 100 ms..60 s backoff without jitter and `max_attempts`: the outage tests' relay.
fn outage_config(max_attempts: u32) -> RelayConfig {
    RelayConfig {
        poll_interval: Duration::from_millis(50),
        min_poll_interval: Duration::from_millis(10),
        retry: RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(60),
            multiplier: 2.0,
            jitter: 0.0,
        },
        ..config()
    }
}

/// A relay over a broker that is down for ten minutes while events keep arriving, then back; with
/// `check_failing`, its readiness check keeps failing after it is back (only a probe can tell).
async fn outage(check_failing: bool) {
    let memory = MemoryStore::new();
    let claims = Arc::new(AtomicUsize::new(0));
    let probes = Arc::new(AtomicUsize::new(0));
    let publisher = ScriptedPublisher::new();
    publisher.set_down(true);
    publisher.set_check_failing(check_failing);
    let cfg = outage_config(5);
    let store = Probing(memory.clone(), claims.clone(), probes.clone());
    let relay = Relay::new(Arc::new(store), publisher.clone(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    let mut written = Vec::new();
    for _ in 0..600 {
        written.extend(fill(&memory, 3, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let during = claims.load(Ordering::SeqCst);
    // After the first failed batch: a check every 100 ms, 200 ms, ... 10 s, each followed by a
    // one-event probe: about seventy claims, not one per poll (12,000 without the pause).
    assert!(
        during <= 80,
        "{during} claims in a ten-minute outage: the relay spins"
    );
    // Only the first claim found the broker down; every later one is flagged as a probe (a store
    // that reads ahead stops reading for them).
    let probed = probes.load(Ordering::SeqCst);
    assert!(
        probed > 0 && probed + 1 >= during,
        "{probed} of {during} claims during the outage were flagged as probes"
    );
    let tried: Vec<u32> = written
        .iter()
        .map(|id| memory.get(*id).unwrap().attempts)
        .collect();
    assert!(
        memory.dead_letters().is_empty() && tried.iter().filter(|a| **a > 0).count() <= 10,
        "an outage must not use up the events' attempts: {:?}",
        tried.iter().filter(|a| **a > 0).collect::<Vec<_>>()
    );
    publisher.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while publisher.delivered().len() < written.len() {
        assert!(
            Instant::now() < deadline,
            "not drained after the broker came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    assert_complete_and_ordered(&written, &publisher.delivered());
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_broker_stops_the_claims_until_it_answers_again() {
    outage(false).await;
}

#[tokio::test(start_paused = true)]
async fn a_probe_finds_the_broker_back_when_its_readiness_check_keeps_failing() {
    outage(true).await;
}

#[tokio::test(start_paused = true)]
async fn an_event_whose_destination_stays_down_does_not_hold_every_probe() {
    let memory = MemoryStore::new();
    let publisher = ScriptedPublisher::new();
    // A readiness check that never passes; one event whose own destination never answers.
    publisher.set_check_failing(true);
    let stuck = fill(&memory, 1, 1)[0];
    publisher.on_event(stuck, Behavior::FailRetryable);
    let cfg = outage_config(1000);
    let relay = Relay::new(Arc::new(memory.clone()), publisher.clone(), cfg).unwrap();
    let (task, shutdown) = spawn(relay);
    // The stuck event alone failed: the relay now probes one event at a time.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let later = fill(&memory, 5, 2);
    // `fill` writes round by round over a0..a4: a0's events are at 0 and 5, behind the stuck one.
    let others: Vec<Uuid> = later
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 5 != 0)
        .map(|(_, id)| *id)
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let delivered: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
        if others.iter().all(|id| delivered.contains(id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the other aggregates never got through: every probe took the stuck event"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    assert!(publisher.delivered().iter().all(|e| e.id != stuck));
    let tries = publisher.tries(stuck);
    assert!(
        tries < 40,
        "the stuck event was sent {tries} times in about two minutes: probes keep taking it"
    );
}
