//! Classification of SQS errors into the toolkit's error model, and every error the publisher
//! reports of its own: each one's kind, retryability, message and context are set here.

use std::fmt::Display;
use std::time::Duration;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use txoutbox_core::{Error, ErrorKind};

/// How an SQS error code is classified: kind, and whether retrying may help.
///
/// Throttling and server-side failures are temporary; a missing queue, denied access and invalid
/// message contents are permanent.
pub fn classify_code(code: &str) -> (ErrorKind, bool) {
    match code {
        "ThrottlingException"
        | "Throttling"
        | "RequestThrottled"
        | "KmsThrottled"
        | "AWS.SimpleQueueService.RequestThrottled" => (ErrorKind::Throttled, true),
        "AWS.SimpleQueueService.NonExistentQueue"
        | "QueueDoesNotExist"
        | "AWS.SimpleQueueService.QueueDeletedRecently"
        | "QueueDeletedRecently" => (ErrorKind::DestinationNotFound, false),
        "AccessDenied"
        | "AccessDeniedException"
        | "KmsAccessDenied"
        | "KmsDisabled"
        | "KmsInvalidKeyUsage"
        | "KmsNotFound"
        | "KmsInvalidState" => (ErrorKind::PermissionDenied, false),
        "InvalidClientTokenId"
        | "SignatureDoesNotMatch"
        | "UnrecognizedClientException"
        | "ExpiredToken"
        | "IncompleteSignature"
        | "MissingAuthenticationToken" => {
            // Credentials are an operator's fix, not the events' fault: they wait.
            (ErrorKind::PermissionDenied, true)
        }
        "InvalidMessageContents"
        | "InvalidParameterValue"
        | "MissingParameter"
        | "InvalidAttributeName"
        | "InvalidAttributeValue"
        | "UnsupportedOperation"
        | "InvalidParameterCombination" => (ErrorKind::InvalidInput, false),
        "MessageTooLong" | "BatchRequestTooLong" => (ErrorKind::PayloadTooLarge, false),
        "ServiceUnavailable"
        | "InternalError"
        | "InternalFailure"
        | "RequestTimeout"
        | "AWS.SimpleQueueService.ServiceUnavailable" => (ErrorKind::Connection, true),
        _ => (ErrorKind::Unexpected, true),
    }
}

/// Maps one entry that `SendMessageBatch` refused (the rest of the batch may have been taken) to the
/// toolkit's error: classified by its code ([`classify_code`]), and permanent whenever SQS says the
/// sender is at fault (sending it again would fail the same way).
pub fn map_entry_failure(entry: &aws_sdk_sqs::types::BatchResultErrorEntry) -> Error {
    let (kind, retryable) = classify_code(entry.code());
    let e = Error::new(
        kind,
        format!(
            "SQS refused the message: {} {}",
            entry.code(),
            entry.message().unwrap_or("")
        ),
    )
    .with_context("adapter", "sqs")
    .with_context("sender_fault", entry.sender_fault());
    if entry.sender_fault() || !retryable {
        e.permanent()
    } else {
        e.temporary()
    }
}

