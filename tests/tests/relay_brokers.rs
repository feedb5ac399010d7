//! PostgreSQL -> two relays (library) -> each real broker, end to end, with an independent consumer
//! as the checker.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_core::{RelayConfig, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::PostgresStore;
use txoutbox_tests::harness::{assert_clean_verdict, report, Broker, Sink};
use txoutbox_tests::{spawn_relays, write_rounds};

async fn two_relays_deliver_everything_in_aggregate_order(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let committed = write_rounds(&table, 50, 10).await;
    let config = RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let (relays, shutdown) = spawn_relays(&table, 2, sink.publisher(), config).await;
    sink.wait_all(&committed, Duration::from_secs(60)).await;
    shutdown.cancel();
    for r in relays {
        r.await.unwrap();
    }
    let verdict = sink.judge(&committed).await;
    report("two-relays", broker, &verdict);
    assert_clean_verdict(&verdict);
    assert_eq!(
        PostgresStore::new(pg, table).stats().await.unwrap().pending,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    two_relays_deliver_everything_in_aggregate_order(Broker::Amqp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    two_relays_deliver_everything_in_aggregate_order(Broker::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs() {
    two_relays_deliver_everything_in_aggregate_order(Broker::Sqs).await;
}
