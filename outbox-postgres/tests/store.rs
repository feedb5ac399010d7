//! The PostgreSQL store against the real server: conformance suite, schema, writer, operations.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use sqlx::Row;
use txoutbox_core::testkit::{sample_event, store_suite, EventStatus, TestStore};
use txoutbox_core::{Action, ClaimRequest, NewEvent, OrderingPolicy, Settlement, Store};
use txoutbox_postgres::testing::{fresh_table, pool, PgFixture, PgTestStore};
use txoutbox_postgres::{migrate, DeadLetterFilter, OutboxTable, PostgresStore, Retention, Writer};

fn strict(limit: usize) -> ClaimRequest {
    ClaimRequest::new(limit, OrderingPolicy::PerAggregate)
}

/// Ends the sessions holding a claim on `table` open (as a crash or a network cut would), waiting
/// until each has ended; returns how many.
async fn end_claiming_sessions(pool: &sqlx::PgPool, table: &OutboxTable) -> i64 {
    sqlx::query(
        "SELECT count(pg_terminate_backend(pid, 10000)) AS n FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'
           AND strpos(query, $1) > 0",
    )
    .bind(table.schema())
    .fetch_one(pool)
    .await
    .unwrap()
    .get("n")
}

#[tokio::test]
async fn conformance_with_deleted_rows() {
    let fx = PgFixture {
        pool: pool(16).await,
        retention: Retention::Delete,
    };
    store_suite::run_all(&fx).await;
}

#[tokio::test]
async fn conformance_with_kept_rows() {
    let fx = PgFixture {
        pool: pool(16).await,
        retention: Retention::Keep,
    };
    store_suite::run_all(&fx).await;
}

#[tokio::test]
async fn migrate_is_idempotent_and_plain_sql_inserts_work() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    assert!(
        migrate(&pool, &table).await.unwrap().is_empty(),
        "second run applies nothing"
    );
    // The classic insert, unchanged, from any language.
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4)",
        table.qualified()
    );
    sqlx::query(&sql)
        .bind("order")
        .bind("7")
        .bind("order.created")
        .bind(serde_json::json!({"total": 1}))
        .execute(&pool)
        .await
        .unwrap();
    let store = PostgresStore::new(pool.clone(), table.clone());
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(b.events.len(), 1);
    let e = &b.events[0];
    assert_eq!(
        (e.aggregate_id.as_str(), e.event_type.as_str(), e.attempts),
        ("7", "order.created", 0)
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&e.payload).unwrap(),
        serde_json::json!({"total": 1})
    );
    assert_eq!(e.content_type, "application/json");
    assert!(e.headers.is_empty());
    b.lease.release().await.unwrap();
    // The dead-letters view exists under its classic name.
    let n: i64 = sqlx::query(&format!(
        "SELECT count(*) AS n FROM \"{}\".outbox_dead_letters",
        table.schema()
    ))
    .fetch_one(&pool)
    .await
    .unwrap()
    .get("n");
    assert_eq!(n, 0);
}

/// The writer takes what a service holds: a sqlx `Transaction` (the event exists only if it
/// commits), a pooled connection, a `PgConnection` (outside a transaction, each write commits on
/// its own).
#[tokio::test]
async fn the_writer_takes_a_transaction_a_pooled_connection_or_a_connection() {
    use sqlx::Connection;
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let writer = Writer::new(table.clone());
    let mut tx = pool.begin().await.unwrap();
    writer.enqueue(&mut tx, sample_event("a", 0)).await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let committed = writer.enqueue(&mut tx, sample_event("a", 1)).await.unwrap();
    tx.commit().await.unwrap();
    let mut pooled = pool.acquire().await.unwrap();
    let from_pool = writer
        .enqueue_many(
            &mut pooled,
            vec![sample_event("b", 0), sample_event("b", 1)],
        )
        .await
        .unwrap();
    drop(pooled);
    let mut conn = sqlx::PgConnection::connect(&txoutbox_postgres::testing::database_url())
        .await
        .unwrap();
    let alone = writer
        .enqueue(&mut conn, sample_event("c", 0))
        .await
        .unwrap();
    conn.close().await.unwrap();
    let ids: Vec<uuid::Uuid> = sqlx::query_scalar(&format!(
        "SELECT id FROM {} ORDER BY seq",
        table.qualified()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut expected = vec![committed];
    expected.extend(from_pool);
    expected.push(alone);
    assert_eq!(ids, expected, "the rolled-back event is not there");
}

#[tokio::test]
async fn migrate_upgrades_a_classic_table_in_place() {
    let pool = pool(4).await;
    let schema = format!(
        "outbox_t_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.outbox_events (
            id UUID PRIMARY KEY DEFAULT gen_random_uuid(),
            aggregate_type VARCHAR(100) NOT NULL, aggregate_id VARCHAR(100) NOT NULL,
            event_type VARCHAR(100) NOT NULL, payload JSONB NOT NULL,
            attempts INT NOT NULL DEFAULT 0, created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
            processed_at TIMESTAMPTZ);
         CREATE INDEX idx_outbox_unprocessed ON {schema}.outbox_events (created_at) WHERE processed_at IS NULL;
         INSERT INTO {schema}.outbox_events (aggregate_type, aggregate_id, event_type, payload)
            VALUES ('order', '1', 'order.created', '{{}}'), ('order', '1', 'order.paid', '{{}}');"
    )).execute(&pool).await.unwrap();
    let table = OutboxTable::new(schema, "outbox_events").unwrap();
    migrate(&pool, &table).await.unwrap();
    let store = PostgresStore::new(pool.clone(), table);
    let b = store.claim(strict(10)).await.unwrap();
    let types: Vec<&str> = b.events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        ["order.created", "order.paid"],
        "existing rows keep their order"
    );
    b.lease.release().await.unwrap();
}

