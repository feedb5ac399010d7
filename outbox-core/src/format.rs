//! Message formats: the shape an event takes on the wire, so that consumers built for other stacks
//! read it unchanged.
//!
//! - [`MessageFormat::Outbox`] (default): the payload as the body, the event's fields in the
//!   broker's native fields and `outbox-*` headers.
//! - [`MessageFormat::CloudeventsBinary`]: CloudEvents 1.0, binary content mode. The body is the
//!   payload, the content type is `datacontenttype`, and the attributes travel as headers named by
//!   the broker's binding: `ce_` on Kafka (Kafka protocol binding), `cloudEvents_` on RabbitMQ
//!   (AMQP protocol binding; `ce-` for Knative's RabbitMQ binding), `ce-` message attributes on SQS
//!   (named as the HTTP binding's headers, which SQS has no binding of its own to replace).
//! - [`MessageFormat::CloudeventsStructured`]: CloudEvents 1.0, structured content mode: the body is
//!   the JSON event format (`application/cloudevents+json`), the payload in `data` (JSON payloads
//!   as JSON, other text as a string, anything else in `data_base64`).
//! - [`MessageFormat::Debezium`]: the conventions of Debezium's outbox event router: the body is the
//!   payload as stored, the key (Kafka) is the aggregate id, header `id` is the event id and header
//!   `eventType` the event type (its documented `type:header:eventType` placement); the default
//!   Kafka topic `outbox.event.{aggregate_type}` is the router's default too.
//!
//! The CloudEvents attributes: `specversion` 1.0, `id` the event id, `source` from
//! [`Formatter`]'s template (default `/outbox/{aggregate_type}`), `type` the event type, `time` the
//! creation time (RFC 3339, microseconds, UTC), `subject` the aggregate id, `datacontenttype` the
//! payload's content type, and the extensions `partitionkey` (the aggregate id: the partitioning
//! extension) and `aggregatetype`; `traceparent` / `tracestate` (the distributed tracing extension)
//! when the event carries them.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::routing::Template;
use crate::{header, Error, Event};

/// The shape of the messages a publisher sends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum MessageFormat {
    /// The payload as the body, the event's fields as `outbox-*` headers (default).
    #[default]
    Outbox,
    /// CloudEvents 1.0, binary content mode.
    CloudeventsBinary,
    /// CloudEvents 1.0, structured content mode (JSON event format).
    CloudeventsStructured,
    /// Debezium's outbox event router conventions.
    Debezium,
}

impl MessageFormat {
    /// The configuration value (`outbox`, `cloudevents-binary`, `cloudevents-structured`,
    /// `debezium`).
    pub fn as_str(self) -> &'static str {
        match self {
            MessageFormat::Outbox => "outbox",
            MessageFormat::CloudeventsBinary => "cloudevents-binary",
            MessageFormat::CloudeventsStructured => "cloudevents-structured",
            MessageFormat::Debezium => "debezium",
        }
    }
}

impl std::fmt::Display for MessageFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The CloudEvents spec version written.
pub const CLOUDEVENTS_SPEC_VERSION: &str = "1.0";

/// The content type of a structured CloudEvent.
pub const CLOUDEVENTS_JSON: &str = "application/cloudevents+json; charset=utf-8";

/// The default template of the CloudEvents `source` attribute.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "/outbox/{aggregate_type}";

/// Debezium's header carrying the event id.
pub const DEBEZIUM_ID: &str = "id";

/// Debezium's header carrying the event type (`table.fields.additional.placement =
/// type:header:eventType`).
pub const DEBEZIUM_EVENT_TYPE: &str = "eventType";

/// Puts events in a [`MessageFormat`]: the headers the format adds, the body and the content type.
/// Publishers keep their own native fields and `outbox-*` headers beside these (so that
/// [`crate::header::EVENT_ID`]-reading consumers work in every format), except where the broker's
/// limits leave no room (SQS's ten attributes in binary mode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formatter {
    format: MessageFormat,
    source: Template,
}

impl Default for Formatter {
    fn default() -> Self {
        Formatter {
            format: MessageFormat::Outbox,
            // DEFAULT_CLOUDEVENTS_SOURCE.
            source: Template::prefix_then_aggregate_type("/outbox/"),
        }
    }
}

