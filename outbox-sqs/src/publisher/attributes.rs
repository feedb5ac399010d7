//! The message attributes an event gets (SQS allows ten): the format's, the body encoding, then its
//! headers, trace context first, those that do not fit folded into one JSON attribute; and the
//! characters and names SQS accepts in them.

use std::collections::BTreeMap;

use aws_sdk_sqs::types::MessageAttributeValue;

use txoutbox_core::format::{Formatter, MessageFormat};
use txoutbox_core::{header, Error, Event};

use crate::error;

/// Most message attributes SQS accepts on one message.
pub const MAX_ATTRIBUTES: usize = 10;
/// The attribute that carries the event headers that do not fit in attributes of their own.
pub const FOLDED_HEADERS: &str = "outbox-headers";
/// The attribute set to `base64` when the body is the base64 of a payload SQS cannot carry as text.
pub const ENCODING: &str = "outbox-encoding";

/// Whether SQS accepts `c` in a message body or attribute value.
pub(super) fn valid_sqs_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

/// JSON text with every character SQS refuses written as a `\uXXXX` escape (still the same JSON).
pub(super) fn sqs_safe_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if valid_sqs_char(c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

fn valid_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// A `String` message attribute of `value`.
pub(crate) fn attribute(value: &str) -> Result<MessageAttributeValue, Error> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(error::invalid_attribute)
}

/// The prefix of CloudEvents attributes in binary mode: SQS has no CloudEvents binding, so they are
/// named as the HTTP binding names its headers (`ce-id`, ...; `content-type` is `datacontenttype`).
pub const CLOUDEVENTS_PREFIX: &str = "ce-";

/// How many CloudEvents attributes travel as message attributes in binary mode: `specversion`,
/// `id`, `source`, `type`, `time` and `subject` (with `content-type`, seven of SQS's ten; the
/// `partitionkey` and `aggregatetype` extensions are left out, the aggregate being the subject).
pub const CLOUDEVENTS_ATTRIBUTES: usize = 6;

