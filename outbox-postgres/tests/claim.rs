//! Ordered claims where the claimable events are not among the first ready rows: the oldest ready
//! rows belong to partitions other leases hold or to one aggregate's held-back backlog, and the skip
//! scan over the aggregates must find the rest; batches over backlogs written in runs; the claim
//! statements' byte budget against its rule, under both policies (the real server; each test in
//! its own table).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeSet;

use sqlx::PgPool;
use txoutbox_core::{Action, ClaimRequest, OrderingPolicy, Settlement, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{OutboxTable, PostgresStore};

fn strict(limit: usize) -> ClaimRequest {
    ClaimRequest::new(limit, OrderingPolicy::PerAggregate)
}

/// Inserts `per` rows for each aggregate named `prefix{i}`, i in `range`, interleaved (row 1 of
/// every aggregate, then row 2 of every aggregate, ...), in one statement.
async fn insert(
    pool: &PgPool,
    table: &OutboxTable,
    prefix: &str,
    range: std::ops::Range<i32>,
    per: i32,
) {
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', $1 || lpad(a::text, 4, '0'), 'e' || r, '{{}}'::jsonb
         FROM generate_series(1, $4) r, generate_series($2, $3 - 1) a ORDER BY r, a",
        table.qualified()
    ))
    .bind(prefix)
    .bind(range.start)
    .bind(range.end)
    .bind(per)
    .execute(pool)
    .await
    .unwrap();
}

/// Puts the head of every aggregate whose id starts with `prefix` in backoff for an hour.
async fn back_off_heads(pool: &PgPool, table: &OutboxTable, prefix: &str) {
    sqlx::query(&format!(
        "UPDATE {t} SET retry_after = now() + interval '1 hour', attempts = 1
         WHERE seq IN (SELECT min(seq) FROM {t} WHERE aggregate_id LIKE $1 || '%' GROUP BY aggregate_id)",
        t = table.qualified()
    ))
    .bind(prefix)
    .execute(pool)
    .await
    .unwrap();
}

/// Each aggregate's next unpublished event number (events are `e1`, `e2`...: see [`insert`]).
#[derive(Default, Debug)]
struct NextEvents(std::collections::BTreeMap<String, u32>);

impl NextEvents {
    /// Checks that `events` are, per aggregate, its next ones in order, and moves past them.
    fn take(&mut self, events: &[txoutbox_core::Event]) {
        for e in events {
            let n: u32 = e.event_type[1..].parse().unwrap();
            let expected = self.0.entry(e.aggregate_id.clone()).or_insert(1);
            assert_eq!(
                n, *expected,
                "{}: not its oldest unpublished event",
                e.aggregate_id
            );
            *expected += 1;
        }
    }
}

fn aggregates(events: &[txoutbox_core::Event]) -> BTreeSet<String> {
    events.iter().map(|e| e.aggregate_id.clone()).collect()
}

#[tokio::test]
async fn a_long_backlog_behind_a_backing_off_head_does_not_hide_other_aggregates() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // One aggregate with 2,000 events whose head backs off, then ten aggregates with one each: the
    // oldest ready rows are all the blocked aggregate's.
    insert(&pool, &table, "p", 0..1, 2000).await;
    back_off_heads(&pool, &table, "p").await;
    insert(&pool, &table, "a", 0..10, 1).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let batch = store.claim(strict(10)).await.unwrap();
    let expected: BTreeSet<String> = (0..10).map(|i| format!("a{i:04}")).collect();
    assert_eq!(aggregates(&batch.events), expected);
    assert_eq!(batch.events.len(), 10);
    batch.lease.release().await.unwrap();
}

#[tokio::test]
async fn a_second_relay_finds_the_events_beyond_those_the_first_holds() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // 100 aggregates with 10 events each come first, then 50 aggregates with one event each.
    insert(&pool, &table, "a", 0..100, 10).await;
    insert(&pool, &table, "b", 0..50, 1).await;
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    // The first takes the partitions of every `a` aggregate (the oldest 100 aggregates).
    let held = first.claim(strict(100)).await.unwrap();
    let held_aggregates = aggregates(&held.events);
    assert_eq!(held_aggregates.len(), 100, "{held_aggregates:?}");
    // The second relay's window (its oldest ready rows) holds only the first relay's partitions:
    // the skip scan finds the `b` aggregates the first does not hold.
    let batch = second.claim(strict(100)).await.unwrap();
    let mine = aggregates(&batch.events);
    assert!(
        !mine.is_empty(),
        "the second relay found nothing beyond the window"
    );
    assert!(mine.iter().all(|a| a.starts_with('b')), "{mine:?}");
    assert!(
        mine.is_disjoint(&held_aggregates),
        "an aggregate in two leases"
    );
    assert_eq!(
        batch.events.len(),
        mine.len(),
        "one event per aggregate, each once"
    );
    batch.lease.release().await.unwrap();
    held.lease.release().await.unwrap();
}

