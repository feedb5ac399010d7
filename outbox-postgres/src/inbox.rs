//! The consumer-side inbox: makes a message handler idempotent inside the consumer's own transaction.
//!
//! At-least-once delivery means a consumer may see an event twice. [`Inbox::process`] records the event
//! id in `processed_events` with `ON CONFLICT DO NOTHING` and runs the handler only when the id is new,
//! in the same transaction as the handler's own writes: both commit together, or neither does (a
//! handler error rolls back the record, so the message is processed again on redelivery).
//!
//! The event id travels in each broker's native field; `txoutbox_amqp::event_id`,
//! `txoutbox_kafka::event_id` and `txoutbox_sqs::event_id` read it back.

use std::time::Duration;

use futures_core::future::BoxFuture;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use txoutbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;
use crate::migrate::{apply, render_names, RenderedMigration};
use crate::table::OutboxTable;

/// The embedded inbox migrations, as written for the default name (`processed_events`).
pub static INBOX_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./inbox_migrations");

/// The default inbox table.
pub const DEFAULT_INBOX_TABLE: &str = "processed_events";

/// What became of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Processed<T> {
    /// The event was new: the handler ran and its writes committed with the inbox record.
    Done(T),
    /// The event was already processed by this consumer: the handler did not run.
    Duplicate,
}

/// Why processing failed. Either way nothing was committed, so the message can be processed again.
#[derive(Debug)]
pub enum InboxError<E> {
    /// The handler failed; the inbox record was rolled back with the handler's writes.
    Handler(E),
    /// The database failed.
    Store(Error),
}

/// The database's error is the [`source`](std::error::Error::source) of [`InboxError::Store`] and is
/// not repeated in its text, so that error reporters that walk the chain print it once. A handler's
/// error need not be a `std::error::Error` (an `anyhow::Error` is not), so it is part of the text of
/// [`InboxError::Handler`] instead.
impl<E: std::fmt::Display> std::fmt::Display for InboxError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InboxError::Handler(e) => write!(f, "the handler failed (nothing committed): {e}"),
            InboxError::Store(_) => write!(f, "the inbox failed (nothing committed)"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for InboxError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            InboxError::Store(e) => Some(e),
            InboxError::Handler(_) => None,
        }
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn a_bad_inbox_name_is_reported_as_the_inbox_s() {
        let e = Inbox::in_table("public", "Processed-Events", "billing").unwrap_err();
        assert!(
            e.message()
                .starts_with("inbox.table = \"Processed-Events\""),
            "{e}"
        );
        let e = Inbox::in_table("Bad Schema", "processed_events", "billing").unwrap_err();
        assert!(e.message().starts_with("inbox.schema"), "{e}");
        assert!(Inbox::in_table("public", "processed_events", "billing").is_ok());
    }

    #[test]
    fn each_cause_is_printed_once_along_the_chain() {
        let e: InboxError<String> = InboxError::Store(Error::new(
            txoutbox_core::ErrorKind::Connection,
            "connection reset by the server",
        ));
        let mut chain = vec![e.to_string()];
        let mut next = e.source();
        while let Some(cause) = next {
            chain.push(cause.to_string());
            next = cause.source();
        }
        let text = chain.join(": ");
        assert_eq!(text.matches("connection reset").count(), 1, "{text}");
        assert!(
            text.starts_with("the inbox failed (nothing committed): "),
            "{text}"
        );
        let h: InboxError<String> = InboxError::Handler("bad order".into());
        assert!(h.source().is_none());
        assert_eq!(
            h.to_string(),
            "the handler failed (nothing committed): bad order"
        );
    }
}

/// An inbox table, used by one named consumer (several consumers may share the table).
#[derive(Debug, Clone)]
pub struct Inbox {
    table: OutboxTable,
    consumer: String,
    insert_sql: String,
}

impl Inbox {
    /// The inbox `public.processed_events` for `consumer`.
    ///
    /// # Errors
    /// A config error when `consumer` is empty.
    pub fn new(consumer: impl Into<String>) -> Result<Self, Error> {
        Self::in_table("public", DEFAULT_INBOX_TABLE, consumer)
    }

