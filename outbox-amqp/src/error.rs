//! Classification of lapin errors and AMQP reply codes into the toolkit's error model, every error
//! the publisher reports of its own (each one's kind, retryability, message and context), and the
//! size limit read from RabbitMQ's refusal of a message over it.

use std::time::Duration;

use lapin::message::BasicReturnMessage;
use lapin::ErrorKind as LapinKind;
use txoutbox_core::duration::format as duration;
use txoutbox_core::{Error, ErrorKind, Uuid};

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

/// The limit in RabbitMQ's refusal of a message over its `max_message_size` (`text`, the error's
/// text): it closes the channel with 406 PRECONDITION_FAILED, "message size N is larger than
/// configured max size M". (At RabbitMQ's hard cap the text says "max size M" without
/// "configured".) `None` for any other text.
pub fn parse_size_limit(text: &str) -> Option<usize> {
    let (_, rest) = text.split_once("message size ")?;
    let (_, rest) = rest.split_once(" is larger than ")?;
    let (_, rest) = rest.split_once("max size ")?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// `field`, `len` bytes long, does not fit an AMQP short string (at most `max` bytes): permanent.
pub fn too_long(field: &str, len: usize, max: usize) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!("{field} is {len} bytes long; AMQP allows at most {max}"),
    )
    .with_context("adapter", "amqp")
}

/// The configured exchange cannot be declared, or is missing (`cause`): retryable, saying how to fix
/// it (an operator's fix, not the events' fault, so they wait until it is fixed).
pub fn exchange_unusable(exchange: &str, cause: Error) -> Error {
    Error::new(
        cause.kind(),
        format!(
            "exchange {exchange:?} cannot be used: {}; create it, fix amqp.exchange, or set amqp.declare_exchange = true",
            cause.message()
        ),
    )
    .temporary()
    .with_context("adapter", "amqp")
    .with_source(cause)
}

/// The exchange `name`, an event's destination, does not exist (`cause`, the broker's answer):
/// permanent.
pub fn exchange_missing(name: &str, cause: Error) -> Error {
    Error::new(
        ErrorKind::DestinationNotFound,
        format!("exchange {name:?} (the event's destination) does not exist"),
    )
    .with_context("adapter", "amqp")
    .with_source(cause)
}

/// The connection is lost or not there, for `reason`: retryable.
pub fn connection_lost(reason: &str) -> Error {
    Error::new(ErrorKind::Connection, reason.to_string()).with_context("adapter", "amqp")
}

/// The broker at `url` (password redacted) is not tried again before `wait` has passed; `last` is
/// what the last attempt failed with: retryable.
pub fn unreachable(url: &str, wait: Duration, last: Option<&Error>) -> Error {
    let mut e = connection_lost(&format!(
        "RabbitMQ at {url} is unreachable; next connection attempt in {} ms",
        wait.as_millis()
    ));
    if let Some(last) = last {
        e = e.with_source(last.clone());
    }
    e.temporary()
}

/// Connecting to `url` (password redacted) took longer than `amqp.connect_timeout`: retryable.
pub fn connect_timeout(url: &str, timeout: Duration) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!(
            "connecting to {url} took longer than amqp.connect_timeout = {}",
            duration(timeout)
        ),
    )
    .with_context("adapter", "amqp")
}

/// The broker did not answer the readiness check's round trip within `amqp.connect_timeout`:
/// retryable.
pub fn no_answer(timeout: Duration) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!(
            "RabbitMQ did not answer on its connection within amqp.connect_timeout = {}",
            duration(timeout)
        ),
    )
    .with_context("adapter", "amqp")
}

/// A message's properties (about `header_bytes`) do not fit in a content-header frame of the
/// connection (`frame_max`): permanent.
pub fn headers_too_large(header_bytes: usize, frame_max: usize) -> Error {
    Error::new(
        ErrorKind::InvalidInput,
        format!(
            "the headers take about {header_bytes} bytes; an AMQP frame of this connection carries at most {frame_max} (move large values into the payload)"
        ),
    )
    .with_context("adapter", "amqp")
}

/// A message body of `len` bytes, over `amqp.max_message_bytes` (`limit`), not sent: permanent.
pub fn oversized(len: usize, limit: usize) -> Error {
    Error::new(
        ErrorKind::PayloadTooLarge,
        format!("the message body is {len} bytes; amqp.max_message_bytes is {limit}"),
    )
    .with_context("adapter", "amqp")
}

/// A message body of `len` bytes that RabbitMQ refused over its own `max_message_size` (`limit`),
/// lower than `amqp.max_message_bytes` (`configured`): permanent.
pub fn over_broker_limit(len: usize, limit: usize, configured: usize, event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::PayloadTooLarge,
        format!(
            "the message body is {len} bytes; RabbitMQ refused it over its max_message_size of {limit} \
             (raise max_message_size in rabbitmq.conf, or write smaller events; amqp.max_message_bytes, \
             {configured}, is checked before sending)"
        ),
    )
    .permanent()
    .with_context("adapter", "amqp")
    .with_context("event_id", event_id)
}

