//! A relay with what operators rely on, for a service to run in its own process: the relay engine
//! with Prometheus metrics, `/healthz` and `/readyz`, the outbox's statistics gauges, automatic
//! cleanup, and (under the WAL source) the slot's reader and gauges. The `outbox` binary runs its
//! relay through this same API, so a composed relay exports the same families, with the same
//! labels, as the shipped alert rules and dashboard read.
//!
//! Needs the `ops` feature (`txoutbox-postgres = { version = "...", features = ["ops"] }`).
//!
//! ```no_run
//! # async fn demo(publisher: std::sync::Arc<dyn txoutbox_core::Publisher>) -> Result<(), txoutbox_core::Error> {
//! use txoutbox_core::{CancellationToken, RelayConfig};
//! use txoutbox_postgres::ops::{OpsConfig, RelayService};
//! use txoutbox_postgres::{connect, OutboxTable, PostgresStore};
//!
//! let relay = RelayConfig::default();
//! // A pool of the relay's own, as large as it needs (keepalives are set on every connection).
//! let pool = connect("postgres://postgres@127.0.0.1:5432/test", RelayService::connections_needed(&relay, &OpsConfig::default())).await?;
//! let store = PostgresStore::new(pool, OutboxTable::default());
//! let service = RelayService::polling(store, publisher, relay, OpsConfig::default())?;
//! // Merge `/metrics`, `/healthz` and `/readyz` into the service's own router.
//! let app = axum::Router::new().merge(service.router());
//! # let _ = app;
//! let shutdown = CancellationToken::new();
//! // Runs until `shutdown` is cancelled (on SIGTERM, say); batches in flight are settled first.
//! let summary = service.run(shutdown.clone()).await;
//! # let _ = summary;
//! # Ok(()) }
//! ```

pub mod cleanup;
pub mod health;
pub mod http;
pub mod metrics;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tracing::{error, info, warn};

use txoutbox_core::{
    CancellationToken, Error, ErrorKind, Publisher, Relay, RelayConfig, RelaySummary, Store, Wake,
};

use crate::wal::WalStore;
use crate::{OutboxTable, PostgresStore};

pub use cleanup::CleanupSchedule;
pub use health::{Liveness, Readiness};
pub use http::{router, serve, Ops};
pub use metrics::{BuildInfo, CleanupOutcome, Metrics, DEFAULT_MAX_EVENT_TYPE_LABELS};
/// The Prometheus client the metrics are made with, for metrics of the service's own
/// ([`Metrics::register`]).
pub use prometheus_client;

/// The operations side of a [`RelayService`]. The defaults are the `outbox` binary's.
#[derive(Debug, Clone)]
pub struct OpsConfig {
    /// How often the outbox's statistics (the pending, dead-letter and held-back gauges) and the
    /// WAL gauges are refreshed. Default 5 s (the binary's `http.stats_interval`).
    pub stats_interval: Duration,
    /// How long a probe of `/readyz` waits for the checks. Default 2 s (`http.ready_timeout`).
    pub ready_timeout: Duration,
    /// `/healthz` fails after this long without progress while work is due. Default (`None`): 5
    /// minutes, or the relay's hold time plus a minute when that is longer
    /// (`http.liveness_timeout`).
    pub liveness_timeout: Option<Duration>,
    /// The most distinct `event_type` label values per metric (`http.max_event_type_labels`).
    pub max_event_type_labels: usize,
    /// Automatic cleanup of published rows kept by [`Retention::Keep`](crate::Retention::Keep)
    /// (`database.keep_processed_for`). Default `None`: off.
    pub cleanup: Option<CleanupSchedule>,
    /// What `outbox_build_info` says. Default: this library's version; set the service's own.
    pub build: BuildInfo,
}

impl Default for OpsConfig {
    fn default() -> Self {
        OpsConfig {
            stats_interval: Duration::from_secs(5),
            ready_timeout: Duration::from_secs(2),
            liveness_timeout: None,
            max_event_type_labels: DEFAULT_MAX_EVENT_TYPE_LABELS,
            cleanup: None,
            build: BuildInfo::default(),
        }
    }
}

