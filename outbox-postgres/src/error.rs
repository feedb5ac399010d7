//! Classification of database errors into the toolkit's error model, by SQLSTATE.

use txoutbox_core::{Error, ErrorKind};

/// How a SQLSTATE code is classified: kind, and whether retrying may help.
pub fn classify_sqlstate(code: &str) -> (ErrorKind, bool) {
    match code {
        // serialization_failure, deadlock_detected
        "40001" | "40P01" => (ErrorKind::Database, true),
        // lock_not_available, query_canceled (statement_timeout)
        "55P03" => (ErrorKind::Database, true),
        // object_in_use: a replication slot read by another session at this moment
        "55006" => (ErrorKind::Database, true),
        "57014" => (ErrorKind::Timeout, true),
        // admin_shutdown, crash_shutdown, cannot_connect_now
        "57P01" | "57P02" | "57P03" => (ErrorKind::Connection, true),
        // idle_in_transaction_session_timeout
        "25P03" => (ErrorKind::Connection, true),
        // invalid_authorization_specification, invalid_password, insufficient_privilege
        "28000" | "28P01" | "42501" => (ErrorKind::PermissionDenied, false),
        // undefined_table / undefined_column: the schema is missing or old
        "42P01" | "42703" => (ErrorKind::Schema, false),
        c if c.starts_with("08") => (ErrorKind::Connection, true),
        // insufficient_resources (disk full, out of memory, too many connections)
        c if c.starts_with("53") => (ErrorKind::Database, true),
        // data exceptions and integrity violations: the input is wrong
        c if c.starts_with("22") || c.starts_with("23") => (ErrorKind::InvalidInput, false),
        _ => (ErrorKind::Database, false),
    }
}

/// Maps a sqlx error to the toolkit's error, with the operation as context.
pub fn map_sqlx(operation: &'static str, err: sqlx::Error) -> Error {
    let (kind, retryable, message) = match &err {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.to_string()).unwrap_or_default();
            let (kind, retryable) = classify_sqlstate(&code);
            let hint = if code == "42P01" || code == "42703" {
                " (is the schema migrated? run `outbox migrate`)"
            } else {
                ""
            };
            (
                kind,
                retryable,
                format!("database error {code} during {operation}{hint}"),
            )
        }
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) => (
            ErrorKind::Connection,
            true,
            format!("cannot reach the database during {operation}"),
        ),
        sqlx::Error::PoolTimedOut => (
            ErrorKind::Timeout,
            true,
            format!(
                "no database connection available within database.acquire_timeout during {operation} \
                 (the pool is busy, or the server does not answer: raise database.pool_size or database.acquire_timeout, or check the server)"
            ),
        ),
        sqlx::Error::PoolClosed => (
            ErrorKind::Connection,
            false,
            format!("the connection pool was closed during {operation}"),
        ),
        sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => (
            ErrorKind::Connection,
            true,
            format!("the database connection failed during {operation}"),
        ),
        sqlx::Error::Configuration(_) => (
            ErrorKind::Config,
            false,
            format!("invalid database configuration during {operation}"),
        ),
        _ => (
            ErrorKind::Database,
            false,
            format!("unexpected database error during {operation}"),
        ),
    };
    Error::new(kind, message)
        .with_context("adapter", "postgres")
        .with_context("operation", operation)
        .with_source(err)
        .with_retryable(retryable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstate_table() {
        let cases = [
            ("40001", ErrorKind::Database, true),
            ("40P01", ErrorKind::Database, true),
            ("57P01", ErrorKind::Connection, true),
            ("57P03", ErrorKind::Connection, true),
            ("08006", ErrorKind::Connection, true),
            ("08001", ErrorKind::Connection, true),
            ("53300", ErrorKind::Database, true),
            ("57014", ErrorKind::Timeout, true),
            ("42P01", ErrorKind::Schema, false),
            ("28P01", ErrorKind::PermissionDenied, false),
            ("23505", ErrorKind::InvalidInput, false),
            ("22P02", ErrorKind::InvalidInput, false),
            ("42601", ErrorKind::Database, false),
        ];
        for (code, kind, retry) in cases {
            assert_eq!(classify_sqlstate(code), (kind, retry), "SQLSTATE {code}");
        }
    }

    #[test]
    fn io_errors_are_retryable_connection_errors() {
        let e = map_sqlx(
            "claim",
            sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "refused",
            )),
        );
        assert_eq!(e.kind(), ErrorKind::Connection);
        assert!(e.is_retryable());
        assert_eq!(e.context_value("operation"), Some("claim"));
        assert!(e.to_string().contains("refused"));
        let e = map_sqlx("claim", sqlx::Error::PoolTimedOut);
        assert!(e.is_retryable());
        assert_eq!(e.kind(), ErrorKind::Timeout);
        let e = map_sqlx("claim", sqlx::Error::RowNotFound);
        assert!(!e.is_retryable());
    }
}