#[tokio::test]
async fn rolled_back_transactions_leave_no_event() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let writer = Writer::new(table.clone());
    sqlx::query(&format!(
        "CREATE TABLE \"{}\".orders (id bigint PRIMARY KEY)",
        table.schema()
    ))
    .execute(&pool)
    .await
    .unwrap();
    let orders = format!("INSERT INTO \"{}\".orders (id) VALUES ($1)", table.schema());

    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&orders)
        .bind(1_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    writer.enqueue(&mut tx, sample_event("1", 0)).await.unwrap();
    tx.rollback().await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&orders)
        .bind(2_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    let kept = writer
        .enqueue_many(&mut tx, vec![sample_event("2", 0), sample_event("2", 1)])
        .await
        .unwrap();
    writer.commit(tx).await.unwrap();

    // An invalid event fails the enqueue; the caller's transaction then writes nothing.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&orders)
        .bind(3_i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    let err = writer
        .enqueue_many(
            &mut tx,
            vec![
                sample_event("3", 0),
                NewEvent::new("order", "", "x", serde_json::json!({})),
            ],
        )
        .await
        .unwrap_err();
    assert!(err.message().contains("aggregate_id"), "{err}");
    tx.rollback().await.unwrap();

    let store = PostgresStore::new(pool.clone(), table.clone());
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(b.events.iter().map(|e| e.id).collect::<Vec<_>>(), kept);
    b.lease.release().await.unwrap();
    let n: i64 = sqlx::query(&format!(
        "SELECT count(*) AS n FROM \"{}\".orders",
        table.schema()
    ))
    .fetch_one(&pool)
    .await
    .unwrap()
    .get("n");
    assert_eq!(n, 1);
}

#[tokio::test]
async fn dead_letters_list_retry_discard() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = PostgresStore::new(pool.clone(), table);
    let ts = PgTestStore::new(store.clone());
    let events = vec![
        sample_event("a", 0),
        NewEvent::new("invoice", "i", "invoice.paid", serde_json::json!({})),
        sample_event("c", 0),
        sample_event("a", 1),
    ];
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    ts.insert(events).await.unwrap();
    let b = store.claim(strict(3)).await.unwrap();
    assert_eq!(b.events.len(), 3);
    let dead = |id, error: &str| Settlement {
        id,
        action: Action::DeadLetter {
            attempts: 2,
            error: error.into(),
        },
    };
    b.lease
        .settle(vec![
            dead(ids[0], "too large"),
            dead(ids[1], "denied"),
            dead(ids[2], "bad"),
        ])
        .await
        .unwrap();

    let all = store
        .dead_letters(&DeadLetterFilter::All, None, 100)
        .await
        .unwrap();
    assert_eq!(
        all.iter().map(|d| d.id).collect::<Vec<_>>(),
        ids[..3].to_vec()
    );
    assert_eq!(all[0].last_error.as_deref(), Some("too large"));
    assert_eq!(all[0].attempts, 2);
    let by_type = store
        .dead_letters(
            &DeadLetterFilter::EventType("invoice.paid".into()),
            None,
            100,
        )
        .await
        .unwrap();
    assert_eq!(by_type.len(), 1);

    // By aggregate (every one of a type, or one), and by age.
    let of = |t: &str, id: Option<&str>| DeadLetterFilter::Aggregate {
        aggregate_type: t.into(),
        aggregate_id: id.map(Into::into),
    };
    let listed = |v: Vec<txoutbox_postgres::DeadLetter>| v.iter().map(|d| d.id).collect::<Vec<_>>();
    assert_eq!(
        listed(
            store
                .dead_letters(&of("order", None), None, 100)
                .await
                .unwrap()
        ),
        vec![ids[0], ids[2]]
    );
    assert_eq!(
        listed(
            store
                .dead_letters(&of("order", Some("c")), None, 100)
                .await
                .unwrap()
        ),
        vec![ids[2]]
    );
    let hour = Some(Duration::from_secs(3600));
    assert!(
        store
            .dead_letters(&DeadLetterFilter::All, hour, 100)
            .await
            .unwrap()
            .is_empty(),
        "none is an hour old"
    );
    sqlx::query(&format!(
        "UPDATE {} SET dead_lettered_at = now() - interval '2 hours' WHERE id = $1",
        store.table().qualified()
    ))
    .bind(ids[2])
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(
        listed(
            store
                .dead_letters(&DeadLetterFilter::All, hour, 100)
                .await
                .unwrap()
        ),
        vec![ids[2]]
    );

    // One whole, with what waits behind it: a's second event.
    let d = store.dead_letter(ids[0]).await.unwrap().unwrap();
    assert_eq!(d.letter.last_error.as_deref(), Some("too large"));
    assert_eq!((d.letter.attempts, d.held_back), (2, 1));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&d.event.payload).unwrap(),
        serde_json::json!({"aggregate": "a", "n": 0})
    );
    assert!(d.event.headers.contains_key("traceparent"));
    assert_eq!(
        d.blocking, ids[0],
        "it is its aggregate's first dead letter"
    );
    assert!(
        store.dead_letter(ids[3]).await.unwrap().is_none(),
        "a pending event is no dead letter"
    );
    // A later dead letter of the same aggregate names the first as what holds the aggregate back.
    let set_dead = |dead: bool| {
        format!(
            "UPDATE {} SET dead_lettered_at = {} WHERE id = $1",
            store.table().qualified(),
            if dead { "now()" } else { "NULL" }
        )
    };
    sqlx::query(&set_dead(true))
        .bind(ids[3])
        .execute(&pool)
        .await
        .unwrap();
    let later = store.dead_letter(ids[3]).await.unwrap().unwrap();
    assert_eq!((later.blocking, later.held_back), (ids[0], 0));
    sqlx::query(&set_dead(false))
        .bind(ids[3])
        .execute(&pool)
        .await
        .unwrap();

    // Retry by id: the event is pending again with attempts reset; a's later event stays behind it.
    assert_eq!(
        store
            .retry_dead_letters(&DeadLetterFilter::Ids(vec![ids[0]]))
            .await
            .unwrap(),
        1
    );
    let st = ts.state(ids[0]).await.unwrap().unwrap();
    assert_eq!((st.status, st.attempts), (EventStatus::Pending, 0));
    assert_eq!(
        st.last_error.as_deref(),
        Some("too large"),
        "the last error is kept for the record"
    );
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(
        b.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        vec![ids[0], ids[3]]
    );
    b.lease.release().await.unwrap();

    // Discard by type, then retry all.
    assert_eq!(
        store
            .discard_dead_letters(&DeadLetterFilter::EventType("invoice.paid".into()))
            .await
            .unwrap(),
        1
    );
    assert!(ts.state(ids[1]).await.unwrap().is_none());
    assert_eq!(
        store
            .retry_dead_letters(&DeadLetterFilter::All)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        store
            .dead_letters(&DeadLetterFilter::All, None, 100)
            .await
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        store
            .discard_dead_letters(&DeadLetterFilter::All)
            .await
            .unwrap(),
        0,
        "pending events are never discarded"
    );
    // Discarding by aggregate releases that aggregate only.
    sqlx::query(&set_dead(true))
        .bind(ids[3])
        .execute(&pool)
        .await
        .unwrap();
    let other = DeadLetterFilter::Aggregate {
        aggregate_type: "order".into(),
        aggregate_id: Some("c".into()),
    };
    assert_eq!(store.discard_dead_letters(&other).await.unwrap(), 0);
    let mine = DeadLetterFilter::Aggregate {
        aggregate_type: "order".into(),
        aggregate_id: Some("a".into()),
    };
    assert_eq!(store.discard_dead_letters(&mine).await.unwrap(), 1);
    assert!(ts.state(ids[3]).await.unwrap().is_none());
}

