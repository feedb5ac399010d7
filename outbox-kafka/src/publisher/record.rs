//! The record an event becomes: its topic (checked as Kafka checks names), key, value, headers and
//! timestamp, and handing it to the producer, waiting out a full local queue.

use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureRecord};
use tokio::time::Instant;

use txoutbox_core::format::Formatter;
use txoutbox_core::{header, Error, ErrorKind, Event};

use super::KafkaPublisher;
use crate::error::{self, map_kafka};

/// Longest legal Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// The prefix of CloudEvents attribute headers in binary mode (the Kafka protocol binding).
pub const CLOUDEVENTS_PREFIX: &str = "ce_";

/// Checks a topic name as Kafka does: 1 to 249 characters of `a-z A-Z 0-9 . _ -`, not `.` or `..`.
pub fn check_topic(topic: &str) -> Result<(), Error> {
    let legal = !topic.is_empty()
        && topic.len() <= MAX_TOPIC_LEN
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-');
    if legal {
        Ok(())
    } else {
        Err(error::illegal_topic(topic, MAX_TOPIC_LEN))
    }
}

/// The record's headers: `outbox-*`, `content-type` (the format's), the format's own (CloudEvents
/// `ce_*` attributes, Debezium's `id` and `eventType`), then the event's headers.
fn headers(event: &Event, format: &Formatter) -> OwnedHeaders {
    let id = event.id.to_string();
    let extra = format.headers(event, CLOUDEVENTS_PREFIX);
    let mut h = OwnedHeaders::new_with_capacity(event.headers.len() + extra.len() + 4)
        .insert(Header {
            key: header::EVENT_ID,
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: header::EVENT_TYPE,
            value: Some(event.event_type.as_str()),
        })
        .insert(Header {
            key: header::AGGREGATE_TYPE,
            value: Some(event.aggregate_type.as_str()),
        })
        .insert(Header {
            key: header::CONTENT_TYPE,
            value: Some(format.content_type(event)),
        });
    // An event header of a name the format sets is left out: one value per name, the format's.
    let own = event
        .headers
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(name, _)| name == *k))
        .map(|(k, v)| (k.as_str(), v.as_str()));
    for (k, v) in extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(own)
    {
        h = h.insert(Header {
            key: k,
            value: Some(v),
        });
    }
    h
}

impl KafkaPublisher {
    /// `cause`, when it says the record is too large, with a message naming the record's size and
    /// the limits that apply (librdkafka's own text names neither).
    pub(super) fn name_the_limit(&self, cause: Error, event: &Event) -> Error {
        if cause.kind() != ErrorKind::PayloadTooLarge {
            return cause;
        }
        let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
        let size = self.format.body(event).len() + event.aggregate_id.len() + headers;
        error::oversized(size, self.config.max_message_bytes, cause)
    }

    /// Hands `event` to `producer` (waiting out a full local queue until `enqueue_deadline`); the
    /// error, when it cannot be sent, names the event.
    pub(super) async fn enqueue(
        &self,
        producer: &super::producer::Producer,
        event: &Event,
        enqueue_deadline: Instant,
    ) -> Result<DeliveryFuture, Error> {
        // The aggregate id is the record's key: librdkafka's default partitioner sends a record
        // with an empty key to any partition, where the aggregate's order would be lost.
        if event.aggregate_id.is_empty() && self.config.spreads_empty_keys() {
            return Err(error::empty_key(event.id));
        }
        let topic = self.topic.destination(event);
        self.allowed.check(&topic).map_err(|e| {
            e.with_context("adapter", "kafka")
                .with_context("event_id", event.id)
        })?;
        check_topic(&topic).map_err(|e| e.with_context("event_id", event.id))?;
        let body = self.format.body(event);
        let mut record = FutureRecord::to(&topic)
            .key(event.aggregate_id.as_bytes())
            .payload(body.as_ref())
            .headers(headers(event, &self.format))
            .timestamp(event.created_at.timestamp_millis());
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < enqueue_deadline =>
                {
                    // Back-pressure: librdkafka's background thread drains the queue.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => {
                    return Err(self
                        .name_the_limit(map_kafka("produce", e), event)
                        .with_context("event_id", event.id))
                }
            }
        }
    }
}
