//! The one error model of the toolkit.
//!
//! Every failure carries a [`ErrorKind`] (what went wrong), an [`ErrorStatus`] (may it succeed if tried
//! again), a message, context pairs (adapter, operation, event id...) and the original cause. Adapters
//! classify their native errors into this model; only the relay decides what to do with them.

use std::fmt;
use std::sync::Arc;

/// What went wrong, independent of the adapter that saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A failure with no better kind; see the message and the source.
    Unexpected,
    /// The configuration is invalid (a bad value, a missing key, an impossible combination).
    Config,
    /// An input (event, identifier, header) is invalid and will never be accepted as it is.
    InvalidInput,
    /// The server could not be reached or the connection was lost.
    Connection,
    /// An operation did not finish in time.
    Timeout,
    /// A local queue or buffer is full: slow down, the event itself is fine.
    Backpressure,
    /// The server asked us to slow down (throttling, rate limit).
    Throttled,
    /// The message is larger than the broker accepts.
    PayloadTooLarge,
    /// The destination (topic, exchange, queue) does not exist or has an invalid name.
    DestinationNotFound,
    /// The broker accepted the message but could not route it anywhere.
    Unroutable,
    /// Authentication or authorisation failed.
    PermissionDenied,
    /// The broker refused the message (negative acknowledgement).
    Rejected,
    /// The database reported an error.
    Database,
    /// The operation is not supported by this adapter or server.
    Unsupported,
    /// The database's schema is missing or older than the code (a table or column does not exist):
    /// run the migrations. A fault of the deployment found at run time, unlike [`ErrorKind::Config`],
    /// which the configuration's own checks find.
    Schema,
}

impl ErrorKind {
    /// A short, stable, snake_case name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Unexpected => "unexpected",
            ErrorKind::Config => "config",
            ErrorKind::InvalidInput => "invalid_input",
            ErrorKind::Connection => "connection",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Backpressure => "backpressure",
            ErrorKind::Throttled => "throttled",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::DestinationNotFound => "destination_not_found",
            ErrorKind::Unroutable => "unroutable",
            ErrorKind::PermissionDenied => "permission_denied",
            ErrorKind::Rejected => "rejected",
            ErrorKind::Database => "database",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Schema => "schema",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether trying again may succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorStatus {
    /// Trying again will fail the same way: the event dead-letters at once.
    Permanent,
    /// Trying again later may succeed: the event is retried with backoff.
    Temporary,
    /// It was temporary, but the retries were exhausted.
    Persistent,
}

impl ErrorStatus {
    /// A short, stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorStatus::Permanent => "permanent",
            ErrorStatus::Temporary => "temporary",
            ErrorStatus::Persistent => "persistent",
        }
    }
}

