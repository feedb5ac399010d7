//! The `outbox` binary with the SQS publisher.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::OutboxTable;
use outbox_sqs::testing::Fixture;

fn with_sqs(table: &OutboxTable, fx: &Fixture, args: &[&str]) -> std::process::Command {
    let mut c = outbox(table, args);
    c.env("OUTBOX_PUBLISHER__TYPE", "sqs")
        .env("OUTBOX_SQS__QUEUE", &fx.queue_name)
        .env("OUTBOX_SQS__REGION", "us-east-1")
        .env("OUTBOX_SQS__ENDPOINT_URL", outbox_sqs::testing::endpoint())
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test");
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_to_sqs_and_publish_test() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new(true).await;
    let out = run(with_sqs(&table, &fx, &["publish-test"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for a in 0..4 {
        insert_plain(&table, &format!("s-{a}"), 10).await;
    }
    let mut relay = Running::start(with_sqs(&table, &fx, &["relay"]));
    let got = fx.wait_for(41, Duration::from_secs(60)).await;
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    assert_eq!(got.len(), 41, "the test event and 40 relayed events");
    let mut last: HashMap<String, i64> = HashMap::new();
    for d in got
        .iter()
        .filter(|d| d.received.event_type.as_deref() == Some("order.created"))
    {
        let agg = d.received.aggregate_id.clone().unwrap();
        let n = serde_json::from_slice::<serde_json::Value>(&d.received.payload).unwrap()["n"]
            .as_i64()
            .unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(prev < n, "{agg}: {n} after {prev}");
        }
    }
    assert_eq!(last.len(), 4);
}
