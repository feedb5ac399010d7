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

use txoutbox_core::testkit::sample_event;
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::wal::{MessageWriter, FALLBACK_MARK_TYPE};
use txoutbox_postgres::{OutboxTable, Writer};
use txoutbox_tests::harness::{
    assert_clean_verdict, assert_crash_verdict, logged, relay_log_dir, report_with,
    restart_postgres, wait_until, Broker, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, wal_position, WalSource};

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

/// Writers racing on a few shared aggregates with both write forms: each transaction writes one
/// event of one aggregate, a row (the writer API) or a table-less event (`MessageWriter::emit`),
/// held open a few milliseconds, and records it in a table of its own in the same transaction (in
/// the order the aggregate's writer-order lock gives: commit order per aggregate). A table-less
/// event's transaction holds `tableless` for reading: the scenario takes it for writing while no
/// slot exists, when table-less events are lost by design (GUARANTEES.md section 5).
struct BothForms {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    tableless: std::sync::Arc<tokio::sync::RwLock<()>>,
    record: String,
}

impl BothForms {
    async fn start(pg: &sqlx::PgPool, table: &OutboxTable, prefix: &str, writers: usize) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let commits = format!("\"{}\".both_forms_commits", table.schema());
        sqlx::query(&format!(
            "CREATE TABLE {commits} (n bigserial PRIMARY KEY, id uuid NOT NULL, aggregate_id text NOT NULL,
                                     table_less bool NOT NULL)"
        ))
        .execute(pg)
        .await
        .unwrap();
        let record =
            format!("INSERT INTO {commits} (id, aggregate_id, table_less) VALUES ($1, $2, $3)");
        let stop = Arc::new(AtomicBool::new(false));
        let tableless = Arc::new(tokio::sync::RwLock::new(()));
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (table, stop, tableless, record) = (
                table.clone(),
                stop.clone(),
                tableless.clone(),
                record.clone(),
            );
            let prefix = prefix.to_string();
            let mut rng = txoutbox_tests::harness::rng(&format!("both forms writer {w}"));
            tasks.push(tokio::spawn(async move {
                let pg = pool(1).await;
                let writer = Writer::new(table.clone());
                let messages = MessageWriter::new(prefix, &table);
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let aggregate = format!("b-a{}", rng.usize(0..6));
                    let event = sample_event(&aggregate, n);
                    let id = event.id;
                    n += 1;
                    let table_less = rng.bool();
                    let _guard = if table_less {
                        Some(tableless.read().await)
                    } else {
                        None
                    };
                    let Ok(mut tx) = pg.begin().await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    if table_less {
                        messages.emit(&mut tx, event).await.unwrap();
                    } else {
                        writer.enqueue(&mut tx, event).await.unwrap();
                    }
                    sqlx::query(&record)
                        .bind(id)
                        .bind(&aggregate)
                        .bind(table_less)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_micros(rng.u64(0..3_000))).await;
                    tx.commit().await.unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }));
        }
        BothForms {
            stop,
            tasks,
            tableless,
            record,
        }
    }

    /// Stops the writers; what committed, in the order the aggregates' locks gave.
    async fn stop(self, pg: &sqlx::PgPool, table: &OutboxTable) -> Vec<(String, uuid::Uuid)> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for t in self.tasks {
            t.await.unwrap();
        }
        sqlx::query_as(&format!(
            "SELECT aggregate_id, id FROM \"{}\".both_forms_commits ORDER BY n",
            table.schema()
        ))
        .fetch_all(pg)
        .await
        .unwrap()
    }
}

