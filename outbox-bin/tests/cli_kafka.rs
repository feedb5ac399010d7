//! The `outbox` binary with the Kafka publisher.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use outbox_kafka::testing::Fixture;
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::OutboxTable;

fn with_kafka(table: &OutboxTable, fx: &Fixture, args: &[&str]) -> std::process::Command {
    let mut c = outbox(table, args);
    c.env("OUTBOX_PUBLISHER__TYPE", "kafka")
        .env("OUTBOX_KAFKA__BROKERS", outbox_kafka::testing::brokers())
        .env("OUTBOX_KAFKA__TOPIC", &fx.topic);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_to_kafka_and_publish_test() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new(3).await;
    let out = run(with_kafka(&table, &fx, &["publish-test"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for a in 0..6 {
        insert_plain(&table, &format!("k-{a}"), 10).await;
    }
    let mut relay = Running::start(with_kafka(&table, &fx, &["relay"]));
    let got = fx.wait_for(61, Duration::from_secs(60)).await;
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    assert_eq!(got.len(), 61, "the test event and 60 relayed events");
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
    assert_eq!(last.len(), 6);
}