#[tokio::test]
async fn cleanup_removes_only_old_processed_rows() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = PostgresStore::with_retention(pool.clone(), table.clone(), Retention::Keep);
    let ts = PgTestStore::new(store.clone());
    ts.insert((0..25).map(|i| sample_event(&format!("k{i}"), 0)).collect())
        .await
        .unwrap();
    store_suite::settle_all(store.claim(strict(20)).await.unwrap(), Action::Published).await;
    // A dead letter, and 5 pending rows.
    let b = store.claim(strict(1)).await.unwrap();
    let dl = b.events[0].id;
    b.lease
        .settle(vec![Settlement {
            id: dl,
            action: Action::DeadLetter {
                attempts: 1,
                error: "x".into(),
            },
        }])
        .await
        .unwrap();
    // Age 15 of the 20 processed rows by an hour.
    sqlx::query(&format!(
        "UPDATE {t} SET processed_at = processed_at - interval '1 hour' WHERE id IN (SELECT id FROM {t} WHERE processed_at IS NOT NULL ORDER BY seq LIMIT 15)",
        t = table.qualified()
    )).execute(&pool).await.unwrap();

    let mut progress = Vec::new();
    let removed = store
        .cleanup(Duration::from_secs(600), 4, |n| progress.push(n))
        .await
        .unwrap();
    assert_eq!(removed, 15);
    assert_eq!(
        progress,
        vec![4, 8, 12, 15],
        "bounded batches with progress"
    );
    let counts = sqlx::query(&format!(
        "SELECT count(*) FILTER (WHERE processed_at IS NOT NULL) AS processed,
                count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) AS dead,
                count(*) FILTER (WHERE processed_at IS NULL AND dead_lettered_at IS NULL) AS pending FROM {}",
        table.qualified()
    )).fetch_one(&pool).await.unwrap();
    let (p, d, q): (i64, i64, i64) = (
        counts.get("processed"),
        counts.get("dead"),
        counts.get("pending"),
    );
    assert_eq!((p, d, q), (5, 1, 4));
    assert!(store
        .cleanup(Duration::from_secs(600), 0, |_| {})
        .await
        .is_err());
}

