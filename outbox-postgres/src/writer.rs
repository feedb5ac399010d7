//! The writer: enqueues events inside the caller's transaction.

use std::sync::Arc;

use sqlx::{Postgres, Transaction};
use uuid::Uuid;

use outbox_core::{Error, ErrorKind, NewEvent, Payload, Wake};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// Enqueues events in the caller's transaction, so each event commits or rolls back with the business
/// data written next to it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_postgres::{OutboxTable, Writer};
/// use outbox_core::NewEvent;
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
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type, headers, destination)
             SELECT u.id, u.aggregate_type, u.aggregate_id, u.event_type, u.payload::jsonb, u.payload_bytes, u.content_type, u.headers::jsonb, u.destination
             FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::text[], $8::text[], $9::text[])
                  WITH ORDINALITY AS u(id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type, headers, destination, ord)
             ORDER BY u.ord",
            table.qualified()
        );
        // One event (the common case): plain VALUES, cheaper for the server than building and
        // unnesting nine one-element arrays.
        let insert_one_sql = format!(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type, headers, destination)
             VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8::jsonb, $9)",
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

    /// Enqueues one event in `tx` and returns its id.
    ///
    /// # Errors
    /// [`outbox_core::ErrorKind::InvalidInput`] when the event does not validate,
    /// [`outbox_core::ErrorKind::PayloadTooLarge`] when its payload exceeds
    /// [`Writer::max_payload_bytes`]; a database error otherwise. Either way the caller's transaction decides: roll it back and nothing was written.
    pub async fn enqueue(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        event: NewEvent,
    ) -> Result<Uuid, Error> {
        let id = event.id;
        self.enqueue_many(tx, vec![event]).await?;
        Ok(id)
    }

    /// Enqueues many events in `tx` with one statement, in order, and returns their ids.
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
        tx: &mut Transaction<'_, Postgres>,
        events: Vec<NewEvent>,
    ) -> Result<Vec<Uuid>, Error> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let n = events.len();
        let mut ids = Vec::with_capacity(n);
        let mut aggregate_types = Vec::with_capacity(n);
        let mut aggregate_ids = Vec::with_capacity(n);
        let mut event_types = Vec::with_capacity(n);
        let mut payloads = Vec::with_capacity(n);
        let mut payload_bytes: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
        let mut content_types = Vec::with_capacity(n);
        let mut headers = Vec::with_capacity(n);
        let mut destinations = Vec::with_capacity(n);
        for e in events {
            #[cfg(feature = "opentelemetry")]
            let e = {
                let mut e = e;
                outbox_core::trace::inject_current(&mut e.headers);
                e
            };
            e.validate()?;
            ids.push(e.id);
            content_types.push(e.payload.content_type().to_string());
            let (text, data) = match e.payload {
                Payload::Json(v) => (v.to_string(), None),
                Payload::Binary { data, .. } => ("null".to_string(), Some(data)),
            };
            let size = data.as_ref().map_or(text.len(), Vec::len);
            self.check_size(size, e.id, &e.event_type)?;
            payloads.push(text);
            payload_bytes.push(data);
            headers.push(serde_json::to_string(&e.headers).unwrap_or_else(|_| "{}".into()));
            aggregate_types.push(e.aggregate_type);
            aggregate_ids.push(e.aggregate_id);
            event_types.push(e.event_type);
            destinations.push(e.destination);
        }
        let query = if n == 1 {
            sqlx::query(&self.insert_one_sql)
                .bind(ids[0])
                .bind(aggregate_types.pop())
                .bind(aggregate_ids.pop())
                .bind(event_types.pop())
                .bind(payloads.pop())
                .bind(payload_bytes.pop().flatten())
                .bind(content_types.pop())
                .bind(headers.pop())
                .bind(destinations.pop().flatten())
        } else {
            sqlx::query(&self.insert_sql)
                .bind(&ids)
                .bind(&aggregate_types)
                .bind(&aggregate_ids)
                .bind(&event_types)
                .bind(&payloads)
                .bind(&payload_bytes)
                .bind(&content_types)
                .bind(&headers)
                .bind(&destinations)
        };
        query
            .execute(&mut **tx)
            .await
            .map_err(|e| map_sqlx("enqueue", e))?;
        Ok(ids)
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
