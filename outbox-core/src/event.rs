//! The event model: what the writer enqueues ([`NewEvent`]) and what the relay publishes ([`Event`]).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, ErrorKind};

/// The content type of JSON payloads, the default.
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// Names of the standard headers that publishers put on every message, next to the event's own headers.
///
/// Each broker maps them to its native fields where it has one (Kafka key, AMQP `message_id`, SQS
/// `MessageDeduplicationId`) and carries them as headers or attributes as well.
pub mod header {
    /// The event id (UUID), the consumer's deduplication key.
    pub const EVENT_ID: &str = "outbox-event-id";
    /// The event type, such as `order.created`.
    pub const EVENT_TYPE: &str = "outbox-event-type";
    /// The aggregate type, such as `order`.
    pub const AGGREGATE_TYPE: &str = "outbox-aggregate-type";
    /// The aggregate id.
    pub const AGGREGATE_ID: &str = "outbox-aggregate-id";
    /// The payload's content type.
    pub const CONTENT_TYPE: &str = "content-type";
    /// W3C trace context, carried unchanged when the writer captured it.
    pub const TRACEPARENT: &str = "traceparent";
    /// W3C trace state, carried unchanged when the writer captured it.
    pub const TRACESTATE: &str = "tracestate";
}

/// An event read from the outbox, ready to be published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Unique id (UUID v7 when written through the writer API); the consumer's deduplication key.
    pub id: Uuid,
    /// The kind of entity the event belongs to, such as `order`.
    pub aggregate_type: String,
    /// The entity's id; events of one aggregate are published in insertion order.
    pub aggregate_id: String,
    /// The event name consumers expect, such as `order.created`.
    pub event_type: String,
    /// The message body.
    pub payload: Vec<u8>,
    /// The payload's MIME type, `application/json` by default.
    pub content_type: String,
    /// Extra headers (including W3C `traceparent` / `tracestate` when captured).
    pub headers: BTreeMap<String, String>,
    /// A per-event destination (topic, exchange or queue) that overrides the publisher's routing.
    pub destination: Option<String>,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// Publish attempts already made before this one (0 on the first delivery).
    pub attempts: u32,
}

impl Event {
    /// The number of this attempt (1 on the first delivery), as logged.
    pub fn attempt(&self) -> u32 {
        self.attempts.saturating_add(1)
    }

    /// The payload as UTF-8 text, if it is valid UTF-8.
    pub fn payload_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.payload).ok()
    }

    /// True when the payload is JSON.
    pub fn is_json(&self) -> bool {
        self.content_type == JSON_CONTENT_TYPE || self.content_type.ends_with("+json")
    }
}

/// The body of a new event.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// A JSON document, stored in the `payload jsonb` column.
    Json(serde_json::Value),
    /// Opaque bytes (protobuf, Avro...), stored as bytes with their content type.
    Binary {
        /// MIME type, such as `application/x-protobuf`.
        content_type: String,
        /// The bytes.
        data: Vec<u8>,
    },
}

impl Payload {
    /// The content type of this payload.
    pub fn content_type(&self) -> &str {
        match self {
            Payload::Json(_) => JSON_CONTENT_TYPE,
            Payload::Binary { content_type, .. } => content_type,
        }
    }
}

/// An event to enqueue in the caller's transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// The id; a fresh UUID v7 unless set with [`NewEvent::with_id`].
    pub id: Uuid,
    /// The kind of entity, such as `order`.
    pub aggregate_type: String,
    /// The entity's id.
    pub aggregate_id: String,
    /// The event name, such as `order.created`.
    pub event_type: String,
    /// The body.
    pub payload: Payload,
    /// Extra headers.
    pub headers: BTreeMap<String, String>,
    /// Optional destination overriding the publisher's routing.
    pub destination: Option<String>,
}

