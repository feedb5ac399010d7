//! The message writer: table-less events as transactional logical decoding messages in the
//! caller's transaction, nothing in the outbox table. Only the WAL source reads them (see
//! `wal::decode` for the message's JSON fields).

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::format::base64;
use txoutbox_core::{Error, NewEvent, Payload};

use crate::error::map_sqlx;

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
        let mut map = serde_json::Map::new();
        map.insert("id".into(), event.id.to_string().into());
        map.insert("aggregate_type".into(), event.aggregate_type.clone().into());
        map.insert("aggregate_id".into(), event.aggregate_id.clone().into());
        map.insert("event_type".into(), event.event_type.clone().into());
        match &event.payload {
            Payload::Json(v) => {
                map.insert("payload".into(), v.clone());
            }
            Payload::Binary { content_type, data } => {
                map.insert("payload_base64".into(), base64(data).into());
                map.insert("content_type".into(), content_type.clone().into());
            }
        }
        if !event.headers.is_empty() {
            map.insert(
                "headers".into(),
                Value::Object(
                    event
                        .headers
                        .iter()
                        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                        .collect(),
                ),
            );
        }
        if let Some(d) = &event.destination {
            map.insert("destination".into(), d.clone().into());
        }
        Value::Object(map).to_string()
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
