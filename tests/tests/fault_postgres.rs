//! Scenario 3: PostgreSQL restarted during load, and crashed (an immediate stop: no shutdown
//! checkpoint, recovery from the WAL). The relay reconnects and nothing is lost. Alone in its file:
//! the restart cuts every connection of this process. Judged against the database's record of
//! what committed (a transaction whose `COMMIT` the restart cut counts if and only if it committed).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_tests::harness::{
    assert_crash_verdict, committed_in_db, crash_postgres, one_at_a_time, relay_log_dir,
    report_with, restart_postgres, soak_factor, Broker, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};

/// PostgreSQL restarted (or, with `crash`, crashed) under load while one relay publishes to
/// `broker`; with `wal`, the relay reads the WAL source (its reader's session ends with the restart
/// and takes the slot again).
async fn restart_during_load(broker: Broker, wal: bool, crash: bool) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup_if(wal, &table).await;
    let env = source
        .as_ref()
        .map(|w| w.relay_env(&[]))
        .unwrap_or_default();
    let sink = Sink::new(broker).await;
    let load = broker.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &pairs(&env));
    let mut restarts = 0;
    for _ in 0..soak_factor() {
        let before = sink.received_count().await;
        sink.wait_past(
            before,
            Duration::from_secs(60),
            "the relay published nothing before the restart",
        )
        .await;
        let restart = if crash {
            crash_postgres
        } else {
            restart_postgres
        };
        tokio::task::spawn_blocking(restart).await.unwrap();
        restarts += 1;
    }
    let before = sink.received_count().await;
    sink.wait_past(
        before,
        Duration::from_secs(120),
        "the relay published nothing after the restart",
    )
    .await;
    let written = load.stop().await;
    let pg = pool(2).await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(120)).await;
    assert_eq!(
        relay.terminate(Duration::from_secs(60)),
        Some(0),
        "the relay survived the restart"
    );
    let verdict = sink.judge(&committed).await;
    report_with(
        if crash {
            "postgres-crash"
        } else {
            "postgres-restart"
        },
        broker,
        &verdict,
        if wal { " source=wal" } else { "" },
    );
    println!(
        "  ({} events of transactions whose commit the writer could not confirm; the database \
             says which committed)",
        written.uncertain.len()
    );
    // A restart loses the relay's sessions: what it published and had not marked is sent again
    // (README, guarantee 3), at most a batch per batch in flight.
    // WAL source: the relay outlives the restart, and publishes from what its reader held
    // (up to wal.read_ahead, 2000 events) until it finds the reader's connections cut; all of
    // it is read again from the slot's confirmed position.
    if wal && crash {
        // A crash also loses what the slot confirmed since the last checkpoint: the reader replays
        // from there (outbox-postgres/README.md), every replayed event a duplicate. Nothing is lost
        // and first deliveries keep their order.
        assert_eq!(
            (verdict.lost, verdict.order_violations, verdict.unexpected),
            (0, 0, 0),
            "{verdict}"
        );
    } else {
        assert_crash_verdict(&verdict, restarts, 100, if wal { 2 + 20 } else { 2 });
    }
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_during_load_loses_nothing() {
    // One restart at a time: the scenarios run in turn (polling relays to each broker, then the
    // WAL source to RabbitMQ and Kafka).
    let _serial = one_at_a_time().await;
    for broker in Broker::ALL {
        restart_during_load(broker, false, false).await;
    }
    for broker in [Broker::Amqp, Broker::Kafka] {
        restart_during_load(broker, true, false).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_during_load_loses_nothing() {
    let _serial = one_at_a_time().await;
    restart_during_load(Broker::Kafka, false, true).await;
    restart_during_load(Broker::Amqp, true, true).await;
}