impl Formatter {
    /// A formatter for `format`, with `source` the template of the CloudEvents `source` attribute
    /// (placeholders `{aggregate_type}`, `{event_type}`, `{aggregate_id}`); `key` names the setting
    /// in errors.
    ///
    /// # Errors
    /// A config error naming `key` when the template does not parse.
    pub fn new(format: MessageFormat, key: &str, source: &str) -> Result<Self, Error> {
        Ok(Formatter {
            format,
            source: Template::parse(key, source)?,
        })
    }

    /// The format.
    pub fn format(&self) -> MessageFormat {
        self.format
    }

    /// The CloudEvents attributes of `event` that travel as headers in binary mode, in this order:
    /// `specversion`, `id`, `source`, `type`, `time`, `subject`, `partitionkey`, `aggregatetype`
    /// (`datacontenttype` is the message's content type). Names without the binding's prefix.
    pub fn cloudevents_attributes(&self, event: &Event) -> Vec<(&'static str, String)> {
        vec![
            ("specversion", CLOUDEVENTS_SPEC_VERSION.to_string()),
            ("id", event.id.to_string()),
            ("source", self.source.render_with(event, uri_segment)),
            ("type", event.event_type.clone()),
            ("time", time(event)),
            ("subject", event.aggregate_id.clone()),
            ("partitionkey", event.aggregate_id.clone()),
            ("aggregatetype", event.aggregate_type.clone()),
        ]
    }

    /// The headers the format adds, with `prefix` before CloudEvents attribute names (the broker's
    /// binding: `ce_` Kafka, `cloudEvents_` AMQP, `ce-` SQS): the attributes in binary mode, `id`
    /// and `eventType` for Debezium, none otherwise.
    pub fn headers(&self, event: &Event, prefix: &str) -> Vec<(String, String)> {
        match self.format {
            MessageFormat::CloudeventsBinary => self
                .cloudevents_attributes(event)
                .into_iter()
                .map(|(k, v)| (format!("{prefix}{k}"), v))
                .collect(),
            MessageFormat::Debezium => vec![
                (DEBEZIUM_ID.to_string(), event.id.to_string()),
                (DEBEZIUM_EVENT_TYPE.to_string(), event.event_type.clone()),
            ],
            MessageFormat::Outbox | MessageFormat::CloudeventsStructured => Vec::new(),
        }
    }

    /// The message's content type: [`CLOUDEVENTS_JSON`] in structured mode, else the payload's.
    pub fn content_type<'a>(&self, event: &'a Event) -> &'a str {
        match self.format {
            MessageFormat::CloudeventsStructured => CLOUDEVENTS_JSON,
            _ => event.content_type.as_str(),
        }
    }

    /// The message body: the JSON event in structured mode, else the payload.
    pub fn body<'a>(&self, event: &'a Event) -> Cow<'a, [u8]> {
        match self.format {
            MessageFormat::CloudeventsStructured => Cow::Owned(self.structured(event)),
            _ => Cow::Borrowed(event.payload.as_slice()),
        }
    }

    /// The JSON event format of `event`: the attributes, `datacontenttype`, the tracing extension
    /// when present, and the payload in `data` (embedded as JSON when the content type is JSON and
    /// the payload is valid JSON; a string when the content type is text, [`is_text`], and the
    /// payload UTF-8) or else in `data_base64`, so that a consumer gets one type of data for one
    /// content type whatever the bytes.
    fn structured(&self, event: &Event) -> Vec<u8> {
        let mut attributes = serde_json::Map::new();
        for (k, v) in self.cloudevents_attributes(event) {
            attributes.insert(k.to_string(), v.into());
        }
        if !event.content_type.is_empty() {
            attributes.insert("datacontenttype".into(), event.content_type.clone().into());
        }
        for name in [header::TRACEPARENT, header::TRACESTATE] {
            if let Some(v) = event.headers.get(name) {
                attributes.insert(name.to_string(), v.clone().into());
            }
        }
        let json_payload = (event.content_type.is_empty() || is_json(&event.content_type))
            && serde_json::from_slice::<serde::de::IgnoredAny>(&event.payload).is_ok();
        let text_payload = if is_text(&event.content_type) {
            std::str::from_utf8(&event.payload).ok()
        } else {
            None
        };
        let mut out = serde_json::to_vec(&attributes).unwrap_or_else(|_| b"{}".to_vec());
        // Reopen the object to append the data member (the payload is not parsed into a value).
        out.pop();
        if !attributes.is_empty() {
            out.push(b',');
        }
        if json_payload {
            out.extend_from_slice(b"\"data\":");
            out.extend_from_slice(&event.payload);
        } else if let Some(text) = text_payload {
            out.extend_from_slice(b"\"data\":");
            out.extend_from_slice(
                serde_json::to_string(text)
                    .unwrap_or_else(|_| "\"\"".into())
                    .as_bytes(),
            );
        } else {
            out.extend_from_slice(b"\"data_base64\":\"");
            out.extend_from_slice(base64(&event.payload).as_bytes());
            out.push(b'"');
        }
        out.push(b'}');
        out
    }
}

