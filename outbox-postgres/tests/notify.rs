//! LISTEN/NOTIFY wake-up against the real PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_core::{CancellationToken, Wake};
use outbox_postgres::notify::{install_notify_trigger, listen, remove_notify_trigger};
use outbox_postgres::testing::{fresh_table, pool};

#[tokio::test]
async fn one_notification_per_inserting_transaction_wakes_the_relay() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    install_notify_trigger(&pool, &table).await.unwrap();
    install_notify_trigger(&pool, &table).await.unwrap(); // idempotent
    let wake = Wake::new();
    let shutdown = CancellationToken::new();
    let task = {
        let (pool, table, wake, shutdown) =
            (pool.clone(), table.clone(), wake.clone(), shutdown.clone());
        tokio::spawn(async move { listen(&pool, &table, wake, shutdown).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await; // listening
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
