//! `outbox relay`: builds the store and the publisher, runs the relay with its statistics, the
//! operations endpoint, the automatic cleanup and the NOTIFY listener or the WAL source's reader,
//! until a signal stops it.

use std::sync::Arc;
use std::time::Duration;

use tracing::{error, info, warn};

use txoutbox_core::{CancellationToken, Relay, Store};
use txoutbox_postgres::pooler::session_pool;
use txoutbox_postgres::wal::WalStore;
use txoutbox_postgres::{notify, OutboxTable, PostgresStore, Source};

use super::signals::{watch_signals, Signals};
use super::status::held_back_under;
use super::{build_publisher, store, Failure};
use crate::config::Config;
use crate::metrics::Metrics;

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
    let start = async {
        // Under the WAL source, the polling machinery works on the held table.
        let pg = if wal_source {
            store(&config, config.wal.held_table(&table)?).await?
        } else {
            store(&config, table.clone()).await?
        };
        // Behind a transaction-mode pooler, what needs a session of its own goes to
        // database.direct_url.
        let session = session_pool(&config.database, pg.pool(), &config.database.session_uses())
            .await?
            .pool;
        if wal_source {
            wal_preflight(&config, &pg).await?;
        } else {
            // Back from the WAL source: what it left in its held table goes first.
            txoutbox_postgres::wal::refuse_polling_over_held_events(
                pg.pool(),
                &config.wal.held_table(&table)?,
            )
            .await?;
        }
        // A missing privilege is waited for below, with readiness saying which.
        match pg.check().await {
            Err(e) if !txoutbox_postgres::is_missing_grant(&e) => return Err(e.into()),
            _ => {}
        }
        let publisher = build_publisher(&config).await?;
        refuse_unreachable_as_configured(publisher.as_ref()).await?;
        Ok::<_, Failure>((pg, session, publisher))
    };
    let (pg, session, publisher) = tokio::select! {
        started = start => started?,
        _ = shutdown.cancelled() => {
            info!("shutdown requested while starting; nothing was claimed");
            return Ok(());
        }
    };
    let wake = txoutbox_core::Wake::new();
    let wal = if wal_source {
        let slot = config.wal.slot(&table)?;
        Some(
            WalStore::new(session.clone(), slot, pg.clone(), &config.wal)?
                .with_wake(wake.clone())
                .with_held_poll_interval(config.relay.poll_interval),
        )
    } else {
        None
    };
    let store: Arc<dyn Store> = match &wal {
        Some(w) => Arc::new(w.clone()),
        None => Arc::new(pg.clone()),
    };
    let liveness = Arc::new(crate::health::Liveness::new(config.liveness_timeout()));
    let metrics =
        Arc::new(Metrics::new(config.http.max_event_type_labels).with_liveness(liveness.clone()));
    let relay = Relay::new(store.clone(), publisher.clone(), config.relay.clone())?
        .with_observer(metrics.clone())
        .with_wake(wake);
    let reader = wal.as_ref().map(|w| {
        tokio::spawn(watch_wal(
            w.clone(),
            metrics.clone(),
            config.wal.retained_wal_warning,
            config.http.stats_interval,
            shutdown.clone(),
        ));
        w.start()
    });
    {
        let (store, metrics, shutdown) = (store.clone(), metrics.clone(), shutdown.clone());
        let every = config.http.stats_interval;
        let ordering = config.relay.ordering;
        tokio::spawn(async move {
            loop {
                metrics.stats_refreshing();
                match store.stats().await {
                    Ok(s) => metrics.record_stats(&held_back_under(ordering, s)),
                    Err(e) => {
                        metrics.stats_failed();
                        warn!(error = %e, "cannot count the outbox for metrics");
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = shutdown.cancelled() => return,
                }
            }
        });
    }
    let server = if config.http.enabled {
        let ops = crate::http::Ops {
            metrics: metrics.clone(),
            liveness: liveness.clone(),
            readiness: crate::health::Readiness::new(
                store.clone(),
                publisher.clone(),
                config.http.ready_timeout,
            ),
        };
        let serve = crate::http::serve(config.http.listen, ops, shutdown.clone()).await?;
        info!(listen = %config.http.listen, "serving /metrics, /healthz and /readyz");
        Some(tokio::spawn(serve))
    } else {
        None
    };
    if let (Some(older_than), true) = (
        config.database.keep_processed_for,
        config.database.auto_cleanup,
    ) {
        let schedule = crate::cleanup::CleanupSchedule {
            older_than,
            interval: config.database.cleanup_interval,
            batch_size: config.database.cleanup_batch_size,
        };
        tokio::spawn(crate::cleanup::run(
            pg.clone(),
            schedule,
            metrics.clone(),
            shutdown.clone(),
        ));
    }
    // Under the WAL source, the slot's stream brings the events: no NOTIFY listener.
    if config.database.notify && wal.is_none() {
        let wake = relay.wake_handle();
        let (pool, table, shutdown) = (session.clone(), table.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = notify::listen(&pool, &table, wake, shutdown).await {
                warn!(error = %e, "LISTEN/NOTIFY unavailable; relying on polling");
            }
        });
    }
    info!(
        table = %table.qualified(),
        publisher = publisher.name(),
        version = crate::build_info::VERSION,
        commit = crate::build_info::COMMIT,
        adapters = crate::build_info::ADAPTERS,
        "relay running; SIGTERM or Ctrl-C stops it"
    );
    // The relay logs its own summary when it stops.
    if wait_for_grants(store.as_ref(), &liveness, &shutdown).await {
        relay.run(shutdown.clone()).await;
    }
    shutdown.cancel();
    if let Some(reader) = reader {
        // Settled batches are confirmed before the slot is let go.
        reader.stop().await;
    }
    if let Some(server) = server {
        let _ = server.await;
    }
    Ok(())
}

