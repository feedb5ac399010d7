//! Classification of Kafka errors into the toolkit's error model.

use outbox_core::{Error, ErrorKind};
use rdkafka::error::{KafkaError, RDKafkaErrorCode as Code};

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
/// the producer, which starts a new session. (Seen with Tansu after it refused one record: every later
/// send failed with `ProducerFenced` until the producer was replaced.)
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
}