#[tokio::test]
async fn aggregates_are_told_apart_the_same_under_a_linguistic_collation() {
    // The claim groups the window by bytes; the table's columns here sort linguistically (ICU), where
    // "a" < "á" < "b" < "B", while by bytes "B" < "a" < "b" < "á".
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // (The dead-letters view depends on the columns; this test does not use it.)
    sqlx::raw_sql(&format!(
        "DROP VIEW \"{}\".outbox_dead_letters;
         ALTER TABLE {} ALTER COLUMN aggregate_type TYPE text COLLATE \"en-x-icu\",
                        ALTER COLUMN aggregate_id TYPE text COLLATE \"en-x-icu\"",
        table.schema(),
        table.qualified()
    ))
    .execute(&pool)
    .await
    .expect("this test needs PostgreSQL built with ICU (collation en-x-icu)");
    let ids = ["b", "á", "B", "a"];
    for round in 1..=3 {
        for id in ids {
            sqlx::query(&format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, $2, '{{}}'::jsonb)",
                table.qualified()
            ))
            .bind(id)
            .bind(format!("e{round}"))
            .execute(&pool)
            .await
            .unwrap();
        }
    }
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    let batch = first.claim(strict(100)).await.unwrap();
    assert_eq!(batch.events.len(), 12, "every run, each event once");
    for id in ids {
        let run: Vec<&str> = batch
            .events
            .iter()
            .filter(|e| e.aggregate_id == id)
            .map(|e| e.event_type.as_str())
            .collect();
        assert_eq!(run, ["e1", "e2", "e3"], "aggregate {id:?}");
    }
    // Every aggregate is held: another relay gets none of them.
    let other = second.claim(strict(100)).await.unwrap();
    assert!(other.events.is_empty(), "{:?}", aggregates(&other.events));
    other.lease.release().await.unwrap();
    batch.lease.release().await.unwrap();
}

#[tokio::test]
async fn skip_scans_go_on_past_blocked_aggregates_until_they_find_a_ready_head() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // 600 aggregates (more than one scan visits) with a backing-off head and a ready second row,
    // then one ready aggregate last in key order.
    insert(&pool, &table, "b", 0..600, 2).await;
    back_off_heads(&pool, &table, "b").await;
    insert(&pool, &table, "z", 0..1, 1).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let batch = store.claim(strict(1)).await.unwrap();
    assert_eq!(
        aggregates(&batch.events),
        BTreeSet::from(["z0000".to_string()])
    );
    // Published, then nothing is ready.
    let settlements = published(&batch.events);
    batch.lease.settle(settlements).await.unwrap();
    let empty = store.claim(strict(1)).await.unwrap();
    assert!(empty.events.is_empty(), "only backing-off heads remain");
    empty.lease.release().await.unwrap();
}

#[tokio::test]
async fn rotating_skip_scans_give_every_blocked_out_aggregate_its_turn() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // A blocked aggregate's backlog fills the window; 700 single-event aggregates lie beyond it.
    // Successive claims of 300 must, between them, reach all 700.
    insert(&pool, &table, "p", 0..1, 3000).await;
    back_off_heads(&pool, &table, "p").await;
    insert(&pool, &table, "c", 0..700, 1).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let mut seen = BTreeSet::new();
    for turn in 0..3 {
        let batch = store.claim(strict(300)).await.unwrap();
        let mine = aggregates(&batch.events);
        assert_eq!(
            mine.len(),
            batch.events.len(),
            "an aggregate twice in a batch"
        );
        assert_eq!(mine.len(), 300, "turn {turn}: the batch did not fill");
        if turn < 2 {
            // The third turn reaches the last aggregate and goes on from the first.
            assert!(
                mine.is_disjoint(&seen),
                "a turn came twice before every aggregate had one"
            );
        }
        seen.extend(mine);
        batch.lease.release().await.unwrap();
    }
    assert_eq!(seen.len(), 700);
    assert!(seen.iter().all(|a| a.starts_with('c')));
}