/// Maps an SDK error to the toolkit's error.
pub fn map_sdk<E, R>(operation: &'static str, err: SdkError<E, R>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    if matches!(err, SdkError::DispatchFailure(_)) {
        if let Some(problem) = txoutbox_core::tls::certificate_problem(&err) {
            return txoutbox_core::tls::certificate_error(
                problem,
                txoutbox_core::tls::TlsSettings {
                    server: "The SQS endpoint",
                    host: "",
                    address: "sqs.endpoint_url (or the region's endpoint)",
                    ca: "sqs.ca_file",
                },
            )
            .with_context("adapter", "sqs")
            .with_context("operation", operation)
            .with_source(err);
        }
    }
    let (kind, retryable, detail) = match &err {
        SdkError::ServiceError(service) => {
            let e = service.err();
            let code = e.code().unwrap_or("unknown");
            let (kind, retryable) = classify_code(code);
            (
                kind,
                retryable,
                format!("{code}: {}", e.message().unwrap_or("")),
            )
        }
        SdkError::TimeoutError(_) => (ErrorKind::Timeout, true, "timed out".to_string()),
        SdkError::DispatchFailure(d) => {
            let what = if d.is_timeout() {
                ErrorKind::Timeout
            } else {
                ErrorKind::Connection
            };
            (what, true, "the endpoint cannot be reached".to_string())
        }
        SdkError::ResponseError(_) => (
            ErrorKind::Connection,
            true,
            "the response could not be read".to_string(),
        ),
        SdkError::ConstructionFailure(_) => (
            ErrorKind::InvalidInput,
            false,
            "the request could not be built".to_string(),
        ),
        _ => (
            ErrorKind::Unexpected,
            true,
            "unexpected SDK error".to_string(),
        ),
    };
    Error::new(kind, format!("SQS {operation} failed: {detail}"))
        .with_context("adapter", "sqs")
        .with_source(err)
        .with_retryable(retryable)
}

/// A message attribute the SDK refuses to build (`cause`): permanent.
pub fn invalid_attribute(cause: impl Display) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("invalid message attribute: {cause}"),
    )
}

/// A `SendMessageBatch` entry the SDK refuses to build (`cause`): permanent.
pub fn invalid_entry(cause: impl Display) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("invalid SQS entry: {cause}"),
    )
}

/// SQS answered `GetQueueUrl` for `queue` without a URL: retryable.
pub fn no_queue_url(queue: &str) -> Error {
    Error::new(
        ErrorKind::Unexpected,
        format!("SQS returned no URL for queue {queue:?}"),
    )
    .temporary()
}

/// An event's queue was not among those resolved for the call: retryable.
pub fn queue_not_resolved() -> Error {
    Error::new(ErrorKind::Unexpected, "queue not resolved").temporary()
}

/// A payload (`len` bytes of `content_type`) that is not text SQS can carry, in CloudEvents binary
/// mode, where no CloudEvents consumer could read it base64-encoded: permanent.
pub fn not_sqs_text(len: usize, content_type: &str) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "the payload ({len} bytes of {content_type}) is not text SQS can carry (binary, or characters SQS refuses), \
             so in CloudEvents binary mode no CloudEvents consumer could read it as sent: \
             use publisher.format = \"cloudevents-structured\" (bytes travel in data_base64)"
        ),
    )
    .with_context("adapter", "sqs")
}

/// A CloudEvents attribute (`name`) that cannot travel as a message attribute of its own (empty,
/// or with characters SQS refuses): permanent.
pub fn cloudevents_attribute_refused(name: &str) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "the CloudEvents attribute {name} is empty or has characters SQS refuses in a message attribute: \
             use publisher.format = \"cloudevents-structured\""
        ),
    )
    .with_context("adapter", "sqs")
}

/// A message of `size` bytes (body and attributes), over `sqs.max_message_bytes` (`limit`), not
/// sent: permanent.
pub fn oversized(size: usize, limit: usize) -> Error {
    Error::new(
        ErrorKind::PayloadTooLarge,
        format!(
            "the message is {size} bytes (body and attributes); sqs.max_message_bytes is {limit}"
        ),
    )
}

/// The delay header (`header`) of an event holds `value`, not a whole number of seconds: permanent.
pub fn bad_delay(header: &str, value: &str) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("header {header} = {value:?}: expected a whole number of seconds"),
    )
}

/// A request not sent because half of `sqs.operation_timeout` (`operation_timeout`) passed before
/// its turn: back-pressure (no attempt counted).
pub fn not_sent_in_time(operation_timeout: Duration) -> Error {
    Error::new(
        ErrorKind::Backpressure,
        format!(
            "not sent: half of sqs.operation_timeout = {} passed before this request's turn",
            txoutbox_core::duration::format(operation_timeout)
        ),
    )
    .with_context("adapter", "sqs")
}

