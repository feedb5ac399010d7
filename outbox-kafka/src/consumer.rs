//! The consumer side: reading what the publisher wrote into each record.

#[cfg(test)]
use rdkafka::message::{Header, OwnedHeaders};
use txoutbox_core::header;

/// The event id of a received record: its `outbox-event-id` header. Use it as the deduplication key
/// (for instance with `txoutbox_postgres::Inbox`).
pub fn event_id<M: rdkafka::message::Message>(message: &M) -> Option<txoutbox_core::Uuid> {
    use rdkafka::message::Headers;
    let headers = message.headers()?;
    headers
        .iter()
        .find(|h| h.key == header::EVENT_ID)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod event_id_tests {
    use super::*;
    use rdkafka::message::{OwnedMessage, Timestamp};

    #[test]
    fn reads_the_header() {
        let id = txoutbox_core::Uuid::now_v7();
        let headers = OwnedHeaders::new().insert(Header {
            key: header::EVENT_ID,
            value: Some(id.to_string().as_str()),
        });
        let m = OwnedMessage::new(
            None,
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            Some(headers),
        );
        assert_eq!(event_id(&m), Some(id));
        let bare = OwnedMessage::new(None, None, "t".into(), Timestamp::NotAvailable, 0, 0, None);
        assert_eq!(event_id(&bare), None);
    }
}