#[tokio::test]
async fn heads_beyond_the_window_are_found_again_once_the_skip_scans_rest_is_over() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    insert(&pool, &table, "p", 0..1, 2000).await;
    back_off_heads(&pool, &table, "p").await;
    insert(&pool, &table, "c", 0..10, 1).await;
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    let held = first.claim(strict(10)).await.unwrap();
    assert_eq!(held.events.len(), 10);
    // The second relay walks every aggregate and finds each head taken: its skip scans rest.
    let none = second.claim(strict(10)).await.unwrap();
    assert!(none.events.is_empty());
    none.lease.release().await.unwrap();
    held.lease.release().await.unwrap();
    // The rest is bounded (at most 2 s): the released heads are claimed again after it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let batch = second.claim(strict(10)).await.unwrap();
        let n = batch.events.len();
        batch.lease.release().await.unwrap();
        if n == 10 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the heads beyond the window were never claimed again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A settlement publishing each of `events`.
fn published(events: &[txoutbox_core::Event]) -> Vec<Settlement> {
    events
        .iter()
        .map(|e| Settlement {
            id: e.id,
            action: Action::Published,
        })
        .collect()
}

/// A pool of the test database whose every connection first runs `setting` (a `SET` statement).
async fn pool_with(max_connections: u32, setting: &str) -> PgPool {
    let setting = setting.to_string();
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max_connections)
        .after_connect(move |conn, _| {
            let setting = setting.clone();
            Box::pin(async move { sqlx::query(&setting).execute(conn).await.map(|_| ()) })
        })
        .connect(&txoutbox_postgres::testing::database_url())
        .await
        .unwrap()
}

/// Buffers of `table` (heap and indexes) read so far, as the statistics system has them.
async fn buffers_read(admin: &PgPool, table: &OutboxTable) -> i64 {
    let mut conn = admin.acquire().await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query_scalar(
        "SELECT (coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0)
                + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0))::bigint
         FROM pg_statio_user_tables WHERE schemaname = $1 AND relname = $2",
    )
    .bind(table.schema())
    .bind(table.table())
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// Runs on the store's only connection: its pending statistics are flushed when it goes idle.
async fn flush_stats(pool: &PgPool) {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .unwrap();
}

/// Waits until the statistics show more reads than `before` (the flush follows the statement).
async fn buffers_read_after(admin: &PgPool, table: &OutboxTable, before: i64) -> i64 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let now = buffers_read(admin, table).await;
        if now > before || std::time::Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn plans_made_while_the_outbox_was_empty_stay_cheap_once_a_backlog_builds_up() {
    // The outbox is usually empty, so the relay's cached plans are made while it is. Generic plans
    // from the first execution on, on a table analyzed empty, make that certain here.
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    sqlx::query(&format!("ANALYZE {}", table.qualified()))
        .execute(&admin)
        .await
        .unwrap();
    let relay_pool = pool_with(1, "SET plan_cache_mode = force_generic_plan").await;
    let store = PostgresStore::new(relay_pool.clone(), table.clone());
    for _ in 0..3 {
        let empty = store.claim(strict(500)).await.unwrap();
        assert!(empty.events.is_empty());
        empty.lease.release().await.unwrap();
    }
    // A backlog of 20,000 events over 1,000 aggregates, never analyzed (written on the store's
    // connection, so that its reads are flushed with the empty claims', before the measure).
    insert(&relay_pool, &table, "a", 0..1000, 20).await;
    flush_stats(&relay_pool).await;
    let before = buffers_read_after(&admin, &table, 0).await;
    let batch = store.claim(strict(500)).await.unwrap();
    assert_eq!(batch.events.len(), 500);
    assert_eq!(
        aggregates(&batch.events).len(),
        500,
        "one event per aggregate"
    );
    batch.lease.release().await.unwrap();
    flush_stats(&relay_pool).await;
    let read = buffers_read_after(&admin, &table, before).await - before;
    // A claim reads the window twice (choosing its partitions, then its events), one probe of the
    // held-back index per event and the batch: well under two buffers per pending row. A plan that scans the backlog once per candidate reads hundreds of
    // thousands.
    assert!(
        read > 0 && read < 40_000,
        "one claim of 500 read {read} buffers of a 20,000-row outbox"
    );
}

