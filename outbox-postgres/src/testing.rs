//! Helpers for tests against a real PostgreSQL (feature `test-utils`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use txoutbox_core::testkit::{EventState, EventStatus, StoreFixture, TestStore};
use txoutbox_core::{Error, NewEvent};

use crate::error::map_sqlx;
use crate::migrate::migrate;
use crate::pool::connect;
use crate::store::{PostgresStore, Retention};
use crate::table::OutboxTable;
use crate::writer::Writer;

/// The default test database.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_string())
}

/// PgBouncer in transaction mode with prepared statements carried (`max_prepared_statements`
/// above 0): `PGBOUNCER_URL`, or the one `scripts/test-env.sh` starts on 127.0.0.1:6432.
pub fn pgbouncer_url() -> String {
    std::env::var("PGBOUNCER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_string())
}

/// PgBouncer in transaction mode without prepared statements (as before 1.21):
/// `PGBOUNCER_UNPREPARED_URL`, or the one `scripts/test-env.sh` starts on 127.0.0.1:6433.
pub fn pgbouncer_unprepared_url() -> String {
    std::env::var("PGBOUNCER_UNPREPARED_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6433/test".to_string())
}

/// A name of its own for the sessions of one process under test (`<prefix>-<random>`), and the test
/// database's URL carrying it as `application_name`, so that `pg_stat_activity` tells its sessions
/// apart ([`sessions_holding_a_claim`]).
pub fn database_url_named(prefix: &str) -> (String, String) {
    url_named(&database_url(), prefix)
}

/// As [`database_url_named`], for `url` (the test database through a pooler, say).
pub fn url_named(url: &str, prefix: &str) -> (String, String) {
    let name = format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..12]);
    let separator = if url.contains('?') { '&' } else { '?' };
    let named = format!("{url}{separator}application_name={name}");
    (name, named)
}

/// How many sessions named `name` hold a claim while its batch is published: the claim's
/// transaction stays open, idle, until the batch is settled (`idle in transaction`), holding its
/// partitions (advisory locks) or its rows (a transaction id). A statement running on its own (a
/// claim query, an empty claim) does not count, nor does a transaction of several statements seen
/// between two of them that holds neither (the statistics' read-only transaction).
pub async fn sessions_holding_a_claim(pg: &PgPool, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity a
         WHERE a.application_name = $1 AND a.state = 'idle in transaction'
           AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.granted
                         AND l.locktype IN ('advisory', 'transactionid'))",
    )
    .bind(name)
    .fetch_one(pg)
    .await
    .unwrap()
}

/// A pool to the test database; panics with how to start the server when it is unreachable.
pub async fn pool(max_connections: u32) -> PgPool {
    pool_at(&database_url(), max_connections).await
}

/// A pool of `url` (the test database, directly or through a pooler); panics with how to start the
/// server or the pooler when it is unreachable.
pub async fn pool_at(url: &str, max_connections: u32) -> PgPool {
    match connect(url, max_connections).await {
        Ok(p) => p,
        Err(e) => panic!(
            "PostgreSQL (or the pooler in front of it) is required for this test and is unreachable at {}: {e}\n\
             Start them with `bash scripts/test-env.sh` (it starts PostgreSQL on 5432 with \
             `pg_ctlcluster --skip-systemctl-redirect <version> main start`, creates the database, and starts PgBouncer \
             on 6432 and 6433), or point DATABASE_URL, PGBOUNCER_URL and PGBOUNCER_UNPREPARED_URL at running servers.",
            crate::redact_url(url)
        ),
    }
}

/// A table name in a schema of its own (`outbox_t_<random>`), not created: `scripts/test-env.sh` drops
/// these schemas (and their WAL slots and publications) left by earlier runs.
pub fn unmigrated_table() -> OutboxTable {
    let schema = format!("outbox_t_{}", &Uuid::new_v4().simple().to_string()[..12]);
    OutboxTable::new(schema, "outbox_events").expect("a valid generated name")
}

/// A new, migrated outbox table in a schema of its own (`outbox_t_<random>`), isolated from every
/// other test. `scripts/test-env.sh` drops these schemas before each run.
pub async fn fresh_table(pool: &PgPool) -> OutboxTable {
    let table = unmigrated_table();
    migrate(pool, &table).await.expect("migrate a fresh table");
    table
}

/// A [`TestStore`] over a [`PostgresStore`]: inserts through the [`Writer`], one transaction per call.
#[derive(Debug, Clone)]
pub struct PgTestStore {
    /// The store under test.
    pub store: PostgresStore,
    /// A writer for the same table.
    pub writer: Writer,
}

impl PgTestStore {
    /// Wraps `store`.
    pub fn new(store: PostgresStore) -> Self {
        let writer = Writer::new(store.table().clone());
        PgTestStore { store, writer }
    }
}

#[async_trait]
impl txoutbox_core::Store for PgTestStore {
    async fn claim(&self, r: txoutbox_core::ClaimRequest) -> Result<txoutbox_core::Batch, Error> {
        self.store.claim(r).await
    }
    async fn stats(&self) -> Result<txoutbox_core::StoreStats, Error> {
        self.store.stats().await
    }
    async fn check(&self) -> Result<(), Error> {
        self.store.check().await
    }
}

#[async_trait]
impl TestStore for PgTestStore {
    async fn insert(&self, events: Vec<NewEvent>) -> Result<(), Error> {
        let mut tx = self
            .store
            .pool()
            .begin()
            .await
            .map_err(|e| map_sqlx("begin", e))?;
        self.writer.enqueue_many(&mut tx, events).await?;
        self.writer.commit(tx).await
    }

