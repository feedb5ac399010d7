//! The writers: [`Writer`] enqueues events as rows of the outbox table inside the caller's
//! transaction; [`message::MessageWriter`] writes table-less events as logical decoding messages,
//! for the WAL source only.

use std::sync::Arc;

use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

use txoutbox_core::{Error, ErrorKind, NewEvent, Wake};

use crate::error::map_sqlx;
use crate::row::{Columns, INSERT_ARRAYS, INSERT_COLUMNS, INSERT_UNNESTED, INSERT_VALUES};
use crate::table::OutboxTable;

pub(crate) mod message;

/// Enqueues events in the caller's transaction, so each event commits or rolls back with the business
/// data written next to it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use txoutbox_postgres::{OutboxTable, Writer};
/// use txoutbox_core::NewEvent;
///
/// let writer = Writer::new(OutboxTable::default());
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id, total) VALUES ($1, $2)").bind(42_i64).bind(99_i64).execute(&mut *tx).await?;
/// writer.enqueue(&mut tx, NewEvent::new("order", "42", "order.created", serde_json::json!({"total": 99}))).await?;
/// writer.commit(tx).await?; // commits, then wakes an in-process relay
/// # Ok(()) }
/// ```
///
/// Payloads larger than [`Writer::max_payload_bytes`] (default [`DEFAULT_MAX_PAYLOAD_BYTES`], 1 MiB)
/// are refused before anything is written: no broker takes an event of any size (Kafka's default
/// `message.max.bytes` is 1 MB, SQS's maximum 1 MiB), and an outbox of huge rows slows every relay.
#[derive(Debug, Clone)]
pub struct Writer {
    insert_sql: Arc<str>,
    insert_one_sql: Arc<str>,
    wake: Option<Wake>,
    max_payload_bytes: usize,
}

/// The default of [`Writer::max_payload_bytes`]: 1 MiB (1,048,576 bytes), SQS's maximum message size
/// and about Kafka's default one (1,000,000 bytes).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

impl Writer {
    /// A writer for `table`.
    pub fn new(table: OutboxTable) -> Self {
        let insert_sql = format!(
            "INSERT INTO {} ({INSERT_COLUMNS})
             SELECT {INSERT_UNNESTED}
             FROM UNNEST({INSERT_ARRAYS})
                  WITH ORDINALITY AS u({INSERT_COLUMNS}, ord)
             ORDER BY u.ord",
            table.qualified()
        );
        // One event (the common case): plain VALUES, cheaper for the server than building and
        // unnesting nine one-element arrays.
        let insert_one_sql = format!(
            "INSERT INTO {} ({INSERT_COLUMNS})
             VALUES ({INSERT_VALUES})",
            table.qualified()
        );
        Writer {
            insert_sql: insert_sql.into(),
            insert_one_sql: insert_one_sql.into(),
            wake: None,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
        }
    }

    /// Sets the largest payload this writer accepts, in bytes (of the JSON text, or of an opaque
    /// payload). Match it to the smallest limit of the brokers your events go to: the relay
    /// dead-letters an event its broker refuses as too large.
    pub fn with_max_payload_bytes(mut self, max_payload_bytes: usize) -> Self {
        self.max_payload_bytes = max_payload_bytes;
        self
    }

    /// The largest payload this writer accepts, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    fn check_size(&self, size: usize, id: Uuid, event_type: &str) -> Result<(), Error> {
        if size <= self.max_payload_bytes {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::PayloadTooLarge,
            format!(
                "the payload of event {id} ({event_type}) is {size} bytes, over the writer's limit of {} bytes: \
                 store large data elsewhere and put a reference in the event, or raise the limit with \
                 Writer::with_max_payload_bytes (within what the broker accepts)",
                self.max_payload_bytes
            ),
        ))
    }

    /// Wakes this relay after each [`Writer::commit`] (for a relay running in the same process).
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.wake = Some(wake);
        self
    }

    /// Enqueues one event on `conn` and returns its id.
    ///
    /// `conn` is whatever the service holds: `&mut tx` for a sqlx `Transaction` (the business
    /// transaction: the event exists only if it commits), a pooled connection, a `PgConnection`.
    /// Outside a transaction the event is committed at once, on its own: the business write and
    /// the event are atomic only when both are in one transaction.
    ///
    /// # Errors
    /// [`txoutbox_core::ErrorKind::InvalidInput`] when the event does not validate,
    /// [`txoutbox_core::ErrorKind::PayloadTooLarge`] when its payload exceeds
    /// [`Writer::max_payload_bytes`]; a database error otherwise. Either way the caller's transaction decides: roll it back and nothing was written.
    pub async fn enqueue(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid, Error> {
        let id = event.id;
        self.enqueue_many(conn, vec![event]).await?;
        Ok(id)
    }

    /// Enqueues many events on `conn` (as [`Writer::enqueue`]) with one statement, in order, and
    /// returns their ids.
    ///
    /// Two transactions that write overlapping aggregates should list them in the same order (a
    /// deadlock between them fails one with SQLSTATE 40P01, to be retried). Each aggregate written waits for any other
    /// transaction still writing it (the outbox table's writer lock, held to commit), so that the
    /// events of an aggregate are published in the order their transactions committed.
    ///
    /// # Errors
    /// As [`Writer::enqueue`]; no event is written when one is invalid.
    pub async fn enqueue_many(
        &self,
        conn: &mut PgConnection,
        events: Vec<NewEvent>,
    ) -> Result<Vec<Uuid>, Error> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let n = events.len();
        let mut columns = Columns::with_capacity(n);
        for e in events {
            #[cfg(feature = "opentelemetry")]
            let e = {
                let mut e = e;
                txoutbox_core::trace::inject_current(&mut e.headers);
                e
            };
            e.validate()?;
            columns.push_new(e, |size, id, event_type| {
                self.check_size(size, id, event_type)
            })?;
        }
        let query = if n == 1 {
            columns.bind_one(sqlx::query(&self.insert_one_sql))
        } else {
            columns.bind(sqlx::query(&self.insert_sql))
        };
        query
            .execute(conn)
            .await
            .map_err(|e| map_sqlx("enqueue", e))?;
        Ok(columns.into_ids())
    }

    /// Commits `tx`, then wakes the in-process relay (if one was given with [`Writer::with_wake`]).
    ///
    /// # Errors
    /// A database error when the commit fails (then nothing was written).
    pub async fn commit(&self, tx: Transaction<'_, Postgres>) -> Result<(), Error> {
        tx.commit().await.map_err(|e| map_sqlx("commit", e))?;
        self.wake();
        Ok(())
    }

    /// Wakes the in-process relay, if any.
    pub fn wake(&self) {
        if let Some(w) = &self.wake {
            w.wake();
        }
    }
}
