//! The consumer-side inbox against the real PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use sqlx::{PgPool, Row};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{Inbox, InboxError, OutboxTable, Processed};
use uuid::Uuid;

async fn setup(consumer: &str) -> (PgPool, Inbox, String) {
    let pool = pool(16).await;
    let schema = fresh_table(&pool).await.schema().to_string();
    let inbox = Inbox::with_table(
        OutboxTable::new(&schema, "processed_events").unwrap(),
        consumer,
    )
    .unwrap();
    assert!(!inbox.migrate(&pool).await.unwrap().is_empty());
    assert!(inbox.migrate(&pool).await.unwrap().is_empty(), "idempotent");
    let counter = format!("\"{schema}\".counter");
    sqlx::raw_sql(&format!(
        "CREATE TABLE {counter} (n int NOT NULL); INSERT INTO {counter} VALUES (0);"
    ))
    .execute(&pool)
    .await
    .unwrap();
    (pool, inbox, counter)
}

async fn count(pool: &PgPool, counter: &str) -> i32 {
    sqlx::query(&format!("SELECT n FROM {counter}"))
        .fetch_one(pool)
        .await
        .unwrap()
        .get("n")
}

fn bump(
    counter: String,
) -> impl for<'c> FnOnce(
    &'c mut sqlx::PgConnection,
) -> futures_core::future::BoxFuture<'c, Result<(), sqlx::Error>> {
    move |conn| {
        Box::pin(async move {
            sqlx::query(&format!("UPDATE {counter} SET n = n + 1"))
                .execute(&mut *conn)
                .await?;
            Ok(())
        })
    }
}

#[tokio::test]
async fn a_message_delivered_three_times_is_handled_once() {
    let (pool, inbox, counter) = setup("billing").await;
    let id = Uuid::now_v7();
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        outcomes.push(
            inbox
                .process(&pool, id, bump(counter.clone()))
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        outcomes,
        vec![
            Processed::Done(()),
            Processed::Duplicate,
            Processed::Duplicate
        ]
    );
    assert_eq!(count(&pool, &counter).await, 1);
    assert!(inbox.seen(&pool, id).await.unwrap());
}

#[tokio::test]
async fn a_handler_error_rolls_back_the_record_so_the_message_is_retried() {
    let (pool, inbox, counter) = setup("billing").await;
    let id = Uuid::now_v7();
    let c = counter.clone();
    let failed = inbox
        .process(&pool, id, move |conn| {
            Box::pin(async move {
                sqlx::query(&format!("UPDATE {c} SET n = n + 100"))
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| e.to_string())?;
                Err::<(), String>("downstream refused".into())
            })
        })
        .await;
    match failed {
        Err(InboxError::Handler(msg)) => assert_eq!(msg, "downstream refused"),
        other => panic!("expected the handler's error, got {other:?}"),
    }
    assert!(
        !inbox.seen(&pool, id).await.unwrap(),
        "the record rolled back with the handler"
    );
    assert_eq!(
        count(&pool, &counter).await,
        0,
        "the handler's writes rolled back too"
    );
    assert_eq!(
        inbox
            .process(&pool, id, bump(counter.clone()))
            .await
            .unwrap(),
        Processed::Done(())
    );
    assert_eq!(count(&pool, &counter).await, 1);
}

#[tokio::test]
async fn concurrent_deliveries_run_the_handler_once() {
    let (pool, inbox, counter) = setup("billing").await;
    let id = Uuid::now_v7();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (pool, inbox, counter) = (pool.clone(), inbox.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            inbox.process(&pool, id, bump(counter)).await.unwrap()
        }));
    }
    let mut done = 0;
    for t in tasks {
        if t.await.unwrap() == Processed::Done(()) {
            done += 1;
        }
    }
    assert_eq!(done, 1);
    assert_eq!(count(&pool, &counter).await, 1);
}

#[tokio::test]
async fn consumers_are_independent_and_cleanup_forgets_old_records() {
    let (pool, billing, counter) = setup("billing").await;
    let shipping = Inbox::with_table(billing.table().clone(), "shipping").unwrap();
    let id = Uuid::now_v7();
    assert_eq!(
        billing
            .process(&pool, id, bump(counter.clone()))
            .await
            .unwrap(),
        Processed::Done(())
    );
    assert_eq!(
        shipping
            .process(&pool, id, bump(counter.clone()))
            .await
            .unwrap(),
        Processed::Done(()),
        "another consumer handles it too"
    );
    assert_eq!(count(&pool, &counter).await, 2);
    sqlx::query(&format!(
        "UPDATE {} SET processed_at = now() - interval '2 days' WHERE consumer = 'billing'",
        billing.table().qualified()
    ))
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        billing
            .cleanup(&pool, Duration::from_secs(86400), 100)
            .await
            .unwrap(),
        1
    );
    assert!(!billing.seen(&pool, id).await.unwrap());
    assert!(shipping.seen(&pool, id).await.unwrap());
    assert!(Inbox::new("").is_err());
}
