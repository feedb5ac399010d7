//! Connection poolers in front of the server (PgBouncer, the pooler of a managed offering).
//!
//! In transaction mode a pooler lends a server session to a client for one transaction, then to
//! another client. What runs inside a transaction works through it: the writer, the polling claim
//! (transaction-scoped advisory locks, `SET LOCAL`), statistics, cleanup. Named prepared statements,
//! which sqlx uses for every query, work only when the pooler carries them across sessions
//! (PgBouncer 1.21 or later with `max_prepared_statements` above 0). What needs a session of its own
//! cannot go through it at all: the WAL source's replication connection and its reader lock (a
//! session advisory lock, which another client would be lent and share), and LISTEN
//! (`database.notify`). Those take `database.direct_url`.

use std::collections::BTreeSet;

use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::Connection;

use txoutbox_core::{Error, ErrorKind};

use crate::config::{DatabaseConfig, Source};
use crate::error::map_sqlx;

/// How a URL's connections reach the server's sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Each connection keeps one server session (the server itself, or a session-mode pool).
    Session,
    /// Connections share server sessions between transactions (a transaction- or statement-mode
    /// pooler).
    Transaction,
}

/// What the relay needs a server session of its own for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionUse {
    /// The WAL source: its replication connection and its reader lock.
    WalSource,
    /// LISTEN for `database.notify`.
    Listen,
}

impl SessionUse {
    fn what(self) -> &'static str {
        match self {
            SessionUse::WalSource => {
                "the WAL source (database.source = \"wal\") needs a server session of its own for its replication connection and its reader lock"
            }
            SessionUse::Listen => {
                "LISTEN (database.notify = true) needs a server session of its own to receive notifications"
            }
        }
    }
}

/// Two connections of `options` run a few statements in turn and report the server session
/// (`pg_backend_pid()`) each ran in. Straight to the server, each connection keeps its own session
/// throughout. Through a transaction-mode pooler, a connection is lent a session per statement:
/// the one another connection just gave back (PgBouncer's default, last in first out), or the next
/// in turn (`server_round_robin`), so one connection sees two sessions or two see the same one.
///
/// # Errors
/// A connection error, or (a config error naming `max_prepared_statements` and `setting`) a
/// pooler that does not carry named prepared statements between the sessions it lends.
pub async fn probe(options: &PgConnectOptions, setting: &str) -> Result<Pooling, Error> {
    // As the pools of this crate: without the startup parameter PgBouncer refuses.
    let options = options.clone().extra_float_digits(None);
    let connect = || async {
        PgConnection::connect_with(&options)
            .await
            .map_err(|e| map_sqlx("connect", e))
    };
    let mut conns = [connect().await?, connect().await?];
    let mut seen = [BTreeSet::new(), BTreeSet::new()];
    let mut result = Ok(());
    for i in [0, 0, 1, 1, 0, 1, 0, 0, 1, 1] {
        match sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(&mut conns[i])
            .await
        {
            Ok(pid) => {
                seen[i].insert(pid);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    // Statement mode refuses transactions, and every claim is one.
    let transactions = if result.is_ok() {
        sqlx::raw_sql("BEGIN; SELECT 1; COMMIT")
            .execute(&mut conns[0])
            .await
            .map(|_| ())
    } else {
        Ok(())
    };
    for conn in conns {
        let _ = conn.close().await;
    }
    if let Err(e) = result {
        return Err(prepared_statements_refused(e, setting));
    }
    if let Err(e) = transactions {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "{setting} refuses a transaction of several statements (a connection pooler in statement mode?): \
                 the relay claims and the writer writes in transactions. Use the pooler's transaction or session mode"
            ),
        )
        .with_source(map_sqlx("connection pooler check", e)));
    }
    Ok(
        if seen.iter().all(|s| s.len() == 1) && seen[0].is_disjoint(&seen[1]) {
            Pooling::Session
        } else {
            Pooling::Transaction
        },
    )
}

/// A probe's failed statement: the refusal of a pooler that does not carry prepared statements
/// (`prepared statement "sqlx_s_1" already exists` or `does not exist`), said with its fix;
/// anything else as it came.
fn prepared_statements_refused(e: sqlx::Error, setting: &str) -> Error {
    let code = match &e {
        sqlx::Error::Database(db) => db.code().map(|c| c.to_string()),
        _ => None,
    };
    let base = map_sqlx("connection pooler check", e);
    match code.as_deref() {
        // duplicate_prepared_statement, invalid_sql_statement_name
        Some("42P05" | "26000") => Error::new(
            ErrorKind::Config,
            format!(
                "{setting} reaches a connection pooler in transaction mode that does not keep prepared statements apart between its clients: \
                 the relay and the writer use named prepared statements. Set max_prepared_statements (PgBouncer 1.21 or later, e.g. 200) on the pooler, \
                 use its session mode, or point {setting} at the server itself"
            ),
        )
        .with_source(base),
        _ => base,
    }
}