/// `value` as one segment of a URI reference: every character but the unreserved ones and the
/// sub-delimiters, `:` and `@` percent-encoded (UTF-8), `/` included, so that an aggregate type
/// with spaces or slashes still makes a valid `source`.
fn uri_segment(value: &str) -> Cow<'_, str> {
    let keep = |b: u8| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b);
    if value.bytes().all(keep) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() * 3);
    for b in value.bytes() {
        if keep(b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Cow::Owned(out)
}

/// `time`: the creation time in RFC 3339, microseconds, UTC.
fn time(event: &Event) -> String {
    event
        .created_at
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// Standard base64: ASCII whitespace ignored (PostgreSQL's `encode(..., 'base64')` breaks lines),
/// padding only at the end; `None` for anything else.
pub fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let clean: Vec<u8> = text.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let data_len = clean.iter().rposition(|b| *b != b'=').map_or(0, |i| i + 1);
    let padding = clean.len() - data_len;
    if padding > 2 || (padding > 0 && !clean.len().is_multiple_of(4)) || data_len % 4 == 1 {
        return None;
    }
    let data = &clean[..data_len];
    let mut out = Vec::with_capacity(data.len() * 3 / 4);
    for chunk in data.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c)? << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

/// Whether `content_type` is JSON (`application/json`, `*/*+json`, `text/json`; parameters ignored).
pub fn is_json(content_type: &str) -> bool {
    let essence = essence(content_type);
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

/// The media type of `content_type` without its parameters, in lower case.
fn essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Whether `content_type` is text carried as a string in structured mode: `text/*`, XML
/// (`*/xml`, `*/*+xml`).
pub fn is_text(content_type: &str) -> bool {
    let essence = essence(content_type);
    essence.starts_with("text/") || essence.ends_with("/xml") || essence.ends_with("+xml")
}

/// Standard base64 with padding, for the test kit's decoder requests.
#[cfg(any(test, feature = "test-utils"))]
pub(crate) fn base64_for_tests(bytes: &[u8]) -> String {
    base64(bytes)
}

/// Standard base64 with padding (RFC 4648): `data_base64`, and table-less events' `payload_base64`.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(payload: &[u8], content_type: &str) -> Event {
        let mut e = crate::testkit::publisher_suite::event("order-42", 0);
        e.payload = payload.to_vec();
        e.content_type = content_type.into();
        e.aggregate_type = "order".into();
        e
    }

    fn structured(e: &Event) -> serde_json::Value {
        let f = Formatter::new(
            MessageFormat::CloudeventsStructured,
            "s",
            "/shop/{aggregate_type}",
        )
        .unwrap();
        assert_eq!(f.content_type(e), CLOUDEVENTS_JSON);
        serde_json::from_slice(&f.body(e)).unwrap()
    }

    #[test]
    fn binary_mode_names_the_attributes_with_the_bindings_prefix() {
        let mut e = event(br#"{"total":9}"#, "application/json");
        e.created_at = chrono::DateTime::parse_from_rfc3339("2026-12-04T10:11:12.345678Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let f = Formatter::new(
            MessageFormat::CloudeventsBinary,
            "s",
            "/shop/{aggregate_type}",
        )
        .unwrap();
        let h = f.headers(&e, "ce_");
        let names: Vec<&str> = h.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "ce_specversion",
                "ce_id",
                "ce_source",
                "ce_type",
                "ce_time",
                "ce_subject",
                "ce_partitionkey",
                "ce_aggregatetype"
            ]
        );
        let get = |k: &str| h.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(get("ce_specversion"), "1.0");
        assert_eq!(get("ce_id"), e.id.to_string());
        assert_eq!(get("ce_source"), "/shop/order");
        assert_eq!(get("ce_time"), "2026-12-04T10:11:12.345678Z");
        assert_eq!(get("ce_subject"), "order-42");
        assert_eq!(f.body(&e).as_ref(), e.payload.as_slice());
        assert_eq!(f.content_type(&e), "application/json");
        // CloudEvents attribute names are lower-case letters and digits, at most 20.
        for (k, _) in f.cloudevents_attributes(&e) {
            assert!(
                k.len() <= 20
                    && k.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
            );
        }
    }

    #[test]
    fn structured_mode_embeds_json_and_encodes_the_rest() {
        let mut e = event(br#"{"total": 9, "items": [1, 2]}"#, "application/json");
        e.headers
            .insert("traceparent".into(), "00-abc-def-01".into());
        let v = structured(&e);
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], e.id.to_string());
        assert_eq!(v["source"], "/shop/order");
        assert_eq!(v["type"], e.event_type);
        assert_eq!(v["subject"], "order-42");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["traceparent"], "00-abc-def-01");
        assert_eq!(v["data"]["items"][1], 2);
        assert!(v.get("data_base64").is_none());
        // Text that is not JSON: a string.
        let v = structured(&event(b"plain \"text\"\n", "text/plain"));
        assert_eq!(v["data"], "plain \"text\"\n");
        // A JSON content type whose payload is not JSON: its bytes, never broken JSON.
        let v = structured(&event(b"{not json", "application/json"));
        assert_eq!(v["data_base64"], "e25vdCBqc29u");
        // A binary content type whose bytes happen to be UTF-8: bytes still, as for any other
        // payload of that type.
        let v = structured(&event(b"\x08\x96\x01", "application/x-protobuf"));
        assert_eq!(v["data_base64"], "CJYB");
        assert!(v.get("data").is_none());
        let v = structured(&event(b"<a>1</a>", "application/soap+xml"));
        assert_eq!(v["data"], "<a>1</a>");
        // Binary: base64.
        let v = structured(&event(&[0, 1, 2, 0xff, 0xfe], "application/octet-stream"));
        assert_eq!(v["data_base64"], "AAEC//4=");
        assert!(v.get("data").is_none());
    }

    #[test]
    fn debezium_and_outbox_headers() {
        let e = event(b"{}", "application/json");
        let f = Formatter::new(MessageFormat::Debezium, "s", DEFAULT_CLOUDEVENTS_SOURCE).unwrap();
        assert_eq!(
            f.headers(&e, "ce_"),
            [
                ("id".to_string(), e.id.to_string()),
                ("eventType".to_string(), e.event_type.clone())
            ]
        );
        assert_eq!(f.body(&e).as_ref(), b"{}");
        assert!(Formatter::default().headers(&e, "ce_").is_empty());
        let default_source = Formatter::default().cloudevents_attributes(&e)[2].1.clone();
        assert_eq!(default_source, "/outbox/order");
        assert_eq!(
            Template::parse("s", DEFAULT_CLOUDEVENTS_SOURCE)
                .unwrap()
                .render(&e),
            default_source
        );
        assert!(Formatter::new(
            MessageFormat::Outbox,
            "publisher.cloudevents_source",
            "/{nope}"
        )
        .unwrap_err()
        .message()
        .contains("publisher.cloudevents_source"));
    }

    #[test]
    fn the_source_is_a_uri_reference_whatever_the_values() {
        let mut e = event(b"{}", "application/json");
        e.aggregate_type = "Sales Order/EU 100%".into();
        let f = Formatter::new(
            MessageFormat::CloudeventsBinary,
            "s",
            "/shop/{aggregate_type}",
        )
        .unwrap();
        assert_eq!(
            f.cloudevents_attributes(&e)[2].1,
            "/shop/Sales%20Order%2FEU%20100%25"
        );
        e.aggregate_type = "zoë".into();
        assert_eq!(f.cloudevents_attributes(&e)[2].1, "/shop/zo%C3%AB");
        e.aggregate_type = "order-v2_x.y~z".into();
        assert_eq!(f.cloudevents_attributes(&e)[2].1, "/shop/order-v2_x.y~z");
    }

    #[test]
    fn base64_matches_rfc_4648() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), expected);
        }
        assert!(is_json("application/vnd.shop+json; charset=utf-8"));
        assert!(!is_json("text/plain"));
    }
}
