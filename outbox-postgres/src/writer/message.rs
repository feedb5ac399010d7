//! The message writer: table-less events as transactional logical decoding messages in the
//! caller's transaction, nothing in the outbox table. Only the WAL source reads them (see
//! `wal::decode` for the message's JSON fields).

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::format::base64;
use txoutbox_core::{Error, NewEvent, Payload};

use crate::error::map_sqlx;

/// A table-less event's message: a JSON object of the event's fields, as the writer writes it and
/// the WAL source's decoder reads it (the decoder reads the payload as its exact JSON text, `P`).
/// Only the aggregate, the event type and one of the two payloads are required: plain SQL may
/// leave out the id (the reader derives one from the message's position) and the rest.
#[derive(serde::Serialize, serde::Deserialize)]
pub(crate) struct TablelessMessage<P> {
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
/// [`MessageWriter::emit`] sends the message as a statement of its own, whose round trip is most
/// of its cost to the writer. For the lowest cost, write it in the business statement: bind
/// [`MessageWriter::encode`]'s JSON as the message of a
/// `pg_logical_emit_message(true, '<prefix>', $n)` there, for example
/// `WITH o AS (INSERT INTO orders ... RETURNING id) SELECT o.id, pg_logical_emit_message(true, 'outbox', $4) FROM o`.
#[derive(Debug, Clone)]
pub struct MessageWriter {
    prefix: String,
}

impl Default for MessageWriter {
    fn default() -> Self {
        MessageWriter {
            prefix: DEFAULT_MESSAGE_PREFIX.into(),
        }
    }
}

impl MessageWriter {
    /// A writer of messages with `prefix` (the reader's `wal.message_prefix`).
    pub fn new(prefix: impl Into<String>) -> Self {
        MessageWriter {
            prefix: prefix.into(),
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
    /// `conn` is whatever the service holds: a `Transaction`, a pooled connection, a
    /// `PgConnection`. Outside a transaction the message is committed at once, on its own.
    ///
    /// # Errors
    /// A database error.
    pub async fn emit(&self, conn: &mut PgConnection, event: NewEvent) -> Result<Uuid, Error> {
        sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
            .bind(&self.prefix)
            .bind(Self::encode(&event))
            .execute(conn)
            .await
            .map_err(|e| map_sqlx("wal emit", e))?;
        Ok(event.id)
    }
}
