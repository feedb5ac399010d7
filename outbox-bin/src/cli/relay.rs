//! `outbox relay`: builds the store and the publisher, runs the relay with its statistics, the
//! operations endpoint, the automatic cleanup and the NOTIFY listener or the WAL source's reader,
//! until a signal stops it.

use tracing::{info, warn};

use std::sync::Arc;

use txoutbox_core::{CancellationToken, Publisher, Store};
use txoutbox_postgres::ops::{serve, RelayService};
use txoutbox_postgres::pooler::session_pool;
use txoutbox_postgres::wal::WalStore;
use txoutbox_postgres::{OutboxTable, PostgresStore, Source};

use super::signals::{watch_signals, Signals};
use super::{build_publisher, store, Failure};
use crate::config::Config;

/// How long the start waits for the broker's first answer.
pub(super) const BROKER_CHECK_AT_START: std::time::Duration = std::time::Duration::from_secs(15);

/// Asks the broker once before the relay claims anything. A broker it can never reach as
/// configured (its certificate refused: a CA not configured, a host name the certificate does not
/// hold) stops the start with the setting to fix; one that is down or slow does not: the relay
/// starts, keeps trying, and readiness says so.
async fn refuse_unreachable_as_configured(
    publisher: &dyn txoutbox_core::Publisher,
) -> Result<(), txoutbox_core::Error> {
    match tokio::time::timeout(BROKER_CHECK_AT_START, publisher.check()).await {
        Ok(Err(e))
            if e.kind() == txoutbox_core::ErrorKind::Config
                || txoutbox_core::tls::is_certificate_error(&e) =>
        {
            Err(e)
        }
        Ok(Err(e)) => {
            warn!(error = %e, "the broker cannot be reached yet; the relay starts and keeps trying");
            Ok(())
        }
        Ok(Ok(())) | Err(_) => Ok(()),
    }
}

pub(super) async fn cmd_relay(config: Config, table: OutboxTable) -> Result<(), Failure> {
    config.check_relay_pool()?;
    // Signals are watched from the start: SIGTERM while connecting is a clean exit too.
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(Signals::install(), shutdown.clone()));
    let wal_source = config.database.source == Source::Wal;
    let (pg, session, publisher) = tokio::select! {
        started = start(&config, &table, wal_source) => started?,
        _ = shutdown.cancelled() => {
            info!("shutdown requested while starting; nothing was claimed");
            return Ok(());
        }
    };
    let service = service_of(&config, &table, wal_source, pg, session, publisher.clone())?;
    let server = if config.http.enabled {
        let serve = serve(config.http.listen, service.ops(), shutdown.clone())
            .await
            .map_err(|e| {
                txoutbox_core::Error::config(format!(
                    "http.listen = {}: {}, or set http.enabled = false",
                    config.http.listen,
                    e.message()
                ))
            })?;
        info!(listen = %config.http.listen, "serving /metrics, /healthz and /readyz");
        Some(tokio::spawn(serve))
    } else {
        None
    };
    info!(
        table = %table.qualified(),
        publisher = publisher.name(),
        version = crate::build_info::VERSION,
        commit = crate::build_info::COMMIT,
        adapters = crate::build_info::ADAPTERS,
        "relay running; SIGTERM or Ctrl-C stops it"
    );
    service.run(shutdown.clone()).await;
    shutdown.cancel();
    if let Some(server) = server {
        let _ = server.await;
    }
    Ok(())
}

/// What the relay starts from: the store (the outbox table's, or the held table's under the WAL
/// source), the pool of the sessions of its own, and the publisher, each checked.
async fn start(
    config: &Config,
    table: &OutboxTable,
    wal_source: bool,
) -> Result<(PostgresStore, sqlx::PgPool, Arc<dyn Publisher>), Failure> {
    // Under the WAL source, the polling machinery works on the held table.
    let pg = if wal_source {
        store(config, config.wal.held_table(table)?).await?
    } else {
        store(config, table.clone()).await?
    };
    // Behind a transaction-mode pooler, what needs a session of its own goes to
    // database.direct_url.
    let session = session_pool(&config.database, pg.pool(), &config.database.session_uses())
        .await?
        .pool;
    if wal_source {
        wal_preflight(config, &pg).await?;
    } else {
        // Back from the WAL source: what it left in its held table goes first.
        txoutbox_postgres::wal::refuse_polling_over_held_events(
            pg.pool(),
            &config.wal.held_table(table)?,
        )
        .await?;
    }
    // A missing privilege is waited for below, with readiness saying which.
    match pg.check().await {
        Err(e) if !txoutbox_postgres::is_missing_grant(&e) => return Err(e.into()),
        _ => {}
    }
    let publisher = build_publisher(config).await?;
    refuse_unreachable_as_configured(publisher.as_ref()).await?;
    Ok((pg, session, publisher))
}

/// The relay of the configured source, with its operations side.
fn service_of(
    config: &Config,
    table: &OutboxTable,
    wal_source: bool,
    pg: PostgresStore,
    session: sqlx::PgPool,
    publisher: Arc<dyn Publisher>,
) -> Result<RelayService, Failure> {
    let ops = config.ops();
    if wal_source {
        let slot = config.wal.slot(table)?;
        let wal = WalStore::new(session, slot, pg, &config.wal)?;
        return Ok(RelayService::wal(
            wal,
            publisher,
            config.relay.clone(),
            ops,
        )?);
    }
    let service = RelayService::polling(pg, publisher, config.relay.clone(), ops)?;
    Ok(if config.database.notify {
        service.with_notify(session)?
    } else {
        service
    })
}

/// Before the WAL source starts: the server can decode, the held table is there.
async fn wal_preflight(config: &Config, held: &PostgresStore) -> Result<(), Failure> {
    config.wal.validate()?;
    Ok(txoutbox_postgres::wal::preflight(held.pool(), held.table()).await?)
}
