//! Relay engine tests over the in-memory store and scripted publishers, on tokio's paused clock.
//! The helpers they share are here; each group of checks has a file of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::Duration;

use uuid::Uuid;

use crate::testkit::{sample_event, MemoryStore};
use crate::{CancellationToken, Event, Relay, RelayConfig, RetryPolicy};

mod calls;
mod conformance;
mod outage;
mod outcomes;
mod polling;
mod store_faults;

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
