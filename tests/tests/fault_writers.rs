//! Scenario 7: writers racing on a few shared aggregates (plain SQL and the writer API, transactions
//! held open at random, some rolled back) while two relay processes publish, one of them SIGKILLed
//! and restarted again and again. Judged against the database: every committed event arrives, each
//! aggregate in `seq` order (which is commit order), nothing rolled back is published, and
//! duplicates stay within what the kills can explain.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_postgres::testing::{database_url, fresh_table, pgbouncer_url, pool};
use txoutbox_tests::harness::{
    assert_crash_verdict, committed_by_seq, one_at_a_time, relay_log_dir, report, soak_factor,
    unpublished, Broker, Kills, RacingLoad, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};

const KEEP: (&str, &str) = ("OUTBOX_DATABASE__KEEP_PROCESSED_FOR", "1h");
/// The WAL source leaves the outbox table's rows in place.
const WAL_KEEP: (&str, &str) = ("OUTBOX_WAL__DELETE_PUBLISHED", "false");
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// With `wal`, the relays read the WAL source (the outbox table's rows are kept, to judge by): one
/// reads, the other stands by, and the kills land on either. With `pooled`, the writers and the
/// relays (polling) go through PgBouncer in transaction mode.
async fn racing_writers_two_relays_killed(broker: Broker, wal: bool, pooled: bool) {
    let _serial = one_at_a_time().await;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup_if(wal, &table).await;
    let env = match &source {
        Some(w) => w.relay_env(&[WAL_KEEP]),
        None => vec![(KEEP.0.to_string(), KEEP.1.to_string())],
    };
    let sink = Sink::new(broker).await;
    let url = if pooled {
        pgbouncer_url()
    } else {
        database_url()
    };
    let load = RacingLoad::start_at(&url, &table, 8, 6, Duration::from_millis(5));
    let mut relays = vec![
        RelayProcess::start_at(&url, &table, &sink, &pairs(&env)),
        RelayProcess::start_at(&url, &table, &sink, &pairs(&env)),
    ];
    let scenario = match (wal, pooled) {
        (true, _) => "racing-writers-2-relays-kill9-wal",
        (false, true) => "racing-writers-2-relays-kill9-pgbouncer",
        (false, false) => "racing-writers-2-relays-kill9",
    };
    let mut killer = Kills::new(scenario);
    let mut before = sink.received_count().await;
    for k in 0..8 * soak_factor() {
        let i = k % relays.len();
        if wal {
            killer.kill_any(relays.remove(i), &sink, before).await;
        } else {
            killer.kill(relays.remove(i), &pg, &sink, before).await;
        }
        before = sink.received_count().await;
        relays.insert(i, RelayProcess::start_at(&url, &table, &sink, &pairs(&env)));
    }
    let rolled_back = load.stop().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    // Under the WAL source the rows stay unmarked (kept for the judgement): the held table is
    // what must drain, and the sink says the rest.
    while match &source {
        Some(w) => w.held_unpublished().await > 0,
        None => unpublished(&pg, &table).await > 0,
    } {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relays did not drain the outbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let committed = committed_by_seq(&pg, &table).await;
    sink.wait_all(&committed, Duration::from_secs(120)).await;
    for r in relays {
        assert_eq!(r.terminate(Duration::from_secs(60)), Some(0));
    }
    // Late re-deliveries count too: read until nothing more arrives, then judge all of it.
    let verdict = sink.judge(&committed).await;
    report(scenario, broker, &verdict);
    println!("rolled_back={}", rolled_back.len());
    if !wal {
        killer.assert_some_hit_work();
    }
    assert!(!committed.is_empty() && !rolled_back.is_empty());
    // Rolled-back events are not in the outbox: any of them received counts as unexpected.
    // WAL source: what was published and not yet confirmed is read again (one more round).
    assert_crash_verdict(&verdict, killer.count, BATCH, IN_FLIGHT + usize::from(wal));
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// Through PgBouncer in transaction mode (`scripts/test-env.sh` starts it), as managed databases
/// are reached: the writers and both relays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_rabbitmq_through_pgbouncer() {
    racing_writers_two_relays_killed(Broker::Amqp, false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_rabbitmq_wal_source() {
    racing_writers_two_relays_killed(Broker::Amqp, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_kafka_wal_source() {
    racing_writers_two_relays_killed(Broker::Kafka, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_kafka() {
    racing_writers_two_relays_killed(Broker::Kafka, false, false).await;
}