/// Inserts five events for each of `aggregates` aggregates (`a0`, `a1`...), aggregate after
/// aggregate, so that in seq order each head is followed by its own run.
async fn runs_one_after_another(pool: &PgPool, table: &OutboxTable, aggregates: i32) {
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'a' || a, 'e' || r, '{{}}'::jsonb
         FROM generate_series(0, $1 - 1) a, generate_series(1, 5) r ORDER BY a, r",
        table.qualified()
    ))
    .bind(aggregates)
    .execute(pool)
    .await
    .unwrap();
}

/// A backlog written in runs: the first claim reads in seq order and finds runs longer than two,
/// so the next claims spread over as many aggregates as they can (every aggregate's first event,
/// then every second one...), each aggregate's events still a prefix of its run in seq order.
#[tokio::test]
async fn batches_over_a_backlog_written_in_runs_spread_over_the_aggregates() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    runs_one_after_another(&pool, &table, 20).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let first = store.claim(strict(10)).await.unwrap();
    assert_eq!(first.events.len(), 10);
    assert_eq!(
        aggregates(&first.events).len(),
        2,
        "seq order: two runs of five"
    );
    first.lease.release().await.unwrap();
    let batch = store.claim(strict(10)).await.unwrap();
    assert_eq!(batch.events.len(), 10);
    // Twice the batch looked at (four runs of five): four first events, four second, two third.
    assert_eq!(aggregates(&batch.events).len(), 4, "spread over the runs");
    let seqs: Vec<String> = batch
        .events
        .iter()
        .map(|e| format!("{}/{}", e.aggregate_id, e.event_type))
        .collect();
    let mut sorted = seqs.clone();
    sorted.sort();
    assert_eq!(seqs, sorted, "events come back in seq order: {seqs:?}");
    for a in aggregates(&batch.events) {
        let types: Vec<&str> = batch
            .events
            .iter()
            .filter(|e| e.aggregate_id == a)
            .map(|e| e.event_type.as_str())
            .collect();
        assert_eq!(
            types,
            ["e1", "e2", "e3"][..types.len()],
            "{a}: not a prefix of its run"
        );
    }
    batch.lease.release().await.unwrap();
}

/// Aggregates held back behind a dead letter count for nothing when a claim chooses its
/// partitions: with few events (well under the reads' bounds), ten held-back aggregates first in
/// the window must not keep the claim from the one claimable aggregate behind them.
#[tokio::test]
async fn held_back_aggregates_do_not_hide_a_claimable_one_behind_them() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    insert(&pool, &table, "h", 0..10, 2).await;
    sqlx::query(&format!(
        "UPDATE {t} SET dead_lettered_at = now(), attempts = 5
         WHERE seq IN (SELECT min(seq) FROM {t} WHERE aggregate_id LIKE 'h%' GROUP BY aggregate_id)",
        t = table.qualified()
    ))
    .execute(&pool)
    .await
    .unwrap();
    insert(&pool, &table, "z", 0..1, 1).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let batch = store.claim(strict(10)).await.unwrap();
    assert_eq!(
        aggregates(&batch.events),
        BTreeSet::from(["z0000".to_string()]),
        "only the claimable aggregate, and it is found"
    );
    batch.lease.release().await.unwrap();
}