/// The attributes the message format gives `event`: in CloudEvents binary mode the CloudEvents
/// attributes and `content-type` (in place of the `outbox-*` attributes, which would not leave
/// room: SQS allows ten); else `outbox-event-id`, `outbox-event-type`, `outbox-aggregate-type`,
/// `outbox-aggregate-id`, `content-type` (the format's) and the format's own (Debezium's `id` and
/// `eventType`).
pub(super) fn base_attributes(event: &Event, format: &Formatter) -> Vec<(String, String)> {
    if format.format() == MessageFormat::CloudeventsBinary {
        return format
            .cloudevents_attributes(event)
            .into_iter()
            .take(CLOUDEVENTS_ATTRIBUTES)
            .map(|(k, v)| (format!("{CLOUDEVENTS_PREFIX}{k}"), v))
            .chain([(header::CONTENT_TYPE.to_string(), event.content_type.clone())])
            .collect();
    }
    [
        (header::EVENT_ID, event.id.to_string()),
        (header::EVENT_TYPE, event.event_type.clone()),
        (header::AGGREGATE_TYPE, event.aggregate_type.clone()),
        (header::AGGREGATE_ID, event.aggregate_id.clone()),
        (header::CONTENT_TYPE, format.content_type(event).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain(format.headers(event, CLOUDEVENTS_PREFIX))
    .collect()
}

/// The attributes of `event` (at most 10) and their size in bytes, with the body encoding if any.
pub(super) fn attributes(
    event: &Event,
    encoding: Option<&str>,
    format: &Formatter,
) -> (Vec<(String, String)>, usize) {
    let mut attrs: Vec<(String, String)> = Vec::with_capacity(MAX_ATTRIBUTES);
    let mut folded: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in base_attributes(event, format) {
        if !v.is_empty() && v.chars().all(valid_sqs_char) {
            attrs.push((k, v));
        } else {
            folded.insert(k, v);
        }
    }
    if let Some(enc) = encoding {
        attrs.push((ENCODING.to_string(), enc.to_string()));
    }
    // traceparent and tracestate first, then the rest by name.
    let mut headers: Vec<(&String, &String)> = event.headers.iter().collect();
    headers.sort_by_key(|(k, _)| match k.as_str() {
        header::TRACEPARENT => 0,
        header::TRACESTATE => 1,
        _ => 2,
    });
    let room = MAX_ATTRIBUTES - attrs.len();
    let fits_all = headers.len() <= room && folded.is_empty();
    let individual_room = if fits_all {
        room
    } else {
        room.saturating_sub(1)
    };
    for (k, v) in headers {
        let own = attrs.len() < individual_room + (MAX_ATTRIBUTES - room)
            && valid_attribute_name(k)
            && !v.is_empty()
            && v.chars().all(valid_sqs_char)
            && !attrs.iter().any(|(n, _)| n == k);
        if own {
            attrs.push((k.clone(), v.clone()));
        } else {
            folded.insert(k.clone(), v.clone());
        }
    }
    if !folded.is_empty() {
        let json = serde_json::to_string(&folded).unwrap_or_default();
        attrs.push((FOLDED_HEADERS.to_string(), sqs_safe_json(&json)));
    }
    let size = attrs
        .iter()
        .map(|(k, v)| k.len() + v.len() + "String".len())
        .sum();
    (attrs, size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(headers: &[(&str, &str)]) -> Event {
        Event {
            id: txoutbox_core::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            event_type: "order.created".into(),
            payload: b"{}".to_vec(),
            content_type: "application/json".into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            destination: None,
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    fn names(attrs: &[(String, String)]) -> Vec<&str> {
        attrs.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn few_headers_get_attributes_of_their_own() {
        let (attrs, size) = attributes(
            &ev(&[("traceparent", "00-abc-01"), ("x-tenant", "acme")]),
            None,
            &Formatter::default(),
        );
        assert_eq!(
            names(&attrs),
            [
                "outbox-event-id",
                "outbox-event-type",
                "outbox-aggregate-type",
                "outbox-aggregate-id",
                "content-type",
                "traceparent",
                "x-tenant"
            ]
        );
        assert!(size > 0);
    }

    #[test]
    fn each_format_fits_its_attributes_in_ten() {
        let e = ev(&[
            ("traceparent", "00-abc-01"),
            ("tracestate", "a=b"),
            ("x-tenant", "acme"),
        ]);
        let format = |f| Formatter::new(f, "s", "/shop/{aggregate_type}").unwrap();
        let (attrs, _) = attributes(
            &e,
            Some("base64"),
            &format(MessageFormat::CloudeventsBinary),
        );
        assert_eq!(
            names(&attrs),
            [
                "ce-specversion",
                "ce-id",
                "ce-source",
                "ce-type",
                "ce-time",
                "ce-subject",
                "content-type",
                "outbox-encoding",
                "traceparent",
                "outbox-headers"
            ]
        );
        let (attrs, _) = attributes(&e, None, &format(MessageFormat::Debezium));
        assert_eq!(names(&attrs)[5..7], ["id", "eventType"]);
        assert_eq!(attrs.len(), MAX_ATTRIBUTES);
        let (attrs, _) = attributes(&e, None, &format(MessageFormat::CloudeventsStructured));
        assert_eq!(attrs[4].1, txoutbox_core::format::CLOUDEVENTS_JSON);
    }

    #[test]
    fn what_does_not_fit_is_folded_into_one_json_attribute() {
        let many: Vec<(String, String)> =
            (0..8).map(|i| (format!("h{i}"), format!("v{i}"))).collect();
        let mut headers: Vec<(&str, &str)> =
            many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        headers.push(("traceparent", "00-abc-01"));
        headers.push(("bad name!", "x"));
        let (attrs, _) = attributes(&ev(&headers), Some("base64"), &Formatter::default());
        assert_eq!(attrs.len(), MAX_ATTRIBUTES, "never more than SQS allows");
        let n = names(&attrs);
        assert!(
            n.contains(&"traceparent"),
            "trace context keeps its own attribute: {n:?}"
        );
        assert!(n.contains(&ENCODING));
        let folded: BTreeMap<String, String> =
            serde_json::from_str(&attrs.last().unwrap().1).unwrap();
        assert_eq!(attrs.last().unwrap().0, FOLDED_HEADERS);
        assert!(folded.contains_key("bad name!"));
        // Every header is somewhere: in its own attribute or folded.
        for (k, _) in &headers {
            assert!(n.contains(k) || folded.contains_key(*k), "{k} lost");
        }
    }

    #[test]
    fn folded_json_escapes_what_sqs_refuses() {
        let json = serde_json::to_string(&BTreeMap::from([("k", "a\u{FFFF}b")])).unwrap();
        let safe = sqs_safe_json(&json);
        assert!(safe.chars().all(valid_sqs_char), "{safe}");
        let back: BTreeMap<String, String> = serde_json::from_str(&safe).unwrap();
        assert_eq!(back["k"], "a\u{FFFF}b");
    }

    #[test]
    fn attribute_names_follow_sqs_rules() {
        for ok in ["traceparent", "x-tenant", "a.b_c"] {
            assert!(valid_attribute_name(ok), "{ok}");
        }
        for bad in [
            "",
            "AWS.thing",
            "amazon.x",
            ".a",
            "a.",
            "a..b",
            "sp ace",
            "ü",
        ] {
            assert!(!valid_attribute_name(bad), "{bad}");
        }
        assert!(
            valid_sqs_char('a')
                && valid_sqs_char('\n')
                && !valid_sqs_char('\u{0}')
                && !valid_sqs_char('\u{FFFF}')
        );
    }
}