    async fn state(&self, id: Uuid) -> Result<Option<EventState>, Error> {
        let sql = format!(
            "SELECT attempts, last_error, processed_at IS NOT NULL AS processed, dead_lettered_at IS NOT NULL AS dead FROM {} WHERE id = $1",
            self.store.table().qualified()
        );
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(self.store.pool())
            .await
            .map_err(|e| map_sqlx("state", e))?;
        Ok(row.map(|r| {
            let processed: bool = r.get("processed");
            let dead: bool = r.get("dead");
            let attempts: i32 = r.get("attempts");
            EventState {
                status: if processed {
                    EventStatus::Processed
                } else if dead {
                    EventStatus::DeadLettered
                } else {
                    EventStatus::Pending
                },
                attempts: attempts as u32,
                last_error: r.get("last_error"),
            }
        }))
    }
}

/// Builds a fresh PostgreSQL outbox for each conformance check.
#[derive(Debug, Clone)]
pub struct PgFixture {
    /// The pool shared by the stores.
    pub pool: PgPool,
    /// Retention of the stores built.
    pub retention: Retention,
}

#[async_trait]
impl StoreFixture for PgFixture {
    async fn store(&self) -> Arc<dyn TestStore> {
        let table = fresh_table(&self.pool).await;
        Arc::new(PgTestStore::new(PostgresStore::with_retention(
            self.pool.clone(),
            table,
            self.retention,
        )))
    }
}

/// A [`TestStore`] over a [`WalStore`](crate::wal::WalStore) with its reader running: inserts
/// through the [`Writer`] and returns once the reader has the events (in its buffer or the held
/// table); an event's state is the buffer's (pending) or the held table's. The slot is dropped with
/// it.
pub struct WalTestStore {
    store: crate::wal::WalStore,
    pg: PgTestStore,
    reader: std::sync::Mutex<Option<crate::wal::ReaderHandle>>,
    pool: PgPool,
}

#[async_trait]
impl txoutbox_core::Store for WalTestStore {
    async fn claim(&self, r: txoutbox_core::ClaimRequest) -> Result<txoutbox_core::Batch, Error> {
        self.store.claim(r).await
    }
    /// Once the reader has moved what was settled as failures to the held table (a moment after
    /// the settlement).
    async fn stats(&self) -> Result<txoutbox_core::StoreStats, Error> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while self.store.moving() && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.store.stats().await
    }
    async fn check(&self) -> Result<(), Error> {
        self.store.check().await
    }
}

#[async_trait]
impl TestStore for WalTestStore {
    async fn insert(&self, events: Vec<NewEvent>) -> Result<(), Error> {
        let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
        let source = PgTestStore::new(PostgresStore::new(
            self.pool.clone(),
            self.store.slot().table().clone(),
        ));
        source.insert(events).await?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        for id in ids {
            while self.store.buffered(id).is_none() && self.pg.state(id).await?.is_none() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the WAL reader did not read {id} within 30 s"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        Ok(())
    }

    async fn state(&self, id: Uuid) -> Result<Option<EventState>, Error> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            match self.store.buffered(id) {
                // Settled as a failure: the reader moves it to the held table in a moment.
                Some(true) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Some(_) => {
                    return Ok(Some(EventState {
                        status: EventStatus::Pending,
                        attempts: 0,
                        last_error: None,
                    }))
                }
                None => return self.pg.state(id).await,
            }
        }
    }
}

impl Drop for WalTestStore {
    fn drop(&mut self) {
        let reader = self.reader.lock().unwrap().take();
        let slot = self.store.slot().clone();
        // A pool of this thread's own runtime: a connection the shared pool opened here would
        // stay in it, tied to this runtime, and fail the test's next statement once it is gone
        // ("a Tokio context was found, but it is being shut down").
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                if let Some(r) = reader {
                    r.stop().await;
                }
                let Ok(pool) = connect(&database_url(), 1).await else {
                    return;
                };
                // The walsender lets the slot go a moment after the reader stopped.
                for _ in 0..100 {
                    if slot.drop(&pool).await.is_ok() {
                        return;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            });
        })
        .join();
    }
}

/// Builds a fresh outbox table with its WAL source (slot, publication, held table) and a running
/// reader for each conformance check.
#[derive(Debug, Clone)]
pub struct WalFixture {
    /// The pool shared by the stores.
    pub pool: PgPool,
}

#[async_trait]
impl StoreFixture for WalFixture {
    async fn store(&self) -> Arc<dyn TestStore> {
        let table = fresh_table(&self.pool).await;
        let config = crate::wal::WalConfig {
            message_prefix: table.schema().to_string(),
            ..crate::wal::WalConfig::default()
        };
        let slot = config.slot(&table).unwrap();
        slot.setup(&self.pool).await.unwrap();
        let held = config.held_table(&table).unwrap();
        migrate(&self.pool, &held).await.unwrap();
        let held = PostgresStore::new(self.pool.clone(), held);
        let store = crate::wal::WalStore::new(self.pool.clone(), slot, held.clone(), &config)
            .unwrap()
            .with_held_poll_interval(std::time::Duration::from_millis(20));
        let reader = store.start();
        Arc::new(WalTestStore {
            store,
            pg: PgTestStore::new(held),
            reader: std::sync::Mutex::new(Some(reader)),
            pool: self.pool.clone(),
        })
    }
}
