//! Classification of Kafka errors into the toolkit's error model, and every error the publisher
//! reports of its own: each one's kind, retryability, message and context are set here.

use std::fmt::Display;

use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};
use txoutbox_core::{Error, ErrorKind, Uuid};

/// How a librdkafka / broker error code is classified: kind, and whether retrying may help.
///
/// The local queue being full is back-pressure (the relay retries without counting an attempt).
/// Transport, timeout and leadership errors are temporary. Problems of the message or its topic
/// (too large, invalid topic, not authorised, rejected by policy) are permanent.
pub fn classify_code(code: Code) -> (ErrorKind, bool) {
    if ends_session(code) {
        return (ErrorKind::Connection, true);
    }
    match code {
        // The record was not refused: the producer dropped it from its queue because it failed
        // (a fatal error caused by another record, whose own report names it) or was replaced.
        // Sent again without counting an attempt.
        Code::QueueFull | Code::PurgeQueue | Code::PurgeInflight | Code::Fatal => {
            (ErrorKind::Backpressure, true)
        }
        Code::BrokerTransportFailure
        | Code::AllBrokersDown
        | Code::Resolve
        | Code::NetworkException => (ErrorKind::Connection, true),
        Code::MessageTimedOut
        | Code::RequestTimedOut
        | Code::OperationTimedOut
        | Code::TimedOutQueue => (ErrorKind::Timeout, true),
        Code::NotLeaderForPartition
        | Code::LeaderNotAvailable
        | Code::PreferredLeaderNotAvailable
        | Code::NotEnoughReplicas
        | Code::NotEnoughReplicasAfterAppend
        | Code::UnknownTopicOrPartition
        | Code::UnknownTopic
        | Code::UnknownPartition
        | Code::ISRInsufficient
        | Code::Retry => (ErrorKind::Rejected, true),
        Code::MessageSizeTooLarge | Code::MessageBatchTooLarge => {
            (ErrorKind::PayloadTooLarge, false)
        }
        Code::InvalidTopic => (ErrorKind::DestinationNotFound, false),
        Code::TopicAuthorizationFailed | Code::ClusterAuthorizationFailed => {
            (ErrorKind::PermissionDenied, false)
        }
        Code::SaslAuthenticationFailed | Code::Authentication => {
            (ErrorKind::PermissionDenied, true)
        }
        Code::InvalidMessage
        | Code::InvalidRecord
        | Code::PolicyViolation
        | Code::BadMessage
        | Code::InvalidArgument => (ErrorKind::InvalidInput, false),
        _ => (ErrorKind::Unexpected, true),
    }
}

/// Whether the broker refused the producer's idempotence session itself (its producer id, epoch or
/// sequence): every later message of that producer would be refused too, so the publisher replaces
/// the producer, which starts a new session. (Tansu, for one, answers every send after a record it
/// refused with `ProducerFenced` until the producer is replaced.)
pub fn ends_session(code: Code) -> bool {
    matches!(
        code,
        Code::ProducerFenced
            | Code::Fenced
            | Code::InvalidProducerEpoch
            | Code::InvalidProducerIdMapping
            | Code::UnknownProducerId
            | Code::OutOfOrderSequenceNumber
    )
}

/// Maps a Kafka error to the toolkit's error.
pub fn map_kafka(operation: &'static str, err: KafkaError) -> Error {
    let (kind, retryable) = match err.rdkafka_error_code() {
        Some(code) => classify_code(code),
        None => match err {
            KafkaError::Canceled => (ErrorKind::Connection, true),
            KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) => {
                (ErrorKind::Config, false)
            }
            _ => (ErrorKind::Unexpected, true),
        },
    };
    Error::new(kind, format!("Kafka {operation} failed"))
        .with_context("adapter", "kafka")
        .with_source(err)
        .with_retryable(retryable)
}

/// A topic name Kafka refuses (more than `max_len` characters, or others than `a-z A-Z 0-9 . _ -`,
/// or `.` / `..`): permanent.
pub fn illegal_topic(topic: &str, max_len: usize) -> Error {
    Error::new(
        ErrorKind::DestinationNotFound,
        format!(
            "{topic:?} is not a legal Kafka topic name: expected 1 to {max_len} characters of a-z, A-Z, 0-9, '.', '_' and '-'"
        ),
    )
    .with_context("adapter", "kafka")
}

/// librdkafka refused to create a producer with the settings (`cause`): a config error.
pub fn producer_not_created(cause: impl Display) -> Error {
    Error::config(format!(
        "kafka: the producer cannot be created with these settings: {cause} (check kafka.properties)"
    ))
}

/// A record of about `size` bytes refused as too large (`cause`, whose text names neither the size
/// nor the limits), naming `kafka.max_message_bytes` (`limit`) and the broker's limits: permanent.
pub fn oversized(size: usize, limit: usize, cause: Error) -> Error {
    Error::new(
        ErrorKind::PayloadTooLarge,
        format!(
            "the record is about {size} bytes (body, key and headers); kafka.max_message_bytes is {limit} \
             (the broker's message.max.bytes or the topic's max.message.bytes may be lower): \
             move large data out of the event, or raise the limits"
        ),
    )
    .with_context("adapter", "kafka")
    .with_source(cause)
    .permanent()
}

/// An event whose aggregate id, the record's key, is empty, under a partitioner that sends a record
/// with an empty key to any partition: permanent.
pub fn empty_key(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        "the event's aggregate_id is empty: it is the Kafka record's key, and the producer's \
         partitioner (consistent_random, librdkafka's default) sends a record with an empty \
         key to any partition, out of order with the rest of its aggregate; write a non-empty \
         aggregate_id (the Writer refuses an empty one), or set kafka.properties.partitioner \
         to one that hashes an empty key (murmur2_random: the Java client's)",
    )
    .with_context("adapter", "kafka")
    .with_context("event_id", event_id)
}

