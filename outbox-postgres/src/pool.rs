//! Connection pools: opened from a URL or [`DatabaseConfig`], each connection with server-side TCP
//! keepalives and a user timeout ([`KEEPALIVES`]), so that a vanished relay's session, and its
//! locks, end within about 25 s.

use crate::config::DatabaseConfig;
use crate::error::map_sqlx;

/// Opens a connection pool to `url` with at most `max_connections` connections.
///
/// # Errors
/// A connection error naming the host (the password is never shown) and how to fix it.
pub async fn connect(
    url: &str,
    max_connections: u32,
) -> Result<sqlx::PgPool, txoutbox_core::Error> {
    connect_url(
        url,
        "database.url",
        max_connections,
        std::time::Duration::from_secs(10),
    )
    .await
}

/// Opens a pool as [`DatabaseConfig`] says (URL, pool size, acquire timeout).
///
/// # Errors
/// As [`connect`].
pub async fn connect_config(config: &DatabaseConfig) -> Result<sqlx::PgPool, txoutbox_core::Error> {
    connect_url(
        &config.url,
        "database.url",
        config.pool_size,
        config.acquire_timeout,
    )
    .await
}

/// Run on every new connection of a pool opened here (see `connect_url`). Keepalives find a peer
/// gone while the connection is quiet; `tcp_user_timeout` (PostgreSQL 12 and later) one gone while
/// the server still has data it sent unacknowledged (a cut in the middle of an answer, or right
/// after one whose acknowledgement was lost with it), where keepalives do not apply and the
/// kernel's retransmissions would keep the session, and its locks, for about 15 minutes.
pub(crate) const KEEPALIVES: &str =
    "SELECT set_config('tcp_keepalives_idle', '10', false), set_config('tcp_keepalives_interval', '5', false),
            set_config('tcp_keepalives_count', '3', false);
     SELECT set_config('tcp_user_timeout', '25000', false)
     WHERE current_setting('tcp_user_timeout', true) IS NOT NULL";

/// [`KEEPALIVES`] for one transaction: every claim sets them on its own connection, so a lease
/// (the claim's transaction) is released within about 25 s of its relay vanishing whatever pool
/// the store was given.
pub(crate) const KEEPALIVES_LOCAL: &str =
    "SELECT set_config('tcp_keepalives_idle', '10', true), set_config('tcp_keepalives_interval', '5', true),
            set_config('tcp_keepalives_count', '3', true);
     SELECT set_config('tcp_user_timeout', '25000', true)
     WHERE current_setting('tcp_user_timeout', true) IS NOT NULL";

/// The pause between two connection attempts the start waits through.
const RETRY: std::time::Duration = std::time::Duration::from_millis(250);

/// A connection failure that may pass by itself: the server not listening yet, starting up, or
/// out of connection slots.
fn worth_waiting(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(io) => io.kind() == std::io::ErrorKind::ConnectionRefused,
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57P03" | "53300")),
        _ => false,
    }
}

/// Why a connection to the server `options` names failed: a certificate refused (naming the
/// setting that fixes it), or the server unreachable or refusing (naming where it was looked for).
fn connect_failure(
    options: &sqlx::postgres::PgConnectOptions,
    setting: &str,
    e: sqlx::Error,
) -> txoutbox_core::Error {
    let host = options.get_host().to_string();
    if let Some(problem) = txoutbox_core::tls::certificate_problem(&e) {
        return txoutbox_core::tls::certificate_error(
            problem,
            txoutbox_core::tls::TlsSettings {
                server: "PostgreSQL",
                host: &host,
                address: setting,
                ca: &format!("sslrootcert=<file> (with sslmode=verify-full) in {setting}"),
            },
        )
        .with_source(map_sqlx("connect", e));
    }
    let base = map_sqlx("connect", e);
    txoutbox_core::Error::new(
        base.kind(),
        format!(
            "cannot connect to PostgreSQL at {}: is the server running and the database created?",
            server_address(options)
        ),
    )
    .with_source(base)
}

/// `host:port/database`, as errors name the server.
fn server_address(options: &sqlx::postgres::PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    )
}

/// One connection first, on its own: the pool reports only that it timed out, hiding the cause
/// (refused, a name that does not resolve, a password refused, a certificate refused). As the pool
/// does, a server refusing connections, still starting (57P03) or full (53300) is tried again
/// until `acquire_timeout`: a relay started a moment before its database waits.
async fn first_connection(
    options: &sqlx::postgres::PgConnectOptions,
    setting: &str,
    acquire_timeout: std::time::Duration,
) -> Result<(), txoutbox_core::Error> {
    use sqlx::{postgres::PgConnection, Connection};
    let deadline = tokio::time::Instant::now() + acquire_timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout(left, PgConnection::connect_with(options)).await {
            Err(_) => {
                return Err(txoutbox_core::Error::new(
                    txoutbox_core::ErrorKind::Timeout,
                    format!(
                        "PostgreSQL at {} did not answer within database.acquire_timeout ({}): is the address right, \
                         and does a firewall let the connection through?",
                        server_address(options),
                        txoutbox_core::duration::format(acquire_timeout)
                    ),
                ))
            }
            Ok(Err(e)) if worth_waiting(&e) && tokio::time::Instant::now() + RETRY < deadline => {
                tokio::time::sleep(RETRY).await;
            }
            Ok(Err(e)) if worth_waiting(&e) => {
                return Err(connect_failure(options, setting, e).with_context(
                    "tried for",
                    format!(
                        "database.acquire_timeout {}",
                        txoutbox_core::duration::format(acquire_timeout)
                    ),
                ))
            }
            Ok(Err(e)) => return Err(connect_failure(options, setting, e)),
            Ok(Ok(conn)) => {
                let _ = conn.close().await;
                return Ok(());
            }
        }
    }
}

/// A pool of `url`, the value of the setting `setting` (named in its errors).
pub(crate) async fn connect_url(
    url: &str,
    setting: &str,
    max_connections: u32,
    acquire_timeout: std::time::Duration,
) -> Result<sqlx::PgPool, txoutbox_core::Error> {
    use sqlx::postgres::PgPoolOptions;
    let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e| {
        txoutbox_core::Error::new(
            txoutbox_core::ErrorKind::Config,
            format!("{setting} is not a valid PostgreSQL URL: expected postgres://user[:password]@host[:port]/database"),
        )
        .with_source(e)
    })?;
    // sqlx asks for `extra_float_digits = 2` in the startup packet by default; nothing here reads
    // floats as text, and PgBouncer refuses a startup parameter it does not know unless told to
    // ignore it (`ignore_startup_parameters`).
    let options = options.extra_float_digits(None);
    first_connection(&options, setting, acquire_timeout).await?;
    PgPoolOptions::new()
        .max_connections(max_connections.max(1))
        // Server-side TCP keepalives and user timeout: when the relay's host or network vanishes,
        // the server notices within about 25 s and ends the session, so the partitions its batches
        // held are claimable again (with the kernel's defaults a dead peer's session, and its
        // locks, last about two hours). Set once per connection (startup options are refused by some poolers). They guard the
        // server's own socket: behind a session pooler that is the pooler's connection, whose own
        // keepalives then guard the relay's side.
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                use sqlx::Executor;
                conn.execute(sqlx::raw_sql(KEEPALIVES)).await.map(|_| ())
            })
        })
        .acquire_timeout(acquire_timeout)
        .connect_with(options.clone())
        .await
        .map_err(|e| connect_failure(&options, setting, e))
}
