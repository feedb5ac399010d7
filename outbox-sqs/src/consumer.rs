//! The consumer side: reading what the publisher wrote into each message.

use txoutbox_core::header;

/// The event id of a received message: its `outbox-event-id` attribute, or `ce-id` when it was
/// sent in CloudEvents binary mode. Use it as the deduplication key (for instance with
/// `txoutbox_postgres::Inbox`).
pub fn event_id(message: &aws_sdk_sqs::types::Message) -> Option<txoutbox_core::Uuid> {
    let attributes = message.message_attributes()?;
    let cloudevents_id = format!("{}id", crate::publisher::attributes::CLOUDEVENTS_PREFIX);
    attributes
        .get(header::EVENT_ID)
        .or_else(|| attributes.get(&cloudevents_id))?
        .string_value()?
        .parse()
        .ok()
}

#[cfg(test)]
mod event_id_tests {
    use super::*;
    use crate::publisher::attributes::attribute;

    #[test]
    fn reads_the_attribute() {
        let id = txoutbox_core::Uuid::now_v7();
        let m = aws_sdk_sqs::types::Message::builder()
            .message_attributes(header::EVENT_ID, attribute(&id.to_string()).unwrap())
            .build();
        assert_eq!(event_id(&m), Some(id));
        let cloudevent = aws_sdk_sqs::types::Message::builder()
            .message_attributes("ce-id", attribute(&id.to_string()).unwrap())
            .build();
        assert_eq!(event_id(&cloudevent), Some(id));
        assert_eq!(
            event_id(&aws_sdk_sqs::types::Message::builder().build()),
            None
        );
    }
}