impl OpsConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// A configuration error naming the setting: a zero statistics interval or readiness timeout
    /// (a query loop, a probe that never waits), a zero cleanup interval or batch size.
    pub fn validate(&self) -> Result<(), Error> {
        let zero = |what: &str, fix: &str| {
            Err(Error::new(ErrorKind::Config, format!("{what} is 0: {fix}")))
        };
        if self.stats_interval.is_zero() {
            return zero(
                "OpsConfig::stats_interval",
                "the statistics would be queried without pause; 5 s is the default",
            );
        }
        if self.ready_timeout.is_zero() {
            return zero(
                "OpsConfig::ready_timeout",
                "a readiness probe would never wait for its checks; 2 s is the default",
            );
        }
        if let Some(cleanup) = &self.cleanup {
            if cleanup.interval.is_zero() {
                return zero(
                    "CleanupSchedule::interval",
                    "the cleanup would run without pause; see CleanupSchedule::keeping",
                );
            }
            if cleanup.batch_size == 0 {
                return zero(
                    "CleanupSchedule::batch_size",
                    "the cleanup would remove nothing; 1000 is the default",
                );
            }
        }
        Ok(())
    }

    /// The liveness timeout in force for `relay` (see [`OpsConfig::liveness_timeout`]).
    pub fn liveness_timeout_for(&self, relay: &RelayConfig) -> Duration {
        self.liveness_timeout.unwrap_or_else(|| {
            Duration::from_secs(300).max(relay.hold_for().saturating_add(Duration::from_secs(60)))
        })
    }
}

/// Where the service's events come from.
#[derive(Clone)]
enum Source {
    /// The outbox table, polled (and woken by NOTIFY when `listener` is set).
    Polling {
        table: OutboxTable,
        /// The pool the NOTIFY listener takes its connection from.
        listener: Option<PgPool>,
    },
    /// A replication slot's stream.
    Wal(WalStore),
}

/// A relay with its metrics, health, statistics, cleanup and source tasks; see the [module](self).
pub struct RelayService {
    relay: Relay,
    /// The store the relay claims from (the WAL source, or `pg`).
    store: Arc<dyn Store>,
    /// The PostgreSQL store: the outbox table, or the WAL source's held table.
    pg: PostgresStore,
    publisher: Arc<dyn Publisher>,
    source: Source,
    config: OpsConfig,
    metrics: Arc<Metrics>,
    liveness: Arc<Liveness>,
    readiness: Arc<Readiness>,
}

impl std::fmt::Debug for RelayService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayService")
            .field("table", &self.pg.table().qualified())
            .field("publisher", &self.publisher.name())
            .finish_non_exhaustive()
    }
}

impl RelayService {
    /// The connections the store's pool must hold so that nothing waits for one: one per batch in
    /// flight (its claim stays open while the batch is published and settled), one for the
    /// statistics, one for the readiness check, and one for the automatic cleanup when
    /// `ops.cleanup` is set. A NOTIFY listener on the same pool takes one more.
    pub fn connections_needed(relay: &RelayConfig, ops: &OpsConfig) -> u32 {
        u32::try_from(relay.max_in_flight)
            .unwrap_or(u32::MAX)
            .saturating_add(2)
            .saturating_add(u32::from(ops.cleanup.is_some()))
    }

    /// A relay that polls `store`'s table and publishes through `publisher`.
    ///
    /// The store sets the TCP keepalives and user timeout the lease's release time depends on, on
    /// every claim, whatever pool it was given (see `GUARANTEES.md`, "The lease lasts the
    /// publish"; behind a pooler they guard the pooler's connection, and the pooler's own settings
    /// the relay's).
    ///
    /// # Errors
    /// A configuration error when `relay` is not valid for `publisher`, or when the store's pool
    /// holds fewer connections than [`RelayService::connections_needed`] (claims would wait for a
    /// connection while their leases age).
    pub fn polling(
        store: PostgresStore,
        publisher: Arc<dyn Publisher>,
        relay: RelayConfig,
        ops: OpsConfig,
    ) -> Result<Self, Error> {
        let source = Source::Polling {
            table: store.table().clone(),
            listener: None,
        };
        let shared: Arc<dyn Store> = Arc::new(store.clone());
        Self::build(shared, store, source, publisher, relay, ops, Wake::new())
    }