/// Waits until a session waits for one of the claim's partition locks: true then; false when
/// `claim` ended first (its wait for a partition is bounded, and a slow machine may not have
/// looked in time), so that the caller starts another.
async fn someone_waits_for_a_partition<T>(
    pool: &PgPool,
    claim: &tokio::task::JoinHandle<T>,
) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return true;
        }
        if claim.is_finished() {
            return false;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no claim waited for a partition"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// A claim that finds every partition with events held waits for the lease holding the oldest;
/// when that lease settles, the waiting claim reads in a snapshot taken after the lock, so it does
/// not see the published events as pending (a duplicate without a crash), even when the role's
/// default isolation is REPEATABLE READ (the claim's transaction is READ COMMITTED regardless).
#[tokio::test]
async fn a_claim_waiting_for_a_partition_sees_what_its_holder_settled() {
    for isolation in ["read committed", "repeatable read"] {
        let admin = pool(2).await;
        let table = fresh_table(&admin).await;
        insert(&admin, &table, "a", 0..1, 3).await;
        let setting = format!("SET default_transaction_isolation = '{isolation}'");
        let relay_pool = pool_with(4, &setting).await;
        let first = PostgresStore::new(relay_pool.clone(), table.clone());
        let second = PostgresStore::new(relay_pool.clone(), table.clone());
        let held = first.claim(strict(10)).await.unwrap();
        assert_eq!(held.events.len(), 3, "{isolation}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let waiting = loop {
            let second = second.clone();
            let waiting = tokio::spawn(async move { second.claim(strict(10)).await });
            if someone_waits_for_a_partition(&admin, &waiting).await {
                break waiting;
            }
            let missed = waiting.await.unwrap().unwrap();
            assert!(missed.events.is_empty(), "{isolation}: {:?}", missed.events);
            missed.lease.release().await.unwrap();
            assert!(
                std::time::Instant::now() < deadline,
                "{isolation}: no claim was seen waiting for a partition"
            );
        };
        let settled = published(&held.events);
        held.lease.settle(settled).await.unwrap();
        let after = waiting.await.unwrap().unwrap();
        assert!(
            after.events.is_empty(),
            "{isolation}: published events claimed again: {:?}",
            after.events
        );
        after.lease.release().await.unwrap();
        // The wait is bounded: with the partition held throughout, a claim comes back empty.
        insert(&admin, &table, "a", 0..1, 1).await;
        let held = first.claim(strict(10)).await.unwrap();
        assert_eq!(held.events.len(), 1);
        let started = std::time::Instant::now();
        let second = PostgresStore::new(relay_pool.clone(), table.clone());
        let none = second.claim(strict(10)).await.unwrap();
        assert!(none.events.is_empty());
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "the wait for a partition is not bounded"
        );
        none.lease.release().await.unwrap();
        held.lease.release().await.unwrap();
    }
}

/// A store takes again the partitions of a batch it settled (its kept set) while another store
/// holds one of them: the claim reads only the partitions it could take again, so no two live
/// leases hold events of one aggregate, and every batch takes each aggregate's oldest unpublished
/// events, in order.
#[tokio::test]
async fn kept_partitions_taken_again_never_share_an_aggregate_with_another_lease() {
    let pool = pool(6).await;
    let table = fresh_table(&pool).await;
    // Four aggregates: a batch of ten holds all four, and their partitions are its kept set.
    insert(&pool, &table, "a", 0..4, 40).await;
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    let mut next = NextEvents::default();
    for round in 0..5 {
        // The first store fills a batch and settles it: its partitions become its kept set.
        let batch = first.claim(strict(10)).await.unwrap();
        assert_eq!(batch.events.len(), 10, "round {round}");
        next.take(&batch.events);
        let settled = published(&batch.events);
        batch.lease.settle(settled).await.unwrap();
        // The second store holds one event: the partition of the aggregate with the oldest.
        let held = second.claim(strict(1)).await.unwrap();
        assert_eq!(held.events.len(), 1, "round {round}");
        next.take(&held.events);
        // The first store takes its kept set again, but for the partition the second holds.
        let mine = first.claim(strict(10)).await.unwrap();
        assert!(!mine.events.is_empty(), "round {round}");
        next.take(&mine.events);
        assert!(
            aggregates(&mine.events).is_disjoint(&aggregates(&held.events)),
            "round {round}: an aggregate in two live leases"
        );
        for b in [held, mine] {
            let settled = published(&b.events);
            b.lease.settle(settled).await.unwrap();
        }
    }
}

/// A claim for a publisher that takes an aggregate's run in one call.
fn whole_runs(limit: usize) -> ClaimRequest {
    ClaimRequest {
        whole_runs: true,
        ..strict(limit)
    }
}

