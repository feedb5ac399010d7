//! The `outbox` binary with the RabbitMQ publisher: publish-test, and SIGTERM under load.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use txoutbox_amqp::testing::Fixture;
use txoutbox_core::testkit::sample_event;
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{OutboxTable, Writer};

fn with_amqp(table: &OutboxTable, fx: &Fixture, args: &[&str]) -> std::process::Command {
    let mut c = outbox(table, args);
    c.env("OUTBOX_PUBLISHER__TYPE", "amqp")
        .env("OUTBOX_AMQP__URL", txoutbox_amqp::testing::amqp_url())
        .env("OUTBOX_AMQP__EXCHANGE", &fx.exchange);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_test_checks_connectivity_and_routing() {
    let fx = Fixture::new().await;
    let table = OutboxTable::default();
    let out = run(with_amqp(&table, &fx, &["publish-test"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("published test event"),
        "{}",
        text(&out.stdout)
    );
    let got = fx.wait_for(1, Duration::from_secs(10)).await;
    assert_eq!(
        got[0].received.event_type.as_deref(),
        Some("outbox.publish_test")
    );
    // publisher.format reaches the publisher the binary builds.
    let mut c = with_amqp(&table, &fx, &["publish-test"]);
    c.env("OUTBOX_PUBLISHER__FORMAT", "cloudevents-binary").env(
        "OUTBOX_PUBLISHER__CLOUDEVENTS_SOURCE",
        "/shop/{aggregate_type}",
    );
    let out = run(c);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = fx.wait_for(2, Duration::from_secs(10)).await;
    let headers = &got[1].received.headers;
    assert_eq!(
        headers.get("cloudEvents_specversion").map(String::as_str),
        Some("1.0")
    );
    assert_eq!(
        headers.get("cloudEvents_id"),
        got[1].received.event_id.map(|id| id.to_string()).as_ref()
    );
    assert!(
        headers
            .get("cloudEvents_source")
            .is_some_and(|s| s.starts_with("/shop/")),
        "{headers:?}"
    );
    // An exchange nobody is bound to: the publish fails, and says why.
    let mut c = with_amqp(&table, &fx, &["publish-test"]);
    c.env("OUTBOX_AMQP__EXCHANGE", format!("{}.lonely", fx.exchange));
    let out = run(c);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("NO_ROUTE"),
        "{}",
        text(&out.stderr)
    );
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_cleanly_and_loses_nothing() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new().await;

    // Writers commit continuously while the relay runs.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (table, stop) = (table.clone(), stop.clone());
        tokio::spawn(async move {
            let pg = pool(2).await;
            let w = Writer::new(table);
            let mut ids = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let mut tx = pg.begin().await.unwrap();
                let events: Vec<_> = (0..20)
                    .map(|a| sample_event(&format!("agg-{a}"), n))
                    .collect();
                ids.extend(events.iter().map(|e| e.id));
                w.enqueue_many(&mut tx, events).await.unwrap();
                w.commit(tx).await.unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ids
        })
    };
    let mut c = with_amqp(&table, &fx, &["relay"]);
    c.env("OUTBOX_RELAY__SHUTDOWN_TIMEOUT", "10s")
        .env("OUTBOX_RELAY__BATCH_SIZE", "50");
    let mut relay = Running::start(c);
    let first = fx.wait_for(200, Duration::from_secs(30)).await;
    assert!(first.len() >= 200, "the relay is publishing");
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    stop.store(true, Ordering::SeqCst);
    let committed = writer.await.unwrap();

    // Nothing is left claimed: a second relay drains the rest, and every committed event arrives.
    let mut c = with_amqp(&table, &fx, &["relay"]);
    c.env("OUTBOX_RELAY__BATCH_SIZE", "50");
    let mut second = Running::start(c);
    let got = fx.wait_for(committed.len(), Duration::from_secs(60)).await;
    second.signal("-TERM");
    assert_eq!(second.wait_exit(Duration::from_secs(60)), 0);
    let received: HashSet<_> = got.iter().filter_map(|d| d.received.event_id).collect();
    let lost = committed.iter().filter(|id| !received.contains(id)).count();
    let duplicates = got.len() - received.len();
    println!(
        "sigterm under load: committed={} delivered={} duplicates={duplicates} lost={lost}",
        committed.len(),
        received.len()
    );
    assert_eq!(lost, 0);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_reports_an_unreachable_broker() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let port = free_port();
    let dead_broker = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("OUTBOX_PUBLISHER__TYPE", "amqp")
        .env(
            "OUTBOX_AMQP__URL",
            format!("amqp://guest:guest@127.0.0.1:{dead_broker}/%2f"),
        )
        .env("OUTBOX_AMQP__CONNECT_TIMEOUT", "1s")
        .env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"));
    let mut relay = Running::start(c);
    relay.wait_log("serving /metrics", Duration::from_secs(30));
    let (code, _) = http_get(port, "/healthz");
    assert_eq!(code, 200, "the process is alive");
    let (code, body) = http_get(port, "/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("broker:"),
        "the reason names the broker: {body}"
    );
    assert!(!body.contains("database:"), "the database is fine: {body}");
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
}
