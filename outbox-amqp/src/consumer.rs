//! The consumer side: reading what the publisher wrote into each message.

use lapin::types::AMQPValue;
use lapin::BasicProperties;
use txoutbox_core::header;

/// The event id of a received message: its `message_id`, else the `outbox-event-id` header. Use it
/// as the deduplication key (for instance with `txoutbox_postgres::Inbox`).
pub fn event_id(properties: &BasicProperties) -> Option<txoutbox_core::Uuid> {
    if let Some(id) = properties
        .message_id()
        .as_ref()
        .and_then(|m| m.as_str().parse().ok())
    {
        return Some(id);
    }
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(header::EVENT_ID)? {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod event_id_tests {
    use super::*;
    use lapin::types::{FieldTable, LongString};

    #[test]
    fn reads_the_message_id_then_the_header() {
        let id = txoutbox_core::Uuid::now_v7();
        let p = BasicProperties::default().with_message_id(id.to_string().into());
        assert_eq!(event_id(&p), Some(id));
        let mut h = FieldTable::default();
        h.insert(
            header::EVENT_ID.into(),
            AMQPValue::LongString(LongString::from(id.to_string())),
        );
        assert_eq!(
            event_id(&BasicProperties::default().with_headers(h)),
            Some(id)
        );
        assert_eq!(event_id(&BasicProperties::default()), None);
    }
}
