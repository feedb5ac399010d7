//! A lost replication slot loses no row event: two `outbox relay` processes under the WAL source
//! (one reads the slot, one stands by) publish to RabbitMQ under continuous writes while the slot
//! is taken from them, twice per scenario: dropped (the second time the reader is SIGKILLed during
//! its fallback, and the standby finishes it), invalidated by `max_slot_wal_keep_size`, removed
//! before a server restart, or its publication loses the outbox table. Each time the reading relay
//! publishes from the outbox table, makes the slot (or publication) again and streams again; the run
//! is judged against the database's record of what committed: nothing lost, nothing out of order,
//! and no duplicate unless a relay was killed or the server restarted (then within what a crash
//! explains).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::wal::FALLBACK_MARK_TYPE;
use txoutbox_postgres::OutboxTable;
use txoutbox_tests::harness::{
    assert_clean_verdict, assert_crash_verdict, logged, relay_log_dir, report_with,
    restart_postgres, wait_until, Broker, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// Scenarios that change the whole server (a restart, `max_slot_wal_keep_size`) run alone; the
/// others may run beside each other.
static SERVER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    /// The reader's replication session ended and the slot dropped (an operator, a failover).
    Dropped,
    /// The slot invalidated by `max_slot_wal_keep_size` (`wal_status = 'lost'`).
    Invalidated,
    /// The slot dropped, then the server restarted.
    RestartedWithoutSlot,
    /// The outbox table removed from the publication.
    Unpublished,
}

impl Fault {
    fn whole_server(self) -> bool {
        matches!(self, Fault::Invalidated | Fault::RestartedWithoutSlot)
    }
}

/// Ends the slot's replication session and drops the slot (the reader connects again within a
/// second: tried until the drop wins).
async fn drop_slot(pg: &sqlx::PgPool, wal: &WalSource) {
    let slot = wal.slot.slot().to_string();
    wait_until(Duration::from_secs(60), "the slot dropped", || {
        let slot = slot.clone();
        async move {
            let _ = sqlx::query(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
            )
            .bind(&slot)
            .execute(pg)
            .await;
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(pg)
                .await
                .is_ok()
        }
    })
    .await;
}

/// Writes WAL elsewhere (another table) with the relays paused, under a small
/// `max_slot_wal_keep_size`, until a checkpoint invalidates the slot; the setting is reset after.
async fn invalidate_slot(
    pg: &sqlx::PgPool,
    wal: &WalSource,
    table: &OutboxTable,
    relays: &[RelayProcess],
) {
    let filler = format!("{}.slot_filler", table.schema());
    sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {filler} (v text)"))
        .execute(pg)
        .await
        .unwrap();
    let _reset = KeepSizeReset(pg.clone());
    sqlx::query("ALTER SYSTEM SET max_slot_wal_keep_size = '32MB'")
        .execute(pg)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(pg)
        .await
        .unwrap();
    for r in relays {
        r.pause();
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let status: Option<String> =
            sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
                .bind(wal.slot.slot())
                .fetch_one(pg)
                .await
                .unwrap();
        if status.as_deref() == Some("lost") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was not invalidated (wal_status {status:?}) after 180 s of WAL"
        );
        // About 40 MB of WAL, then a checkpoint (which invalidates slots past the limit).
        sqlx::query(&format!(
            "INSERT INTO {filler} SELECT repeat(md5(g::text), 32) FROM generate_series(1, 30000) g"
        ))
        .execute(pg)
        .await
        .unwrap();
        sqlx::query("CHECKPOINT").execute(pg).await.unwrap();
    }
    sqlx::query(&format!("TRUNCATE {filler}"))
        .execute(pg)
        .await
        .unwrap();
    for r in relays {
        r.resume();
    }
}

/// Resets `max_slot_wal_keep_size` when dropped (a failed scenario too).
struct KeepSizeReset(sqlx::PgPool);

impl Drop for KeepSizeReset {
    fn drop(&mut self) {
        let pool = self.0.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let _ = sqlx::query("ALTER SYSTEM RESET max_slot_wal_keep_size")
                    .execute(&pool)
                    .await;
                let _ = sqlx::query("SELECT pg_reload_conf()").execute(&pool).await;
            });
        })
        .join();
    }
}

/// Whether a fallback to the outbox table is unfinished (the held table's mark).
async fn in_fallback(pg: &sqlx::PgPool, wal: &WalSource) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE aggregate_type = $1)",
        wal.held.qualified()
    ))
    .bind(FALLBACK_MARK_TYPE)
    .fetch_one(pg)
    .await
    .unwrap_or(false)
}

/// Whether the slot is streamed again: it exists, has its WAL, a relay reads it, and the
/// publication holds the table.
async fn streamed_again(pg: &sqlx::PgPool, wal: &WalSource, table: &OutboxTable) -> bool {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots
                        WHERE slot_name = $1 AND active AND wal_status IS DISTINCT FROM 'lost')
            AND EXISTS (SELECT 1 FROM pg_publication_tables
                        WHERE pubname = $2 AND schemaname = $3 AND tablename = $4)",
    )
    .bind(wal.slot.slot())
    .bind(wal.slot.publication())
    .bind(table.schema())
    .bind(table.table())
    .fetch_one(pg)
    .await
    .unwrap_or(false)
}

