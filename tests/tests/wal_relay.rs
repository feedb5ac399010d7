//! The relay engine over the WAL source (a logical replication slot of the real PostgreSQL, with
//! `wal_level = logical` set by `scripts/test-env.sh`): order, failures moved to the held table,
//! dead letters, table-less events, and a standby taking over.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_core::testkit::{sample_event, Behavior, ScriptedPublisher};
use txoutbox_core::{CancellationToken, RelayConfig, RetryPolicy, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::wal::{MessageWriter, UNDECODABLE_AGGREGATE_TYPE};
use txoutbox_postgres::{DeadLetterFilter, OutboxTable};
use txoutbox_tests::harness::{assert_clean_verdict, wait_until};
use txoutbox_tests::wal::WalSource;
use txoutbox_tests::{check, write_rounds};
use uuid::Uuid;

fn relay_config() -> RelayConfig {
    RelayConfig {
        batch_size: 50,
        max_in_flight: 2,
        poll_interval: Duration::from_millis(50),
        min_poll_interval: Duration::from_millis(5),
        retry: RetryPolicy {
            max_attempts: 50,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
            multiplier: 2.0,
            jitter: 0.2,
        },
        ..RelayConfig::default()
    }
}

/// A relay over `wal` with this file's settings, publishing to `publisher` until `shutdown`.
async fn spawn(
    wal: &WalSource,
    publisher: &std::sync::Arc<ScriptedPublisher>,
    shutdown: &CancellationToken,
) -> (
    txoutbox_postgres::wal::WalStore,
    tokio::task::JoinHandle<txoutbox_core::RelaySummary>,
) {
    wal.spawn_relay(publisher.clone(), relay_config(), shutdown.clone())
        .await
}

/// A fresh outbox table with its WAL source, a scripted publisher and a shutdown token.
struct Fixture {
    pool: sqlx::PgPool,
    table: OutboxTable,
    wal: WalSource,
    publisher: std::sync::Arc<ScriptedPublisher>,
    shutdown: CancellationToken,
}

async fn fixture() -> Fixture {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let wal = WalSource::setup(&table).await;
    Fixture {
        pool,
        table,
        wal,
        publisher: ScriptedPublisher::new(),
        shutdown: CancellationToken::new(),
    }
}

async fn source_rows(pool: &sqlx::PgPool, table: &OutboxTable) -> i64 {
    sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until every committed event was delivered, nothing waits in the held table, and the
/// outbox table was emptied.
async fn drained(
    pool: &sqlx::PgPool,
    table: &OutboxTable,
    wal: &WalSource,
    publisher: &ScriptedPublisher,
    total: usize,
) {
    wait_until(Duration::from_secs(120), "the WAL relays drain", || async {
        let delivered: std::collections::HashSet<Uuid> =
            publisher.delivered().iter().map(|e| e.id).collect();
        delivered.len() >= total
            && wal.held_unpublished().await == 0
            && source_rows(pool, table).await == 0
    })
    .await;
}

/// What the publisher received of `committed`, judged, once the relay of `task` stopped.
async fn judged(
    publisher: &ScriptedPublisher,
    shutdown: &CancellationToken,
    task: tokio::task::JoinHandle<txoutbox_core::RelaySummary>,
    committed: &[(String, Uuid)],
    what: &str,
) -> txoutbox_tests::Verdict {
    shutdown.cancel();
    task.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(committed, &received);
    println!("{what}: {verdict}");
    verdict
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_relays_keep_order_through_random_failures_with_a_standby() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let (a, ta) = spawn(&wal, &publisher, &shutdown).await;
    let (b, tb) = spawn(&wal, &publisher, &shutdown).await;
    wait_until(
        Duration::from_secs(30),
        "one relay reads the slot",
        || async { a.progress().active || b.progress().active },
    )
    .await;
    // Retryable failures on about 8% of the events (by id: random), each failing once or twice:
    // the failed event and the later ones of its aggregate go through the held table.
    publisher.when(
        |e| e.id.as_u128() % 100 < 4,
        Behavior::FailRetryableTimes(1),
    );
    publisher.when(
        |e| (4..8).contains(&(e.id.as_u128() % 100)),
        Behavior::FailRetryableTimes(2),
    );
    let mut committed = Vec::new();
    for _ in 0..4 {
        // The same 100 aggregates each time, committed later and later.
        committed.extend(write_rounds(&table, 100, 5).await);
    }
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    assert!(
        a.progress().active != b.progress().active,
        "exactly one reader: {:?} {:?}",
        a.progress(),
        b.progress()
    );
    shutdown.cancel();
    ta.await.unwrap();
    tb.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("WAL source, two relays, 100 aggregates x 20 events, 8% failing: {verdict}");
    assert_clean_verdict(&verdict);
    // A failed event is published again from the held table, carrying its attempts.
    let moved = publisher
        .delivered()
        .iter()
        .filter(|e| e.attempts > 0)
        .count();
    println!("failed events published again from the held table: {moved}");
    assert!(moved > 0, "the failures went through the held table");
    // Everything is confirmed: the slot holds nothing of this outbox any more (once the server
    // has let go of the readers' slot and taken their last confirms, which it does on its own time).
    wait_until(
        Duration::from_secs(60),
        "the slot released and everything of this outbox confirmed",
        || async { wal.slot.status(&pool).await.unwrap().lag_seconds == Some(0.0) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_dead_letters_and_holds_back_only_its_aggregate() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let committed = write_rounds(&table, 10, 6).await;
    let poison = committed
        .iter()
        .filter(|(a, _)| a == "agg-3")
        .nth(1)
        .unwrap()
        .1;
    publisher.on_event(poison, Behavior::FailPermanent);
    let (store, task) = spawn(&wal, &publisher, &shutdown).await;
    let others: Vec<(String, Uuid)> = committed
        .iter()
        .filter(|(a, _)| a != "agg-3")
        .cloned()
        .collect();
    let first_of_3 = committed.iter().find(|(a, _)| a == "agg-3").unwrap().1;
    wait_until(
        Duration::from_secs(60),
        "the healthy aggregates and the dead letter",
        || async {
            let got: std::collections::HashSet<Uuid> =
                publisher.delivered().iter().map(|e| e.id).collect();
            others.iter().all(|(_, id)| got.contains(id))
                && got.contains(&first_of_3)
                && store.held().stats().await.unwrap().dead_letters == 1
                && source_rows(&pool, &table).await == 0
        },
    )
    .await;
    let held = store.held().stats().await.unwrap();
    assert_eq!(held.dead_letters, 1, "{held:?}");
    // The 4 events after the poison wait behind it, in the held table.
    assert_eq!(held.pending, 4, "the 4 behind the dead letter: {held:?}");
    assert_eq!(held.held_back, 4, "{held:?}");
    let delivered: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let after_poison: Vec<Uuid> = committed
        .iter()
        .filter(|(a, _)| a == "agg-3")
        .skip(1)
        .map(|(_, id)| *id)
        .collect();
    assert!(
        after_poison.iter().all(|id| !delivered.contains(id)),
        "nothing of agg-3 after the poison is published"
    );
    // The slot moved on: everything read is settled, and the server has the position.
    wait_until(Duration::from_secs(30), "the slot confirmed", || async {
        let progress = store.progress();
        progress.unsettled == 0
            && progress.confirmed_lsn > 0
            && wal.confirmed(&pool).await >= progress.confirmed_lsn
    })
    .await;

    // The operator fixes the cause and retries the dead letter: agg-3 follows, in order.
    publisher.clear_rules();
    let retried = store
        .held()
        .retry_dead_letters(&DeadLetterFilter::Ids(vec![poison]))
        .await
        .unwrap();
    assert_eq!(retried, 1);
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    let verdict = judged(
        &publisher,
        &shutdown,
        task,
        &committed,
        "WAL source, poison event retried",
    )
    .await;
    assert_clean_verdict(&verdict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_less_events_in_commit_order_and_undecodable_messages_dead_lettered() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let messages = MessageWriter::new(table.schema(), &table);
    let writer = txoutbox_postgres::Writer::new(table.clone());
    let mut committed = Vec::new();
    for n in 0..20 {
        let mut tx = pool.begin().await.unwrap();
        // Table-less events and outbox rows, side by side in one transaction.
        for a in 0..3 {
            let e = sample_event(&format!("m-{a}"), n);
            committed.push((
                e.aggregate_id.clone(),
                messages.emit(&mut tx, e).await.unwrap(),
            ));
        }
        let e = sample_event("row", n);
        committed.push((
            e.aggregate_id.clone(),
            writer.enqueue(&mut tx, e).await.unwrap(),
        ));
        if n == 7 {
            sqlx::query("SELECT pg_logical_emit_message(true, $1, 'not an event')")
                .bind(table.schema())
                .execute(&mut *tx)
                .await
                .unwrap();
        }
        if n == 9 {
            // Rolled back: never published.
            tx.rollback().await.unwrap();
            committed.truncate(committed.len() - 4);
            continue;
        }
        tx.commit().await.unwrap();
    }
    let (store, task) = spawn(&wal, &publisher, &shutdown).await;
    wait_until(
        Duration::from_secs(60),
        "every event and the dead letter",
        || async {
            publisher.delivered().len() >= committed.len()
                && store.held().stats().await.unwrap().dead_letters == 1
                && source_rows(&pool, &table).await == 0
        },
    )
    .await;
    shutdown.cancel();
    task.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("WAL source, table-less and row events: {verdict}");
    assert_clean_verdict(&verdict);
    let letters = store
        .held()
        .dead_letters(&DeadLetterFilter::All, None, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].aggregate_type, UNDECODABLE_AGGREGATE_TYPE);
    assert!(
        letters[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("not a JSON object"),
        "{letters:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_when_the_readers_session_ends() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let (a, ta) = spawn(&wal, &publisher, &shutdown).await;
    wait_until(Duration::from_secs(30), "the first relay reads", || async {
        a.progress().active
    })
    .await;
    let (b, tb) = spawn(&wal, &publisher, &shutdown).await;
    let mut committed = write_rounds(&table, 20, 5).await;
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    assert!(a.progress().active && !b.progress().active);

    // The reader's session ends under it (as when its process or host dies).
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(l.pid) FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted
           AND l.classid::int4 = hashtext('outbox-wal-reader') AND l.objid::int4 = hashtext($1)) t",
    )
    .bind(wal.slot.slot())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(ended, 1, "the reader's session holds the lock");
    let more = write_rounds(&table, 20, 5).await;
    committed.extend(more);
    wait_until(
        Duration::from_secs(30),
        "the standby takes over",
        || async { b.progress().active },
    )
    .await;
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    // The first relay stands by now.
    wait_until(
        Duration::from_secs(30),
        "the first relay stands by",
        || async { !a.progress().active },
    )
    .await;
    shutdown.cancel();
    ta.await.unwrap();
    tb.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("WAL source, reader's session ended: {verdict}");
    assert_eq!(verdict.lost, 0, "{verdict}");
    assert_eq!(verdict.order_violations, 0, "{verdict}");
    assert_eq!(verdict.unexpected, 0, "{verdict}");
    // At most what was read and not confirmed is published again.
    assert!(verdict.duplicates <= 100, "{verdict}");
}

/// Ends the session of the reader holding the slot's lock (as when its process or host dies);
/// returns how many sessions it ended (one while a reader holds it).
async fn end_reader_session(pool: &sqlx::PgPool, wal: &WalSource) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(l.pid) FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.granted
           AND l.classid::int4 = hashtext('outbox-wal-reader') AND l.objid::int4 = hashtext($1)) t",
    )
    .bind(wal.slot.slot())
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Writers keep committing while failures go through the held table and the reader's session ends
/// three times under it: each time a relay takes the slot again and replays from the confirmed
/// position. Nothing is lost, first deliveries keep every aggregate's order, and nothing moved to
/// the held table is published out of turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_ending_mid_stream_with_failures_lose_nothing_and_keep_order() {
    let Fixture {
        pool,
        table,
        mut wal,
        publisher,
        shutdown,
    } = fixture().await;
    // A reader holds at most this many unconfirmed events: the bound on what a takeover replays.
    wal.config.read_ahead = 200;
    let (a, ta) = spawn(&wal, &publisher, &shutdown).await;
    let (b, tb) = spawn(&wal, &publisher, &shutdown).await;
    publisher.when(
        |e| e.id.as_u128() % 100 < 8,
        Behavior::FailRetryableTimes(1),
    );
    let writer = {
        let table = table.clone();
        tokio::spawn(async move {
            let mut committed = Vec::new();
            for _ in 0..8 {
                committed.extend(write_rounds(&table, 50, 5).await);
            }
            committed
        })
    };
    let mut ended = 0;
    for _ in 0..3 {
        let before = publisher.delivered().len();
        wait_until(
            Duration::from_secs(60),
            "a reader publishes again",
            || async {
                (a.progress().active || b.progress().active) && publisher.delivered().len() > before
            },
        )
        .await;
        ended += end_reader_session(&pool, &wal).await;
    }
    assert!(ended >= 2, "the readers' sessions were ended {ended} times");
    let committed = writer.await.unwrap();
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    shutdown.cancel();
    ta.await.unwrap();
    tb.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("WAL source, 8% failing, reader's session ended {ended} times: {verdict}");
    assert_eq!(
        (verdict.lost, verdict.order_violations, verdict.unexpected),
        (0, 0, 0),
        "{verdict}"
    );
    // At most what each reader had read and not confirmed (its read-ahead, and the batches in
    // flight it had claimed from it) is published again.
    let cfg = relay_config();
    let bound = ended as usize * (wal.config.read_ahead + cfg.batch_size * cfg.max_in_flight);
    assert!(verdict.duplicates <= bound, "{verdict}: over {bound}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_the_slot_is_missing() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let wal = WalSource::setup(&table).await;
    let store = wal.store(txoutbox_core::Wake::new()).await;
    store.check().await.unwrap();
    wal.slot.drop(&pool).await.unwrap();
    let e = store.check().await.unwrap_err();
    assert!(
        e.message().contains(wal.slot.slot()) && e.message().contains("outbox wal setup"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_written_twice_is_published_twice_and_wedges_nothing() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let messages = MessageWriter::new(table.schema(), &table);
    // A writer that retried a commit whose answer it never saw writes the same event again; both
    // copies may land in one batch.
    let twice = sample_event("dup", 0);
    let after = sample_event("dup", 1);
    let mut tx = pool.begin().await.unwrap();
    messages.emit(&mut tx, twice.clone()).await.unwrap();
    messages.emit(&mut tx, twice.clone()).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    messages.emit(&mut tx, after.clone()).await.unwrap();
    tx.commit().await.unwrap();
    let (store, task) = spawn(&wal, &publisher, &shutdown).await;
    wait_until(
        Duration::from_secs(60),
        "both copies and the next event",
        || async { publisher.delivered().len() >= 3 },
    )
    .await;
    wait_until(
        Duration::from_secs(30),
        "everything settled and confirmed",
        || async {
            let progress = store.progress();
            progress.unsettled == 0
                && progress.confirmed_lsn > 0
                && wal.confirmed(&pool).await >= progress.confirmed_lsn
        },
    )
    .await;
    shutdown.cancel();
    task.await.unwrap();
    let ids: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![twice.id, twice.id, after.id]);
}

/// Back-pressure from the publisher is a reason to wait: under the WAL source the events it pushed
/// back stay in the reader's buffer (nothing is moved to the held table, no attempt is counted),
/// and are published in order once it takes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backpressure_moves_nothing_to_the_held_table() {
    let Fixture {
        pool,
        table,
        wal,
        publisher,
        shutdown,
    } = fixture().await;
    let committed = write_rounds(&table, 20, 5).await;
    let pushed: Vec<Uuid> = committed
        .iter()
        .filter(|(a, _)| a == "agg-3")
        .map(|(_, id)| *id)
        .collect();
    for id in &pushed {
        publisher.on_event(*id, Behavior::Backpressure);
    }
    let (_store, task) = spawn(&wal, &publisher, &shutdown).await;
    wait_until(
        Duration::from_secs(60),
        "the publisher pushed back on the first event of agg-3 three times",
        || async { publisher.tries(pushed[0]) >= 3 },
    )
    .await;
    let held = wal.held.qualified();
    let held_rows = || async {
        sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {held}"))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // While it goes on pushing back (each settle would have moved the events and the rest of their
    // aggregate at once).
    for _ in 0..20 {
        assert_eq!(held_rows().await, 0, "events moved to the held table");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    publisher.clear_rules();
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    assert_eq!(held_rows().await, 0, "events moved to the held table");
    shutdown.cancel();
    let summary = task.await.unwrap();
    assert_eq!(summary.retried, 0, "{summary:?}");
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("WAL source, back-pressure on one aggregate: {verdict}");
    assert_clean_verdict(&verdict);
}

/// A transaction larger than the reader holds in memory (here `wal.read_ahead = 20`: parts of 200
/// events) comes in parts, which go to the held table after the events still in memory: every
/// event once, each aggregate's in commit order, with transactions before and after it and a
/// publisher slow enough that batches are in flight when the parts come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_the_read_ahead_goes_through_the_held_table_in_order() {
    large_transaction(false).await;
}

/// As above, the reader's session ending while the transaction's parts are handed over: the
/// reader reads it again from its start and skips what the held table has (published or not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_ending_in_the_middle_of_a_large_transaction_does_not_hand_it_over_twice() {
    large_transaction(true).await;
}

async fn large_transaction(end_session: bool) {
    let Fixture {
        pool,
        table,
        mut wal,
        publisher,
        shutdown,
    } = fixture().await;
    wal.config.read_ahead = 20;
    publisher.set_latency(Duration::from_millis(20));
    let (_store, task) = spawn(&wal, &publisher, &shutdown).await;
    let mut committed = write_rounds(&table, 10, 3).await;
    // One transaction of 2,050 events over 10 aggregates.
    let writer = txoutbox_postgres::Writer::new(table.clone());
    let mut tx = pool.begin().await.unwrap();
    let events: Vec<_> = (0..2_050)
        .map(|n| sample_event(&format!("agg-{}", n % 10), 100 + n))
        .collect();
    let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
    let rows: Vec<(String, Uuid)> = sqlx::query_as(&format!(
        "SELECT aggregate_id, id FROM {} WHERE id = ANY($1) ORDER BY seq",
        table.qualified()
    ))
    .bind(&ids)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    writer.commit(tx).await.unwrap();
    committed.extend(rows);
    committed.extend(write_rounds(&table, 10, 3).await);
    let held_in = || wal.held_rows_in();
    if end_session {
        wait_until(
            Duration::from_secs(60),
            "four parts in the held table",
            || async { held_in().await >= 800 },
        )
        .await;
        assert_eq!(end_reader_session(&pool, &wal).await, 1);
    }
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    let held = held_in().await;
    // Each part once, with the events the buffer held at the first part, the later events of the
    // same aggregates, and the mark's writes. A reader that read the transaction again also moves
    // the transactions it reads again (their aggregates wait in the held table): there, a part
    // handed over twice shows as hundreds of duplicates in the verdict below.
    assert!(
        held >= 2_050,
        "the large transaction went through the held table ({held} rows went in)"
    );
    if !end_session {
        assert!(
            held <= 2_050 + 30 + 30 + 20,
            "the large transaction went through the held table once ({held} rows went in)"
        );
    }
    shutdown.cancel();
    task.await.unwrap();
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!(
        "WAL source, a transaction of 2,050 events in parts of 200{}: {verdict} held_rows_in={held}",
        if end_session { ", the reader's session ended in the middle" } else { "" }
    );
    if end_session {
        // What the buffer had in flight at the end (2 batches of 50, and one settling).
        txoutbox_tests::harness::assert_crash_verdict(&verdict, 1, 50, 3);
    } else {
        assert_clean_verdict(&verdict);
    }
}

/// A switch from polling to WAL (`outbox wal setup`, then a relay with `database.source = "wal"`)
/// keeps each row's delivery state: a dead letter of the polling source still holds its aggregate
/// back and is listed among the dead letters, with its last error; an event backing off waits for
/// its time; the other aggregates flow, the events written after the switch included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_from_polling_keeps_dead_letters_and_backoffs() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // What a polling relay left: agg-1's first event dead-lettered, agg-2's first backing off.
    let mut committed = write_rounds(&table, 4, 3).await;
    let first = |agg: &str| committed.iter().find(|(a, _)| a == agg).unwrap().1;
    let (poison, waiting) = (first("agg-1"), first("agg-2"));
    let t = table.qualified();
    sqlx::query(&format!(
        "UPDATE {t} SET dead_lettered_at = now(), attempts = 5, last_error = 'poison: refused by the broker' WHERE id = $1"
    ))
    .bind(poison)
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "UPDATE {t} SET retry_after = now() + interval '1 hour', attempts = 1, last_error = 'timeout' WHERE id = $1"
    ))
    .bind(waiting)
    .execute(&pool)
    .await
    .unwrap();
    // The switch, as `outbox wal setup` makes it, and a WAL relay.
    let wal = WalSource::setup(&table).await;
    txoutbox_postgres::wal::mark_new_slot(&pool, &table, &wal.held, wal.slot.slot())
        .await
        .unwrap();
    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let (store, task) = spawn(&wal, &publisher, &shutdown).await;
    committed.extend(write_rounds(&table, 4, 2).await);
    let held_back = |agg: &str| {
        let agg = agg.to_string();
        committed
            .iter()
            .filter(move |(a, _)| *a == agg)
            .map(|(_, id)| *id)
    };
    let flowing: Vec<Uuid> = held_back("agg-0").chain(held_back("agg-3")).collect();
    wait_until(
        Duration::from_secs(60),
        "the other aggregates published and the table emptied",
        || async {
            let got: std::collections::HashSet<Uuid> =
                publisher.delivered().iter().map(|e| e.id).collect();
            flowing.iter().all(|id| got.contains(id)) && source_rows(&pool, &table).await == 0
        },
    )
    .await;
    let delivered: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    assert!(
        held_back("agg-1").all(|id| !delivered.contains(&id)),
        "nothing of agg-1 goes out past its dead letter"
    );
    assert!(
        held_back("agg-2").all(|id| !delivered.contains(&id)),
        "nothing of agg-2 goes out before its backing-off event's time"
    );
    let letters = store
        .held()
        .dead_letters(&DeadLetterFilter::All, None, 10)
        .await
        .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].id, poison);
    assert_eq!(
        letters[0].last_error.as_deref(),
        Some("poison: refused by the broker")
    );
    assert_eq!(store.held().stats().await.unwrap().dead_letters, 1);

    // The operator retries the dead letter and the backoff ends: both aggregates follow, in order.
    store
        .held()
        .retry_dead_letters(&DeadLetterFilter::Ids(vec![poison]))
        .await
        .unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET retry_after = now() WHERE id = $1",
        wal.held.qualified()
    ))
    .bind(waiting)
    .execute(&pool)
    .await
    .unwrap();
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    let verdict = judged(
        &publisher,
        &shutdown,
        task,
        &committed,
        "a switch from polling to WAL",
    )
    .await;
    assert_clean_verdict(&verdict);
}

