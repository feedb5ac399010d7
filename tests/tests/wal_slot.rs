//! The WAL source when its slot cannot be streamed, with `wal.auto_recreate = false` (the operator
//! makes it again): the relay publishes the outbox table's rows meanwhile, readiness fails naming
//! the fix, and once `outbox wal setup` ran the relay streams again; table-less events committed
//! while no slot existed are counted as a gap. And an idle outbox on a busy database: the slot keeps
//! no more WAL than a few checkpoints' worth.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::testkit::{sample_event, ScriptedPublisher};
use txoutbox_core::{CancellationToken, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::wal::{mark_new_slot, MessageWriter, WalStore};
use txoutbox_postgres::{OutboxTable, Writer};
use txoutbox_tests::harness::{assert_clean_verdict, wait_until};
use txoutbox_tests::wal::{run_store, wal_position, WalSource};
use txoutbox_tests::{check, Verdict};
use uuid::Uuid;

/// One event for each of 5 aggregates, in one transaction; each event's aggregate and id.
async fn write_rows(pool: &sqlx::PgPool, table: &OutboxTable, round: usize) -> Vec<(String, Uuid)> {
    let writer = Writer::new(table.clone());
    let mut tx = pool.begin().await.unwrap();
    let events: Vec<_> = (0..5)
        .map(|a| sample_event(&format!("agg-{a}"), round))
        .collect();
    let aggregates: Vec<String> = events.iter().map(|e| e.aggregate_id.clone()).collect();
    let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
    writer.commit(tx).await.unwrap();
    aggregates.into_iter().zip(ids).collect()
}

/// A table-less event, committed: its aggregate and id.
async fn write_message(pool: &sqlx::PgPool, table: &OutboxTable, n: usize) -> (String, Uuid) {
    write_message_of(pool, table, "message", n).await
}

/// A table-less event of `aggregate`, committed: its aggregate and id.
async fn write_message_of(
    pool: &sqlx::PgPool,
    table: &OutboxTable,
    aggregate: &str,
    n: usize,
) -> (String, Uuid) {
    let mut tx = pool.begin().await.unwrap();
    let e = sample_event(aggregate, n);
    let aggregate = e.aggregate_id.clone();
    let id = MessageWriter::new(table.schema(), table)
        .emit(&mut tx, e)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    (aggregate, id)
}

async fn delivered(publisher: &ScriptedPublisher, events: &[(String, Uuid)]) {
    wait_until(Duration::from_secs(60), "the events delivered", || async {
        let got: std::collections::HashSet<Uuid> =
            publisher.delivered().iter().map(|e| e.id).collect();
        events.iter().all(|(_, id)| got.contains(id))
    })
    .await;
}

/// The verdict over what `publisher` delivered, in order.
fn verdict(publisher: &ScriptedPublisher, committed: &[(String, Uuid)]) -> Verdict {
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    check(committed, &received)
}

/// A relay over a fresh table's WAL source, running.
struct Running {
    pool: sqlx::PgPool,
    table: OutboxTable,
    wal: WalSource,
    publisher: Arc<ScriptedPublisher>,
    shutdown: CancellationToken,
    store: WalStore,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn start(auto_recreate: bool) -> Running {
        Running::start_with(auto_recreate, true).await
    }

    async fn start_with(auto_recreate: bool, delete_published: bool) -> Running {
        let pool = pool(4).await;
        let table = fresh_table(&pool).await;
        let mut wal = WalSource::setup(&table).await;
        wal.config.auto_recreate = auto_recreate;
        wal.config.delete_published = delete_published;
        let publisher = ScriptedPublisher::new();
        let shutdown = CancellationToken::new();
        let store = wal.store(txoutbox_core::Wake::new()).await;
        let task = run_store(store.clone(), publisher.clone(), &shutdown);
        Running {
            pool,
            table,
            wal,
            publisher,
            shutdown,
            store,
            task,
        }
    }
}

/// Ends the slot's replication session and drops the slot (the reader connects again within a
/// second: tried until the drop wins).
async fn drop_the_slot(pool: &sqlx::PgPool, wal: &WalSource) {
    wait_until(Duration::from_secs(30), "the slot dropped", || async {
        let _ = sqlx::query(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
             WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(wal.slot.slot())
        .execute(pool)
        .await;
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(wal.slot.slot())
            .execute(pool)
            .await
            .is_ok()
    })
    .await;
}

/// How many times the store fell back for `reason`.
fn fallbacks_for(store: &WalStore, reason: &str) -> u64 {
    store
        .progress()
        .fallback
        .by_reason
        .iter()
        .find(|(r, _)| *r == reason)
        .map_or(0, |(_, n)| *n)
}

/// Rows of the outbox table (the WAL source deletes what it published, once confirmed).
async fn rows_left(pool: &sqlx::PgPool, table: &OutboxTable) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    SlotDropped,
    TableUnpublished,
    TableRecreated,
}

async fn operator_makes_it_again(fault: Fault) {
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start(false).await;
    let mut rows = Vec::new();
    let mut messages = Vec::new();
    for round in 0..3 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    messages.push(write_message(&pool, &table, 0).await);
    delivered(&publisher, &[rows.clone(), messages.clone()].concat()).await;
    // Everything confirmed on the server (rows deleted, the message's position passed): nothing is
    // published twice after the fault.
    let position = wal_position(&pool).await;
    wait_until(Duration::from_secs(30), "everything confirmed", || async {
        rows_left(&pool, &table).await == 0 && wal.confirmed(&pool).await >= position
    })
    .await;
    let mut unread = None;
    let mut unread_span = 0;
    match fault {
        Fault::SlotDropped => {
            drop_the_slot(&pool, &wal).await;
            let dropped_at = wal_position(&pool).await;
            // No slot holds it: not published, and counted.
            unread = Some(write_message(&pool, &table, 1).await);
            // The gap reported must cover it: from at most where the old slot stood when it
            // was dropped to at least past the message.
            unread_span = wal_position(&pool).await - dropped_at;
        }
        Fault::TableUnpublished => {
            wal.unpublish(&pool, &table).await;
        }
        Fault::TableRecreated => {
            sqlx::query(&format!("DROP TABLE {} CASCADE", table.qualified()))
                .execute(&pool)
                .await
                .unwrap();
            // Made again as a new installation would (its bookkeeping gone with it).
            sqlx::query(&format!(
                "DROP TABLE \"{}\".\"{}_migrations\"",
                table.schema(),
                table.table()
            ))
            .execute(&pool)
            .await
            .unwrap();
            txoutbox_postgres::migrate(&pool, &table).await.unwrap();
        }
    }
    // Written while the slot cannot be streamed: published from the table.
    let mut during = Vec::new();
    for round in 3..6 {
        during.extend(write_rows(&pool, &table, round).await);
    }
    delivered(&publisher, &during).await;
    rows.extend(during);
    let reason = store.progress().fallback.reason.expect("in fallback");
    let e = store.check().await.expect_err("not ready in fallback");
    assert!(
        e.message().contains("outbox wal setup") && e.message().contains("auto_recreate"),
        "readiness names the fix: {e}"
    );
    assert!(
        reason.contains(match fault {
            Fault::SlotDropped => "does not exist",
            Fault::TableUnpublished | Fault::TableRecreated => "does not hold",
        }),
        "{reason}"
    );
    // The operator makes it again.
    wal.slot.setup(&pool).await.unwrap();
    wait_until(Duration::from_secs(60), "streaming again", || async {
        store.progress().fallback.reason.is_none() && store.check().await.is_ok()
    })
    .await;
    for round in 6..9 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    messages.push(write_message(&pool, &table, 2).await);
    delivered(&publisher, &[rows.clone(), messages.clone()].concat()).await;
    shutdown.cancel();
    task.await.unwrap();
    // Once each, in order per aggregate; the unread message never (it would be unexpected).
    assert_clean_verdict(&verdict(&publisher, &[rows, messages].concat()));
    let progress = store.progress();
    // One fallback (counted again should the reader reconnect in the middle).
    assert!(progress.fallback.total >= 1, "{progress:?}");
    assert!(progress.fallback.moved >= 15, "{progress:?}");
    let reason = match fault {
        Fault::SlotDropped => "slot_missing",
        Fault::TableUnpublished | Fault::TableRecreated => "table_not_published",
    };
    assert!(fallbacks_for(&store, reason) >= 1, "{progress:?}");
    match unread {
        Some(_) => {
            assert_eq!(progress.fallback.tableless_gaps, 1, "{progress:?}");
            assert!(
                progress.fallback.tableless_gap_bytes >= unread_span,
                "the gap's range covers the unread message ({unread_span} bytes at least): {progress:?}"
            );
        }
        None => assert_eq!(progress.fallback.tableless_gaps, 0, "{progress:?}"),
    }
}

/// With `wal.delete_published = false` the outbox table keeps published rows, so a missing slot
/// (or a publication without the table) cannot be made up for from the table: the reader publishes
/// nothing from it, stays reported as falling back (not ready, counted once) until `outbox wal
/// setup`, then streams again, leaving no fallback mark behind.
async fn without_deleting_published_rows(fault: Fault) {
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start_with(false, false).await;
    let mut rows = write_rows(&pool, &table, 0).await;
    delivered(&publisher, &rows).await;
    let reason = match fault {
        Fault::SlotDropped => {
            drop_the_slot(&pool, &wal).await;
            "slot_missing"
        }
        Fault::TableUnpublished => {
            wal.unpublish(&pool, &table).await;
            "table_not_published"
        }
        Fault::TableRecreated => unreachable!("not a case of this test"),
    };
    // Not published: no slot decodes them, and the table's published rows look the same.
    let _unpublished = write_rows(&pool, &table, 1).await;
    wait_until(Duration::from_secs(30), "the reader falls back", || async {
        store.progress().fallback.reason.is_some()
    })
    .await;
    // Held while the slot is missing (a reader that gave up and tried again every second would
    // leave it now and then, and count each try).
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let progress = store.progress();
        assert!(progress.fallback.reason.is_some(), "{progress:?}");
        let e = store.check().await.expect_err("not ready without the slot");
        assert!(e.message().contains("outbox wal setup"), "{e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(fallbacks_for(&store, reason), 1);
    wal.slot.setup(&pool).await.unwrap();
    wait_until(Duration::from_secs(60), "streaming again", || async {
        store.progress().fallback.reason.is_none() && store.check().await.is_ok()
    })
    .await;
    // No fallback mark is left: one would make a relay that deletes published rows (after a change
    // of the setting) move, and publish again, every row the table keeps.
    let marks: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE event_type = $1",
        wal.held.qualified()
    ))
    .bind(txoutbox_postgres::wal::FALLBACK_MARK_TYPE)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(marks, 0, "a fallback mark is left in the held table");
    let after = write_rows(&pool, &table, 2).await;
    delivered(&publisher, &after).await;
    rows.extend(after);
    shutdown.cancel();
    task.await.unwrap();
    // Those written without a slot would count as unexpected.
    assert_clean_verdict(&verdict(&publisher, &rows));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_deleting_published_rows_a_missing_slot_waits_for_setup() {
    without_deleting_published_rows(Fault::SlotDropped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_deleting_published_rows_an_unpublished_table_waits_for_setup() {
    without_deleting_published_rows(Fault::TableUnpublished).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_without_auto_recreate_publishes_the_table_until_setup() {
    operator_makes_it_again(Fault::SlotDropped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_out_of_the_publication_fails_readiness_and_loses_no_row() {
    operator_makes_it_again(Fault::TableUnpublished).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_dropped_and_made_again_fails_readiness_and_loses_no_row() {
    operator_makes_it_again(Fault::TableRecreated).await;
}

/// Aggregates written both ways while the table is out of the publication (the slot can still be
/// read): the table-less events are published during the fallback too, each before the rows of its
/// aggregate written after it, and none again once the relay streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_write_forms_keep_their_order_while_the_table_is_out_of_the_publication() {
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start(false).await;
    let mut committed = write_rows(&pool, &table, 0).await;
    delivered(&publisher, &committed).await;
    wal.unpublish(&pool, &table).await;
    wait_until(Duration::from_secs(30), "the reader falls back", || async {
        store.progress().fallback.reason.is_some()
    })
    .await;
    // Each round: a table-less event of agg-0 and agg-3, then a row of every aggregate.
    for n in 1..6 {
        committed.push(write_message_of(&pool, &table, "agg-0", n).await);
        committed.push(write_message_of(&pool, &table, "agg-3", n).await);
        committed.extend(write_rows(&pool, &table, n).await);
    }
    // Published from the table and the slot while the table is still out of the publication.
    delivered(&publisher, &committed).await;
    assert!(store.progress().fallback.reason.is_some());
    wal.slot.setup(&pool).await.unwrap();
    wait_until(Duration::from_secs(60), "streaming again", || async {
        store.progress().fallback.reason.is_none() && store.check().await.is_ok()
    })
    .await;
    for n in 6..8 {
        committed.push(write_message_of(&pool, &table, "agg-0", n).await);
        committed.extend(write_rows(&pool, &table, n).await);
    }
    delivered(&publisher, &committed).await;
    shutdown.cancel();
    task.await.unwrap();
    // In order per aggregate across both forms, each once (the stream skips what the fallback
    // took from the slot).
    assert_clean_verdict(&verdict(&publisher, &committed));
}

/// The table removed from the publication and added again at once (between two looks of the
/// reader): the rows written in between were not decoded, and are published from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_removed_and_added_again_at_once_loses_no_row() {
    // The test adds the table back itself (a relay that looked in between would have).
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start(false).await;
    let mut rows = Vec::new();
    for round in 0..3 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    delivered(&publisher, &rows).await;
    let alter = |what: &str| {
        format!(
            "ALTER PUBLICATION {} {what} TABLE {}",
            wal.slot.publication(),
            table.qualified()
        )
    };
    sqlx::query(&alter("DROP")).execute(&pool).await.unwrap();
    for round in 3..6 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    sqlx::query(&alter("ADD")).execute(&pool).await.unwrap();
    for round in 6..9 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    delivered(&publisher, &rows).await;
    wait_until(Duration::from_secs(30), "streaming again", || async {
        store.progress().fallback.reason.is_none() && store.progress().fallback.total >= 1
    })
    .await;
    shutdown.cancel();
    task.await.unwrap();
    // The rows written after the table was added back are both moved and streamed: published
    // once all the same.
    assert_clean_verdict(&verdict(&publisher, &rows));
    assert!(
        store.progress().fallback.moved >= 15,
        "{:?}",
        store.progress()
    );
}

/// What takes the slot from its reader in [`writers_racing_the_fallback`].
#[derive(Clone, Copy, PartialEq)]
enum Strike {
    /// The slot dropped with its session, made again by the reader (`wal.auto_recreate`).
    SlotDropped,
    /// The table taken out of the publication and put back by the operator.
    Unpublished,
    /// Only the replication session ended (the slot stays): the reading ends early, without a
    /// fallback, and the same relay reads again.
    StreamEnded,
}

/// Writers never stop while the slot is taken from the reader three times. The reader falls back
/// (or only reads again), makes the slot or waits for the publication, moves the table's rows and
/// streams again: each time rows commit between the new stream's start and the last move, and
/// batches are in flight when the stream ends. Nothing crashed: each event once, in order.
async fn writers_racing_the_fallback(strike: Strike) {
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start(strike == Strike::SlotDropped).await;
    let stop_writing = CancellationToken::new();
    let writers = {
        let (pool, table, stop) = (pool.clone(), table.clone(), stop_writing.clone());
        tokio::spawn(async move {
            let mut rows = Vec::new();
            let mut round = 0;
            while !stop.is_cancelled() {
                rows.extend(write_rows(&pool, &table, round).await);
                round += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            rows
        })
    };
    for n in 1..=3u64 {
        wait_until(
            Duration::from_secs(60),
            "deliveries before the fault",
            || async { publisher.delivered().len() >= 100 * n as usize },
        )
        .await;
        match strike {
            Strike::Unpublished => {
                wal.unpublish(&pool, &table).await;
                wait_until(Duration::from_secs(60), "the reader falls back", || async {
                    store.progress().fallback.total >= n
                })
                .await;
                wal.republish(&pool, &table).await;
            }
            Strike::SlotDropped => drop_the_slot(&pool, &wal).await,
            Strike::StreamEnded => {
                let ended = end_the_stream(&pool, &wal).await;
                wait_until(Duration::from_secs(60), "a new stream", || async {
                    slot_pid(&pool, &wal).await.is_some_and(|pid| pid != ended)
                })
                .await;
            }
        }
        wait_until(Duration::from_secs(120), "streaming again", || async {
            let p = store.progress();
            let fell_back = strike == Strike::StreamEnded || p.fallback.total >= n;
            fell_back && p.fallback.reason.is_none() && store.check().await.is_ok()
        })
        .await;
    }
    stop_writing.cancel();
    let rows = writers.await.unwrap();
    delivered(&publisher, &rows).await;
    shutdown.cancel();
    task.await.unwrap();
    assert_clean_verdict(&verdict(&publisher, &rows));
    let moved = store.progress().fallback.moved;
    if strike == Strike::StreamEnded {
        assert_eq!(
            store.progress().fallback.total,
            0,
            "no fallback: {moved} moved"
        );
    } else {
        assert!(moved > 0, "{:?}", store.progress());
    }
}

/// The server process of the slot's replication session, if one streams it.
async fn slot_pid(pool: &sqlx::PgPool, wal: &WalSource) -> Option<i32> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(wal.slot.slot())
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
}

/// Ends the slot's replication session (the slot stays); the server process ended.
async fn end_the_stream(pool: &sqlx::PgPool, wal: &WalSource) -> i32 {
    let pid = slot_pid(pool, wal).await.expect("a stream of the slot");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(pool)
        .await
        .unwrap();
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_racing_a_slot_made_again_get_each_event_once() {
    writers_racing_the_fallback(Strike::SlotDropped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_racing_a_publication_repair_get_each_event_once() {
    writers_racing_the_fallback(Strike::Unpublished).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_racing_a_stream_that_ends_get_each_event_once() {
    writers_racing_the_fallback(Strike::StreamEnded).await;
}

/// Rows committed before the slot was made are not in it: with the mark `outbox wal setup` writes
/// when it makes the slot (as a relay does when it makes it again and stops before moving them),
/// the relay moves them to the held table before it streams, and publishes each once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_the_slot_was_made_are_published() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let mut rows = Vec::new();
    for round in 0..3 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    let wal = WalSource::setup(&table).await;
    mark_new_slot(&pool, &table, &wal.held, wal.slot.slot())
        .await
        .unwrap();
    for round in 3..6 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let store = wal.store(txoutbox_core::Wake::new()).await;
    let task = run_store(store.clone(), publisher.clone(), &shutdown);
    delivered(&publisher, &rows).await;
    for round in 6..9 {
        rows.extend(write_rows(&pool, &table, round).await);
    }
    delivered(&publisher, &rows).await;
    wait_until(Duration::from_secs(30), "streaming", || async {
        store.progress().fallback.reason.is_none() && store.check().await.is_ok()
    })
    .await;
    shutdown.cancel();
    task.await.unwrap();
    assert_clean_verdict(&verdict(&publisher, &rows));
    assert_eq!(
        store.progress().fallback.moved,
        15,
        "the rows before the slot"
    );
}

/// The WAL the slot keeps (from its restart position).
async fn retained(pool: &sqlx::PgPool, wal: &WalSource) -> i64 {
    sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint FROM pg_replication_slots
         WHERE slot_name = $1",
    )
    .bind(wal.slot.slot())
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_on_a_busy_database_keeps_no_wal() {
    let Running {
        pool,
        table,
        wal,
        publisher,
        shutdown,
        store,
        task,
    } = Running::start(true).await;
    wait_until(Duration::from_secs(30), "the reader reads", || async {
        store.progress().active
    })
    .await;
    let other = format!("{}.busy", table.schema());
    sqlx::query(&format!("CREATE TABLE {other} (v text)"))
        .execute(&pool)
        .await
        .unwrap();
    // About 128 MB of WAL in another table, none in the outbox.
    let written_from = wal_position(&pool).await;
    for _ in 0..8 {
        sqlx::query(&format!(
            "INSERT INTO {other} SELECT repeat(md5(g::text), 16) FROM generate_series(1, 20000) g"
        ))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(&format!("TRUNCATE {other}"))
            .execute(&pool)
            .await
            .unwrap();
    }
    let written = wal_position(&pool).await - written_from;
    assert!(written > 64 << 20, "wrote {written} bytes of WAL");
    // The reader confirms the idle slot's position; the slot's restart position follows at the
    // next snapshots of running transactions (each checkpoint logs one).
    wait_until(
        Duration::from_secs(120),
        "the slot keeps less than an eighth of the WAL written since",
        || async {
            let _ = sqlx::query("CHECKPOINT").execute(&pool).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            retained(&pool, &wal).await < (written / 8) as i64
        },
    )
    .await;
    shutdown.cancel();
    task.await.unwrap();
    assert!(publisher.delivered().is_empty());
}
