//! A connection pooler in transaction mode in front of the database (PgBouncer, started by
//! `scripts/test-env.sh` on 6432 with `max_prepared_statements` and on 6433 without): the probe
//! tells it from the server itself; a pooler without prepared statements is refused at start,
//! naming the setting; what needs a session of its own (LISTEN, the WAL source) is refused through
//! it, naming `database.direct_url`, and runs with it. The racing-writers and kill -9 scenarios
//! through the pooler are in `fault_writers.rs` and `fault_kill.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_postgres::pooler::{probe, Pooling};
use txoutbox_postgres::testing::{
    database_url, fresh_table, pgbouncer_unprepared_url, pgbouncer_url, pool, url_named,
};
use txoutbox_tests::harness::{
    logged, relay_log_dir, unpublished, wait_until, write_through, Broker, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};

fn options(url: &str) -> sqlx::postgres::PgConnectOptions {
    url.parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_tells_a_transaction_pooler_from_the_server() {
    assert_eq!(
        probe(&options(&database_url()), "database.url")
            .await
            .unwrap(),
        Pooling::Session
    );
    // Several times: the answer must not depend on which server sessions the pooler lends.
    for _ in 0..5 {
        assert_eq!(
            probe(&options(&pgbouncer_url()), "database.url")
                .await
                .unwrap(),
            Pooling::Transaction
        );
    }
    let refused = probe(&options(&pgbouncer_unprepared_url()), "database.url")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("max_prepared_statements") && refused.contains("database.url"),
        "{refused}"
    );
}

/// A pooler that does not carry prepared statements: the relay exits at start (config error, 2),
/// naming `max_prepared_statements`, and claims nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_without_prepared_statements_is_refused_at_start() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(Broker::Amqp).await;
    let written = write_through(&database_url(), &table, 5).await;
    let relay = RelayProcess::start_at(&pgbouncer_unprepared_url(), &table, &sink, &[]);
    assert_eq!(relay.exit_code(), Some(2));
    assert_eq!(logged(&table, "max_prepared_statements"), 1);
    assert_eq!(unpublished(&pg, &table).await, written.len() as i64);
    assert_eq!(sink.received_count().await, 0);
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// LISTEN (`database.notify`) through the pooler: refused, naming `database.direct_url` and
/// `database.notify = false`; a `direct_url` to another database: refused. With `direct_url`, the
/// relay listens there: with a poll interval of an hour, once the relay has drained a first batch
/// only a notification brings a second one, written through the pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_needs_direct_url_behind_a_pooler() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    txoutbox_postgres::notify::install_notify_trigger(&pg, &table)
        .await
        .unwrap();
    let sink = Sink::new(Broker::Amqp).await;
    let notify = ("OUTBOX_DATABASE__NOTIFY", "true");
    let relay = RelayProcess::start_at(&pgbouncer_url(), &table, &sink, &[notify]);
    assert_eq!(relay.exit_code(), Some(2));
    assert_eq!(logged(&table, "database.direct_url"), 1);
    assert_eq!(logged(&table, "database.notify = false"), 1);
    let elsewhere = database_url().replace("/test", "/postgres");
    assert_ne!(
        elsewhere,
        database_url(),
        "DATABASE_URL names the database test"
    );
    let relay = RelayProcess::start_at(
        &pgbouncer_url(),
        &table,
        &sink,
        &[notify, ("OUTBOX_DATABASE__DIRECT_URL", &elsewhere)],
    );
    assert_eq!(relay.exit_code(), Some(2));
    assert_eq!(logged(&table, "reach different databases"), 1);
    let (direct_name, direct) = url_named(&database_url(), "outbox-test-direct");
    let relay = RelayProcess::start_at(
        &pgbouncer_url(),
        &table,
        &sink,
        &[
            notify,
            ("OUTBOX_DATABASE__DIRECT_URL", &direct),
            ("OUTBOX_RELAY__POLL_INTERVAL", "1h"),
        ],
    );
    wait_until(Duration::from_secs(60), "the relay never listened", || {
        let (pg, name) = (pg.clone(), direct_name.clone());
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'",
            )
            .bind(name)
            .fetch_one(&pg)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    let mut committed = write_through(&pgbouncer_url(), &table, 10).await;
    sink.wait_all(&committed, Duration::from_secs(60)).await;
    committed.extend(write_through(&pgbouncer_url(), &table, 10).await);
    sink.assert_delivered(&committed, Duration::from_secs(60))
        .await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// The WAL source through the pooler: refused, naming `database.direct_url`. With `direct_url`,
/// its replication connection and reader lock go there, its held table's claims through the
/// pooler, and the events the writer commits through the pooler are published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_needs_direct_url_behind_a_pooler() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup(&table).await;
    let sink = Sink::new(Broker::Amqp).await;
    let env = source.relay_env(&[]);
    let relay = RelayProcess::start_at(&pgbouncer_url(), &table, &sink, &pairs(&env));
    assert_eq!(relay.exit_code(), Some(2));
    assert_eq!(logged(&table, "database.direct_url"), 1);
    let (direct_name, direct) = url_named(&database_url(), "outbox-test-direct");
    let env = source.relay_env(&[("OUTBOX_DATABASE__DIRECT_URL", &direct)]);
    let relay = RelayProcess::start_at(&pgbouncer_url(), &table, &sink, &pairs(&env));
    let load = Broker::Amqp.load_at(&pgbouncer_url(), &table).await;
    // The reader lock is held by a session of the server itself, not by one the pooler lends.
    wait_until(
        Duration::from_secs(60),
        "no relay took the reader lock",
        || async { source.reader(&pg).await.is_some() },
    )
    .await;
    assert_eq!(source.reader(&pg).await, Some(direct_name));
    sink.wait_past(0, Duration::from_secs(60), "the relay published nothing")
        .await;
    let (committed, verdict) = source.finish(&pg, &table, &sink, load, vec![relay]).await;
    assert!(!committed.is_empty());
    assert_eq!(
        (verdict.lost, verdict.order_violations, verdict.duplicates),
        (0, 0, 0),
        "{verdict}"
    );
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}