/// A message `SendMessageBatch` reported neither taken nor refused: retryable.
pub fn no_result() -> Error {
    Error::new(
        ErrorKind::Unexpected,
        "SQS reported no result for this message",
    )
    .temporary()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_entry_is_permanent_when_the_sender_is_at_fault() {
        let entry = |code: &str, sender_fault: bool| {
            aws_sdk_sqs::types::BatchResultErrorEntry::builder()
                .id("0")
                .code(code)
                .message("detail")
                .sender_fault(sender_fault)
                .build()
                .expect("a complete entry")
        };
        let e = map_entry_failure(&entry("ServiceUnavailable", false));
        assert_eq!((e.kind(), e.is_retryable()), (ErrorKind::Connection, true));
        let e = map_entry_failure(&entry("ServiceUnavailable", true));
        assert!(!e.is_retryable(), "the sender's fault does not go away");
        let e = map_entry_failure(&entry("InvalidParameterValue", false));
        assert_eq!(
            (e.kind(), e.is_retryable()),
            (ErrorKind::InvalidInput, false)
        );
        assert!(
            e.to_string()
                .contains("SQS refused the message: InvalidParameterValue detail"),
            "{e}"
        );
    }

    #[test]
    fn code_table() {
        let cases = [
            ("ThrottlingException", ErrorKind::Throttled, true),
            ("RequestThrottled", ErrorKind::Throttled, true),
            (
                "AWS.SimpleQueueService.NonExistentQueue",
                ErrorKind::DestinationNotFound,
                false,
            ),
            ("QueueDoesNotExist", ErrorKind::DestinationNotFound, false),
            ("AccessDenied", ErrorKind::PermissionDenied, false),
            ("KmsAccessDenied", ErrorKind::PermissionDenied, false),
            ("InvalidClientTokenId", ErrorKind::PermissionDenied, true),
            ("InvalidMessageContents", ErrorKind::InvalidInput, false),
            ("InvalidParameterValue", ErrorKind::InvalidInput, false),
            ("BatchRequestTooLong", ErrorKind::PayloadTooLarge, false),
            ("ServiceUnavailable", ErrorKind::Connection, true),
            ("SomethingNew", ErrorKind::Unexpected, true),
        ];
        for (code, kind, retry) in cases {
            assert_eq!(classify_code(code), (kind, retry), "{code}");
        }
    }

    /// The publisher's own errors: kind and retryability.
    #[test]
    fn constructor_table() {
        let cases = [
            (invalid_attribute("bad"), ErrorKind::InvalidInput, false),
            (invalid_entry("bad"), ErrorKind::InvalidInput, false),
            (no_queue_url("q"), ErrorKind::Unexpected, true),
            (queue_not_resolved(), ErrorKind::Unexpected, true),
            (
                not_sqs_text(3, "application/octet-stream"),
                ErrorKind::InvalidInput,
                false,
            ),
            (
                cloudevents_attribute_refused("ce-subject"),
                ErrorKind::InvalidInput,
                false,
            ),
            (oversized(2000, 1024), ErrorKind::PayloadTooLarge, false),
            (
                bad_delay("outbox-delay-seconds", "soon"),
                ErrorKind::InvalidInput,
                false,
            ),
            (
                not_sent_in_time(Duration::from_secs(30)),
                ErrorKind::Backpressure,
                true,
            ),
            (no_result(), ErrorKind::Unexpected, true),
        ];
        for (e, kind, retry) in cases {
            assert_eq!((e.kind(), e.is_retryable()), (kind, retry), "{e}");
        }
        assert_eq!(
            not_sent_in_time(Duration::from_secs(30)).message(),
            "not sent: half of sqs.operation_timeout = 30s passed before this request's turn"
        );
        assert_eq!(
            bad_delay("outbox-delay-seconds", "soon").message(),
            "header outbox-delay-seconds = \"soon\": expected a whole number of seconds"
        );
    }
}
