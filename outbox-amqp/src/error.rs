//! Classification of lapin errors and AMQP reply codes into the toolkit's error model.

use lapin::ErrorKind as LapinKind;
use outbox_core::{Error, ErrorKind};

/// How an AMQP reply code is classified: kind, and whether retrying may help.
///
/// Codes that concern one message or destination (no route, not found, access refused, too large)
/// are permanent; codes that concern the connection or the broker's state are temporary.
pub fn classify_reply_code(code: u16) -> (ErrorKind, bool) {
    match code {
        311 => (ErrorKind::PayloadTooLarge, false), // CONTENT_TOO_LARGE
        312 | 313 => (ErrorKind::Unroutable, false), // NO_ROUTE, NO_CONSUMERS
        403 => (ErrorKind::PermissionDenied, false), // ACCESS_REFUSED
        404 => (ErrorKind::DestinationNotFound, false), // NOT_FOUND
        405 => (ErrorKind::Rejected, true),         // RESOURCE_LOCKED
        406 => (ErrorKind::InvalidInput, false),    // PRECONDITION_FAILED
        320 => (ErrorKind::Connection, true),       // CONNECTION_FORCED
        402 => (ErrorKind::Config, false),          // INVALID_PATH (vhost)
        530 => (ErrorKind::PermissionDenied, true), // NOT_ALLOWED (vhost access, connection level)
        540 => (ErrorKind::Unsupported, false),     // NOT_IMPLEMENTED
        541 => (ErrorKind::Rejected, true),         // INTERNAL_ERROR
        501..=506 => (ErrorKind::Connection, true), // frame/syntax/command/channel/resource errors
        _ => (ErrorKind::Unexpected, true),
    }
}

/// Maps a lapin error to the toolkit's error. Errors that concern the connection are temporary;
/// broker replies are classified by [`classify_reply_code`].
pub fn map_lapin(operation: &'static str, err: lapin::Error) -> Error {
    let (kind, retryable, message) = match err.kind() {
        LapinKind::ProtocolError(amqp) => {
            let code = amqp.get_id();
            let (kind, retryable) = classify_reply_code(code);
            (
                kind,
                retryable,
                format!(
                    "broker replied {code} {} during {operation}",
                    amqp.get_message()
                ),
            )
        }
        LapinKind::IOError(_)
        | LapinKind::RuntimeShutdownError(_)
        | LapinKind::MissingHeartbeatError
        | LapinKind::InvalidConnectionState(_)
        | LapinKind::InvalidChannelState(..)
        | LapinKind::InvalidChannel(_)
        | LapinKind::ChannelsLimitReached
        | LapinKind::ParsingError(_) => (
            ErrorKind::Connection,
            true,
            format!("the broker connection failed during {operation}"),
        ),
        LapinKind::AuthProviderError(_) => (
            ErrorKind::PermissionDenied,
            true,
            format!(
                "authentication failed during {operation}: check the user and password in amqp.url"
            ),
        ),
        LapinKind::InvalidProtocolVersion(_) => (
            ErrorKind::Unsupported,
            true,
            format!("the broker does not speak AMQP 0-9-1 (during {operation})"),
        ),
        LapinKind::SerialisationError(_) => (
            ErrorKind::InvalidInput,
            false,
            format!("the message could not be encoded as an AMQP frame during {operation}"),
        ),
        _ => (
            ErrorKind::Unexpected,
            true,
            format!("unexpected AMQP client error during {operation}"),
        ),
    };
    Error::new(kind, message)
        .with_context("adapter", "amqp")
        .with_context("operation", operation)
        .with_source(err)
        .with_retryable(retryable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_code_table() {
        let cases = [
            (311, ErrorKind::PayloadTooLarge, false),
            (312, ErrorKind::Unroutable, false),
            (403, ErrorKind::PermissionDenied, false),
            (404, ErrorKind::DestinationNotFound, false),
            (405, ErrorKind::Rejected, true),
            (406, ErrorKind::InvalidInput, false),
            (320, ErrorKind::Connection, true),
            (504, ErrorKind::Connection, true),
            (530, ErrorKind::PermissionDenied, true),
            (541, ErrorKind::Rejected, true),
            (999, ErrorKind::Unexpected, true),
        ];
        for (code, kind, retry) in cases {
            assert_eq!(
                classify_reply_code(code),
                (kind, retry),
                "reply code {code}"
            );
        }
    }

    #[test]
    fn io_errors_are_retryable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let e = map_lapin("publish", lapin::Error::from(io));
        assert_eq!(e.kind(), ErrorKind::Connection);
        assert!(e.is_retryable());
        assert_eq!(e.context_value("adapter"), Some("amqp"));
    }
}