/// `n` events published and kept, their `processed_at` moved an hour back.
async fn expired_rows(pool: &sqlx::PgPool, store: &PostgresStore, table: &OutboxTable, n: usize) {
    PgTestStore::new(store.clone())
        .insert((0..n).map(|i| sample_event(&format!("k{i}"), 0)).collect())
        .await
        .unwrap();
    store_suite::settle_all(store.claim(strict(n)).await.unwrap(), Action::Published).await;
    sqlx::query(&format!(
        "UPDATE {} SET processed_at = processed_at - interval '1 hour'",
        table.qualified()
    ))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn cleanup_batches_take_turns_under_the_tables_cleanup_lock() {
    use txoutbox_postgres::{CleanupBatch, CleanupLock};
    let pool = pool(6).await;
    let table = fresh_table(&pool).await;
    let store = PostgresStore::with_retention(pool.clone(), table.clone(), Retention::Keep);
    expired_rows(&pool, &store, &table, 10).await;
    let hour = Duration::from_secs(600);
    // Another session cleaning this table (its lock, as cleanup_batch takes it).
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox-cleanup'), hashtext($1))")
        .bind(table.qualified())
        .execute(&mut *holder)
        .await
        .unwrap();
    // The relay's automatic cleanup skips its turn; nothing is removed.
    assert_eq!(
        store
            .cleanup_batch(hour, 4, CleanupLock::Try)
            .await
            .unwrap(),
        CleanupBatch::Busy
    );
    // Another table's cleanup is not held up by this one's lock.
    let other = fresh_table(&pool).await;
    let other_store = PostgresStore::with_retention(pool.clone(), other.clone(), Retention::Keep);
    expired_rows(&pool, &other_store, &other, 3).await;
    assert_eq!(
        other_store
            .cleanup_batch(hour, 4, CleanupLock::Try)
            .await
            .unwrap(),
        CleanupBatch::Removed(3)
    );
    // `outbox cleanup` waits its turn: it is seen waiting on the lock, then runs once it is free.
    let waiting = {
        let store = store.clone();
        tokio::spawn(async move { store.cleanup(hour, 4, |_| {}).await })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        // A session waiting for this table's cleanup lock (not granted yet).
        let waits: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks
             WHERE locktype = 'advisory' AND NOT granted AND objsubid = 2
               AND classid = hashtext('outbox-cleanup')::oid AND objid = hashtext($1)::oid",
        )
        .bind(table.qualified())
        .fetch_one(&pool)
        .await
        .unwrap();
        if waits > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the manual cleanup never waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!waiting.is_finished());
    let kept: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, 10, "nothing removed while another session cleans");
    holder.commit().await.unwrap();
    assert_eq!(waiting.await.unwrap().unwrap(), 10);
    assert_eq!(
        store
            .cleanup_batch(hour, 4, CleanupLock::Try)
            .await
            .unwrap(),
        CleanupBatch::Removed(0)
    );
    assert!(store
        .cleanup_batch(hour, 0, CleanupLock::Try)
        .await
        .is_err());
}

