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
