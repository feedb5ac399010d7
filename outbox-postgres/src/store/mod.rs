//! The relay's store: claim what no other lease holds (partitions of the aggregates for ordered
//! claims, rows for unordered ones), settle a batch in one statement.
//!
//! [`PostgresStore`] is put together from one module per job: the statements (`sql`), the claim
//! algorithm (`claim`: `ordered`, `skip`, `unordered`), the kept sets of partitions later claims
//! take again (`kept`), the lease and its settlement (`lease`), the bounded statistics (`stats`,
//! over `count` passes), and the operator's tools over dead letters and kept rows (`operator`).

mod claim;
mod count;
mod kept;
mod lease;
pub(crate) mod operator;
mod sql;
mod stats;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sqlx::PgPool;

use txoutbox_core::{Batch, ClaimRequest, Error, Store, StoreStats};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

use count::CountPass;
use kept::KeptSets;
use sql::Sql;

pub(crate) use lease::EmptyLease;
pub use sql::Retention;

/// The PostgreSQL implementation of [`Store`], plus the operator's tools (dead letters, cleanup).
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    table: OutboxTable,
    retention: Retention,
    sql: Arc<Sql>,
    /// Where the next skip scan starts: the last aggregate the previous one visited (`None`: from
    /// the first). Rotating it gives every aggregate its turn, however many there are.
    skip_cursor: Arc<Mutex<Option<(String, String)>>>,
    /// Until when skip scans rest: set when the last ones walked every aggregate and found no head
    /// to take (other relays hold them all), so that claims bound to find nothing beyond the window
    /// do not keep walking the aggregates (the window still runs on every claim).
    skip_rest_until: Arc<Mutex<Option<std::time::Instant>>>,
    /// Whether ordered claims use the wide form of the owned read: set while the backlog comes in
    /// runs (see `claim::ordered::WIDE_ABOVE`).
    wide: Arc<std::sync::atomic::AtomicBool>,
    /// The factor of the window ordered claims choose their partitions from (see
    /// `claim::ordered::WINDOW_FACTOR_MAX`).
    window_factor: Arc<std::sync::atomic::AtomicI64>,
    /// Full batches since the window last widened, modulo `claim::ordered::CALM_CLAIMS`.
    calm_claims: Arc<std::sync::atomic::AtomicU32>,
    /// Sets of partitions that filled recent batches, for later claims to take again (see
    /// `kept::KEPT_SETS`).
    kept: KeptSets,
    /// How many more ordered claims fill their batch with whole runs (see
    /// `claim::ordered::SHARE_CLAIMS`).
    share_claims: Arc<std::sync::atomic::AtomicU32>,
    /// The most rows of each kind one statistics call reads (see [`PostgresStore::with_stats_max_rows`]).
    stats_max_rows: i64,
    /// The counts in progress: pending rows, dead letters.
    stats_passes: Arc<tokio::sync::Mutex<(CountPass, CountPass)>>,
}

/// The default of [`PostgresStore::with_stats_max_rows`] (`database.stats_max_rows`): 100,000 rows
/// per kind and call.
pub const DEFAULT_STATS_MAX_ROWS: u64 = 100_000;

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.qualified())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A store over `table` (migrate it first with [`crate::migrate()`]). Published rows are deleted.
    pub fn new(pool: PgPool, table: OutboxTable) -> Self {
        Self::with_retention(pool, table, Retention::Delete)
    }

    /// A store with the given retention of published rows.
    pub fn with_retention(pool: PgPool, table: OutboxTable, retention: Retention) -> Self {
        let sql = Arc::new(Sql::new(&table, retention));
        PostgresStore {
            pool,
            table,
            retention,
            sql,
            skip_cursor: Arc::new(Mutex::new(None)),
            skip_rest_until: Arc::new(Mutex::new(None)),
            wide: Arc::default(),
            window_factor: Arc::new(std::sync::atomic::AtomicI64::new(1)),
            calm_claims: Arc::default(),
            kept: Arc::default(),
            share_claims: Arc::default(),
            stats_max_rows: DEFAULT_STATS_MAX_ROWS as i64,
            stats_passes: Arc::default(),
        }
    }

    /// Reads at most `rows` rows of each kind (pending, dead letters) per [`Store::stats`] call
    /// (default [`DEFAULT_STATS_MAX_ROWS`]; at least 1,000): a kind with more is counted over
    /// several calls, each going on from where the last stopped, and reported from the last complete
    /// count ([`StoreStats::estimated`] is then true).
    pub fn with_stats_max_rows(mut self, rows: u64) -> Self {
        self.stats_max_rows = i64::try_from(rows).unwrap_or(i64::MAX).max(1_000);
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The retention in force.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// Applies the schema migrations to this store's table (see [`crate::migrate()`]).
    ///
    /// # Errors
    /// As [`crate::migrate()`].
    pub async fn migrate(&self) -> Result<Vec<i64>, Error> {
        crate::migrate::migrate(&self.pool, &self.table).await
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error> {
        self.claim_batch(request).await
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        self.chunked_stats().await
    }

    /// Each batch in flight holds a connection of the pool for its lease (the claim's
    /// transaction): a pool with fewer than `batches_in_flight` connections would make claims wait
    /// while leases age.
    fn check_capacity(&self, batches_in_flight: usize) -> Result<(), Error> {
        let has = self.pool.options().get_max_connections();
        if (has as usize) < batches_in_flight {
            return Err(Error::config(format!(
                "the store's pool holds {has} connections, fewer than max_in_flight = {batches_in_flight}: each batch in flight holds one for its lease; \
                 open the pool with more (txoutbox_postgres::connect(url, n)), or lower max_in_flight"
            )));
        }
        Ok(())
    }

    /// The table answers, and the role may do what claims and settlements do on it: SELECT and
    /// UPDATE, and DELETE when published rows are deleted ([`Retention::Delete`]). A missing
    /// privilege is an error naming the GRANT (the relay would otherwise publish events it cannot
    /// then mark, again and again).
    async fn check(&self) -> Result<(), Error> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(|e| map_sqlx("check", e))?;
        sqlx::query(&format!("SELECT 1 FROM {} LIMIT 0", self.table.qualified()))
            .execute(&mut *conn)
            .await
            .map_err(|e| map_sqlx("check", e))?;
        let (privileges, why): (&[&str], _) = match self.retention {
            Retention::Delete => (
                &["SELECT", "UPDATE", "DELETE"],
                "the relay needs to claim events, mark them and delete the published ones",
            ),
            Retention::Keep => (
                &["SELECT", "UPDATE"],
                "the relay needs to claim events and mark them",
            ),
        };
        crate::grants::check_privileges(&mut conn, &self.table, privileges, false, why).await
    }
}
