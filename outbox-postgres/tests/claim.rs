//! Ordered claims where the heads are not among the first ready rows: the window over the oldest
//! ready rows holds only other relays' heads or one aggregate's backlog, and the skip scan over the
//! aggregates must find the rest (the real server; each test in its own table).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeSet;

use outbox_core::{Action, ClaimRequest, OrderingPolicy, Settlement, Store};
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::{OutboxTable, PostgresStore};
use sqlx::PgPool;

fn strict(limit: usize) -> ClaimRequest {
    ClaimRequest {
        limit,
        ordering: OrderingPolicy::PerAggregate,
    }
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

fn aggregates(events: &[outbox_core::Event]) -> BTreeSet<String> {
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
async fn a_second_relay_finds_the_heads_beyond_those_the_first_holds() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    // 100 aggregates with 10 events each come first, then 50 aggregates with one event each.
    insert(&pool, &table, "a", 0..100, 10).await;
    insert(&pool, &table, "b", 0..50, 1).await;
    let first = PostgresStore::new(pool.clone(), table.clone());
    let second = PostgresStore::new(pool.clone(), table.clone());
    let held = first.claim(strict(100)).await.unwrap();
    let held_aggregates = aggregates(&held.events);
    assert_eq!(held_aggregates.len(), 100);
    assert!(held_aggregates.iter().all(|a| a.starts_with('a')));
    // The second relay's window (its oldest ready rows) holds only the first relay's aggregates.
    let batch = second.claim(strict(100)).await.unwrap();
    let expected: BTreeSet<String> = (0..50).map(|i| format!("b{i:04}")).collect();
    assert_eq!(aggregates(&batch.events), expected);
    assert_eq!(batch.events.len(), 50, "one event per aggregate, each once");
    batch.lease.release().await.unwrap();
    held.lease.release().await.unwrap();
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
    let settlements = batch
        .events
        .iter()
        .map(|e| Settlement {
            id: e.id,
            action: Action::Published,
        })
        .collect();
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
    // Claims of 300 that hold their batches open must, between them, reach all 700.
    insert(&pool, &table, "p", 0..1, 3000).await;
    back_off_heads(&pool, &table, "p").await;
    insert(&pool, &table, "c", 0..700, 1).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let mut seen = BTreeSet::new();
    let mut open = Vec::new();
    for _ in 0..3 {
        let batch = store.claim(strict(300)).await.unwrap();
        for e in &batch.events {
            assert!(seen.insert(e.aggregate_id.clone()), "claimed twice: {e:?}");
        }
        open.push(batch);
    }
    assert_eq!(seen.len(), 700);
    assert!(seen.iter().all(|a| a.starts_with('c')));
    for batch in open {
        batch.lease.release().await.unwrap();
    }
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
