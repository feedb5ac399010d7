//! Scenario 4: four relays over 1,000 aggregates with random retryable failures injected: no
//! aggregate is ever published out of order, and one poisoned aggregate (its events fail permanently)
//! dead-letters without delaying any other aggregate.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::{CancellationToken, Publisher, RelayConfig, RetryPolicy, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::PostgresStore;
use txoutbox_tests::harness::{
    assert_clean_verdict, one_at_a_time, report_with, rng, soak_factor, Broker, FaultInjector, Sink,
};
use txoutbox_tests::wal::WalSource;
use txoutbox_tests::{spawn_relays, write_rounds};

/// With `wal`, the four relays read the WAL source (one reads the slot, three stand by, all of
/// them claim from the held table where the failed events go).
async fn four_relays_with_failures(broker: Broker, wal: bool) {
    let _serial = one_at_a_time().await;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup_if(wal, &table).await;
    let sink = Sink::new(broker).await;
    let rounds = 5 * soak_factor();
    let committed = write_rounds(&table, 1000, rounds).await;
    let poisoned = "agg-13".to_string();
    let healthy: Vec<_> = committed
        .iter()
        .filter(|(a, _)| *a != poisoned)
        .cloned()
        .collect();
    let publisher = Arc::new(FaultInjector::new(
        sink.publisher(),
        50,
        &poisoned,
        rng("fault injector"),
    ));
    let config = RelayConfig {
        batch_size: 200,
        poll_interval: Duration::from_millis(50),
        retry: RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            max_attempts: 100,
            ..RetryPolicy::default()
        },
        ..RelayConfig::default()
    };
    let (relays, shutdown) = match &source {
        Some(w) => {
            let shutdown = CancellationToken::new();
            let mut relays = Vec::new();
            for _ in 0..4 {
                let publisher: Arc<dyn Publisher> = publisher.clone();
                relays.push(
                    w.spawn_relay(publisher, config.clone(), shutdown.clone())
                        .await
                        .1,
                );
            }
            (relays, shutdown)
        }
        None => spawn_relays(&table, 4, publisher, config).await,
    };
    sink.wait_all(&healthy, Duration::from_secs(120)).await;
    shutdown.cancel();
    for r in relays {
        r.await.unwrap();
    }
    // The poisoned aggregate's events are not expected: any of them received counts as unexpected.
    // Injected failures are never sent, so nothing may arrive twice.
    let verdict = sink.judge(&healthy).await;
    report_with(
        "four-relays-injected-failures",
        broker,
        &verdict,
        if wal { " source=wal" } else { "" },
    );
    assert_clean_verdict(&verdict);
    // Under the WAL source the dead letter and what waits behind it are in the held table.
    let kept = match &source {
        Some(w) => w.held.clone(),
        None => table.clone(),
    };
    let stats = PostgresStore::new(pg, kept).stats().await.unwrap();
    assert_eq!(
        stats.dead_letters, 1,
        "the poisoned aggregate's first event is dead-lettered"
    );
    assert_eq!(
        stats.pending,
        rounds as u64 - 1,
        "its later events wait behind it; nothing else is pending"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    four_relays_with_failures(Broker::Amqp, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_wal_source() {
    four_relays_with_failures(Broker::Amqp, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_wal_source() {
    four_relays_with_failures(Broker::Kafka, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_wal_source() {
    four_relays_with_failures(Broker::Sqs, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    four_relays_with_failures(Broker::Kafka, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs() {
    four_relays_with_failures(Broker::Sqs, false).await;
}
