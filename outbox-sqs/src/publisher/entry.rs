//! The `SendMessageBatch` entry an event becomes: its body (text, escaped JSON or base64), its
//! attributes, its size against `sqs.max_message_bytes`, and on a FIFO queue its group and
//! deduplication ids (else the delay its header asks for).

use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use base64::Engine;

use txoutbox_core::format::MessageFormat;
use txoutbox_core::{Error, Event};

use super::attributes::{attribute, attributes, base_attributes, sqs_safe_json, valid_sqs_char};
use super::SqsPublisher;
use crate::error;

/// Event header read as the message's `DelaySeconds` (standard queues), passed to SQS as is.
pub const DELAY_HEADER: &str = "outbox-delay-seconds";

/// One event, ready to send.
pub(super) struct Prepared {
    pub(super) index: usize,
    pub(super) queue_url: String,
    pub(super) aggregate: (String, String),
    pub(super) entry: SendMessageBatchRequestEntry,
    pub(super) size: usize,
}

fn valid_group_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_graphic())
}

/// The FIFO group of an aggregate: its id, or a stable hash when SQS would refuse the id.
pub fn message_group_id(aggregate_type: &str, aggregate_id: &str) -> String {
    if valid_group_id(aggregate_id) {
        return aggregate_id.to_string();
    }
    // FNV-1a: stable across processes and releases, so one aggregate keeps one group.
    let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
    for b in aggregate_type
        .bytes()
        .chain([0u8])
        .chain(aggregate_id.bytes())
    {
        fnv ^= u64::from(b);
        fnv = fnv.wrapping_mul(0x0100_0000_01b3);
    }
    format!("aggregate-{fnv:016x}")
}

/// Whether `queue` (a name or URL) is a FIFO queue.
pub(super) fn is_fifo(queue: &str) -> bool {
    queue.trim_end_matches('/').ends_with(".fifo")
}

impl SqsPublisher {
    pub(super) fn prepare(
        &self,
        index: usize,
        event: &Event,
        queue_url: String,
    ) -> Result<Prepared, Error> {
        let format = self.format.format();
        let body = self.format.body(event);
        let (body, encoding) = match std::str::from_utf8(&body) {
            Ok(text) if text.chars().all(valid_sqs_char) => (text.to_string(), None),
            // The JSON event with the characters SQS refuses escaped: the same JSON.
            Ok(text) if format == MessageFormat::CloudeventsStructured => {
                (sqs_safe_json(text), None)
            }
            _ if format == MessageFormat::CloudeventsBinary => {
                return Err(error::not_sqs_text(
                    event.payload.len(),
                    &event.content_type,
                ));
            }
            _ => (
                base64::engine::general_purpose::STANDARD.encode(&body),
                Some("base64"),
            ),
        };
        if format == MessageFormat::CloudeventsBinary {
            // Every CloudEvents attribute travels as an attribute of its own, never folded.
            if let Some((name, _)) = base_attributes(event, &self.format)
                .into_iter()
                .find(|(_, v)| v.is_empty() || !v.chars().all(valid_sqs_char))
            {
                return Err(error::cloudevents_attribute_refused(&name));
            }
        }
        let (attrs, attr_size) = attributes(event, encoding, &self.format);
        let size = body.len() + attr_size;
        if size > self.config.max_message_bytes {
            return Err(error::oversized(size, self.config.max_message_bytes));
        }
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body);
        for (k, v) in &attrs {
            entry = entry.message_attributes(k, attribute(v)?);
        }
        if is_fifo(&queue_url) {
            entry = entry
                .message_group_id(message_group_id(&event.aggregate_type, &event.aggregate_id))
                .message_deduplication_id(event.id.simple().to_string());
        } else if let Some(delay) = event.headers.get(DELAY_HEADER) {
            let seconds: i32 = delay
                .trim()
                .parse()
                .map_err(|_| error::bad_delay(DELAY_HEADER, delay))?;
            entry = entry.delay_seconds(seconds);
        }
        let entry = entry.build().map_err(error::invalid_entry)?;
        Ok(Prepared {
            index,
            queue_url,
            aggregate: (event.aggregate_type.clone(), event.aggregate_id.clone()),
            entry,
            size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_are_stable_and_valid() {
        assert_eq!(message_group_id("order", "42"), "42");
        let odd = message_group_id("order", "with space é");
        assert_eq!(odd, message_group_id("order", "with space é"), "stable");
        assert!(valid_group_id(&odd));
        assert_ne!(odd, message_group_id("customer", "with space é"));
        assert!(is_fifo("https://sqs.us-east-1.amazonaws.com/1/orders.fifo"));
        assert!(!is_fifo("orders"));
    }
}
