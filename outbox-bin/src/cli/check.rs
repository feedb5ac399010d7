//! `outbox check`: what `outbox relay` checks before it claims anything, and more, one line per
//! check with the fix. It claims, writes and publishes nothing.
//!
//! Exit code: 0 when every check passes; 2 when one fails on the configuration (a value, a
//! missing migration, a certificate refused); 1 when one fails otherwise (a server down, a
//! missing grant).

use std::time::Duration;

use txoutbox_core::{Error, ErrorKind, Store};
use txoutbox_postgres::pooler::{Pooling, SessionUse};
use txoutbox_postgres::wal::WalStore;
use txoutbox_postgres::{OutboxTable, PostgresStore, Source};

use super::{build_publisher, exit_code, store, Failure};
use crate::config::Config;

/// How long the broker check waits: as long as the relay's at start.
const BROKER_CHECK: Duration = super::relay::BROKER_CHECK_AT_START;

/// The checks' outcomes, printed as they come.
#[derive(Default)]
struct Report {
    /// The exit code of each failed check ([`exit_code`]).
    failed: Vec<u8>,
}

impl Report {
    fn line(&mut self, name: &str, result: Result<String, Error>) {
        match result {
            Ok(detail) => println!("ok    {name:<13} {detail}"),
            Err(e) => {
                println!("FAIL  {name:<13} {e}");
                self.failed.push(exit_code(&e));
            }
        }
    }

    fn skipped(name: &str, why: &str) {
        println!("-     {name:<13} skipped: {why}");
    }
}

/// The offline part, also run by `outbox config`: the settings as the relay checks them at start
/// (the pool against what it must hold, the publisher's settings, `relay.publish_timeout` against
/// the publisher's own limit), from the configuration alone: nothing is built or reached.
///
/// # Errors
/// The first config error found.
pub(super) fn offline(config: &Config) -> Result<String, Error> {
    config.check_relay_pool()?;
    if config.database.source == Source::Wal {
        config.wal.validate()?;
    }
    let adapter = config.adapter(config.publisher.kind);
    adapter.validate()?;
    config.publisher.formatter()?;
    config
        .relay
        .validate_against(adapter.name(), adapter.call_limit().as_ref())?;
    Ok(format!(
        "source {}, publisher {}, pool {} connections ({} needed)",
        match config.database.source {
            Source::Polling => "polling",
            Source::Wal => "wal",
        },
        adapter.name(),
        config.database.pool_size,
        config.pool_connections_needed()
    ))
}

pub(super) async fn cmd_check(config: &Config, table: OutboxTable) -> Result<(), Failure> {
    let mut report = Report::default();
    report.line("configuration", offline(config));
    let wal = config.database.source == Source::Wal;
    let kept = if wal {
        config.wal.held_table(&table)?
    } else {
        table.clone()
    };
    match store(config, kept.clone()).await {
        Err(f) => {
            println!("FAIL  {:<13} {}", "database", f.message);
            report.failed.push(f.code);
            Report::skipped("schema", "no database connection");
            Report::skipped("privileges", "no database connection");
        }
        Ok(pg) => {
            report.line("database", database(&pg).await);
            report.line("pooler", pooler(config, &pg).await);
            report.line("schema", schema(&pg, &table).await);
            if wal {
                report.line("wal", wal_prerequisites(config, &table, &pg).await);
            } else {
                let what = if config.database.keep_processed_for.is_some() {
                    "claim and mark"
                } else {
                    "claim, mark and delete"
                };
                report.line(
                    "privileges",
                    pg.check()
                        .await
                        .map(|()| format!("the role may {what} on {}", table.qualified())),
                );
            }
        }
    }
    report.line("broker", broker(config).await);
    // A setting to fix (2) outweighs a server that does not answer (1).
    match report.failed.iter().max() {
        None => Ok(()),
        Some(code) => Err(Failure {
            code: *code,
            message: format!("{} check(s) failed", report.failed.len()),
        }),
    }
}

/// The server, the database and whether the session is encrypted.
async fn database(pg: &PostgresStore) -> Result<String, Error> {
    let (version, database, tls): (String, String, Option<bool>) = sqlx::query_as(
        "SELECT current_setting('server_version'), current_database(),
                (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid())",
    )
    .fetch_one(pg.pool())
    .await
    .map_err(|e| txoutbox_postgres::map_sqlx("check", e))?;
    Ok(format!(
        "PostgreSQL {version}, database {database}, {}",
        if tls == Some(true) {
            "TLS"
        } else {
            "not encrypted"
        }
    ))
}

/// What `database.url` reaches, and `database.direct_url` when something needs it.
async fn pooler(config: &Config, pg: &PostgresStore) -> Result<String, Error> {
    let found = txoutbox_postgres::pooler::session_pool(
        &config.database,
        pg.pool(),
        &config.database.session_uses(),
    )
    .await?;
    Ok(match (found.url_reaches, found.direct) {
        (Pooling::Session, false) => {
            "database.url reaches the server (or a session-mode pool)".into()
        }
        (Pooling::Session, true) => {
            "database.url and database.direct_url reach the server (or a session-mode pool)".into()
        }
        (Pooling::Transaction, true) => {
            "database.url goes through a transaction-mode pooler; database.direct_url reaches the server".into()
        }
        (Pooling::Transaction, false) => {
            "database.url goes through a transaction-mode pooler (nothing here needs a session of its own)".into()
        }
    })
}

/// Every migration applied to the outbox table.
async fn schema(pg: &PostgresStore, table: &OutboxTable) -> Result<String, Error> {
    let pending = match txoutbox_postgres::migrate::pending(pg.pool(), table).await {
        // A relay role need not read the migrations' bookkeeping (the README's roles do not).
        Err(e) if e.kind() == ErrorKind::PermissionDenied => {
            return Ok(format!(
                "{} (this role may not read the migrations' bookkeeping table, so the versions are not compared: the owner's `outbox check` does)",
                table.qualified()
            ))
        }
        other => other?,
    };
    if pending.is_empty() {
        return Ok(format!("{} is migrated", table.qualified()));
    }
    Err(Error::config(format!(
        "{} misses {} migration(s) ({pending:?}): run `outbox migrate`",
        table.qualified(),
        pending.len()
    )))
}

/// `wal_level`, the held table, the role's grants and `REPLICATION`, the slot and publication.
async fn wal_prerequisites(
    config: &Config,
    table: &OutboxTable,
    held: &PostgresStore,
) -> Result<String, Error> {
    txoutbox_postgres::wal::preflight(held.pool(), held.table()).await?;
    let slot = config.wal.slot(table)?;
    let name = slot.slot().to_string();
    // The pool the relay reads the slot with (database.direct_url when set): the replication
    // connection is made from its settings, and opened here as the relay would.
    let session = txoutbox_postgres::pooler::session_pool(
        &config.database,
        held.pool(),
        &[SessionUse::WalSource],
    )
    .await?
    .pool;
    let source = WalStore::new(session, slot, held.clone(), &config.wal)?;
    source.check().await?;
    Ok(format!(
        "wal_level = logical, slot {name} readable over a replication connection, the role may read it and keep the held table {}",
        held.table().qualified()
    ))
}

/// The broker answers, with the configured publisher and its TLS settings.
async fn broker(config: &Config) -> Result<String, Error> {
    let publisher = build_publisher(config).await?;
    match tokio::time::timeout(BROKER_CHECK, publisher.check()).await {
        Ok(Ok(())) => Ok(format!("{} answers", publisher.name())),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "{} did not answer within {}s",
                publisher.name(),
                BROKER_CHECK.as_secs()
            ),
        )),
    }
}