#[tokio::test]
async fn a_terminated_claiming_session_releases_its_events() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let ts = PgTestStore::new(store.clone());
    ts.insert(vec![sample_event("x", 0), sample_event("x", 1)])
        .await
        .unwrap();
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(b.events.len(), 2);
    // Kill the claiming session, as a crash or a network cut would.
    let killed = end_claiming_sessions(&pool, &table).await;
    assert_eq!(killed, 1, "the claiming session must be found");
    // The lease is gone; its outcome is still recorded where no other lease holds the aggregate:
    // the published event is settled outside the lease, the other one is free at once.
    let published = b.events[0].id;
    b.lease
        .settle(vec![Settlement {
            id: published,
            action: Action::Published,
        }])
        .await
        .expect("a lost lease's outcome is settled outside it");
    let again = store.claim(strict(10)).await.unwrap();
    let ids: Vec<_> = again.events.iter().map(|e| e.id).collect();
    assert_eq!(
        ids,
        vec![b.events[1].id],
        "the published event is settled, the other one claimable at once"
    );
    again.lease.release().await.unwrap();
}

#[tokio::test]
async fn stats_and_check_report_missing_schema_clearly() {
    let pool = pool(2).await;
    let store = PostgresStore::new(
        pool,
        OutboxTable::new("outbox_t_missing", "nothing_here").unwrap(),
    );
    let err = store.check().await.unwrap_err();
    assert_eq!(err.kind(), txoutbox_core::ErrorKind::Schema);
    assert!(err.to_string().contains("run `outbox migrate`"), "{err}");
}

#[tokio::test]
async fn the_writer_refuses_payloads_over_its_limit_and_writes_nothing() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let writer = Writer::new(table.clone());
    assert_eq!(
        writer.max_payload_bytes(),
        txoutbox_postgres::DEFAULT_MAX_PAYLOAD_BYTES
    );
    let big = NewEvent::new(
        "order",
        "1",
        "order.big",
        serde_json::json!({ "blob": "x".repeat(1024 * 1024) }),
    );
    let mut tx = pool.begin().await.unwrap();
    let err = writer
        .enqueue_many(&mut tx, vec![sample_event("1", 0), big.clone()])
        .await
        .unwrap_err();
    assert_eq!(err.kind(), txoutbox_core::ErrorKind::PayloadTooLarge);
    let text = err.to_string();
    assert!(
        text.contains("1048587 bytes")
            && text.contains("limit of 1048576 bytes")
            && text.contains("order.big")
            && text.contains("with_max_payload_bytes"),
        "{text}"
    );
    tx.commit().await.unwrap();
    let rows: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "nothing of a refused batch is written");

    // An opaque payload of exactly the limit passes; one byte more does not.
    let at = |n: usize| {
        NewEvent::binary(
            "order",
            "2",
            "order.blob",
            "application/octet-stream",
            vec![0u8; n],
        )
    };
    let mut tx = pool.begin().await.unwrap();
    writer.enqueue(&mut tx, at(1024 * 1024)).await.unwrap();
    let err = writer
        .enqueue(&mut tx, at(1024 * 1024 + 1))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), txoutbox_core::ErrorKind::PayloadTooLarge);
    tx.rollback().await.unwrap();

    // A raised limit takes the large event.
    let raised = writer.clone().with_max_payload_bytes(4 * 1024 * 1024);
    let mut tx = pool.begin().await.unwrap();
    raised.enqueue(&mut tx, big).await.unwrap();
    tx.commit().await.unwrap();
    let store = PostgresStore::new(pool.clone(), table.clone());
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(b.events.len(), 1);
    assert!(b.events[0].payload.len() > 1024 * 1024);
    b.lease.release().await.unwrap();
}