/// How often a relay whose role lacks a privilege looks again.
const GRANT_RETRY: Duration = Duration::from_secs(5);

/// Waits while the role lacks a privilege the relay needs (readiness names it, and the log, once
/// per change): claiming without it would publish events the relay cannot then mark, again and
/// again. Each look counts as progress for liveness (a restart would not grant it). False when
/// stopped meanwhile.
async fn wait_for_grants(
    store: &dyn Store,
    liveness: &crate::health::Liveness,
    shutdown: &CancellationToken,
) -> bool {
    let mut logged: Option<String> = None;
    loop {
        let checked = tokio::select! {
            r = store.check() => r,
            _ = shutdown.cancelled() => return false,
        };
        match checked {
            Err(e) if txoutbox_postgres::is_missing_grant(&e) => {
                liveness.progressed();
                let text = e.to_string();
                if logged.as_deref() != Some(text.as_str()) {
                    error!(error = %e, retry_s = GRANT_RETRY.as_secs(), "the relay's role lacks a privilege it needs: nothing is claimed until it is granted (looked at again every retry_s)");
                    logged = Some(text);
                }
            }
            _ => {
                if logged.is_some() {
                    info!("the relay's role has the privileges it needs: claiming");
                }
                return true;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(GRANT_RETRY) => {}
            _ = shutdown.cancelled() => return false,
        }
    }
}

/// Before the WAL source starts: the server can decode, the held table is there.
async fn wal_preflight(config: &Config, held: &PostgresStore) -> Result<(), Failure> {
    config.wal.validate()?;
    Ok(txoutbox_postgres::wal::preflight(held.pool(), held.table()).await?)
}

/// The WAL source's gauges, refreshed every `every`; a loud warning while the slot keeps more
/// WAL than `warning` bytes.
async fn watch_wal(
    wal: WalStore,
    metrics: Arc<Metrics>,
    warning: u64,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut warned_missing = false;
    loop {
        let progress = wal.progress();
        let positions = match wal.slot().positions(wal.held().pool()).await {
            Ok(Some(p)) => {
                warned_missing = false;
                if p.retains_too_much(warning) {
                    warn!(
                        slot = wal.slot().slot(),
                        retained_bytes = p.retained_bytes,
                        wal_status = p.wal_status.as_deref(),
                        limit = warning,
                        "the slot keeps more WAL than wal.retained_wal_warning (or is losing WAL): the relay is not keeping up, or the slot is not read; the database's disk fills until it is"
                    );
                }
                Some(p)
            }
            Ok(None) => {
                if !warned_missing {
                    error!(
                        slot = wal.slot().slot(),
                        "the replication slot does not exist: the reading relay publishes the outbox table's rows meanwhile and, with wal.auto_recreate, makes it again (else run `outbox wal setup`); table-less events committed while it is missing are not read"
                    );
                    warned_missing = true;
                }
                None
            }
            Err(e) => {
                warn!(error = %e, "cannot read the slot's positions for metrics");
                None
            }
        };
        metrics.record_wal(&progress, positions.as_ref(), warning);
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