/// A transaction that wrote a row while the outbox table was out of the publication, and that
/// stays open after the operator put the table back: the relay keeps publishing from the table
/// meanwhile (other aggregates flow), does not stream again until that transaction ended, and then
/// publishes its row: nothing is lost, whatever the transaction's length, and order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_across_the_publications_repair_loses_nothing() {
    let Fixture {
        pool,
        table,
        mut wal,
        publisher,
        shutdown,
    } = fixture().await;
    // The operator repairs the publication (`outbox wal setup`), not the relay.
    wal.config.auto_recreate = false;
    let (store, task) = spawn(&wal, &publisher, &shutdown).await;
    let mut committed = write_rounds(&table, 3, 2).await;
    wait_until(Duration::from_secs(60), "the first events", || async {
        publisher.delivered().len() >= committed.len()
    })
    .await;

    wal.unpublish(&pool, &table).await;
    // A writer's transaction inserts while the table is out of the publication, and stays open.
    let writer = txoutbox_postgres::Writer::new(table.clone());
    let mut long = pool.begin().await.unwrap();
    let long_id = writer
        .enqueue(&mut long, sample_event("agg-long", 0))
        .await
        .unwrap();
    wait_until(Duration::from_secs(30), "the relay falls back", || async {
        store.progress().fallback.reason.is_some()
    })
    .await;
    wal.republish(&pool, &table).await;
    // Meanwhile other writers go on, and their events are published from the table.
    let during = write_rounds(&table, 3, 2).await;
    committed.extend(during.iter().cloned());
    wait_until(
        Duration::from_secs(30),
        "events written during the long transaction published while it runs",
        || async {
            let got: std::collections::HashSet<Uuid> =
                publisher.delivered().iter().map(|e| e.id).collect();
            during.iter().all(|(_, id)| got.contains(id))
        },
    )
    .await;
    assert!(
        store.progress().fallback.reason.is_some(),
        "the relay does not stream again while the transaction runs"
    );
    long.commit().await.unwrap();
    committed.push(("agg-long".to_string(), long_id));
    committed.extend(write_rounds(&table, 3, 2).await);
    drained(&pool, &table, &wal, &publisher, committed.len()).await;
    wait_until(
        Duration::from_secs(30),
        "the relay streams again",
        || async { store.progress().fallback.reason.is_none() },
    )
    .await;
    let verdict = judged(
        &publisher,
        &shutdown,
        task,
        &committed,
        "a transaction open across the publication's repair",
    )
    .await;
    assert_eq!(verdict.lost, 0, "{verdict}");
    assert_eq!(verdict.order_violations, 0, "{verdict}");
    assert_eq!(verdict.unexpected, 0, "{verdict}");
}