/// The byte budget counts a payload's real size, also for rows copied by plain SQL from compressed
/// rows (whose stored size is a hundredth of the payload).
#[tokio::test]
async fn the_byte_budget_counts_compressed_payloads_at_their_real_size() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let t = table.qualified();
    sqlx::query(&format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'doc', 'seed', 'doc.big', jsonb_build_object('text', repeat('abcdefgh', 500000))"
    ))
    .execute(&pool)
    .await
    .unwrap();
    // Copies of the stored (compressed) payload, each 4 MB as JSON, on three aggregates.
    sqlx::query(&format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'doc', g::text, 'doc.big', (SELECT payload FROM {t} WHERE aggregate_id = 'seed')
         FROM generate_series(1, 3) g"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let (stored, recorded): (i32, i32) = sqlx::query_as(&format!(
        "SELECT pg_column_size(payload), payload_size FROM {t} WHERE aggregate_id = '1'"
    ))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(stored < 200_000, "the copy is stored compressed: {stored}");
    assert!(
        recorded >= 4_000_000,
        "its recorded size is the real one: {recorded}"
    );
    let store = PostgresStore::new(pool.clone(), table.clone());
    for ordering in [OrderingPolicy::PerAggregate, OrderingPolicy::Unordered] {
        let b = store
            .claim(ClaimRequest::new(10, ordering).with_max_bytes(10_000_000))
            .await
            .unwrap();
        assert_eq!(
            b.events.len(),
            2,
            "{ordering:?}: two 4 MB payloads fit a 10 MB budget, three do not"
        );
        b.lease.release().await.unwrap();
    }
    // A batch of one event of each of three aggregates is still cut to the budget.
    for (budget, expected) in [(10_000_000, 2), (20_000_000, 3)] {
        let b = store
            .claim(ClaimRequest::new(3, OrderingPolicy::PerAggregate).with_max_bytes(budget))
            .await
            .unwrap();
        assert_eq!(
            b.events.len(),
            expected,
            "heads filling a batch, budget {budget}"
        );
        assert!(b.events.iter().all(|e| e.payload.len() >= 4_000_000));
        b.lease.release().await.unwrap();
    }
}

