//! The `outbox` binary with each broker publisher: `publish-test`, then `outbox relay` end to end,
//! checked by an independent consumer (the harness of the fault suite).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use common::*;
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::OutboxTable;
use outbox_tests::harness::{Broker, Sink};
use outbox_tests::{check, write_rounds};

fn with_sink(table: &OutboxTable, sink: &Sink, args: &[&str]) -> std::process::Command {
    let mut c = outbox(table, args);
    sink.configure(&mut c);
    c
}

async fn publish_test_then_relay(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let out = run(with_sink(&table, &sink, &["publish-test"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("published test event"),
        "{}",
        text(&out.stdout)
    );
    let committed = write_rounds(&table, 6, 10).await;
    let mut relay = Running::start(with_sink(&table, &sink, &["relay"]));
    let received = sink
        .received(committed.len() + 1, Duration::from_secs(60))
        .await;
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    assert_eq!(
        received.len(),
        committed.len() + 1,
        "the test event and every relayed event"
    );
    let verdict = check(&committed, &received);
    assert_eq!(
        (verdict.lost, verdict.order_violations),
        (0, 0),
        "{}: {verdict}",
        broker.name()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    publish_test_then_relay(Broker::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs() {
    publish_test_then_relay(Broker::Sqs).await;
}