    /// A relay that reads the outbox table's events from `wal`'s replication slot (see
    /// [`crate::wal`]); the reader starts with [`RelayService::run`] and is stopped (its settled
    /// events confirmed) when the relay stops. The store's wake becomes the service's relay's, and
    /// its held table is looked at every `relay.poll_interval`.
    ///
    /// # Errors
    /// As [`RelayService::polling`], for the held table's pool.
    pub fn wal(
        wal: WalStore,
        publisher: Arc<dyn Publisher>,
        relay: RelayConfig,
        ops: OpsConfig,
    ) -> Result<Self, Error> {
        let wake = Wake::new();
        let wal = wal
            .with_wake(wake.clone())
            .with_held_poll_interval(relay.poll_interval);
        let shared: Arc<dyn Store> = Arc::new(wal.clone());
        let pg = wal.held().clone();
        Self::build(shared, pg, Source::Wal(wal), publisher, relay, ops, wake)
    }

    fn build(
        store: Arc<dyn Store>,
        pg: PostgresStore,
        source: Source,
        publisher: Arc<dyn Publisher>,
        relay: RelayConfig,
        mut ops: OpsConfig,
        wake: Wake,
    ) -> Result<Self, Error> {
        ops.validate()?;
        let needed = Self::connections_needed(&relay, &ops);
        let has = pg.pool().options().get_max_connections();
        if has < needed {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "the store's pool holds {has} connections, fewer than the relay uses at once: max_in_flight = {} (one per batch in flight) + 1 (statistics) + 1 (readiness){} = {needed}; \
                     open the pool with at least {needed} (txoutbox_postgres::connect(url, RelayService::connections_needed(..))), or lower max_in_flight",
                    relay.max_in_flight,
                    if ops.cleanup.is_some() { " + 1 (automatic cleanup)" } else { "" },
                ),
            ));
        }
        if ops.max_event_type_labels == 0 {
            ops.max_event_type_labels = DEFAULT_MAX_EVENT_TYPE_LABELS;
        }
        let liveness = Arc::new(Liveness::new(ops.liveness_timeout_for(&relay)));
        let metrics = Metrics::new(ops.max_event_type_labels).with_liveness(liveness.clone());
        metrics.set_build(&ops.build);
        let metrics = Arc::new(metrics);
        let readiness = Readiness::new(store.clone(), publisher.clone(), ops.ready_timeout);
        let relay = Relay::new(store.clone(), publisher.clone(), relay)?
            .with_observer(metrics.clone())
            .with_wake(wake);
        Ok(RelayService {
            relay,
            store,
            pg,
            publisher,
            source,
            config: ops,
            metrics,
            liveness,
            readiness,
        })
    }

    /// Wakes the relay on every NOTIFY of the outbox table's writers (see [`crate::notify`]),
    /// taking one connection of `pool` for as long as the relay runs. Ignored under the WAL source,
    /// whose stream brings the events.
    ///
    /// # Errors
    /// A configuration error when `pool` is the store's own and holds fewer than
    /// [`RelayService::connections_needed`] + 1 connections (the listener's).
    pub fn with_notify(mut self, pool: PgPool) -> Result<Self, Error> {
        if let Source::Polling { listener, .. } = &mut self.source {
            // Clones of one pool share its options.
            if std::ptr::eq(pool.options(), self.pg.pool().options()) {
                let needed =
                    Self::connections_needed(self.relay.config(), &self.config).saturating_add(1);
                let has = pool.options().get_max_connections();
                if has < needed {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "the store's pool holds {has} connections, fewer than the relay uses at once with its NOTIFY listener on the same pool ({needed}); \
                             open it with at least {needed}, or give the listener a pool of its own"
                        ),
                    ));
                }
            }
            listener.replace(pool);
        }
        Ok(self)
    }

    /// What `/metrics`, `/healthz` and `/readyz` answer from.
    pub fn ops(&self) -> Ops {
        Ops {
            metrics: self.metrics.clone(),
            liveness: self.liveness.clone(),
            readiness: self.readiness.clone(),
        }
    }

    /// The axum router of `/metrics`, `/healthz` and `/readyz`, to merge into the service's own
    /// (or to nest under a prefix, `Router::nest("/relay", ..)`, when the service has paths of
    /// those names already).
    pub fn router(&self) -> axum::Router {
        router(self.ops())
    }

    /// The metrics: to render elsewhere, or to register metrics of the service's own
    /// ([`Metrics::register`]) on the same `/metrics`.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The relay's wake: give it to the [`Writer`](crate::Writer) of the same process
    /// ([`Writer::with_wake`](crate::Writer::with_wake)) so an event committed here is claimed at
    /// once instead of at the next poll.
    pub fn wake_handle(&self) -> Wake {
        self.relay.wake_handle()
    }

    /// The store the relay claims from (the outbox table's, or the WAL source).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The publisher.
    pub fn publisher(&self) -> &Arc<dyn Publisher> {
        &self.publisher
    }

    /// Runs the relay and its tasks until `shutdown` is cancelled: the statistics refresh, the
    /// automatic cleanup, the NOTIFY listener or the WAL reader (and its gauges). Claims wait
    /// while the role lacks a privilege the relay needs (readiness names it). On shutdown the
    /// batches in flight are settled, the WAL reader confirms what is settled, and the tasks end.
    pub async fn run(self, shutdown: CancellationToken) -> RelaySummary {
        let stop_tasks = shutdown.child_token();
        // However `run` ends (its future dropped included), the tasks are told to stop.
        let _stop_tasks_on_drop = stop_tasks.clone().drop_guard();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(refresh_stats(
            self.store.clone(),
            self.metrics.clone(),
            self.config.stats_interval,
            self.relay.config().ordering,
            stop_tasks.clone(),
        ));
        if let Some(schedule) = self.config.cleanup {
            tasks.spawn(cleanup::run(
                self.pg.clone(),
                schedule,
                self.metrics.clone(),
                stop_tasks.clone(),
            ));
        }
        // Dropped with `run`'s future, the reader's handle stops it too.
        let reader = match &self.source {
            Source::Wal(wal) => {
                tasks.spawn(watch_wal(
                    wal.clone(),
                    self.metrics.clone(),
                    self.config.stats_interval,
                    stop_tasks.clone(),
                ));
                Some(wal.start())
            }
            Source::Polling {
                table,
                listener: Some(pool),
            } => {
                let (wake, pool, table, stop) = (
                    self.relay.wake_handle(),
                    pool.clone(),
                    table.clone(),
                    stop_tasks.clone(),
                );
                tasks.spawn(async move {
                    if let Err(e) = crate::notify::listen(&pool, &table, wake, stop).await {
                        warn!(error = %e, "LISTEN/NOTIFY unavailable; relying on polling");
                    }
                });
                None
            }
            Source::Polling { listener: None, .. } => None,
        };
        // The relay logs its own summary when it stops.
        let summary = if wait_for_grants(self.store.as_ref(), &self.liveness, &shutdown).await {
            self.relay.run(shutdown.clone()).await
        } else {
            RelaySummary::default()
        };
        stop_tasks.cancel();
        if let Some(reader) = reader {
            // Settled batches are confirmed before the slot is let go.
            reader.stop().await;
        }
        // A cleanup batch or a statistics query in flight ends before `run` returns.
        while tasks.join_next().await.is_some() {}
        summary
    }
}

