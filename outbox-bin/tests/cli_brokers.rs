//! The `outbox` binary with each broker publisher: `publish-test`, then `outbox relay` end to end,
//! checked by an independent consumer (the harness of the fault suite).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::time::Duration;

use common::*;
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::OutboxTable;
use txoutbox_tests::harness::{Broker, Sink};
use txoutbox_tests::{check, write_rounds};

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

/// With NOTIFY on and every batch in flight held up (a Kafka broker that stops answering: both
/// batches wait for their delivery reports with their claims open), a pool of the documented minimum
/// (two batches + statistics + readiness + listener) still serves the readiness check's database
/// part and the statistics: the listener and the batches do not take every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_reaches_the_database_with_every_batch_in_flight_and_notify_on() {
    let (tansu, brokers) = txoutbox_tests::harness::own_tansu(None);
    let fx = txoutbox_kafka::testing::Fixture::create_at(&brokers, "held", 1).await;
    let table = unmigrated_table();
    let mut c = outbox(&table, &["migrate"]);
    c.env("OUTBOX_DATABASE__NOTIFY", "true");
    assert_eq!(run(c).status.code(), Some(0));
    let (tag, url) = txoutbox_postgres::testing::database_url_named("outbox-ready");
    let port = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("DATABASE_URL", url)
        .env("OUTBOX_DATABASE__NOTIFY", "true")
        .env("OUTBOX_RELAY__MAX_IN_FLIGHT", "2")
        .env("OUTBOX_RELAY__BATCH_SIZE", "10")
        .env("OUTBOX_DATABASE__POOL_SIZE", "5")
        .env("OUTBOX_PUBLISHER__TYPE", "kafka")
        .env("OUTBOX_KAFKA__BROKERS", &brokers)
        .env("OUTBOX_KAFKA__TOPIC", &fx.topic)
        .env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("OUTBOX_HTTP__STATS_INTERVAL", "200ms");
    let _relay = Running::start(c);
    // The relay publishes (the broker answers), then the broker stands still.
    insert_plain(&table, "warm", 3).await;
    fx.wait_for(3, Duration::from_secs(60)).await;
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &tansu.id().to_string()])
        .status()
        .unwrap();
    assert!(stop.success());
    for a in 0..40 {
        insert_plain(&table, &format!("a{a}"), 5).await;
    }
    let pg = pool(2).await;
    wait_for_held_claims(
        &pg,
        &tag,
        2,
        Duration::from_secs(20),
        "the two batches never stood in flight together",
    )
    .await;
    for _ in 0..3 {
        let (_, body) = tokio::task::spawn_blocking(move || http_get(port, "/readyz"))
            .await
            .unwrap();
        // The broker may be reported; the database must not be.
        assert!(
            !body.contains("database:"),
            "the readiness check found no database connection under full load: {body}"
        );
        let (code, _) = tokio::task::spawn_blocking(move || http_get(port, "/metrics"))
            .await
            .unwrap();
        assert_eq!(code, 200);
    }
    let n = txoutbox_postgres::testing::sessions_holding_a_claim(&pg, &tag).await;
    assert_eq!(n, 2, "both batches still held while readiness was checked");
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &tansu.id().to_string()])
        .status();
}

