//! The WAL source's slot against the real PostgreSQL (`wal_level = logical`, set by
//! `scripts/test-env.sh`): setup, status and drop.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_core::testkit::sample_event;
use outbox_core::testkit::TestStore;
use outbox_core::ErrorKind;
use outbox_postgres::testing::{fresh_table, pool, PgTestStore};
use outbox_postgres::wal::{self, WalSlot};
use outbox_postgres::{OutboxTable, PostgresStore};

/// Drops the slot at the end of the test, failed or not: a forgotten slot keeps WAL for ever.
struct Dropped(WalSlot, sqlx::PgPool);

impl Drop for Dropped {
    fn drop(&mut self) {
        let (slot, pool) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move { slot.drop(&pool).await })
        })
        .join();
    }
}

async fn logical(pool: &sqlx::PgPool) {
    let level = wal::wal_level(pool).await.unwrap();
    assert_eq!(
        level, "logical",
        "the WAL tests need wal_level = logical: run `bash scripts/test-env.sh` (it sets it and restarts the local server once)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_status_and_drop_of_a_tables_slot() {
    let pool = pool(4).await;
    logical(&pool).await;
    let table = fresh_table(&pool).await;
    let slot = WalSlot::new(table.clone(), None, None).unwrap();
    let _guard = Dropped(slot.clone(), pool.clone());

    let before = slot.status(&pool).await.unwrap();
    assert!(
        !before.slot_exists && !before.publication_exists,
        "{before:?}"
    );
    assert_eq!(before.wal_level, "logical");

    let created = slot.setup(&pool).await.unwrap();
    assert!(created.publication && created.slot, "{created:?}");
    let again = slot.setup(&pool).await.unwrap();
    assert!(!again.publication && !again.slot, "idempotent: {again:?}");

    let idle = slot.status(&pool).await.unwrap();
    assert!(
        idle.slot_exists && idle.publication_exists && !idle.active,
        "{idle:?}"
    );
    assert!(idle.confirmed_lsn.is_some() && idle.restart_lsn.is_some());
    assert!(idle.retained_bytes.unwrap() >= 0 && idle.lag_bytes.unwrap() >= 0);
    assert_eq!(
        idle.lag_seconds,
        Some(0.0),
        "nothing committed since: {idle:?}"
    );
    assert_eq!(idle.oldest_unconfirmed_commit, None);

    // Events committed into the table: the slot holds them, the lag counts from the first commit.
    let written = chrono::Utc::now();
    let store = PgTestStore::new(PostgresStore::new(pool.clone(), table.clone()));
    store
        .insert(vec![sample_event("a", 0), sample_event("a", 1)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let behind = slot.status(&pool).await.unwrap();
    let first = behind
        .oldest_unconfirmed_commit
        .expect("a transaction held");
    assert!(
        first >= written - chrono::Duration::seconds(1) && first <= chrono::Utc::now(),
        "{first} vs {written}"
    );
    assert!(behind.lag_seconds.unwrap() > 0.0, "{behind:?}");
    assert!(
        behind.lag_bytes.unwrap() > idle.lag_bytes.unwrap(),
        "{behind:?}"
    );
    // Peeking for the status consumed nothing.
    let still = slot.status(&pool).await.unwrap();
    assert_eq!(still.oldest_unconfirmed_commit, Some(first));
    assert!(!still.retains_too_much(wal::DEFAULT_RETAINED_WAL_WARNING));
    assert!(still.retains_too_much(0), "any WAL is more than none");

    let dropped = slot.drop(&pool).await.unwrap();
    assert!(dropped.slot && dropped.publication, "{dropped:?}");
    let gone = slot.status(&pool).await.unwrap();
    assert!(!gone.slot_exists && !gone.publication_exists, "{gone:?}");
    let again = slot.drop(&pool).await.unwrap();
    assert!(!again.slot && !again.publication);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_of_an_unmigrated_table_says_to_migrate() {
    let pool = pool(2).await;
    logical(&pool).await;
    let table = OutboxTable::new(
        format!(
            "outbox_t_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ),
        "outbox_events",
    )
    .unwrap();
    let slot = WalSlot::new(table, None, None).unwrap();
    let _guard = Dropped(slot.clone(), pool.clone());
    let e = slot.setup(&pool).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("run `outbox migrate`"), "{e}");
    let status = slot.status(&pool).await.unwrap();
    assert!(
        !status.slot_exists,
        "no slot without its publication: {status:?}"
    );
}