/// Refreshes the statistics gauges every `every` until `stop`.
async fn refresh_stats(
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    every: Duration,
    ordering: txoutbox_core::OrderingPolicy,
    stop: CancellationToken,
) {
    loop {
        metrics.stats_refreshing();
        let refreshed = tokio::select! {
            r = store.stats() => r,
            _ = stop.cancelled() => return,
        };
        match refreshed {
            Ok(s) => metrics.record_stats(&s.under(ordering)),
            Err(e) => {
                metrics.stats_failed();
                warn!(error = %e, "cannot count the outbox for metrics");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// How often a relay whose role lacks a privilege looks again.
const GRANT_RETRY: Duration = Duration::from_secs(5);

/// Waits while the role lacks a privilege the relay needs (readiness names it, and the log, once
/// per change): claiming without it would publish events the relay cannot then mark, again and
/// again. Each look counts as progress for liveness (a restart would not grant it). False when
/// stopped meanwhile.
async fn wait_for_grants(
    store: &dyn Store,
    liveness: &Liveness,
    shutdown: &CancellationToken,
) -> bool {
    let mut logged: Option<String> = None;
    loop {
        let checked = tokio::select! {
            r = store.check() => r,
            _ = shutdown.cancelled() => return false,
        };
        match checked {
            Err(e) if crate::is_missing_grant(&e) => {
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

/// The WAL source's gauges, refreshed every `every`; a loud warning while the slot keeps more
/// WAL than `wal.retained_wal_warning` bytes.
async fn watch_wal(
    wal: WalStore,
    metrics: Arc<Metrics>,
    every: Duration,
    shutdown: CancellationToken,
) {
    let warning = wal.retained_wal_warning();
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
