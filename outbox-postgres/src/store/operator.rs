//! The operator's tools: dead letters (list, retry, discard) and the cleanup of kept rows.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, Postgres, Row};
use uuid::Uuid;

use txoutbox_core::{Error, ErrorKind, Event};

use crate::error::map_sqlx;
use crate::row::{decode_event, EVENT_COLUMNS, MARK_TYPES};

use super::PostgresStore;

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterFilter {
    /// These ids.
    Ids(Vec<Uuid>),
    /// Every dead letter of this event type.
    EventType(String),
    /// Every dead letter of this aggregate (of every aggregate of the type when the id is `None`):
    /// discarding them releases the events held back behind them.
    Aggregate {
        /// The aggregate type.
        aggregate_type: String,
        /// The aggregate id; `None` for every aggregate of the type.
        aggregate_id: Option<String>,
    },
    /// Every dead letter.
    All,
}

impl DeadLetterFilter {
    fn clause(&self) -> &'static str {
        match self {
            DeadLetterFilter::Ids(_) => "id = ANY($1::uuid[])",
            DeadLetterFilter::EventType(_) => "event_type = $1",
            DeadLetterFilter::Aggregate { .. } => {
                "aggregate_type = ($1::text[])[1] AND (($1::text[])[2] IS NULL OR aggregate_id = ($1::text[])[2])"
            }
            DeadLetterFilter::All => "($1::text IS NULL)",
        }
    }

    fn bind<'q>(
        &'q self,
        q: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        match self {
            DeadLetterFilter::Ids(ids) => q.bind(ids),
            DeadLetterFilter::EventType(t) => q.bind(t),
            DeadLetterFilter::Aggregate {
                aggregate_type,
                aggregate_id,
            } => q.bind(vec![Some(aggregate_type.clone()), aggregate_id.clone()]),
            DeadLetterFilter::All => q.bind(None::<String>),
        }
    }
}

/// A dead-lettered event, as listed for operators.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Event id.
    pub id: Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

/// One dead letter whole, for an operator deciding what to do with it.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterDetail {
    /// What the list shows.
    pub letter: DeadLetter,
    /// The event as it would be published (payload, headers, destination, content type).
    pub event: Event,
    /// Pending events of its aggregate written after the aggregate's first dead letter (under
    /// per-aggregate order they wait until it is retried or discarded); counted up to
    /// 100,000.
    pub held_back: u64,
    /// The aggregate's first dead letter: the one that holds its events back (this one, or an
    /// earlier one).
    pub blocking: Uuid,
}

/// The most held-back events [`PostgresStore::dead_letter`] counts (a bounded read).
pub(crate) const HELD_BACK_SHOWN: i64 = 100_000;