#[tokio::test]
async fn claims_that_meet_other_leases_share_the_aggregates_out() {
    let pool = pool(8).await;
    let table = fresh_table(&pool).await;
    // Eight aggregates with 20 events each, interleaved.
    insert(&pool, &table, "a", 0..8, 20).await;
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    // The first relay's claim takes one event of as many aggregates as it can: all eight.
    let a = first.claim(whole_runs(40)).await.unwrap();
    assert_eq!(aggregates(&a.events).len(), 8);
    assert_eq!(a.events.len(), 40);
    // The second relay's claim finds every partition held, waits in vain, and comes back empty.
    let b = second.claim(whole_runs(40)).await.unwrap();
    assert!(b.events.is_empty(), "{} events", b.events.len());
    a.lease.release().await.unwrap();
    b.lease.release().await.unwrap();
    // Having met another lease, the second relay's claims share the aggregates out: two batches in
    // flight at once each fill from aggregates of their own, whole runs in order.
    let c = second.claim(whole_runs(40)).await.unwrap();
    let d = second.claim(whole_runs(40)).await.unwrap();
    assert_eq!(c.events.len(), 40, "{:?}", aggregates(&c.events));
    assert_eq!(d.events.len(), 40, "{:?}", aggregates(&d.events));
    assert!(aggregates(&c.events).is_disjoint(&aggregates(&d.events)));
    assert!(aggregates(&c.events).len() < 8);
    NextEvents::default().take(&c.events);
    NextEvents::default().take(&d.events);
    c.lease.release().await.unwrap();
    d.lease.release().await.unwrap();
    // A relay whose publisher cannot keep a run in order within a call never gets that: one event
    // of each aggregate, the fewest calls.
    let third = PostgresStore::new(pool.clone(), table.clone());
    let e = third.claim(strict(40)).await.unwrap();
    assert_eq!(aggregates(&e.events).len(), 8);
    e.lease.release().await.unwrap();
}