/// The error type of every port and adapter of the toolkit.
///
/// Cheap to clone (the source is shared), so one failure can be reported for every event of a batch.
#[derive(Clone)]
pub struct Error {
    kind: ErrorKind,
    status: ErrorStatus,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// A new error of `kind`. Its status is [`ErrorStatus::Permanent`] unless the kind is one that is
    /// temporary by nature (connection, timeout, backpressure, throttled, rejected); use
    /// [`Error::temporary`] or [`Error::permanent`] to say otherwise.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        let status = match kind {
            ErrorKind::Connection
            | ErrorKind::Timeout
            | ErrorKind::Backpressure
            | ErrorKind::Throttled
            | ErrorKind::Rejected => ErrorStatus::Temporary,
            _ => ErrorStatus::Permanent,
        };
        Error {
            kind,
            status,
            message: message.into(),
            context: Vec::new(),
            source: None,
        }
    }

    /// A configuration error naming the key, the bad value and what is expected.
    pub fn config(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Config, message)
    }

    /// Marks the error as temporary: the operation may succeed if tried again.
    pub fn temporary(mut self) -> Self {
        self.status = ErrorStatus::Temporary;
        self
    }

    /// Marks the error as permanent: trying again will not help.
    pub fn permanent(mut self) -> Self {
        self.status = ErrorStatus::Permanent;
        self
    }

    /// Marks the error temporary when `retryable`, else permanent (for classification tables).
    pub fn with_retryable(self, retryable: bool) -> Self {
        if retryable {
            self.temporary()
        } else {
            self.permanent()
        }
    }

    /// Marks a temporary error as persistent: it was retried until the retries ran out.
    pub fn persistent(mut self) -> Self {
        if self.status == ErrorStatus::Temporary {
            self.status = ErrorStatus::Persistent;
        }
        self
    }

    /// Adds a context pair, such as `("adapter", "kafka")` or `("event_id", id)`.
    pub fn with_context(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, value.to_string()));
        self
    }

    /// Sets the original cause.
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether trying again may succeed.
    pub fn status(&self) -> ErrorStatus {
        self.status
    }

    /// True when the error is temporary and the relay may retry.
    pub fn is_retryable(&self) -> bool {
        self.status == ErrorStatus::Temporary
    }

    /// The message, without context or source.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The context pairs, in the order they were added.
    pub fn context(&self) -> &[(&'static str, String)] {
        &self.context
    }

    /// The value of one context key, if set.
    pub fn context_value(&self, key: &str) -> Option<&str> {
        self.context
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.kind,
            self.status.as_str(),
            self.message
        )?;
        if !self.context.is_empty() {
            f.write_str(" [")?;
            for (i, (k, v)) in self.context.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}={v}")?;
            }
            f.write_str("]")?;
        }
        // The cause chain, each cause once: a cause whose text an earlier one already printed (a
        // wrapped `Error` prints its own chain; many libraries print their source in their text) is
        // not printed again.
        let mut last = self.message.clone();
        let mut source = self
            .source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static));
        while let Some(s) = source {
            let text = s.to_string();
            if !last.contains(&text) {
                write!(f, ": {text}")?;
                last = text;
            }
            source = s.source();
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Error")
            .field("kind", &self.kind)
            .field("status", &self.status)
            .field("message", &self.message)
            .field("context", &self.context)
            .field("source", &self.source)
            .finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

/// Result alias used across the toolkit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_status_follows_kind() {
        assert!(Error::new(ErrorKind::Connection, "x").is_retryable());
        assert!(Error::new(ErrorKind::Timeout, "x").is_retryable());
        assert!(Error::new(ErrorKind::Backpressure, "x").is_retryable());
        assert!(!Error::new(ErrorKind::PayloadTooLarge, "x").is_retryable());
        assert!(!Error::new(ErrorKind::Config, "x").is_retryable());
        assert!(Error::new(ErrorKind::Unexpected, "x")
            .temporary()
            .is_retryable());
        assert!(!Error::new(ErrorKind::Timeout, "x")
            .permanent()
            .is_retryable());
    }

    #[test]
    fn persistent_only_from_temporary() {
        let e = Error::new(ErrorKind::Timeout, "slow").persistent();
        assert_eq!(e.status(), ErrorStatus::Persistent);
        assert!(!e.is_retryable());
        let p = Error::new(ErrorKind::Config, "bad").persistent();
        assert_eq!(p.status(), ErrorStatus::Permanent);
    }

    #[test]
    fn display_carries_context_and_source_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = Error::new(ErrorKind::Connection, "publish failed")
            .with_context("adapter", "amqp")
            .with_context("event_id", "abc")
            .with_source(io);
        let s = e.to_string();
        assert_eq!(
            s,
            "connection (temporary): publish failed [adapter=amqp, event_id=abc]: reset by peer"
        );
        assert_eq!(e.context_value("adapter"), Some("amqp"));
        assert!(std::error::Error::source(&e).is_some());
    }

    /// A library error that prints its own source in its text, as many do.
    #[derive(Debug)]
    struct Chatty(std::io::Error);

    impl fmt::Display for Chatty {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "protocol error: {}", self.0)
        }
    }

    impl std::error::Error for Chatty {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn display_prints_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let inner = Error::new(ErrorKind::Connection, "channel closed")
            .with_context("operation", "confirm")
            .with_source(Chatty(io()));
        assert_eq!(
            inner.to_string(),
            "connection (temporary): channel closed [operation=confirm]: protocol error: reset by peer"
        );
        let outer = Error::new(ErrorKind::Connection, "publish failed")
            .with_context("adapter", "amqp")
            .with_source(inner);
        assert_eq!(
            outer.to_string(),
            "connection (temporary): publish failed [adapter=amqp]: connection (temporary): channel \
             closed [operation=confirm]: protocol error: reset by peer",
            "the wrapped error's chain is printed once, not again cause by cause"
        );
        assert_eq!(outer.to_string().matches("reset by peer").count(), 1);
    }
}
