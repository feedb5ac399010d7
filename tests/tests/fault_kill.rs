//! Scenarios 1 and 6: the relay killed with SIGKILL mid-batch, 20 times in a row during continuous
//! writes, with one relay and with three (killed one at a time); and a graceful SIGTERM under load.
//! Real `outbox` binary, real PostgreSQL, RabbitMQ, Kafka and SQS (moto, with the lighter load it
//! keeps up with: see `Broker::load`). Judged against the database's record of what committed.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_postgres::testing::{database_url, fresh_table, pgbouncer_url, pool};
use txoutbox_tests::harness::{
    assert_clean_run, assert_crash_verdict, committed_in_db, one_at_a_time, relay_log_dir, report,
    soak_factor, Broker, Kills, RelayProcess, Sink,
};

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// `relays` relay processes under continuous writes; `kills` times, one of them (in turn) is
/// SIGKILLed mid-batch and started again; then a fresh relay drains what is left. The writers and
/// the relays connect to `url`.
async fn killed_in_turn(broker: Broker, relays: usize, kills: usize, scenario: &str, url: &str) {
    let _serial = one_at_a_time().await;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let load = broker.load_at(url, &table).await;
    let mut running: Vec<RelayProcess> = (0..relays)
        .map(|_| RelayProcess::start_at(url, &table, &sink, &[]))
        .collect();
    let mut killer = Kills::new(scenario);
    let mut before = sink.received_count().await;
    for k in 0..kills * soak_factor() {
        let i = k % relays;
        let victim = running.remove(i);
        killer.kill(victim, &pg, &sink, before).await;
        before = sink.received_count().await;
        running.insert(i, RelayProcess::start_at(url, &table, &sink, &[]));
    }
    let written = load.stop().await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(180)).await;
    for r in running {
        assert_eq!(r.terminate(Duration::from_secs(60)), Some(0));
    }
    let verdict = sink.judge(&committed).await;
    report(scenario, broker, &verdict);
    killer.assert_some_hit_work();
    assert!(!committed.is_empty());
    assert_crash_verdict(&verdict, killer.count, BATCH, IN_FLIGHT);
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

async fn sigterm_under_load(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let load = broker.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &[("OUTBOX_RELAY__SHUTDOWN_TIMEOUT", "5s")]);
    // Under load: the relay has published and goes on publishing.
    sink.wait_past(0, Duration::from_secs(60), "the relay published nothing")
        .await;
    tokio::time::sleep(Duration::from_secs(2 * soak_factor() as u64)).await;
    // A clean exit within the configured 5 s deadline, plus a margin for a loaded machine to end the
    // process (a relay ignoring its deadline waits for the publisher's 20 s+ limits).
    assert_eq!(
        relay.terminate(Duration::from_secs(5 + 10)),
        Some(0),
        "SIGTERM under load is a clean exit within the shutdown deadline"
    );
    let written = load.stop().await;
    // Nothing was left claimed: a new relay drains everything.
    let relay = RelayProcess::start(&table, &sink, &[]);
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(120)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    report("sigterm-under-load", broker, &verdict);
    // Nothing crashed: no duplicate, unless a publish timed out or the shutdown deadline cut a batch
    // off (both logged), the documented causes.
    assert_clean_run(&verdict, &table, BATCH, IN_FLIGHT);
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// Through PgBouncer in transaction mode (`scripts/test-env.sh` starts it), as managed databases
/// are reached: the writers and the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_rabbitmq_through_pgbouncer() {
    killed_in_turn(
        Broker::Amqp,
        1,
        20,
        "sigkill-x20-pgbouncer",
        &pgbouncer_url(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_kafka() {
    killed_in_turn(Broker::Kafka, 1, 20, "sigkill-x20", &database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_x20_sqs() {
    killed_in_turn(Broker::Sqs, 1, 20, "sigkill-x20", &database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_killed_in_turn_rabbitmq() {
    killed_in_turn(Broker::Amqp, 3, 12, "3-relays-sigkill-x12", &database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_killed_in_turn_kafka() {
    killed_in_turn(
        Broker::Kafka,
        3,
        12,
        "3-relays-sigkill-x12",
        &database_url(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_killed_in_turn_sqs() {
    killed_in_turn(Broker::Sqs, 3, 12, "3-relays-sigkill-x12", &database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_every_broker() {
    let _serial = one_at_a_time().await;
    for broker in Broker::ALL {
        sigterm_under_load(broker).await;
    }
}