/// Rows of `table` read so far (sequential reads and index fetches), as the server's statistics
/// count them, after flushing this connection's own counts.
async fn rows_read(conn: &mut sqlx::PgConnection, table: &OutboxTable) -> i64 {
    // The counts of a session reach the shared statistics when it ends a transaction, at most once a
    // second unless forced; the statistics store answers from a snapshot per transaction.
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
    sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables
         WHERE relid = $1::regclass",
    )
    .bind(table.qualified())
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// Statistics over a backlog larger than `stats_max_rows` read about that many rows of each kind per
/// call, not the backlog, and reach the exact counts over successive calls, whatever the spread of
/// the rows over `seq` (an old burst of dead letters, a gap of published rows, a new backlog).
#[tokio::test]
async fn statistics_read_a_bounded_number_of_rows_and_count_the_rest_over_calls() {
    let admin = pool(4).await;
    let table = fresh_table(&admin).await;
    let t = table.qualified();
    let mut setup = admin.acquire().await.unwrap();
    let insert = |n: i64, event_type: &'static str| {
        format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', (g % 500)::text, '{event_type}', '{{}}' FROM generate_series(1, {n}) g"
        )
    };
    // An old burst (most of it dead-lettered), a gap of published rows, then a new backlog.
    for sql in [
        insert(6_000, "order.old"),
        format!("UPDATE {t} SET dead_lettered_at = now() WHERE event_type = 'order.old' AND seq % 6 <> 0"),
        insert(30_000, "order.done"),
        format!("DELETE FROM {t} WHERE event_type = 'order.done'"),
        insert(40_000, "order.created"),
        insert(9_000, "order.paid"),
    ] {
        sqlx::query(&sql).execute(&mut *setup).await.unwrap();
    }
    let truth: (i64, i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE dead_lettered_at IS NULL),
                count(*) FILTER (WHERE dead_lettered_at IS NOT NULL),
                count(*) FILTER (WHERE dead_lettered_at IS NULL AND event_type = 'order.paid')
         FROM {t}"
    ))
    .fetch_one(&mut *setup)
    .await
    .unwrap();
    // The set-up's own reads (the count above included) reach the statistics now, not during the
    // measurement: a session's counts are otherwise flushed on its own time.
    rows_read(&mut setup, &table).await;
    drop(setup);
    // One connection: the statistics run on it, and it then reports what it read.
    let one = pool(1).await;
    let store = PostgresStore::new(one.clone(), table.clone()).with_stats_max_rows(2_000);
    let mut calls = 0;
    let stats = loop {
        calls += 1;
        assert!(calls <= 60, "the counts never completed");
        let mut conn = one.acquire().await.unwrap();
        let before = rows_read(&mut conn, &table).await;
        drop(conn);
        let stats = store.stats().await.unwrap();
        let mut conn = one.acquire().await.unwrap();
        let read = rows_read(&mut conn, &table).await - before;
        // Two chunks of counts, then the held-back figures: at most 2,000 dead letters, and at
        // most 2,000 rows in all of the probes of their aggregates.
        assert!(
            read <= 4 * 2_000 + 200,
            "one statistics call read {read} rows of a 55,000-row outbox; expected at most 4 x 2,000 + 100"
        );
        assert!(
            stats.estimated,
            "more rows than a chunk: never one exact count"
        );
        assert!(stats.oldest_pending_age_seconds.is_some());
        if stats.pending as i64 == truth.0 && stats.dead_letters as i64 == truth.1 {
            break stats;
        }
        assert!(
            stats.pending as i64 <= truth.0 && stats.dead_letters as i64 <= truth.1,
            "a count in progress never exceeds the truth: {} of {}, {} of {}",
            stats.pending,
            truth.0,
            stats.dead_letters,
            truth.1
        );
    };
    assert!(
        calls >= 20,
        "{calls} calls for 45,000 pending rows in chunks of 2,000"
    );
    let paid = stats
        .by_event_type
        .iter()
        .find(|s| s.event_type == "order.paid")
        .unwrap();
    assert_eq!(paid.pending as i64, truth.2);

    // Below the bound the counts are exact at once; `stats_complete` counts everything now.
    let exact = PostgresStore::new(admin.clone(), table.clone()).with_stats_max_rows(100_000);
    let stats = exact.stats().await.unwrap();
    assert!(!stats.estimated);
    assert_eq!(
        (stats.pending as i64, stats.dead_letters as i64),
        (truth.0, truth.1)
    );
    let fresh = PostgresStore::new(admin.clone(), table.clone()).with_stats_max_rows(2_000);
    let stats = fresh.stats_complete().await.unwrap();
    assert!(!stats.estimated);
    assert_eq!(
        (stats.pending as i64, stats.dead_letters as i64),
        (truth.0, truth.1)
    );
    let held: (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(DISTINCT p.aggregate_id) FROM {t} p
         WHERE p.processed_at IS NULL AND p.dead_lettered_at IS NULL
           AND EXISTS (SELECT 1 FROM {t} d WHERE d.aggregate_id = p.aggregate_id
                       AND d.dead_lettered_at IS NOT NULL AND d.seq < p.seq)"
    ))
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(
        held.0 > 40_000,
        "most of the backlog waits behind the old dead letters"
    );
    assert_eq!(
        (stats.held_back as i64, stats.held_back_aggregates as i64),
        held,
        "pending rows after a dead letter of their aggregate, and their aggregates"
    );
}

