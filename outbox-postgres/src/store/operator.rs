//! The operator's tools: dead letters (list, retry, discard) and the cleanup of kept rows.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, Postgres};
use uuid::Uuid;

use outbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;

use super::*;

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterFilter {
    /// These ids.
    Ids(Vec<Uuid>),
    /// Every dead letter of this event type.
    EventType(String),
    /// Every dead letter.
    All,
}

impl DeadLetterFilter {
    fn clause(&self) -> &'static str {
        match self {
            DeadLetterFilter::Ids(_) => "id = ANY($1::uuid[])",
            DeadLetterFilter::EventType(_) => "event_type = $1",
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

impl PostgresStore {
    /// Lists dead letters, oldest first, at most `limit`.
    ///
    /// # Errors
    /// A database error.
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        let sql = format!(
            "SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, dead_lettered_at
             FROM {} WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL AND {}
             ORDER BY seq LIMIT $2",
            self.table.qualified(),
            filter.clause()
        );
        let rows = filter
            .bind(sqlx::query(&sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| map_sqlx("dead_letters", e))?;
        rows.iter()
            .map(|r| DeadLetter::from_row(r).map_err(|e| map_sqlx("dead_letters", e)))
            .collect()
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
    ///
    /// # Errors
    /// A database error, or [`ErrorKind::Config`] for a zero batch size.
    pub async fn cleanup(
        &self,
        older_than: std::time::Duration,
        batch_size: i64,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<u64, Error> {
        if batch_size <= 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!("cleanup batch size = {batch_size}: expected a positive number"),
            ));
        }
        let t = self.table.qualified();
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (
                SELECT id FROM {t}
                WHERE processed_at IS NOT NULL AND processed_at < now() - $1 * interval '1 millisecond'
                ORDER BY processed_at LIMIT $2)"
        );
        let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0u64;
        loop {
            let n = sqlx::query(&sql)
                .bind(ms)
                .bind(batch_size)
                .execute(&self.pool)
                .await
                .map_err(|e| map_sqlx("cleanup", e))?
                .rows_affected();
            if n == 0 {
                break;
            }
            total += n;
            progress(total);
        }
        Ok(total)
    }
}
