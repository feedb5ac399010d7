//! A broker outage: claims stop until the broker answers again (a probe finds it back when its
//! readiness check keeps failing), events keep their attempts, and one stuck event does not hold
//! every probe.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use super::{assert_complete_and_ordered, config, fill, spawn};
use crate::testkit::{Behavior, MemoryStore, ScriptedPublisher};
use crate::{Error, Relay, RelayConfig, RetryPolicy};

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
