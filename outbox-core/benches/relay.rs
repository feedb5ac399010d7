//! The relay engine's own cost per event, without a database or a broker: claims from the in-memory
//! store, a publisher that acknowledges at once (or fails one aggregate in ten, retryably), and the
//! settlement of every outcome through the retry and ordering policies. `cargo bench -p txoutbox-core`
//! prints the time per drain of 10,000 events; divide by 10,000 for the cost per event.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use txoutbox_core::testkit::MemoryStore;
use txoutbox_core::{
    Error, ErrorKind, Event, NewEvent, PublishOutcome, Publisher, Relay, RelayConfig, RetryPolicy,
};

const EVENTS: usize = 10_000;
const AGGREGATES: usize = 1_000;

/// Acknowledges every event, or fails every event of the aggregates whose number ends in 7.
struct Instant {
    fail_one_in_ten: bool,
}

#[async_trait]
impl Publisher for Instant {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        events
            .iter()
            .map(|e| {
                if self.fail_one_in_ten && e.aggregate_id.ends_with('7') {
                    Err(Error::new(ErrorKind::Connection, "injected"))
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
        "instant"
    }
}

fn filled() -> Arc<MemoryStore> {
    let store = Arc::new(MemoryStore::new());
    store
        .push((0..EVENTS).map(|i| {
            NewEvent::new(
                "order",
                format!("a{}", i % AGGREGATES),
                "order.created",
                serde_json::json!({ "n": i, "pad": "x".repeat(256) }),
            )
        }))
        .unwrap();
    store
}

fn drain(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("relay drain, in-memory store");
    group.throughput(Throughput::Elements(EVENTS as u64));
    group.sample_size(20);
    group.measurement_time(Duration::from_secs(8));
    for fail_one_in_ten in [false, true] {
        let name = if fail_one_in_ten {
            "10k events, 1 aggregate in 10 failing (retry in 1 h)"
        } else {
            "10k events, all acknowledged"
        };
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter_batched(
                filled,
                |store| async move {
                    let config = RelayConfig {
                        // A failed event waits an hour: the drain settles it once and ends.
                        retry: RetryPolicy {
                            initial_backoff: Duration::from_secs(3600),
                            max_backoff: Duration::from_secs(3600),
                            ..RetryPolicy::default()
                        },
                        ..RelayConfig::default()
                    };
                    let relay =
                        Relay::new(store, Arc::new(Instant { fail_one_in_ten }), config).unwrap();
                    relay.drain().await
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();
}

criterion_group!(benches, drain);
criterion_main!(benches);
