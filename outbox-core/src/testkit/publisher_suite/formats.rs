//! The message formats as their consumers read them: CloudEvents binary and structured mode
//! through a third-party CloudEvents SDK, and Debezium's outbox event router shape.

use std::collections::HashSet;

use uuid::Uuid;

use super::common::{event, receive_ours};
use crate::event::Event;
use crate::format::{Formatter, MessageFormat};
use crate::testkit::{decode_cloudevents, BrokerFixture, CloudEventsBinding, Received, Setup};

/// The CloudEvents `source` template the format checks use.
pub const CLOUDEVENTS_SOURCE: &str = "/test/{aggregate_type}";

impl CloudEventsBinding {
    /// The prefix of CloudEvents attribute headers in binary mode on this binding.
    pub fn prefix(self) -> &'static str {
        match self {
            CloudEventsBinding::Kafka => "ce_",
            CloudEventsBinding::Amqp => "cloudEvents_",
            CloudEventsBinding::RabbitMq | CloudEventsBinding::Sqs => "ce-",
        }
    }
}

/// Events of every shape a format must carry, on one new aggregate: a JSON payload (with non-ASCII
/// text, a trace header), plain text with quotes and a newline, and, where the broker carries bytes,
/// a binary payload.
fn format_events(binding: CloudEventsBinding) -> Vec<Event> {
    let aggregate = format!("fmt-{}", Uuid::now_v7().simple());
    let mut events = vec![event(&aggregate, 0)];
    events[0].payload =
        serde_json::json!({"name": "Zoë ünïcødé", "items": [1, 2.5, null], "nested": {"ok": true}})
            .to_string()
            .into_bytes();
    let mut text = event(&aggregate, 1);
    text.payload = b"plain text, \"quoted\"\nand a second line".to_vec();
    text.content_type = "text/plain; charset=utf-8".into();
    text.event_type = "order.noted".into();
    events.push(text);
    if binding.carries_binary_bodies() {
        let mut bytes = event(&aggregate, 2);
        bytes.payload = vec![0, 1, 2, 0x7f, 0x80, 0xfe, 0xff];
        bytes.content_type = "application/octet-stream".into();
        events.push(bytes);
    }
    events
}

/// Publishes `events` with a publisher in `format` and returns what the consumer received of them,
/// in the order published (every event acknowledged and received).
async fn published_as(
    fx: &dyn BrokerFixture,
    format: MessageFormat,
    events: &[Event],
) -> Vec<Received> {
    let formatter = Formatter::new(format, "cloudevents_source", CLOUDEVENTS_SOURCE)
        .unwrap_or_else(|e| panic!("{e}"));
    let p = fx
        .build(Setup {
            format: formatter,
            ..Setup::default()
        })
        .await
        .publisher;
    let outcomes = p.publish(events).await;
    assert!(
        outcomes.iter().all(Result::is_ok),
        "{format}: every event is acknowledged: {outcomes:?}"
    );
    let ids: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let got = receive_ours(fx, &ids, &ids).await;
    events
        .iter()
        .map(|e| {
            got.iter()
                .find(|r| r.event_id == Some(e.id))
                .cloned()
                .unwrap_or_else(|| panic!("{format}: event {} was not received: {got:?}", e.id))
        })
        .collect()
}