    /// The inbox in `schema`.`table` for `consumer`.
    ///
    /// # Errors
    /// A config error naming `inbox.schema` or `inbox.table` when a name is not a plain lower-case
    /// identifier, or when `consumer` is empty.
    pub fn in_table(
        schema: impl Into<String>,
        table: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Result<Self, Error> {
        Self::with_table(OutboxTable::named("inbox", schema, table)?, consumer)
    }

    /// The inbox in `table` for `consumer`.
    ///
    /// # Errors
    /// A config error when `consumer` is empty.
    pub fn with_table(table: OutboxTable, consumer: impl Into<String>) -> Result<Self, Error> {
        let consumer = consumer.into();
        if consumer.trim().is_empty() {
            return Err(Error::new(
                ErrorKind::Config,
                "inbox consumer name is empty: name the handler, such as \"billing.order-created\"",
            ));
        }
        let insert_sql = format!(
            "INSERT INTO {} (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING event_id",
            table.qualified()
        );
        Ok(Inbox {
            table,
            consumer,
            insert_sql,
        })
    }

    /// The table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The inbox migrations, rendered for this table.
    pub fn migrations(&self) -> Vec<RenderedMigration> {
        INBOX_MIGRATOR
            .iter()
            .map(|m| RenderedMigration {
                version: m.version,
                description: m.description.to_string(),
                sql: render_names(&m.sql, DEFAULT_INBOX_TABLE, None, &self.table),
            })
            .collect()
    }

    /// Creates or upgrades the inbox table (idempotent).
    ///
    /// # Errors
    /// A database error.
    pub async fn migrate(&self, pool: &PgPool) -> Result<Vec<i64>, Error> {
        apply(pool, &self.table, self.migrations()).await
    }

    /// Runs `handler` in a new transaction if `event_id` is new for this consumer, and commits the
    /// handler's writes together with the inbox record.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool, inbox: txoutbox_postgres::Inbox, id: uuid::Uuid) -> Result<(), Box<dyn std::error::Error>> {
    /// use txoutbox_postgres::Processed;
    /// let outcome = inbox
    ///     .process(&pool, id, |conn| Box::pin(async move {
    ///         sqlx::query("UPDATE stock SET reserved = reserved + 1").execute(&mut *conn).await?;
    ///         Ok::<_, sqlx::Error>(())
    ///     }))
    ///     .await?;
    /// if outcome == Processed::Duplicate { /* already handled: acknowledge and move on */ }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`InboxError::Handler`] when the handler fails, [`InboxError::Store`] when the database does;
    /// either way nothing was committed.
    pub async fn process<T, E, F>(
        &self,
        pool: &PgPool,
        event_id: Uuid,
        handler: F,
    ) -> Result<Processed<T>, InboxError<E>>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
    {
        let store = |e: sqlx::Error| InboxError::Store(map_sqlx("inbox", e));
        let mut tx = pool.begin().await.map_err(store)?;
        let inserted: Option<(Uuid,)> = sqlx::query_as(&self.insert_sql)
            .bind(&self.consumer)
            .bind(event_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(store)?;
        if inserted.is_none() {
            tx.rollback().await.map_err(store)?;
            return Ok(Processed::Duplicate);
        }
        match handler(&mut tx).await {
            Ok(value) => {
                tx.commit().await.map_err(store)?;
                Ok(Processed::Done(value))
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(InboxError::Handler(e))
            }
        }
    }

    /// True when this consumer already processed `event_id`.
    ///
    /// # Errors
    /// A database error.
    pub async fn seen(&self, pool: &PgPool, event_id: Uuid) -> Result<bool, Error> {
        let sql = format!(
            "SELECT 1 FROM {} WHERE consumer = $1 AND event_id = $2",
            self.table.qualified()
        );
        let row: Option<(i32,)> = sqlx::query_as(&sql)
            .bind(&self.consumer)
            .bind(event_id)
            .fetch_optional(pool)
            .await
            .map_err(|e| map_sqlx("inbox", e))?;
        Ok(row.is_some())
    }

    /// Forgets records older than `older_than` (keep them longer than any redelivery can take),
    /// `batch_size` rows per statement; returns how many were removed.
    ///
    /// # Errors
    /// A database error, or a config error for a zero batch size.
    pub async fn cleanup(
        &self,
        pool: &PgPool,
        older_than: Duration,
        batch_size: i64,
    ) -> Result<u64, Error> {
        if batch_size <= 0 {
            return Err(Error::config(format!(
                "inbox cleanup batch size = {batch_size}: expected a positive number"
            )));
        }
        let t = self.table.qualified();
        let sql = format!(
            "DELETE FROM {t} WHERE ctid IN (
                SELECT ctid FROM {t} WHERE processed_at < now() - $1 * interval '1 millisecond' LIMIT $2)"
        );
        let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0;
        loop {
            let n = sqlx::query(&sql)
                .bind(ms)
                .bind(batch_size)
                .execute(pool)
                .await
                .map_err(|e| map_sqlx("inbox cleanup", e))?
                .rows_affected();
            if n == 0 {
                return Ok(total);
            }
            total += n;
        }
    }
}