impl PostgresStore {
    /// Lists dead letters, oldest first, at most `limit`; with `older_than`, only those
    /// dead-lettered longer ago than that.
    ///
    /// # Errors
    /// A database error.
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        older_than: Option<std::time::Duration>,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        let sql = format!(
            "SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, dead_lettered_at
             FROM {} WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL AND {}
               AND ($3::bigint IS NULL OR now() - dead_lettered_at > $3 * interval '1 millisecond')
             ORDER BY seq LIMIT $2",
            self.table.qualified(),
            filter.clause()
        );
        let older_ms = older_than.map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let rows = filter
            .bind(sqlx::query(&sql))
            .bind(limit)
            .bind(older_ms)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| map_sqlx("dead_letters", e))?;
        rows.iter()
            .map(|r| DeadLetter::from_row(r).map_err(|e| map_sqlx("dead_letters", e)))
            .collect()
    }

    /// The dead letter `id` whole, with how many events wait behind it; `None` when no dead letter
    /// has that id.
    ///
    /// # Errors
    /// A database error.
    pub async fn dead_letter(&self, id: Uuid) -> Result<Option<DeadLetterDetail>, Error> {
        let t = self.table.qualified();
        let row = sqlx::query(&format!(
            "SELECT {EVENT_COLUMNS}, e.last_error, e.dead_lettered_at, f.id AS blocking,
                    (SELECT count(*) FROM (
                         SELECT 1 FROM {t} p
                         WHERE p.aggregate_type = e.aggregate_type AND p.aggregate_id = e.aggregate_id
                           AND p.processed_at IS NULL AND p.dead_lettered_at IS NULL AND p.seq > f.seq
                         LIMIT $2) x) AS held_back
             FROM {t} e
             CROSS JOIN LATERAL (
                 SELECT b.id, b.seq FROM {t} b
                 WHERE b.aggregate_type = e.aggregate_type AND b.aggregate_id = e.aggregate_id
                   AND b.processed_at IS NULL AND b.dead_lettered_at IS NOT NULL
                 ORDER BY b.seq LIMIT 1) f
             WHERE e.id = $1 AND e.dead_lettered_at IS NOT NULL AND e.processed_at IS NULL"
        ))
        .bind(id)
        .bind(HELD_BACK_SHOWN)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| map_sqlx("dead_letter", e))?;
        let Some(row) = row else { return Ok(None) };
        let event = decode_event(&row)?;
        let get = |e: sqlx::Error| map_sqlx("dead_letter", e);
        let held_back: i64 = row.try_get("held_back").map_err(get)?;
        Ok(Some(DeadLetterDetail {
            letter: DeadLetter {
                id: event.id,
                aggregate_type: event.aggregate_type.clone(),
                aggregate_id: event.aggregate_id.clone(),
                event_type: event.event_type.clone(),
                attempts: i32::try_from(event.attempts).unwrap_or(i32::MAX),
                last_error: row.try_get("last_error").map_err(get)?,
                created_at: event.created_at,
                dead_lettered_at: row.try_get("dead_lettered_at").map_err(get)?,
            },
            event,
            held_back: u64::try_from(held_back).unwrap_or(0),
            blocking: row.try_get("blocking").map_err(get)?,
        }))
    }

    /// Makes matching dead letters pending again, with attempts reset (the last error is kept), and
    /// returns how many.
    ///
    /// # Errors
    /// A database error.
    pub async fn retry_dead_letters(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        let change = format!(
            "UPDATE {} SET dead_lettered_at = NULL, attempts = 0, retry_after = NULL",
            self.table.qualified()
        );
        self.change_dead_letters("retry_dead_letters", &change, filter)
            .await
    }

    /// Deletes matching dead letters for good and returns how many. Under per-aggregate ordering this
    /// lets the later events of their aggregates flow.
    ///
    /// # Errors
    /// A database error.
    pub async fn discard_dead_letters(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        let change = format!("DELETE FROM {}", self.table.qualified());
        self.change_dead_letters("discard_dead_letters", &change, filter)
            .await
    }

    /// Runs `change` (an UPDATE or DELETE without WHERE) on the dead letters matching `filter`.
    async fn change_dead_letters(
        &self,
        operation: &'static str,
        change: &str,
        filter: &DeadLetterFilter,
    ) -> Result<u64, Error> {
        let sql = format!(
            "{change} WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL AND {}",
            filter.clause()
        );
        let done = filter
            .bind(sqlx::query(&sql))
            .execute(&self.pool)
            .await
            .map_err(|e| map_sqlx(operation, e))?;
        Ok(done.rows_affected())
    }

    /// Deletes processed rows older than `older_than`, `batch_size` rows per statement (each its own
    /// short transaction, so vacuum and writers are never held up), calling `progress` with the running
    /// total after each batch. Returns the total. Pending rows and dead letters are never touched.
    /// Each batch waits for the cleanup lock (see [`PostgresStore::cleanup_batch`]), so a manual run
    /// and a relay's automatic cleanup take turns.
    ///
    /// # Errors
    /// A database error, or [`ErrorKind::Config`] for a zero batch size.
    pub async fn cleanup(
        &self,
        older_than: std::time::Duration,
        batch_size: i64,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<u64, Error> {
        let mut total = 0u64;
        loop {
            match self
                .cleanup_batch(older_than, batch_size, CleanupLock::Wait)
                .await?
            {
                CleanupBatch::Removed(0) | CleanupBatch::Busy => break,
                CleanupBatch::Removed(n) => {
                    total += n;
                    progress(total);
                }
            }
        }
        Ok(total)
    }

    /// Deletes at most `batch_size` processed rows older than `older_than` (the oldest first), in a
    /// transaction that holds the table's cleanup lock: a transaction-scoped advisory lock in the
    /// two-key space (`hashtext('outbox-cleanup')`, `hashtext(<schema.table>)`), which never meets
    /// the writers' per-aggregate locks (single-key space). With [`CleanupLock::Try`] the batch is
    /// skipped ([`CleanupBatch::Busy`]) when another session holds the lock, so of several relays
    /// one cleans at a time; with [`CleanupLock::Wait`] it waits its turn.
    ///
    /// # Errors
    /// A database error, or [`ErrorKind::Config`] for a batch size below 1.
    pub async fn cleanup_batch(
        &self,
        older_than: std::time::Duration,
        batch_size: i64,
        lock: CleanupLock,
    ) -> Result<CleanupBatch, Error> {
        if batch_size <= 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!("cleanup batch size = {batch_size}: expected a positive number"),
            ));
        }
        let t = self.table.qualified();
        let delete = format!(
            "DELETE FROM {t} WHERE id IN (
                SELECT id FROM {t}
                WHERE processed_at IS NOT NULL AND processed_at < now() - $1 * interval '1 millisecond'
                  AND aggregate_type NOT LIKE '{MARK_TYPES}'
                ORDER BY processed_at LIMIT $2)"
        );
        let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let map = |e| map_sqlx("cleanup", e);
        let mut tx = self.pool.begin().await.map_err(map)?;
        let take = match lock {
            CleanupLock::Try => {
                "SELECT pg_try_advisory_xact_lock(hashtext('outbox-cleanup'), hashtext($1))"
            }
            CleanupLock::Wait => {
                "SELECT pg_advisory_xact_lock(hashtext('outbox-cleanup'), hashtext($1)) IS NOT NULL"
            }
        };
        let locked: bool = sqlx::query_scalar(take)
            .bind(&t)
            .fetch_one(&mut *tx)
            .await
            .map_err(map)?;
        if !locked {
            tx.rollback().await.map_err(map)?;
            return Ok(CleanupBatch::Busy);
        }
        // A batch that hangs (a lock, an overloaded server) must not hold the cleanup lock, and so
        // every relay's cleanup, for ever: it fails instead, and the next round tries again.
        sqlx::query("SET LOCAL statement_timeout = '60s'")
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let removed = sqlx::query(&delete)
            .bind(ms)
            .bind(batch_size)
            .execute(&mut *tx)
            .await
            .map_err(map)?
            .rows_affected();
        tx.commit().await.map_err(map)?;
        Ok(CleanupBatch::Removed(removed))
    }
}

/// Whether a cleanup batch waits for the table's cleanup lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupLock {
    /// Skip the batch when another session cleans (the relay's automatic cleanup).
    Try,
    /// Wait for the other session's batch to end (`outbox cleanup`).
    Wait,
}

/// What one cleanup batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupBatch {
    /// This many expired rows were deleted (0: none are left).
    Removed(u64),
    /// Another session holds the cleanup lock; nothing was done.
    Busy,
}
