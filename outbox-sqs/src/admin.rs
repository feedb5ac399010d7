//! Queue administration for tools (`outbox bench`, set-up scripts), through a publisher's client so
//! that credentials, endpoint and timeouts are those of the [`SqsPublisher`].

use aws_sdk_sqs::types::QueueAttributeName;

use txoutbox_core::{Error, ErrorKind};

use crate::error::map_sdk;
use crate::SqsPublisher;

/// Creates the queue `name` (a FIFO queue when the name ends in `.fifo`, with content-based
/// deduplication off: the publisher sends the event id as the deduplication id) and returns its URL.
/// Creating an existing queue with the same attributes returns its URL.
///
/// # Errors
/// SQS's refusal (for instance an existing queue with other attributes), or an unreachable endpoint.
pub async fn create_queue(publisher: &SqsPublisher, name: &str) -> Result<String, Error> {
    let mut create = publisher.client().create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        create = create
            .attributes(QueueAttributeName::FifoQueue, "true")
            .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
    }
    let out = create
        .send()
        .await
        .map_err(|e| map_sdk("CreateQueue", e).with_context("queue", name))?;
    out.queue_url().map(str::to_string).ok_or_else(|| {
        Error::new(
            ErrorKind::Unexpected,
            format!("SQS created queue {name:?} but returned no URL"),
        )
        .with_context("adapter", "sqs")
    })
}

/// Deletes the queue at `queue_url`.
///
/// # Errors
/// SQS's refusal, or an unreachable endpoint.
pub async fn delete_queue(publisher: &SqsPublisher, queue_url: &str) -> Result<(), Error> {
    publisher
        .client()
        .delete_queue()
        .queue_url(queue_url)
        .send()
        .await
        .map_err(|e| map_sdk("DeleteQueue", e).with_context("queue", queue_url))?;
    Ok(())
}