/// A message of the call not confirmed because RabbitMQ closed the channel over others of it
/// (`refused`, their event ids) larger than its `max_message_size` (`limit`): retryable.
pub fn closed_by_another(refused: &[String], limit: usize, event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Connection,
        format!(
            "the channel closed before this message was confirmed: RabbitMQ refused another message \
             of the call ({}) over its max_message_size of {limit}; to be sent again",
            refused.join(", ")
        ),
    )
    .temporary()
    .with_context("adapter", "amqp")
    .with_context("event_id", event_id)
}

/// No confirm (or no room to write) within `amqp.confirm_timeout`: retryable.
pub fn no_confirm(timeout: Duration) -> Error {
    Error::new(
        ErrorKind::Timeout,
        format!(
            "no publisher confirm within amqp.confirm_timeout = {}",
            duration(timeout)
        ),
    )
    .with_context("adapter", "amqp")
}

/// A message the broker returned (`mandatory`, and no queue bound for it): retryable when
/// `amqp.unroutable_is_retryable` (`retryable`), else permanent.
pub fn unroutable(returned: &BasicReturnMessage, event_id: Uuid, retryable: bool) -> Error {
    Error::new(
        ErrorKind::Unroutable,
        format!(
            "returned by the broker: {} {} (exchange {:?}, routing key {:?}): no queue is bound for it",
            returned.reply_code,
            returned.reply_text,
            returned.delivery.exchange.as_str(),
            returned.delivery.routing_key.as_str()
        ),
    )
    .with_context("adapter", "amqp")
    .with_context("event_id", event_id)
    .with_retryable(retryable)
}

/// A message the broker negatively acknowledged (`basic.nack`): retryable.
pub fn nacked(event_id: Uuid) -> Error {
    Error::new(
        ErrorKind::Rejected,
        "the broker negatively acknowledged the message (basic.nack)",
    )
    .with_context("adapter", "amqp")
    .with_context("event_id", event_id)
}

/// A confirm that was not asked for: the channel is not in confirm mode, retryable.
pub fn not_confirm_mode() -> Error {
    Error::new(
        ErrorKind::Unexpected,
        "the channel is not in confirm mode; the message may not have arrived",
    )
    .temporary()
    .with_context("adapter", "amqp")
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

    #[test]
    fn the_brokers_size_limit_is_read_from_its_refusal() {
        let reason = "invalid_input (temporary): broker replied 406 PRECONDITION_FAILED - message size 2097184 \
                      is larger than configured max size 1048576 during confirm [adapter=amqp]";
        assert_eq!(parse_size_limit(reason), Some(1_048_576));
        assert_eq!(
            parse_size_limit(
                "PRECONDITION_FAILED - message size 600000000 is larger than max size 536870912"
            ),
            Some(536_870_912)
        );
        assert_eq!(
            parse_size_limit("broker replied 406 PRECONDITION_FAILED - inequivalent arg"),
            None
        );
        assert_eq!(
            parse_size_limit("message size 10 is larger than max size "),
            None
        );
        assert_eq!(parse_size_limit(""), None);
    }

    /// The publisher's own errors: kind, retryability and context.
    #[test]
    fn constructor_table() {
        let id = Uuid::nil();
        let cause = || Error::new(ErrorKind::DestinationNotFound, "cause");
        let second = Duration::from_secs(1);
        let cases = [
            (
                too_long("header name", 300, 255),
                ErrorKind::InvalidInput,
                false,
            ),
            (
                exchange_unusable("x", cause()),
                ErrorKind::DestinationNotFound,
                true,
            ),
            (
                exchange_missing("x", cause()),
                ErrorKind::DestinationNotFound,
                false,
            ),
            (connection_lost("closed"), ErrorKind::Connection, true),
            (
                unreachable("amqp://h", second, None),
                ErrorKind::Connection,
                true,
            ),
            (
                connect_timeout("amqp://h", second),
                ErrorKind::Timeout,
                true,
            ),
            (no_answer(second), ErrorKind::Timeout, true),
            (
                headers_too_large(9000, 4096),
                ErrorKind::InvalidInput,
                false,
            ),
            (oversized(10, 5), ErrorKind::PayloadTooLarge, false),
            (
                over_broker_limit(10, 5, 20, id),
                ErrorKind::PayloadTooLarge,
                false,
            ),
            (
                closed_by_another(&["e".into()], 5, id),
                ErrorKind::Connection,
                true,
            ),
            (no_confirm(second), ErrorKind::Timeout, true),
            (nacked(id), ErrorKind::Rejected, true),
            (not_confirm_mode(), ErrorKind::Unexpected, true),
        ];
        for (e, kind, retry) in cases {
            assert_eq!((e.kind(), e.is_retryable()), (kind, retry), "{e}");
            assert_eq!(e.context_value("adapter"), Some("amqp"), "{e}");
        }
        assert_eq!(
            oversized(10, 5).message(),
            "the message body is 10 bytes; amqp.max_message_bytes is 5"
        );
        assert_eq!(
            no_confirm(second).message(),
            "no publisher confirm within amqp.confirm_timeout = 1s"
        );
    }
}