/// The producer dropped an event's delivery report (it was destroyed): retryable.
pub fn report_dropped(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Connection,
        "the producer dropped the delivery report",
    )
    .with_context("adapter", "kafka")
    .with_context("event_id", event_id)
}

/// No delivery report for an event within the call's deadline: retryable.
pub fn no_report(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Timeout,
        "no delivery report within kafka.delivery_timeout",
    )
    .with_context("adapter", "kafka")
    .with_context("event_id", event_id)
}

/// A record refused with its record batch and left unsent alone, the call's time being spent:
/// back-pressure (sent again shortly, no attempt counted).
pub fn not_resent(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Backpressure,
        "refused with its record batch; not sent again alone within the call's time",
    )
    .with_context("adapter", "kafka")
    .with_context("event_id", event_id)
}

/// A record the producer dropped when no record of the call was refused: the producer itself
/// failed, a connection error (an attempt counted; the relay treats the broker as unreachable).
pub fn producer_failed(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Connection,
        "the Kafka producer failed and dropped this record, and no record of the call was \
         refused: a failure of the producer itself (its reason is logged as a fatal error)",
    )
    .with_context("adapter", "kafka")
    .with_context("event_id", event_id)
}

/// The blocking task of `task` (`flush`, `metadata`) failed (`cause`): unexpected.
pub fn task_failed(task: &str, cause: impl Display) -> Error {
    Error::new(
        ErrorKind::Unexpected,
        format!("{task} task failed: {cause}"),
    )
}

/// The brokers at `brokers` did not answer a metadata request (`cause`): a connection error.
pub fn brokers_do_not_answer(brokers: &str, cause: Error) -> Error {
    Error::new(
        ErrorKind::Connection,
        format!("the Kafka brokers at {brokers} do not answer"),
    )
    .with_context("adapter", "kafka")
    .with_source(cause)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_table() {
        let cases = [
            (Code::QueueFull, ErrorKind::Backpressure, true),
            (Code::PurgeQueue, ErrorKind::Backpressure, true),
            (Code::PurgeInflight, ErrorKind::Backpressure, true),
            (Code::Fatal, ErrorKind::Backpressure, true),
            (Code::ProducerFenced, ErrorKind::Connection, true),
            (Code::OutOfOrderSequenceNumber, ErrorKind::Connection, true),
            (Code::UnknownProducerId, ErrorKind::Connection, true),
            (Code::BrokerTransportFailure, ErrorKind::Connection, true),
            (Code::AllBrokersDown, ErrorKind::Connection, true),
            (Code::MessageTimedOut, ErrorKind::Timeout, true),
            (Code::RequestTimedOut, ErrorKind::Timeout, true),
            (Code::NotLeaderForPartition, ErrorKind::Rejected, true),
            (Code::LeaderNotAvailable, ErrorKind::Rejected, true),
            (Code::UnknownTopicOrPartition, ErrorKind::Rejected, true),
            (Code::MessageSizeTooLarge, ErrorKind::PayloadTooLarge, false),
            (Code::InvalidTopic, ErrorKind::DestinationNotFound, false),
            (
                Code::TopicAuthorizationFailed,
                ErrorKind::PermissionDenied,
                false,
            ),
            (
                Code::ClusterAuthorizationFailed,
                ErrorKind::PermissionDenied,
                false,
            ),
            (Code::PolicyViolation, ErrorKind::InvalidInput, false),
        ];
        for (code, kind, retry) in cases {
            assert_eq!(classify_code(code), (kind, retry), "{code:?}");
        }
    }

    #[test]
    fn wrapped_errors_keep_their_cause() {
        let e = map_kafka(
            "produce",
            KafkaError::MessageProduction(Code::MessageSizeTooLarge),
        );
        assert_eq!(e.kind(), ErrorKind::PayloadTooLarge);
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("Message production error"), "{e}");
        assert_eq!(e.context_value("adapter"), Some("kafka"));
    }

    /// The publisher's own errors: kind, retryability and context.
    #[test]
    fn constructor_table() {
        let id = Uuid::nil();
        let cause = || Error::new(ErrorKind::Unexpected, "cause");
        let cases = [
            (
                illegal_topic("a b", 249),
                ErrorKind::DestinationNotFound,
                false,
            ),
            (producer_not_created("bad"), ErrorKind::Config, false),
            (
                oversized(10, 1000, cause()),
                ErrorKind::PayloadTooLarge,
                false,
            ),
            (empty_key(id), ErrorKind::InvalidInput, false),
            (report_dropped(id), ErrorKind::Connection, true),
            (no_report(id), ErrorKind::Timeout, true),
            (not_resent(id), ErrorKind::Backpressure, true),
            (producer_failed(id), ErrorKind::Connection, true),
            (
                task_failed("flush", "panicked"),
                ErrorKind::Unexpected,
                false,
            ),
            (
                brokers_do_not_answer("b:9092", cause()),
                ErrorKind::Connection,
                true,
            ),
        ];
        for (e, kind, retry) in cases {
            assert_eq!((e.kind(), e.is_retryable()), (kind, retry), "{e}");
        }
        let e = oversized(1_500_000, 1_000_000, cause());
        assert!(
            e.message()
                .starts_with("the record is about 1500000 bytes (body, key and headers); kafka.max_message_bytes is 1000000 "),
            "{e}"
        );
        assert_eq!(e.context_value("adapter"), Some("kafka"));
        assert_eq!(
            no_report(id).context_value("event_id"),
            Some(id.to_string().as_str())
        );
    }
}