impl DatabaseConfig {
    /// What a relay on these settings needs a server session of its own for (the WAL source's
    /// reader, or the NOTIFY listener): behind a transaction-mode pooler, those go to
    /// `database.direct_url` ([`crate::pooler::session_pool`]).
    pub fn session_uses(&self) -> Vec<SessionUse> {
        if self.source == Source::Wal {
            vec![SessionUse::WalSource]
        } else if self.notify {
            vec![SessionUse::Listen]
        } else {
            Vec::new()
        }
    }
}

/// What [`session_pool`] gives: the pool for what needs a server session of its own, and what it
/// found on the way.
#[derive(Debug, Clone)]
pub struct SessionPool {
    /// `database.direct_url`'s pool, or `database.url`'s when nothing needs another.
    pub pool: PgPool,
    /// What `database.url` reaches.
    pub url_reaches: Pooling,
    /// Whether `pool` is `database.direct_url`'s.
    pub direct: bool,
}

/// The pool for what needs a server session of its own (`uses`; none: `pool` itself).
/// `database.direct_url` when set (it must not reach a transaction-mode pooler), else `pool`,
/// which then must not either. `pool` (of `database.url`) is probed in any case, so that a pooler
/// without prepared statements is refused before anything is claimed.
///
/// # Errors
/// A config error naming `database.direct_url` when a use needs a session and none is to be had,
/// the probe's errors ([`probe`]), or a connection error of `database.direct_url`.
pub async fn session_pool(
    config: &DatabaseConfig,
    pool: &PgPool,
    uses: &[SessionUse],
) -> Result<SessionPool, Error> {
    let main = probe(&pool.connect_options(), "database.url").await?;
    let same = |pool: &PgPool| SessionPool {
        pool: pool.clone(),
        url_reaches: main,
        direct: false,
    };
    if main == Pooling::Transaction {
        tracing::info!("database.url reaches a connection pooler in transaction mode");
    }
    let Some(direct) = &config.direct_url else {
        if let (Pooling::Transaction, Some(need)) = (main, uses.first()) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "database.url reaches a connection pooler in transaction mode (PgBouncer or similar): {}. \
                     Set database.direct_url (OUTBOX_DATABASE__DIRECT_URL) to the server itself or to a session-mode pool{}",
                    need.what(),
                    if *need == SessionUse::Listen {
                        ", or set database.notify = false (polling alone finds every event)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        return Ok(same(pool));
    };
    if uses.is_empty() {
        tracing::info!(
            "database.direct_url is set but unused: only the WAL source and database.notify need a session of their own"
        );
        return Ok(same(pool));
    }
    let direct = crate::pool::connect_url(
        direct,
        "database.direct_url",
        config.pool_size,
        config.acquire_timeout,
    )
    .await?;
    let checked = async {
        if probe(&direct.connect_options(), "database.direct_url").await? == Pooling::Transaction {
            return Err(Error::new(
                ErrorKind::Config,
                "database.direct_url reaches a connection pooler in transaction mode: it is for what needs a server session of its own \
                 (the WAL source, LISTEN), so point it at the server itself or at a session-mode pool",
            ));
        }
        let (a, b) = (server_of(pool).await?, server_of(&direct).await?);
        if a != b {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "database.url and database.direct_url reach different databases (database {:?} of server {} and database {:?} of server {}): \
                     both must reach the same database of the same server",
                    a.1, a.0, b.1, b.0
                ),
            ));
        }
        Ok(())
    };
    if let Err(e) = checked.await {
        direct.close().await;
        return Err(e);
    }
    Ok(SessionPool {
        pool: direct,
        url_reaches: main,
        direct: true,
    })
}

/// The server (its system identifier) and the database a pool reaches.
async fn server_of(pool: &PgPool) -> Result<(i64, String), Error> {
    sqlx::query_as("SELECT (SELECT system_identifier FROM pg_control_system()), current_database()")
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("connection pooler check", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sessions_of_their_own_follow_the_source_and_notify() {
        let mut c = DatabaseConfig::default();
        assert!(c.session_uses().is_empty());
        c.notify = true;
        assert_eq!(c.session_uses(), [SessionUse::Listen]);
        // The WAL source wakes the relay itself: no listener.
        c.source = Source::Wal;
        assert_eq!(c.session_uses(), [SessionUse::WalSource]);
    }
}