/// Messages in CloudEvents binary and structured mode are read by a third-party CloudEvents SDK
/// (the Python one, through the broker's binding, as its consumers read them) as the events that
/// were published: every attribute, the data (JSON as JSON, text as text, bytes as bytes), the
/// required attributes present in the message itself (the SDK would make up a missing id or time).
/// Messages in Debezium's shape carry its `id` and `eventType` headers, the payload as the body and,
/// on Kafka, the aggregate id as the key.
pub async fn messages_in_each_format_are_read_by_a_cloudevents_library(fx: &dyn BrokerFixture) {
    let binding = fx.cloudevents_binding();
    for format in [
        MessageFormat::CloudeventsBinary,
        MessageFormat::CloudeventsStructured,
    ] {
        let events = format_events(binding);
        let received = published_as(fx, format, &events).await;
        let decoded = decode_cloudevents(binding, &received);
        assert_eq!(decoded.len(), events.len(), "{format}: {decoded:?}");
        for ((e, r), d) in events.iter().zip(&received).zip(&decoded) {
            let what = format!(
                "{format} on {binding:?}, event {} ({})",
                e.id, e.content_type
            );
            assert!(
                d.get("error").is_none(),
                "{what}: the SDK refused it: {d}\nmessage: {r:?}"
            );
            let a = &d["attributes"];
            let text = |k: &str| a[k].as_str().map(str::to_string);
            assert_eq!(text("specversion").as_deref(), Some("1.0"), "{what}: {d}");
            assert_eq!(text("id"), Some(e.id.to_string()), "{what}: {d}");
            assert_eq!(
                text("source").as_deref(),
                Some("/test/order"),
                "{what}: {d}"
            );
            assert_eq!(text("type"), Some(e.event_type.clone()), "{what}: {d}");
            assert_eq!(text("subject"), Some(e.aggregate_id.clone()), "{what}: {d}");
            assert_eq!(
                text("datacontenttype"),
                Some(e.content_type.clone()),
                "{what}: {d}"
            );
            if let Some(key) = text("partitionkey") {
                assert_eq!(key, e.aggregate_id, "{what}: {d}");
            }
            let time = text("time")
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
                .unwrap_or_else(|| panic!("{what}: no RFC 3339 time: {d}"));
            assert_eq!(
                time.timestamp_micros(),
                e.created_at.timestamp_micros(),
                "{what}: the creation time, to the microsecond: {d}"
            );
            if crate::format::is_json(&e.content_type) {
                let sent: serde_json::Value =
                    serde_json::from_slice(&e.payload).unwrap_or_default();
                assert_eq!(d["data"], sent, "{what}: {d}");
            } else if crate::format::is_text(&e.content_type) {
                let sent = String::from_utf8_lossy(&e.payload);
                assert_eq!(d["data"].as_str(), Some(sent.as_ref()), "{what}: {d}");
            } else {
                assert_eq!(
                    d["data_b64"].as_str(),
                    Some(crate::format::base64_for_tests(&e.payload).as_str()),
                    "{what}: {d}"
                );
            }
            // What reached the consumer is the message as sent: nothing re-encoded or folded for the
            // broker (SQS's `outbox-encoding` and `outbox-headers`), which no CloudEvents consumer
            // would undo.
            for marker in ["outbox-encoding", "outbox-headers"] {
                assert!(
                    !r.headers.contains_key(marker),
                    "{what}: {marker} in {:?}",
                    r.headers
                );
            }
            // What the SDK would make up when missing is really in the message.
            if format == MessageFormat::CloudeventsBinary {
                for k in ["specversion", "id", "time"] {
                    let name = format!("{}{k}", binding.prefix());
                    assert!(
                        r.headers.contains_key(&name),
                        "{what}: no {name} in {:?}",
                        r.headers
                    );
                }
            } else {
                assert!(
                    r.content_type
                        .as_deref()
                        .unwrap_or("")
                        .starts_with("application/cloudevents+json"),
                    "{what}: structured mode's content type: {r:?}"
                );
                let body: serde_json::Value = serde_json::from_slice(&r.payload)
                    .unwrap_or_else(|err| panic!("{what}: the body is not JSON: {err}"));
                for k in ["specversion", "id", "time"] {
                    assert!(body.get(k).is_some(), "{what}: no {k} in {body}");
                }
            }
        }
    }
    // Debezium's outbox event router shape.
    let events = format_events(binding);
    let received = published_as(fx, MessageFormat::Debezium, &events).await;
    for (e, r) in events.iter().zip(&received) {
        assert_eq!(r.headers.get("id"), Some(&e.id.to_string()), "{r:?}");
        assert_eq!(r.headers.get("eventType"), Some(&e.event_type), "{r:?}");
        assert_eq!(r.payload, e.payload, "the payload as stored: {r:?}");
        assert_eq!(
            r.content_type.as_deref(),
            Some(e.content_type.as_str()),
            "{r:?}"
        );
        if binding == CloudEventsBinding::Kafka {
            assert_eq!(
                r.aggregate_id.as_deref(),
                Some(e.aggregate_id.as_str()),
                "the key: {r:?}"
            );
        }
    }
}