impl NewEvent {
    /// A new event with a JSON payload and a fresh UUID v7 id.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Self {
        NewEvent {
            id: Uuid::now_v7(),
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload: Payload::Json(payload),
            headers: BTreeMap::new(),
            destination: None,
        }
    }

    /// A new event whose JSON payload is serialised from `value`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when `value` cannot be serialised to JSON.
    pub fn json<T: Serialize + ?Sized>(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        value: &T,
    ) -> Result<Self, Error> {
        let payload = serde_json::to_value(value).map_err(|e| {
            Error::new(
                ErrorKind::InvalidInput,
                "the event payload cannot be serialised to JSON",
            )
            .with_source(e)
        })?;
        Ok(Self::new(aggregate_type, aggregate_id, event_type, payload))
    }

    /// A new event with an opaque binary payload.
    pub fn binary(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        content_type: impl Into<String>,
        data: impl Into<Vec<u8>>,
    ) -> Self {
        NewEvent {
            payload: Payload::Binary {
                content_type: content_type.into(),
                data: data.into(),
            },
            ..Self::new(
                aggregate_type,
                aggregate_id,
                event_type,
                serde_json::Value::Null,
            )
        }
    }

    /// Sets the id (for callers that derive ids themselves).
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets a destination that overrides the publisher's routing for this event.
    pub fn with_destination(mut self, destination: impl Into<String>) -> Self {
        self.destination = Some(destination.into());
        self
    }

    /// Checks the event before it is written.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] naming the field when a type or id is empty, a header name is empty,
    /// or a text field holds a NUL character (which PostgreSQL text cannot store).
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |field: &str, what: &str| {
            Err(Error::new(
                ErrorKind::InvalidInput,
                format!("event {}: `{field}` {what}", self.id),
            ))
        };
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
        ] {
            if value.trim().is_empty() {
                return invalid(field, "must not be empty");
            }
            if value.contains('\0') {
                return invalid(field, "must not contain NUL characters");
            }
        }
        if let Some(d) = &self.destination {
            if d.trim().is_empty() || d.contains('\0') {
                return invalid(
                    "destination",
                    "must be a non-empty name without NUL characters (or unset)",
                );
            }
        }
        for (k, v) in &self.headers {
            if k.trim().is_empty() {
                return invalid("headers", "must not have an empty header name");
            }
            if k.contains('\0') || v.contains('\0') {
                return invalid(
                    "headers",
                    &format!("header `{k}` must not contain NUL characters"),
                );
            }
        }
        if let Payload::Binary { content_type, .. } = &self.payload {
            if content_type.trim().is_empty() {
                return invalid("content_type", "must not be empty for a binary payload");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_event_gets_a_v7_id_and_json_content_type() {
        let e = NewEvent::new("order", "42", "order.created", serde_json::json!({"a": 1}));
        assert_eq!(e.id.get_version_num(), 7);
        assert_eq!(e.payload.content_type(), JSON_CONTENT_TYPE);
        e.validate().unwrap();
    }

    #[test]
    fn validation_names_the_field() {
        let e = NewEvent::new("order", "", "order.created", serde_json::json!({}));
        let err = e.validate().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(
            err.message().contains("`aggregate_id` must not be empty"),
            "{err}"
        );

        let e = NewEvent::new("order", "1", "x", serde_json::json!({})).with_header("", "v");
        assert!(e
            .validate()
            .unwrap_err()
            .message()
            .contains("empty header name"));

        let e = NewEvent::new("order", "1", "a\0b", serde_json::json!({}));
        assert!(e.validate().unwrap_err().message().contains("NUL"));

        let e = NewEvent::binary("order", "1", "x", " ", vec![1, 2]);
        assert!(e.validate().unwrap_err().message().contains("content_type"));
    }

    #[test]
    fn json_constructor_serialises() {
        #[derive(Serialize)]
        struct Created {
            total: u32,
        }
        let e = NewEvent::json("order", "1", "order.created", &Created { total: 5 }).unwrap();
        assert_eq!(e.payload, Payload::Json(serde_json::json!({"total": 5})));
    }
}