/// `/healthz` stays 200 through a broker outage longer than `http.liveness_timeout` (the relay keeps
/// checking the broker: waiting, not stuck), turns 503 once the relay is wedged (its claims hang on
/// a lock held on the outbox table) while events are due, and 200 again once the lock goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_on_a_wedged_relay_and_not_on_a_broker_outage() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    insert_plain(&table, "due", 3).await;
    let port = free_port();
    let dead_endpoint = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("OUTBOX_PUBLISHER__TYPE", "sqs")
        .env("OUTBOX_SQS__QUEUE", "outbox-liveness")
        .env("OUTBOX_SQS__REGION", "us-east-1")
        .env(
            "OUTBOX_SQS__ENDPOINT_URL",
            format!("http://127.0.0.1:{dead_endpoint}"),
        )
        .env("OUTBOX_SQS__OPERATION_TIMEOUT", "1s")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("OUTBOX_RELAY__PUBLISH_TIMEOUT", "2s")
        .env("OUTBOX_RELAY__RETRY__INITIAL_BACKOFF", "200ms")
        .env("OUTBOX_RELAY__RETRY__MAX_BACKOFF", "2s")
        .env("OUTBOX_HTTP__LIVENESS_TIMEOUT", "15s")
        .env("OUTBOX_HTTP__STATS_INTERVAL", "500ms")
        .env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"));
    let mut relay = Running::start(c);
    relay.wait_log("serving /metrics", Duration::from_secs(30));
    let get = move |path: &'static str| tokio::task::spawn_blocking(move || http_get(port, path));
    let oldest_age = || async {
        sqlx::query_scalar::<_, f64>(&format!(
            "SELECT EXTRACT(EPOCH FROM now() - min(created_at))::float8 FROM {} WHERE processed_at IS NULL",
            table.qualified()
        ))
        .fetch_one(&pg)
        .await
        .unwrap()
    };
    // The outage: the events stay pending longer than the liveness timeout; the relay stays live.
    while oldest_age().await < 17.0 {
        let (code, body) = get("/healthz").await.unwrap();
        assert_eq!(code, 200, "a broker outage is not a wedge: {body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The wedge: every statement on the outbox waits for this transaction's lock.
    let mut lock = pg.begin().await.unwrap();
    sqlx::query(&format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        table.qualified()
    ))
    .execute(&mut *lock)
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let body = loop {
        let (code, body) = get("/healthz").await.unwrap();
        if code == 503 {
            break body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/healthz never failed for a relay whose claims hang: {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        body.contains("stalled") && body.contains("http.liveness_timeout = 15s"),
        "{body}"
    );
    // The image's health check says the same, with its exit code.
    let healthcheck = {
        let table = table.clone();
        move || {
            let table = table.clone();
            tokio::task::spawn_blocking(move || {
                run(outbox(
                    &table,
                    &["healthcheck", "--addr", &format!("127.0.0.1:{port}")],
                ))
            })
        }
    };
    let out = healthcheck().await.unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(
        text(&out.stderr).contains("unhealthy (HTTP 503): stalled"),
        "{}",
        text(&out.stderr)
    );
    lock.rollback().await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (code, body) = get("/healthz").await.unwrap();
        if code == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/healthz stayed failed after the lock went: {body}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let out = healthcheck().await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("healthy: ok"));
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE processed_at IS NULL AND dead_lettered_at IS NULL",
        table.qualified()
    ))
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(
        pending, 3,
        "the events wait for the broker, none lost or dead-lettered"
    );
}

/// `relay.publish_timeout` must exceed each publisher's own limit of one call, here on the
/// publishers' defaults (Kafka 50 s, RabbitMQ 55 s, SQS 45 s: README, guarantee 4): at the limit the
/// relay refuses to start, naming both settings; a second above it, it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_timeout_must_exceed_each_publishers_own_limit_on_defaults() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    for (broker, limit, setting) in [
        (Broker::Kafka, 50, "kafka.delivery_timeout"),
        (Broker::Amqp, 55, "amqp.confirm_timeout"),
        (Broker::Sqs, 45, "sqs.operation_timeout"),
    ] {
        let sink = Sink::new(broker).await;
        let relay = |publish_timeout: u64| {
            let mut c = with_sink(&table, &sink, &["relay"]);
            c.env_remove("OUTBOX_KAFKA__DELIVERY_TIMEOUT")
                .env_remove("OUTBOX_SQS__OPERATION_TIMEOUT")
                .env(
                    "OUTBOX_RELAY__PUBLISH_TIMEOUT",
                    format!("{publish_timeout}s"),
                );
            c
        };
        let out = run(relay(limit));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", broker.name());
        assert!(
            err.contains("relay.publish_timeout") && err.contains(setting),
            "{}: {err}",
            broker.name()
        );
        let mut running = Running::start(relay(limit + 1));
        running.wait_log("relay running", Duration::from_secs(30));
        running.signal("-TERM");
        assert_eq!(running.wait_exit(Duration::from_secs(60)), 0);
    }
}