/// Every transition of the WAL source at once, with both write forms: racing writers on a few
/// aggregates write rows and table-less events while the table is taken out of the publication
/// and the slot dropped, each twice, under two relays (one reads, one stands by). Each time the
/// table is out, a transaction that wrote both forms meanwhile stays open until after the relay
/// put the table back (the return to streaming waits for it). Table-less events are not written
/// while no slot exists (no slot can read them: a documented gap the relay reports). Nothing is
/// killed: lost, out of order, unexpected and duplicates all 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_write_forms_through_every_fallback() {
    let _shared = SERVER.read().await;
    let broker = Broker::Amqp;
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let wal = WalSource::setup(&table).await;
    let env = wal.relay_env(&[]);
    let sink = Sink::new(broker).await;
    let relays: Vec<RelayProcess> = (0..2)
        .map(|_| RelayProcess::start(&table, &sink, &pairs(&env)))
        .collect();
    let prefix = wal.slot.message_prefix().to_string();
    let load = BothForms::start(&pg, &table, &prefix, 3).await;
    let mut long = Vec::new();
    let mut before = 0;
    let faults = [
        Fault::Unpublished,
        Fault::Dropped,
        Fault::Unpublished,
        Fault::Dropped,
    ];
    for (round, fault) in faults.into_iter().enumerate() {
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
        match fault {
            Fault::Unpublished => {
                wal.unpublish(&pg, &table).await;
                // Written while the table is out, committed after the relay put it back.
                let mut tx = pg.begin().await.unwrap();
                let aggregate = format!("b-a{}", round % 6);
                let row = sample_event(&aggregate, 10_000 + round);
                let message = sample_event(&aggregate, 20_000 + round);
                let ids = [row.id, message.id];
                Writer::new(table.clone())
                    .enqueue(&mut tx, row)
                    .await
                    .unwrap();
                MessageWriter::new(prefix.clone(), &table)
                    .emit(&mut tx, message)
                    .await
                    .unwrap();
                for (id, table_less) in [(ids[0], false), (ids[1], true)] {
                    sqlx::query(&load.record)
                        .bind(id)
                        .bind(&aggregate)
                        .bind(table_less)
                        .execute(&mut *tx)
                        .await
                        .unwrap();
                }
                wait_until(
                    Duration::from_secs(60),
                    "the relay puts the table back in the publication",
                    || async { wal.published(&pg, &table).await },
                )
                .await;
                // The relay waits for this transaction before it streams again.
                tokio::time::sleep(Duration::from_millis(500)).await;
                assert!(
                    !streamed_again(&pg, &wal, &table).await || in_fallback(&pg, &wal).await,
                    "streaming resumed past a transaction that wrote while the table was out"
                );
                tx.commit().await.unwrap();
                long.extend(ids);
            }
            Fault::Dropped => {
                let _no_tableless = load.tableless.write().await;
                // Every table-less event written so far read from the slot and confirmed: those
                // the slot still held when dropped would be lost with it (the documented gap).
                let written = wal_position(&pg).await;
                wait_until(
                    Duration::from_secs(60),
                    "the slot confirmed past every table-less event",
                    || async { wal.confirmed(&pg).await >= written },
                )
                .await;
                drop_slot(&pg, &wal).await;
                wait_until(
                    Duration::from_secs(180),
                    "the slot streamed again (made again by the relay)",
                    || async { streamed_again(&pg, &wal, &table).await },
                )
                .await;
            }
            _ => unreachable!("not a fault of this scenario"),
        }
        wait_until(
            Duration::from_secs(180),
            "the slot streamed again",
            || async { streamed_again(&pg, &wal, &table).await },
        )
        .await;
        before = sink.received_count().await;
    }
    let committed = load.stop(&pg, &table).await;
    let verdict = wal.finish_with(&sink, &committed, relays).await;
    let fallbacks = logged(&table, "falls back to the outbox table");
    report_with(
        "wal-both-forms-unpublished-and-dropped-x2",
        broker,
        &verdict,
        &format!(
            " source=wal fallbacks={fallbacks} held_open={}",
            long.len() / 2
        ),
    );
    if verdict.duplicates + verdict.order_violations + verdict.lost > 0 {
        explain(&pg, &table, &sink, &committed).await;
    }
    assert!(fallbacks >= faults.len(), "{fallbacks} fallbacks logged");
    assert!(committed.iter().any(|(_, id)| long.contains(id)));
    assert_clean_verdict(&verdict);
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// Prints what went wrong in [`both_write_forms_through_every_fallback`]: each event received twice
/// or out of order, with its form and where it was received.
async fn explain(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    sink: &Sink,
    committed: &[(String, uuid::Uuid)],
) {
    let forms: std::collections::HashMap<uuid::Uuid, bool> = sqlx::query_as(&format!(
        "SELECT id, table_less FROM \"{}\".both_forms_commits",
        table.schema()
    ))
    .fetch_all(pg)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let position: std::collections::HashMap<uuid::Uuid, (usize, &str)> = committed
        .iter()
        .enumerate()
        .map(|(i, (a, id))| (*id, (i, a.as_str())))
        .collect();
    let received = sink.received_settled().await;
    let mut seen = std::collections::HashSet::new();
    let mut last: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let form_of = |i: usize| {
        if forms.get(&committed[i].1).copied().unwrap_or(false) {
            "table-less"
        } else {
            "row"
        }
    };
    for (at, id) in received.iter().enumerate() {
        let Some((i, aggregate)) = position.get(id).copied() else {
            continue;
        };
        let form = if forms.get(id).copied().unwrap_or(false) {
            "table-less"
        } else {
            "row"
        };
        if !seen.insert(*id) {
            println!("received again at {at}: {aggregate} #{i} ({form}) {id}");
            continue;
        }
        if let Some(&prev) = last.get(aggregate) {
            if i < prev {
                println!(
                    "out of order at {at}: {aggregate} #{i} ({form}) {id} after #{prev} ({})",
                    form_of(prev)
                );
            }
        }
        last.insert(aggregate, last.get(aggregate).copied().unwrap_or(0).max(i));
    }
    for (i, (aggregate, id)) in committed.iter().enumerate() {
        if !seen.contains(id) {
            println!("never received: {aggregate} #{i} ({}) {id}", form_of(i));
        }
    }
}