#[tokio::test]
async fn four_claimers_sharing_the_aggregates_out_keep_every_aggregates_order() {
    let pool = pool(12).await;
    let table = fresh_table(&pool).await;
    let (aggs, per) = (16, 50);
    insert(&pool, &table, "a", 0..aggs, per).await;
    let total = (aggs * per) as usize;
    // The events published, in the order their batches were settled: an aggregate's next events
    // are claimable only once the lease of its earlier ones has ended, so each aggregate's events
    // must come in order, each once. Every third batch fails its first aggregate's first event
    // (retried at once) and gives back the rest of that aggregate's events, as the relay does: the
    // next claims must start that aggregate again from the failed event. And no aggregate is in
    // two live leases at once: each lease marks its aggregates from its claim until just before
    // its settle.
    let published_events = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let live = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
    let batches = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stores = [
        PostgresStore::new(pool.clone(), table.clone()),
        PostgresStore::new(pool.clone(), table.clone()),
    ];
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..4 {
        let store = stores[i % 2].clone();
        let published_events = published_events.clone();
        let live = live.clone();
        let batches = batches.clone();
        tasks.spawn(async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            while published_events.lock().unwrap().len() < total {
                assert!(std::time::Instant::now() < deadline, "the drain stalled");
                let batch = store.claim(whole_runs(50)).await.unwrap();
                if batch.events.is_empty() {
                    batch.lease.release().await.unwrap();
                    tokio::task::yield_now().await;
                    continue;
                }
                let mine = aggregates(&batch.events);
                {
                    let mut live = live.lock().unwrap();
                    assert!(live.is_disjoint(&mine), "an aggregate in two live leases");
                    live.extend(mine.iter().cloned());
                }
                let failing = batches
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                    .is_multiple_of(3)
                    .then(|| batch.events[0].aggregate_id.clone());
                let mut settlements = Vec::with_capacity(batch.events.len());
                let mut sent = Vec::new();
                for e in &batch.events {
                    let action = if failing.as_deref() != Some(e.aggregate_id.as_str()) {
                        sent.push(e.clone());
                        Action::Published
                    } else if e.id == batch.events[0].id {
                        Action::Retry {
                            attempts: e.attempts + 1,
                            delay: std::time::Duration::ZERO,
                            error: "refused".into(),
                        }
                    } else {
                        Action::Release
                    };
                    settlements.push(Settlement { id: e.id, action });
                }
                published_events.lock().unwrap().extend(sent);
                live.lock().unwrap().retain(|a| !mine.contains(a));
                batch.lease.settle(settlements).await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let published_events = published_events.lock().unwrap();
    assert_eq!(published_events.len(), total, "an event published twice");
    let mut next = NextEvents::default();
    next.take(&published_events);
    assert!(next.0.values().all(|n| *n == per as u32 + 1), "{next:?}");
    assert_eq!(next.0.len(), aggs as usize);
}

/// `n` aggregate ids (of type `order`) whose claim partitions differ (the partition is the
/// server's hash of the aggregate, as the claim statements compute it): an ordered claim chooses
/// partitions until the bytes of their aggregates fill the budget, so aggregates sharing one
/// partition would be chosen, or passed over, together.
async fn aggregates_apart(pool: &PgPool, n: i64) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT id FROM (
             SELECT DISTINCT ON (part) id, g FROM (
                 SELECT g, 'a' || g AS id,
                        (hashtextextended('a' || g, hashtextextended('order', 0)) & 255)::int AS part
                 FROM generate_series(0, 999) g) c
             ORDER BY part, g) d
         ORDER BY g LIMIT $1",
    )
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// What the byte budget's rule takes from `claimable` (ids and payload sizes, in seq order): the
/// events [`ClaimRequest::fits`] lets join one after the other, up to `request.limit`.
fn by_the_rule(request: &ClaimRequest, claimable: &[(uuid::Uuid, usize)]) -> Vec<uuid::Uuid> {
    let (mut taken, mut bytes) = (Vec::new(), 0usize);
    for (id, size) in claimable {
        if taken.len() >= request.limit || !request.fits(taken.len(), bytes, *size) {
            break;
        }
        bytes += size;
        taken.push(*id);
    }
    taken
}

/// The claim statements apply the byte budget in SQL; each batch they return is what the budget's
/// rule ([`ClaimRequest::fits`]) takes from the claimable events in seq order: a first event larger
/// than the budget alone, events up to the budget exactly, none past it. Both ordering policies,
/// payloads of varied sizes spread over three aggregates (interleaved), each batch published
/// before the next claim. Empty payloads under unordered claims only: an ordered claim chooses
/// partitions until their bytes reach the budget, so after an exact fit an empty event of a
/// partition not yet chosen waits for the next claim (in its order all the same).
#[tokio::test]
async fn every_batch_is_what_the_byte_budget_rule_takes_in_seq_order() {
    use txoutbox_core::NewEvent;
    use txoutbox_postgres::Writer;
    const BUDGET: usize = 100;
    let scenarios: [(&str, &[usize]); 4] = [
        ("a first event over the budget", &[150, 10, 20, 101, 5]),
        ("exact fits", &[60, 40, 1, 99, 100, 30, 70]),
        (
            "events over what is left",
            &[30, 80, 20, 100, 101, 5, 50, 51, 49],
        ),
        ("one byte over, then one under", &[50, 51, 50, 49, 1, 100]),
    ];
    let empty_payloads: (&str, &[usize]) = ("empty payloads", &[60, 40, 0, 0, 100, 0, 5, 0]);
    let pool = pool(4).await;
    let aggs = aggregates_apart(&pool, 3).await;
    assert_eq!(aggs.len(), 3);
    for ordering in [OrderingPolicy::PerAggregate, OrderingPolicy::Unordered] {
        let unordered = (ordering == OrderingPolicy::Unordered).then_some(empty_payloads);
        for (name, sizes) in scenarios.into_iter().chain(unordered) {
            let table = fresh_table(&pool).await;
            let events: Vec<NewEvent> = sizes
                .iter()
                .enumerate()
                .map(|(i, size)| {
                    let agg = &aggs[i % aggs.len()];
                    NewEvent::binary(
                        "order",
                        agg.as_str(),
                        format!("e{i}"),
                        "x/y",
                        vec![7u8; *size],
                    )
                })
                .collect();
            let mut claimable: Vec<(uuid::Uuid, usize)> = events
                .iter()
                .map(|e| e.id)
                .zip(sizes.iter().copied())
                .collect();
            let writer = Writer::new(table.clone());
            let mut tx = pool.begin().await.unwrap();
            writer.enqueue_many(&mut tx, events).await.unwrap();
            tx.commit().await.unwrap();
            let store = PostgresStore::new(pool.clone(), table.clone());
            let request = ClaimRequest::new(50, ordering).with_max_bytes(BUDGET);
            let mut batches = 0;
            while !claimable.is_empty() {
                let batch = store.claim(request).await.unwrap();
                let expected = by_the_rule(&request, &claimable);
                let got: Vec<uuid::Uuid> = batch.events.iter().map(|e| e.id).collect();
                assert_eq!(
                    got, expected,
                    "{ordering:?}, {name}: batch {batches} of {sizes:?}"
                );
                for e in &batch.events {
                    let size = claimable.iter().find(|(id, _)| *id == e.id).unwrap().1;
                    assert_eq!(e.payload.len(), size);
                }
                claimable.retain(|(id, _)| !got.contains(id));
                let settled = published(&batch.events);
                batch.lease.settle(settled).await.unwrap();
                batches += 1;
            }
            let last = store.claim(request).await.unwrap();
            assert!(last.events.is_empty(), "{ordering:?}, {name}: all claimed");
            last.lease.release().await.unwrap();
        }
    }
}