async fn slot_lost(fault: Fault, scenario: &str) {
    let (_shared, _alone);
    if fault.whole_server() {
        _alone = Some(SERVER.write().await);
    } else {
        _shared = Some(SERVER.read().await);
    }
    let broker = Broker::Amqp;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let wal = WalSource::setup(&table).await;
    let env = wal.relay_env(&[]);
    let sink = Sink::new(broker).await;
    let load = broker.load(&table).await;
    let mut relays: Vec<RelayProcess> = (0..2)
        .map(|_| RelayProcess::start(&table, &sink, &pairs(&env)))
        .collect();
    let mut before = 0;
    // Relays killed and server restarts: the only causes of duplicates (an interruption that
    // is neither, such as the slot taken from a running reader, publishes nothing twice).
    let mut crashes = 0;
    let rounds = 2;
    let mut recoveries = Vec::new();
    for round in 0..rounds {
        sink.wait_past(
            before,
            Duration::from_secs(120),
            "no progress between two faults: nothing more was delivered",
        )
        .await;
        wait_until(
            Duration::from_secs(60),
            "a relay reads the slot",
            || async { streamed_again(&pg, &wal, &table).await },
        )
        .await;
        let struck = Instant::now();
        match fault {
            Fault::Dropped if round == 1 => {
                // The reader dies during its fallback, and the standby takes over and finishes it:
                // a transaction left open keeps the slot from being made meanwhile (making a
                // logical slot waits for the transactions running).
                let mut blocker = pg.begin().await.unwrap();
                sqlx::query("SELECT txid_current()")
                    .execute(&mut *blocker)
                    .await
                    .unwrap();
                drop_slot(&pg, &wal).await;
                wait_until(Duration::from_secs(60), "the reader falls back", || async {
                    in_fallback(&pg, &wal).await
                })
                .await;
                let tag = wal.reader(&pg).await.expect("a relay reads");
                let i = relays
                    .iter()
                    .position(|r| r.tag == tag)
                    .expect("the reader is one of the scenario's relays");
                relays.remove(i).kill9();
                crashes += 1;
                relays.push(RelayProcess::start(&table, &sink, &pairs(&env)));
                wait_until(
                    Duration::from_secs(60),
                    "the standby takes over during the fallback",
                    || async { wal.reader(&pg).await.is_some_and(|t| t != tag) },
                )
                .await;
                assert!(in_fallback(&pg, &wal).await, "the fallback is unfinished");
                blocker.commit().await.unwrap();
            }
            Fault::Dropped => drop_slot(&pg, &wal).await,
            Fault::Invalidated => invalidate_slot(&pg, &wal, &table, &relays).await,
            Fault::RestartedWithoutSlot => {
                // The relays paused, none makes the slot again before the restart: the server
                // comes back without it, as after a failover to a server that never had it.
                for r in &relays {
                    r.pause();
                }
                drop_slot(&pg, &wal).await;
                tokio::task::spawn_blocking(restart_postgres).await.unwrap();
                crashes += 1;
                let slots: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
                )
                .bind(wal.slot.slot())
                .fetch_one(&pg)
                .await
                .unwrap();
                assert_eq!(slots, 0, "the server restarted without the slot");
                for r in &relays {
                    r.resume();
                }
            }
            Fault::Unpublished => {
                wal.unpublish(&pg, &table).await;
            }
        }
        wait_until(
            Duration::from_secs(180),
            "the slot streamed again (made again by the relay)",
            || async { streamed_again(&pg, &wal, &table).await },
        )
        .await;
        recoveries.push(struck.elapsed());
        before = sink.received_count().await;
    }
    let (committed, verdict) = wal.finish(&pg, &table, &sink, load, relays).await;
    let fallbacks = logged(&table, "falls back to the outbox table");
    let max = recoveries.iter().max().copied().unwrap_or_default();
    report_with(
        scenario,
        broker,
        &verdict,
        &format!(
            " source=wal fallbacks={fallbacks} recovery_max_ms={}",
            max.as_millis()
        ),
    );
    assert!(!committed.is_empty());
    assert!(
        fallbacks >= rounds,
        "{fallbacks} fallbacks logged for {rounds} faults"
    );
    // A crash republishes at most the batches in flight and those settled since the last
    // confirm; without one, the fallback, the repair and the return to streaming publish each
    // event once.
    if crashes == 0 {
        assert_clean_verdict(&verdict);
    } else {
        assert_crash_verdict(&verdict, crashes, BATCH, IN_FLIGHT + 2);
    }
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_twice_under_load() {
    slot_lost(Fault::Dropped, "wal-slot-dropped-x2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_invalidated_under_load() {
    slot_lost(Fault::Invalidated, "wal-slot-invalidated-x2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_removed_and_server_restarted() {
    slot_lost(Fault::RestartedWithoutSlot, "wal-slot-removed-restart-x2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_removed_from_the_publication() {
    slot_lost(Fault::Unpublished, "wal-table-unpublished-x2").await;
}