/// Over interleaved aggregates a batch is each aggregate's oldest event, in seq order, whole
/// (payload and headers), with the runs behind them left for later.
#[tokio::test]
async fn a_batch_over_interleaved_aggregates_is_their_oldest_events() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let t = table.qualified();
    // Three events of each of four aggregates, interleaved.
    sqlx::query(&format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, headers)
         SELECT 'order', 'o-' || (g % 4), 'order.updated', jsonb_build_object('n', g),
                jsonb_build_object('traceparent', 'tp-' || g)
         FROM generate_series(0, 11) g"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = PostgresStore::new(pool.clone(), table.clone());
    let b = store.claim(strict(4)).await.unwrap();
    let got: Vec<(String, String)> = b
        .events
        .iter()
        .map(|e| {
            (
                e.aggregate_id.clone(),
                String::from_utf8(e.payload.clone()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        (0..4)
            .map(|g| (format!("o-{g}"), format!("{{\"n\": {g}}}")))
            .collect::<Vec<_>>(),
        "each aggregate's first event, in seq order"
    );
    for (g, e) in b.events.iter().enumerate() {
        assert_eq!(e.headers.get("traceparent"), Some(&format!("tp-{g}")));
        assert_eq!(e.attempts, 0);
    }
    // Nothing of these aggregates can be claimed while the batch holds their partitions.
    assert!(store.claim(strict(10)).await.unwrap().events.is_empty());
    let ids = b.events.iter().map(|e| e.id).collect::<Vec<_>>();
    b.lease
        .settle(
            ids.into_iter()
                .map(|id| Settlement {
                    id,
                    action: Action::Published,
                })
                .collect(),
        )
        .await
        .unwrap();
    let next = store.claim(strict(4)).await.unwrap();
    let second: Vec<String> = next
        .events
        .iter()
        .map(|e| String::from_utf8(e.payload.clone()).unwrap())
        .collect();
    assert_eq!(
        second,
        (4..8)
            .map(|g| format!("{{\"n\": {g}}}"))
            .collect::<Vec<_>>()
    );
    next.lease.release().await.unwrap();
}

/// Replicas starting at once migrate at once: several processes migrating one table, and others
/// migrating another outbox table of the same new schema, all succeed, and both tables work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_migrating_at_once_all_succeed() {
    for round in 0..3 {
        let first = txoutbox_postgres::testing::unmigrated_table();
        let second = OutboxTable::new(first.schema(), "other_events").unwrap();
        let mut tasks = Vec::new();
        for i in 0..6 {
            let table = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            // A pool of its own each, as separate processes have.
            let p = pool(1).await;
            tasks.push(tokio::spawn(async move { migrate(&p, &table).await }));
        }
        for t in tasks {
            let applied = t.await.unwrap();
            assert!(applied.is_ok(), "round {round}: {applied:?}");
        }
        let pg = pool(2).await;
        for table in [&first, &second] {
            let store = PostgresStore::new(pg.clone(), table.clone());
            let writer = Writer::new(table.clone());
            let mut tx = pg.begin().await.unwrap();
            writer.enqueue(&mut tx, sample_event("1", 0)).await.unwrap();
            tx.commit().await.unwrap();
            let batch = store.claim(strict(10)).await.unwrap();
            assert_eq!(batch.events.len(), 1, "{}", table.qualified());
            batch.lease.release().await.unwrap();
            // Every migration is recorded once.
            let versions: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT version FROM \"{}\".\"{}_migrations\" ORDER BY version",
                table.schema(),
                table.table()
            ))
            .fetch_all(&pg)
            .await
            .unwrap();
            assert_eq!(
                versions.len(),
                versions
                    .iter()
                    .collect::<std::collections::HashSet<_>>()
                    .len()
            );
            assert!(!versions.is_empty());
        }
    }
}

/// A lease lost mid-publish (its session ended) whose aggregate another relay claims, fails and
/// settles meanwhile: the lost lease's late outcome does not take the event's attempts back, nor
/// replace the later error.
#[tokio::test]
async fn a_lost_leases_late_outcome_never_takes_attempts_back() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let ts = PgTestStore::new(store.clone());
    ts.insert(vec![sample_event("x", 0)]).await.unwrap();
    let a = store.claim(strict(10)).await.unwrap();
    assert_eq!(a.events.len(), 1);
    let id = a.events[0].id;
    let killed = end_claiming_sessions(&pool, &table).await;
    assert_eq!(killed, 1, "the claiming session must be found");
    // Another relay takes the event at once, fails it twice over (its count), and settles.
    let b = store.claim(strict(10)).await.unwrap();
    assert_eq!(b.events.iter().map(|e| e.id).collect::<Vec<_>>(), vec![id]);
    let retry = |attempts, error: &str| Settlement {
        id,
        action: Action::Retry {
            attempts,
            delay: Duration::ZERO,
            error: error.to_string(),
        },
    };
    b.lease
        .settle(vec![retry(2, "the later failure")])
        .await
        .unwrap();
    // The lost lease's outcome arrives late, with the count it knew.
    a.lease
        .settle(vec![retry(1, "the earlier failure")])
        .await
        .expect("a lost lease's outcome is settled where it may be");
    let (attempts, error): (i32, String) = sqlx::query_as(&format!(
        "SELECT attempts, last_error FROM {} WHERE id = $1",
        table.qualified()
    ))
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((attempts, error.as_str()), (2, "the later failure"));
}
