//! Classification of SQS errors into the toolkit's error model.

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use outbox_core::{Error, ErrorKind};

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
}
