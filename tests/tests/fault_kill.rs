//! Scenarios 1 and 6: the relay killed with SIGKILL mid-batch, 20 times in a row during continuous
//! writes; and a graceful SIGTERM under load. Real `outbox` binary, real PostgreSQL, RabbitMQ, Kafka
//! and SQS (moto, with the lighter load it keeps up with: see `Broker::load`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_postgres::testing::{fresh_table, pool};
use outbox_tests::harness::{report, soak_factor, Broker, RelayProcess, Sink};

async fn killed_twenty_times(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let load = broker.load(&table);
    for _ in 0..20 * soak_factor() {
        let relay = RelayProcess::start(&table, &sink, &[]);
        tokio::time::sleep(Duration::from_millis(fastrand::u64(300..900))).await;
        relay.kill9();
    }
    let written = load.stop().await;
    let relay = RelayProcess::start(&table, &sink, &[]);
    let verdict = sink
        .verdict(&written.committed, Duration::from_secs(120))
        .await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    report("sigkill-x20", broker, &verdict);
    assert_eq!(verdict.lost, 0, "{verdict}");
    assert_eq!(verdict.order_violations, 0, "{verdict}");
}

async fn sigterm_under_load(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let load = broker.load(&table);
    let relay = RelayProcess::start(&table, &sink, &[("OUTBOX_RELAY__SHUTDOWN_TIMEOUT", "5s")]);
    tokio::time::sleep(Duration::from_secs(2 * soak_factor() as u64)).await;
    // A clean exit within the configured 5 s deadline (plus a margin for the process to end).
    assert_eq!(
        relay.terminate(Duration::from_secs(8)),
        Some(0),
        "SIGTERM under load is a clean exit within the shutdown deadline"
    );
    let written = load.stop().await;
    // Nothing was left claimed: a new relay drains everything.
    let relay = RelayProcess::start(&table, &sink, &[]);
    let verdict = sink
        .verdict(&written.committed, Duration::from_secs(120))
        .await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    report("sigterm-under-load", broker, &verdict);
    assert_eq!(
        (verdict.lost, verdict.order_violations),
        (0, 0),
        "{verdict}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_rabbitmq() {
    killed_twenty_times(Broker::Amqp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_kafka() {
    killed_twenty_times(Broker::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_sqs() {
    killed_twenty_times(Broker::Sqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_every_broker() {
    for broker in Broker::ALL {
        sigterm_under_load(broker).await;
    }
}
