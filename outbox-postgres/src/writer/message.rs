//! The message writer: table-less events as transactional logical decoding messages in the
//! caller's transaction, nothing in the outbox table. Only the WAL source reads them (see
//! `wal::decode` for the message's JSON fields).

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::format::base64;
use txoutbox_core::{Error, NewEvent, Payload};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// A table-less event's message: a JSON object of the event's fields, as the writer writes it and
/// the WAL source's decoder reads it (the decoder reads the payload as its exact JSON text, `P`).
/// Only the aggregate, the event type and one of the two payloads are required: plain SQL may
/// leave out the id (the reader derives one from the message's position) and the rest.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct TablelessMessage<P> {
    /// The event's place among its aggregate's events of both write forms: a number of the outbox
    /// table's `seq` sequence, taken under the writer-order lock of its aggregate (see
    /// [`MessageWriter::emit`]). Without it a table-less event keeps its order among table-less
    /// events, but not against the table's rows while the WAL source falls back to the table.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) seq: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) id: Option<String>,
    pub(crate) aggregate_type: Option<String>,
    pub(crate) aggregate_id: Option<String>,
    pub(crate) event_type: Option<String>,
    /// The JSON payload.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) payload: Option<P>,
    /// A binary payload, base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) payload_base64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) content_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) headers: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) destination: Option<String>,
}

/// The default prefix of table-less events' messages.
pub const DEFAULT_MESSAGE_PREFIX: &str = "outbox";

/// Writes table-less events: a transactional logical decoding message in the caller's transaction,
/// nothing in the outbox table (no index entries, no rows to delete, no vacuum debt). Read by the WAL
/// source only.
///
/// [`MessageWriter::emit`] keeps an aggregate's order across both write forms: it takes the same
/// per-aggregate writer-order lock as a row of the outbox table (held until the transaction ends)
/// and a number of the table's `seq` sequence, and the message carries it. So while the WAL
/// source publishes from the table (a fallback: the table out of its publication, the slot made
/// again), a table-less event still goes out before the rows of its aggregate written after it.
/// The writer is for one outbox table: the one the WAL source reads ([`MessageWriter::new`]).
///
/// [`MessageWriter::emit`] sends the message as a statement of its own. A message written by other
/// means (plain SQL calling `pg_logical_emit_message(true, '<prefix>', ...)` with
/// [`MessageWriter::encode`]'s JSON, which has no `seq`) keeps its order among table-less events
/// but not against the table's rows of its aggregate while the source falls back.
#[derive(Debug, Clone)]
pub struct MessageWriter {
    prefix: String,
    table: OutboxTable,
}

impl Default for MessageWriter {
    /// Messages with the default prefix, ordered with the rows of the default table
    /// (`public.outbox_events`).
    fn default() -> Self {
        MessageWriter {
            prefix: DEFAULT_MESSAGE_PREFIX.into(),
            table: OutboxTable::default(),
        }
    }
}

impl MessageWriter {
    /// A writer of messages with `prefix` (the reader's `wal.message_prefix`), ordered with the
    /// rows of `table` (the outbox table the WAL source reads).
    pub fn new(prefix: impl Into<String>, table: &OutboxTable) -> Self {
        MessageWriter {
            prefix: prefix.into(),
            table: table.clone(),
        }
    }

    /// The JSON content of `event`'s message.
    pub fn encode(event: &NewEvent) -> String {
        let (payload, payload_base64, content_type) = match &event.payload {
            Payload::Json(v) => (Some(v), None, None),
            Payload::Binary { content_type, data } => {
                (None, Some(base64(data)), Some(content_type.clone()))
            }
        };
        let message = TablelessMessage {
            seq: None,
            id: Some(event.id.to_string()),
            aggregate_type: Some(event.aggregate_type.clone()),
            aggregate_id: Some(event.aggregate_id.clone()),
            event_type: Some(event.event_type.clone()),
            payload,
            payload_base64,
            content_type,
            headers: (!event.headers.is_empty()).then(|| {
                Value::Object(
                    event
                        .headers
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                        .collect(),
                )
            }),
            destination: event.destination.clone(),
        };
        // A struct of strings and JSON values always serialises.
        serde_json::to_string(&message).unwrap_or_default()
    }

    /// Emits `event` on `conn`: in a transaction (`&mut tx` for a sqlx `Transaction`), it exists
    /// only if the transaction commits, and comes out of the slot in commit order. Returns its id.
    ///
    /// It first takes the writer-order lock of the event's aggregate, as a row of the outbox table
    /// does (held until the transaction ends; `SET LOCAL outbox.writer_order = 'off'` leaves it out
    /// for a backfill, as for rows), and the next number of the table's `seq` sequence, which the
    /// message carries (see the type's documentation).
    ///
    /// `conn` is whatever the service holds: a `Transaction`, a pooled connection, a
    /// `PgConnection`. Outside a transaction the message is committed at once, on its own.
    ///
    /// # Errors
    /// A database error (the outbox table missing: make it with `outbox migrate`).
    pub async fn emit(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid, Error> {
        let json = Self::encode(&event);
        // `{"seq":N,` and the rest of the object (the encoding never writes an empty object).
        let rest = json.strip_prefix('{').unwrap_or(&json);
        let table = self.table.qualified();
        // The lock first (its CTE is materialised: evaluated once, before the sequence).
        sqlx::query(
            "WITH l AS MATERIALIZED (
                 SELECT CASE WHEN current_setting('outbox.writer_order', true) IS DISTINCT FROM 'off'
                        THEN pg_advisory_xact_lock(hashtextextended($3,
                                 hashtextextended($2, $5::regclass::oid::bigint))) END AS locked),
             s AS MATERIALIZED (
                 SELECT nextval(pg_get_serial_sequence($5, 'seq')::regclass) AS seq FROM l)
             SELECT pg_logical_emit_message(true, $1, '{\"seq\":' || s.seq || ',' || $4) FROM s",
        )
        .bind(&self.prefix)
        .bind(&event.aggregate_type)
        .bind(&event.aggregate_id)
        .bind(rest)
        .bind(&table)
        .execute(conn)
        .await
        .map_err(|e| map_sqlx("wal emit", e))?;
        Ok(event.id)
    }
}
