//! When the relay claims: the wake-up handle, idle polling backing off, pipelined batches that
//! never share an aggregate, and a graceful shutdown with its deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use super::{config, fill, spawn};
use crate::testkit::{MemoryStore, ScriptedPublisher};
use crate::{Error, Event, OrderingPolicy, PublishOutcome, Publisher, Relay, RelayConfig};

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
