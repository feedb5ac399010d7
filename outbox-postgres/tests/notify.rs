//! LISTEN/NOTIFY wake-up against the real PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_core::{CancellationToken, Wake};
use txoutbox_postgres::notify::{install_notify_trigger, listen, remove_notify_trigger};
use txoutbox_postgres::testing::{fresh_table, pool};

/// A listener on `table`'s notifications, in a task of its own: its wake handle, its shutdown, the task.
fn listening(
    pool: &sqlx::PgPool,
    table: &txoutbox_postgres::OutboxTable,
) -> (
    Wake,
    CancellationToken,
    tokio::task::JoinHandle<Result<(), txoutbox_core::Error>>,
) {
    let wake = Wake::new();
    let shutdown = CancellationToken::new();
    let task = {
        let (pool, table, wake, shutdown) =
            (pool.clone(), table.clone(), wake.clone(), shutdown.clone());
        tokio::spawn(async move { listen(&pool, &table, wake, shutdown).await })
    };
    (wake, shutdown, task)
}

#[tokio::test]
async fn one_notification_per_inserting_transaction_wakes_the_relay() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    install_notify_trigger(&pool, &table).await.unwrap();
    install_notify_trigger(&pool, &table).await.unwrap(); // idempotent
    let (wake, shutdown, task) = listening(&pool, &table);
    let channel = txoutbox_postgres::notify::channel(&table).unwrap();
    listener_pid(&pool, &channel, None).await;
    let insert = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '1', 'order.created', '{{}}')",
        table.qualified()
    );
    let mut tx = pool.begin().await.unwrap();
    for _ in 0..3 {
        sqlx::query(&insert).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), wake.notified())
        .await
        .expect("the commit must wake the relay");

    // Without the trigger, inserts wake nobody.
    remove_notify_trigger(&pool, &table).await.unwrap();
    sqlx::query(&insert).execute(&pool).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), wake.notified())
            .await
            .is_err(),
        "no trigger, no notification"
    );
    shutdown.cancel();
    task.await.unwrap().unwrap();
}

/// The backend of the listening session, once one listens on `channel` (other than `not`).
async fn listener_pid(pool: &sqlx::PgPool, channel: &str, not: Option<i32>) -> i32 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pid: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE query ILIKE 'LISTEN%' AND strpos(query, $1) > 0 AND state = 'idle'
               AND pid IS DISTINCT FROM $2
             LIMIT 1",
        )
        .bind(channel)
        .bind(not)
        .fetch_optional(pool)
        .await
        .unwrap();
        if let Some(pid) = pid {
            return pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session listens on {channel}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The listening session ends (an operator's `pg_terminate_backend`, a failover, an idle timeout):
/// the listener connects and listens again by itself, and the next commit wakes the relay.
#[tokio::test]
async fn a_terminated_listening_session_is_replaced_and_commits_wake_again() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    install_notify_trigger(&pool, &table).await.unwrap();
    let channel = txoutbox_postgres::notify::channel(&table).unwrap();
    let (wake, shutdown, task) = listening(&pool, &table);
    let first = listener_pid(&pool, &channel, None).await;
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(first)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended);
    let second = listener_pid(&pool, &channel, Some(first)).await;
    assert_ne!(first, second);
    // The reconnection woke the relay once (for what it may have missed); take that wake-up.
    let _ = tokio::time::timeout(Duration::from_millis(200), wake.notified()).await;
    let insert = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '1', 'order.created', '{{}}')",
        table.qualified()
    );
    sqlx::query(&insert).execute(&pool).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), wake.notified())
        .await
        .expect("a commit after the reconnection must wake the relay");
    shutdown.cancel();
    task.await.unwrap().unwrap();
}
