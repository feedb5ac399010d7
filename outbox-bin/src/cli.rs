//! The command line: parsing, and one function per subcommand.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use tracing::{error, info, warn};

use outbox_core::{
    CancellationToken, Error, ErrorKind, NewEvent, Publisher, Relay, Store, StoreStats,
};
use outbox_postgres::wal::{check_wal_level, wal_level, WalStore};
use outbox_postgres::{
    connect_config, migrate, notify, schema_sql, DeadLetterFilter, OutboxTable, PostgresStore,
    Source,
};

use crate::config::{Config, LogFormat};
use crate::metrics::Metrics;

const ABOUT: &str = "Transactional outbox relay for PostgreSQL: publishes the events your services \
write in their own transactions to Kafka, RabbitMQ or SQS, at least once and in per-aggregate order.";

const AFTER_HELP: &str = "Configuration: a TOML file (--config, or ./outbox.toml when present), then \
environment overrides OUTBOX_<SECTION>__<KEY> (e.g. OUTBOX_RELAY__BATCH_SIZE=1000) and DATABASE_URL. \
With no file at all the relay uses the local PostgreSQL and prints events as JSON lines.

Typical first run:
  outbox migrate        # create the outbox table (idempotent)
  outbox relay          # publish until SIGTERM / Ctrl-C
  outbox status         # what is pending, how old, what is dead

Exit codes: 0 success, 1 runtime failure, 2 usage or configuration error.";

/// `outbox`: the command line.
#[derive(Debug, Parser)]
#[command(name = "outbox", version, about = ABOUT, after_help = AFTER_HELP)]
pub struct Cli {
    /// Configuration file (TOML). Default: ./outbox.toml when it exists, else built-in defaults.
    #[arg(long, short, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the outbox schema (idempotent; safe to run from several processes).
    Migrate {
        /// Print the SQL instead of applying it (for other migration tools).
        #[arg(long)]
        print: bool,
    },
    /// Run the relay until SIGTERM or SIGINT, then finish in-flight batches within
    /// relay.shutdown_timeout. Several relays on one database share the work and keep
    /// per-aggregate order.
    Relay,
    /// Ask the running relay's /healthz (at http.listen, loopback when it listens on every
    /// address): exit 0 when it answers 200, 1 otherwise. For container health checks (the image
    /// has no curl).
    Healthcheck {
        /// Another endpoint than the configured one (host:port, such as localhost:9464).
        #[arg(long, value_name = "HOST:PORT")]
        addr: Option<String>,
        /// How long to wait for the answer.
        #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = outbox_core::duration::parse)]
        timeout: Duration,
    },
    /// Show pending events, the oldest pending age and dead letters, by event type.
    Status {
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// List, retry or discard dead letters.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLetterCommand),
    /// The WAL source's replication slot and publication: create, show (lag, retained WAL), drop.
    #[command(subcommand)]
    Wal(WalCommand),
    /// Remove published rows older than a duration, in bounded batches (when rows are kept with
    /// database.keep_processed_for).
    Cleanup {
        /// Remove rows published longer ago than this (e.g. 7d, 12h). Default: database.keep_processed_for.
        #[arg(long, value_name = "DURATION", value_parser = outbox_core::duration::parse)]
        older_than: Option<Duration>,
        /// Rows per delete statement. Default: database.cleanup_batch_size.
        #[arg(long)]
        batch_size: Option<i64>,
    },
    /// Send one synthetic event through the configured publisher, to check connectivity, routing and
    /// permissions. Nothing is written to the outbox.
    PublishTest {
        /// Event type of the test event (it routes like real events of that type).
        #[arg(long, default_value = "outbox.publish_test")]
        event_type: String,
        /// Aggregate type of the test event.
        #[arg(long, default_value = "outbox")]
        aggregate_type: String,
        /// Destination (topic / exchange / queue) overriding the routing.
        #[arg(long)]
        destination: Option<String>,
    },
    /// Print the configuration in force (defaults, file and environment merged; secrets redacted).
    Config,
    /// Measure the writer, the relay and the database on this machine, against the configured
    /// database and broker, in a schema of its own (outbox_bench, dropped at the end); prints a table
    /// (or JSON) of throughputs, latencies, ratios and the relay's peak memory. Build with --release.
    Bench(crate::bench::BenchArgs),
}

/// Which dead letters: one of --id, --event-type, --aggregate-type (with --aggregate-id or not),
/// --all.
#[derive(Debug, Args)]
pub struct Selection {
    /// These event ids (repeatable).
    #[arg(long = "id", value_name = "UUID")]
    pub ids: Vec<uuid::Uuid>,
    /// Every dead letter of this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Every dead letter of this aggregate type (with --aggregate-id, of that aggregate only).
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// With --aggregate-type: the aggregate's id.
    #[arg(long, requires = "aggregate_type")]
    pub aggregate_id: Option<String>,
    /// Every dead letter.
    #[arg(long)]
    pub all: bool,
}

/// `wal` subcommands.
#[derive(Debug, Subcommand)]
pub enum WalCommand {
    /// Create the publication (the outbox table's inserts) and the logical replication slot, each
    /// unless it exists (needs wal_level = logical).
    Setup,
    /// Show the slot: whether it exists and is read, its lag (bytes, and seconds since the oldest
    /// transaction it holds committed) and the WAL it keeps on disk; warns above
    /// wal.retained_wal_warning.
    Status {
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot and the publication (stop the relays reading it first). WAL the slot kept is
    /// released; events it held that were not published are not published by it any more.
    Drop {
        /// Confirm.
        #[arg(long)]
        yes: bool,
    },
}

/// `dead-letters` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first (all of them unless --id, --event-type or --aggregate-type
    /// narrows, or --older-than).
    List {
        /// Which ones.
        #[command(flatten)]
        selection: Selection,
        /// Only those dead-lettered longer ago than this (e.g. 1h, 2d).
        #[arg(long, value_name = "DURATION", value_parser = outbox_core::duration::parse)]
        older_than: Option<Duration>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print one dead letter whole: payload, headers, destination, error, and how many events of its
    /// aggregate wait behind its first dead letter.
    Show {
        /// The dead letter's event id.
        #[arg(long)]
        id: uuid::Uuid,
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make dead letters pending again (attempts reset, last error kept).
    Retry {
        /// Which ones (one of --id, --event-type, --aggregate-type, --all).
        #[command(flatten)]
        selection: Selection,
        /// Confirm --all.
        #[arg(long)]
        yes: bool,
    },
    /// Delete dead letters for good.
    Discard {
        /// Which ones (one of --id, --event-type, --aggregate-type, --all).
        #[command(flatten)]
        selection: Selection,
        /// Confirm --all.
        #[arg(long)]
        yes: bool,
    },
}

/// A failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    /// 1 runtime, 2 usage or configuration.
    pub code: u8,
    /// What to print.
    pub message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        // Configuration errors are the ones the configuration's checks find (a bad value, a publisher
        // not built in); what the servers report at run time, a missing table included
        // (`ErrorKind::Schema`), is a runtime failure.
        let code = if e.kind() == ErrorKind::Config { 2 } else { 1 };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

fn usage(message: impl Into<String>) -> Failure {
    Failure {
        code: 2,
        message: message.into(),
    }
}

/// Runs the parsed command; returns the process exit code.
pub fn run(cli: Cli, env: Vec<(String, String)>) -> ExitCode {
    // The benchmark's progress lines are its log; the relays it runs log warnings only unless the
    // level is set explicitly.
    // Docker reserves exit code 2 of a health check: every failure of one is 1.
    let usage_code: u8 = if matches!(cli.command, Command::Healthcheck { .. }) {
        1
    } else {
        2
    };
    let quiet = matches!(cli.command, Command::Bench(_))
        && !env
            .iter()
            .any(|(k, _)| k == "RUST_LOG" || k == "OUTBOX_LOG__LEVEL");
    let mut config = match Config::load(cli.config.as_deref(), env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("outbox: configuration error: {}", e.message());
            return ExitCode::from(usage_code);
        }
    };
    if quiet {
        // The bench's own bulk statements (prefills of a million rows) are slow by design.
        config.log.level = "warn,sqlx::query=error".into();
    }
    init_logging(&config);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outbox: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let outcome = runtime.block_on(dispatch(cli.command, config));
    // A blocking write that never returns (stdout into a pipe nobody reads) must not keep the
    // process from exiting: the runtime waits for its blocking threads a moment, not for ever.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("outbox: {}", f.message);
            ExitCode::from(f.code.min(usage_code))
        }
    }
}

fn init_logging(config: &Config) {
    use tracing_subscriber::EnvFilter;
    // The replication library reports every status update at INFO: its errors only, unless the
    // level names it.
    let level = if config.log.level.contains("pg_walstream") {
        config.log.level.clone()
    } else {
        format!("{},pg_walstream=error", config.log.level)
    };
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to standard error: standard output carries command output and stdout-published events.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.with_ansi(false).try_init(),
    };
}

async fn dispatch(command: Command, config: Config) -> Result<(), Failure> {
    let table = config.database.validate()?;
    // Under the WAL source, pending events, dead letters and kept rows are the held table's.
    let kept = match config.database.source {
        Source::Wal => config.wal.held_table(&table)?,
        Source::Polling => table.clone(),
    };
    match command {
        Command::Migrate { print } => cmd_migrate(&config, &table, print).await,
        Command::Relay => cmd_relay(config, table).await,
        Command::Healthcheck { addr, timeout } => cmd_healthcheck(&config, addr, timeout).await,
        Command::Status { json } => cmd_status(&config, kept, json).await,
        Command::DeadLetters(c) => cmd_dead_letters(&config, kept, c).await,
        Command::Cleanup {
            older_than,
            batch_size,
        } => cmd_cleanup(&config, kept, older_than, batch_size).await,
        Command::PublishTest {
            event_type,
            aggregate_type,
            destination,
        } => cmd_publish_test(&config, event_type, aggregate_type, destination).await,
        Command::Wal(c) => cmd_wal(&config, table, c).await,
        Command::Config => {
            print!("{}", config.to_redacted_toml());
            Ok(())
        }
        Command::Bench(args) => cmd_bench(&config, args).await,
    }
}

async fn store(config: &Config, table: OutboxTable) -> Result<PostgresStore, Failure> {
    let pool = connect_config(&config.database).await?;
    Ok(
        PostgresStore::with_retention(pool, table, config.database.retention())
            .with_stats_max_rows(config.database.stats_max_rows),
    )
}

/// Builds the configured publisher.
///
/// # Errors
/// A config error when the publisher's settings do not validate or it is not in this build.
pub async fn build_publisher(config: &Config) -> Result<Arc<dyn Publisher>, Error> {
    config
        .adapter(config.publisher.kind)
        .publisher(config.publisher.formatter()?)
        .await
}

async fn cmd_bench(config: &Config, args: crate::bench::BenchArgs) -> Result<(), Failure> {
    let options = crate::bench::options(config, &args)?;
    let target = crate::bench::target(config, &args, &crate::bench::progress).await?;
    Ok(crate::bench::run(config, &args, &options, target).await?)
}

async fn cmd_migrate(config: &Config, table: &OutboxTable, print: bool) -> Result<(), Failure> {
    if print {
        print!("{}", schema_sql(table));
        if config.database.notify {
            println!("-- database.notify = true: `outbox migrate` also installs a statement trigger calling pg_notify('{}', '')", notify::channel(table)?);
        }
        return Ok(());
    }
    let pool = connect_config(&config.database).await?;
    let applied = migrate(&pool, table).await?;
    if config.database.source == Source::Wal {
        let held = config.wal.held_table(table)?;
        let held_applied = migrate(&pool, &held).await?;
        if !held_applied.is_empty() {
            println!(
                "{} (the WAL source's held table): applied migrations {:?}",
                held.qualified(),
                held_applied
            );
        }
    }
    if config.database.notify {
        notify::install_notify_trigger(&pool, table).await?;
    } else {
        notify::remove_notify_trigger(&pool, table).await?;
    }
    if applied.is_empty() {
        println!("{} is up to date", table.qualified());
    } else {
        println!("{}: applied migrations {:?}", table.qualified(), applied);
    }
    Ok(())
}

async fn cmd_relay(config: Config, table: OutboxTable) -> Result<(), Failure> {
    config.check_relay_pool()?;
    // Signals are watched from the start: SIGTERM while connecting is a clean exit too.
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(Signals::install(), shutdown.clone()));
    let wal_source = config.database.source == Source::Wal;
    let start = async {
        // Under the WAL source, the polling machinery works on the held table.
        let pg = if wal_source {
            let held = config.wal.held_table(&table)?;
            let pg = store(&config, held).await?;
            wal_preflight(&config, &table, &pg).await?;
            pg
        } else {
            store(&config, table.clone()).await?
        };
        pg.check().await?;
        let publisher = build_publisher(&config).await?;
        Ok::<_, Failure>((pg, publisher))
    };
    let (pg, publisher) = tokio::select! {
        started = start => started?,
        _ = shutdown.cancelled() => {
            info!("shutdown requested while starting; nothing was claimed");
            return Ok(());
        }
    };
    let wake = outbox_core::Wake::new();
    let wal = if wal_source {
        let slot = config.wal.slot(&table)?;
        Some(
            WalStore::new(
                pg.pool().clone(),
                &config.database.url,
                slot,
                pg.clone(),
                &config.wal,
            )
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
            liveness,
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
        let (pool, table, shutdown) = (pg.pool().clone(), table.clone(), shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = notify::listen(&pool, &table, wake, shutdown).await {
                warn!(error = %e, "LISTEN/NOTIFY unavailable; relying on polling");
            }
        });
    }
    info!(table = %table.qualified(), publisher = publisher.name(), "relay running; SIGTERM or Ctrl-C stops it");
    // The relay logs its own summary when it stops.
    relay.run(shutdown.clone()).await;
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

/// Before the WAL source starts: the server can decode, the held table is there.
async fn wal_preflight(
    config: &Config,
    table: &OutboxTable,
    held: &PostgresStore,
) -> Result<(), Failure> {
    config.wal.validate()?;
    check_wal_level(&wal_level(held.pool()).await?)?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(held.table().qualified())
        .fetch_one(held.pool())
        .await
        .map_err(|e| outbox_postgres::map_sqlx("wal", e))?;
    if !exists {
        return Err(Error::config(format!(
            "database.source = \"wal\" but the held table {} does not exist: run `outbox wal setup` (it makes the publication, the slot and that table for {})",
            held.table().qualified(),
            table.qualified()
        ))
        .into());
    }
    Ok(())
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
        let mut figures = crate::metrics::WalFigures {
            active: progress.active,
            unsettled: progress.unsettled as u64,
            lag_seconds: progress.lag_seconds,
            retained_warning: warning,
            ..Default::default()
        };
        match wal.slot().positions(wal.held().pool()).await {
            Ok(Some(p)) => {
                warned_missing = false;
                figures.slot_present = true;
                figures.lag_bytes = p.lag_bytes;
                figures.retained_bytes = p.retained_bytes;
                if p.retains_too_much(warning) {
                    warn!(
                        slot = wal.slot().slot(),
                        retained_bytes = p.retained_bytes,
                        wal_status = p.wal_status.as_deref(),
                        limit = warning,
                        "the slot keeps more WAL than wal.retained_wal_warning (or is losing WAL): the relay is not keeping up, or the slot is not read; the database's disk fills until it is"
                    );
                }
            }
            Ok(None) => {
                if !warned_missing {
                    error!(
                        slot = wal.slot().slot(),
                        "the replication slot does not exist: run `outbox wal setup`; events committed while it is missing are not read"
                    );
                    warned_missing = true;
                }
            }
            Err(e) => warn!(error = %e, "cannot read the slot's positions for metrics"),
        }
        metrics.record_wal(&figures);
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// SIGTERM and SIGINT, caught from the moment [`Signals::install`] returns.
struct Signals {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let streams = match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(term), Ok(int)) => Some((term, int)),
                _ => {
                    error!("cannot install signal handlers");
                    None
                }
            };
            Signals { streams }
        }
        #[cfg(not(unix))]
        {
            Signals {}
        }
    }

    /// The next signal's name; never returns when the handlers could not be installed.
    async fn recv(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            match &mut self.streams {
                Some((term, int)) => tokio::select! {
                    _ = term.recv() => "SIGTERM",
                    _ = int.recv() => "SIGINT",
                },
                None => std::future::pending().await,
            }
        }
        #[cfg(not(unix))]
        {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "Ctrl-C",
                Err(_) => std::future::pending().await,
            }
        }
    }
}

async fn watch_signals(mut signals: Signals, shutdown: CancellationToken) {
    let name = signals.recv().await;
    info!(
        signal = name,
        "shutdown requested: no new claims; finishing in-flight batches"
    );
    shutdown.cancel();
}

/// `stats` as the relay's ordering sees them: without per-aggregate order a dead letter holds
/// nothing back.
fn held_back_under(ordering: outbox_core::OrderingPolicy, mut stats: StoreStats) -> StoreStats {
    if ordering == outbox_core::OrderingPolicy::Unordered {
        stats.held_back = 0;
        stats.held_back_aggregates = 0;
    }
    stats
}

async fn cmd_status(config: &Config, table: OutboxTable, json: bool) -> Result<(), Failure> {
    let pg = store(config, table.clone()).await?;
    let stats = held_back_under(config.relay.ordering, pg.stats_complete().await?);
    if json {
        let v = serde_json::json!({ "table": table.qualified(), "stats": stats });
        println!("{v}");
        return Ok(());
    }
    println!("outbox {}", table.qualified());
    match stats.oldest_pending_age_seconds {
        Some(age) => println!("pending:      {} (oldest {:.1} s)", stats.pending, age),
        None => println!("pending:      {}", stats.pending),
    }
    println!("dead letters: {}", stats.dead_letters);
    if stats.held_back > 0 {
        println!(
            "held back:    {} events of {} aggregates, behind their dead letters \
             (outbox dead-letters retry or discard releases them)",
            stats.held_back, stats.held_back_aggregates
        );
    }
    if !stats.by_event_type.is_empty() {
        println!();
        println!(
            "{:<40} {:>10} {:>10} {:>12}",
            "event type", "pending", "dead", "oldest (s)"
        );
        for t in &stats.by_event_type {
            let oldest = t
                .oldest_pending_age_seconds
                .map(|a| format!("{a:.1}"))
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<40} {:>10} {:>10} {:>12}",
                t.event_type, t.pending, t.dead_letters, oldest
            );
        }
    }
    Ok(())
}

fn filter_of(selection: &Selection, yes: bool, action: &str) -> Result<DeadLetterFilter, Failure> {
    let given = [
        !selection.ids.is_empty(),
        selection.event_type.is_some(),
        selection.aggregate_type.is_some(),
        selection.all,
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        return Err(usage(format!(
            "`dead-letters {action}` takes one of --id, --event-type, --aggregate-type or --all"
        )));
    }
    if !selection.ids.is_empty() {
        return Ok(DeadLetterFilter::Ids(selection.ids.clone()));
    }
    if let Some(t) = &selection.event_type {
        return Ok(DeadLetterFilter::EventType(t.clone()));
    }
    if let Some(t) = &selection.aggregate_type {
        return Ok(DeadLetterFilter::Aggregate {
            aggregate_type: t.clone(),
            aggregate_id: selection.aggregate_id.clone(),
        });
    }
    if selection.all {
        if !yes {
            return Err(usage(format!(
                "`dead-letters {action} --all` changes every dead letter: add --yes to confirm"
            )));
        }
        return Ok(DeadLetterFilter::All);
    }
    Err(usage(format!(
        "`dead-letters {action}` needs --id <UUID>, --event-type <TYPE>, --aggregate-type <TYPE> [--aggregate-id <ID>] or --all --yes"
    )))
}

async fn cmd_dead_letters(
    config: &Config,
    table: OutboxTable,
    command: DeadLetterCommand,
) -> Result<(), Failure> {
    let pg = store(config, table).await?;
    match command {
        DeadLetterCommand::List {
            selection,
            older_than,
            limit,
            json,
        } => {
            let filter = if !selection.ids.is_empty()
                || selection.event_type.is_some()
                || selection.aggregate_type.is_some()
            {
                filter_of(&selection, true, "list")?
            } else {
                DeadLetterFilter::All
            };
            let rows = pg.dead_letters(&filter, older_than, limit).await?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string(&rows).unwrap_or_else(|_| "[]".into())
                );
                return Ok(());
            }
            if rows.is_empty() {
                println!("no dead letters");
            }
            for d in rows {
                println!(
                    "{}  {}  {}/{}  attempts={}  dead since {}\n    {}",
                    d.id,
                    d.event_type,
                    d.aggregate_type,
                    d.aggregate_id,
                    d.attempts,
                    d.dead_lettered_at
                        .map(|t| t.to_rfc3339())
                        .unwrap_or_default(),
                    d.last_error.unwrap_or_default()
                );
            }
            Ok(())
        }
        DeadLetterCommand::Show { id, json } => {
            let Some(d) = pg.dead_letter(id).await? else {
                return Err(Failure {
                    code: 1,
                    message: format!(
                        "no dead letter with id {id} (outbox dead-letters list shows them)"
                    ),
                });
            };
            let payload = match std::str::from_utf8(&d.event.payload) {
                Ok(text) => serde_json::Value::String(text.to_string()),
                Err(_) => serde_json::Value::Null,
            };
            let payload_hex = payload.is_null().then(|| {
                d.event
                    .payload
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            });
            if json {
                let v = serde_json::json!({
                    "id": d.letter.id,
                    "aggregate_type": d.letter.aggregate_type,
                    "aggregate_id": d.letter.aggregate_id,
                    "event_type": d.letter.event_type,
                    "attempts": d.letter.attempts,
                    "last_error": d.letter.last_error,
                    "created_at": d.letter.created_at,
                    "dead_lettered_at": d.letter.dead_lettered_at,
                    "destination": d.event.destination,
                    "content_type": d.event.content_type,
                    "headers": d.event.headers,
                    "payload": payload,
                    "payload_hex": payload_hex,
                    "held_back": d.held_back,
                    "blocking": d.blocking,
                });
                println!("{v}");
                return Ok(());
            }
            let l = &d.letter;
            println!("dead letter {}", l.id);
            println!("  aggregate:     {}/{}", l.aggregate_type, l.aggregate_id);
            println!("  event type:    {}", l.event_type);
            println!("  attempts:      {}", l.attempts);
            println!("  written:       {}", l.created_at.to_rfc3339());
            if let Some(at) = l.dead_lettered_at {
                println!("  dead since:    {}", at.to_rfc3339());
            }
            println!(
                "  destination:   {}",
                d.event
                    .destination
                    .as_deref()
                    .unwrap_or("(the configured routing)")
            );
            println!(
                "  last error:    {}",
                l.last_error.as_deref().unwrap_or("").escape_default()
            );
            let behind = if d.blocking == l.id {
                "behind this dead letter, the first of its aggregate".to_string()
            } else {
                format!("behind {}, the aggregate's first dead letter", d.blocking)
            };
            println!(
                "  held back:     {} later events of its aggregate, {behind}",
                d.held_back
            );
            println!("  content type:  {}", d.event.content_type);
            println!("  headers:");
            for (k, v) in &d.event.headers {
                println!("    {k}: {v}");
            }
            // Shown as text with control characters escaped (a terminal is not a place for them),
            // at most 64 KiB of it; --json gives it all.
            const SHOWN: usize = 64 * 1024;
            let size = d.event.payload.len();
            match (payload.as_str(), &payload_hex) {
                (Some(text), _) => {
                    let shown: String = text
                        .chars()
                        .take(SHOWN)
                        .flat_map(|c| match c {
                            '\n' | '\t' => vec![c],
                            c if c.is_control() => c.escape_default().collect(),
                            c => vec![c],
                        })
                        .collect();
                    println!("  payload ({size} bytes):\n{shown}");
                }
                (None, Some(hex)) => println!(
                    "  payload ({size} bytes, not UTF-8, hex):\n{}",
                    &hex[..hex.len().min(2 * SHOWN)]
                ),
                _ => {}
            }
            if size > SHOWN {
                println!("  (first {SHOWN} bytes shown; --json prints it all)");
            }
            Ok(())
        }
        DeadLetterCommand::Retry { selection, yes } => {
            let filter = filter_of(&selection, yes, "retry")?;
            let n = pg.retry_dead_letters(&filter).await?;
            info!(count = n, filter = ?filter, "dead letters made pending again");
            println!("retrying {n} dead letters");
            Ok(())
        }
        DeadLetterCommand::Discard { selection, yes } => {
            let filter = filter_of(&selection, yes, "discard")?;
            let n = pg.discard_dead_letters(&filter).await?;
            info!(count = n, filter = ?filter, "dead letters discarded");
            println!("discarded {n} dead letters");
            Ok(())
        }
    }
}

async fn cmd_wal(config: &Config, table: OutboxTable, command: WalCommand) -> Result<(), Failure> {
    let slot = config.wal.slot(&table)?;
    let pool = connect_config(&config.database).await?;
    match command {
        WalCommand::Setup => {
            let created = slot.setup(&pool).await?;
            let held = config.wal.held_table(&table)?;
            let applied = migrate(&pool, &held).await?;
            let said = |made: bool| if made { "created" } else { "exists" };
            println!(
                "publication {}: {}\nslot {}: {}\nheld table {}: {}",
                slot.publication(),
                said(created.publication),
                slot.slot(),
                said(created.slot),
                held.qualified(),
                if applied.is_empty() {
                    "up to date".to_string()
                } else {
                    format!("applied migrations {applied:?}")
                }
            );
            info!(
                slot = slot.slot(),
                publication = slot.publication(),
                ?created,
                "wal setup"
            );
            Ok(())
        }
        WalCommand::Status { json } => {
            let status = slot.status(&pool).await?;
            let too_much = status.retains_too_much(config.wal.retained_wal_warning);
            if json {
                let mut value = serde_json::to_value(&status).map_err(|e| Failure {
                    code: 1,
                    message: format!("cannot render the status: {e}"),
                })?;
                value["retains_too_much"] = too_much.into();
                println!("{value}");
            } else {
                print!("{}", wal_status_text(&status));
            }
            if too_much {
                warn!(
                    slot = slot.slot(),
                    retained_bytes = status.retained_bytes,
                    wal_status = status.wal_status.as_deref(),
                    limit = config.wal.retained_wal_warning,
                    "the slot keeps more WAL than wal.retained_wal_warning (or is losing WAL): read it (outbox relay with the WAL source) or drop it (outbox wal drop), before the disk fills"
                );
                eprintln!(
                    "WARNING: slot {} keeps {} of WAL (wal.retained_wal_warning = {}): read it or drop it (outbox wal drop) before the disk fills",
                    slot.slot(),
                    status.retained_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
                    bytes_text(config.wal.retained_wal_warning)
                );
            }
            Ok(())
        }
        WalCommand::Drop { yes } => {
            if !yes {
                return Err(usage(format!(
                    "wal drop removes the slot {} and the publication {}; events they hold that are not published yet are not published by them any more: add --yes to confirm",
                    slot.slot(),
                    slot.publication()
                )));
            }
            let dropped = slot.drop(&pool).await?;
            let said = |gone: bool| if gone { "dropped" } else { "absent" };
            println!(
                "slot {}: {}\npublication {}: {}",
                slot.slot(),
                said(dropped.slot),
                slot.publication(),
                said(dropped.publication)
            );
            info!(slot = slot.slot(), ?dropped, "wal drop");
            Ok(())
        }
    }
}

/// `bytes` for a person: B, KiB, MiB or GiB.
fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `outbox wal status` for a person.
fn wal_status_text(s: &outbox_postgres::wal::WalStatus) -> String {
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let mut out = format!(
        "wal_level:    {}\npublication:  {} ({})\nslot:         {} ({})\n",
        s.wal_level,
        s.publication,
        if s.publication_exists {
            "exists"
        } else {
            "missing"
        },
        s.slot,
        if s.slot_exists { "exists" } else { "missing" }
    );
    if s.slot_exists {
        out += &format!(
            "read now:     {}{}\nconfirmed:    {}\nlag:          {}{}\nretained WAL: {} (wal_status {})\n",
            yes_no(s.active),
            s.active_pid.map_or(String::new(), |p| format!(" (pid {p})")),
            s.confirmed_lsn.as_deref().unwrap_or("?"),
            s.lag_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
            match (s.lag_seconds, &s.lag_unknown) {
                (Some(secs), _) => format!(", {secs:.1} s since the oldest unconfirmed commit"),
                (None, Some(why)) => format!(", seconds unknown: {why}"),
                (None, None) => ", seconds unknown".into(),
            },
            s.retained_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
            s.wal_status.as_deref().unwrap_or("?")
        );
    }
    out
}

async fn cmd_healthcheck(
    config: &Config,
    addr: Option<String>,
    timeout: Duration,
) -> Result<(), Failure> {
    let addr = match addr {
        None => crate::http::local_address(config.http.listen),
        Some(given) => tokio::net::lookup_host(&given)
            .await
            .ok()
            .and_then(|found| {
                // localhost: the IPv4 loopback, which the relay's default listen address is.
                let found: Vec<_> = found.collect();
                found
                    .iter()
                    .find(|a| a.is_ipv4())
                    .or(found.first())
                    .copied()
            })
            .ok_or_else(|| {
                usage(format!(
                    "--addr {given}: expected HOST:PORT, such as localhost:9464"
                ))
            })?,
    };
    let (status, body) = crate::http::get_status(addr, "/healthz", timeout).await?;
    if status == 200 {
        println!("healthy: {}", body.trim());
        Ok(())
    } else {
        Err(Failure {
            code: 1,
            message: format!("unhealthy (HTTP {status}): {}", body.trim()),
        })
    }
}

async fn cmd_cleanup(
    config: &Config,
    table: OutboxTable,
    older_than: Option<Duration>,
    batch_size: Option<i64>,
) -> Result<(), Failure> {
    let batch_size = batch_size.unwrap_or(i64::from(config.database.cleanup_batch_size));
    let Some(older_than) = older_than.or(config.database.keep_processed_for) else {
        return Err(usage(
            "cleanup needs --older-than <DURATION> (or database.keep_processed_for in the configuration)",
        ));
    };
    if batch_size <= 0 {
        return Err(usage(format!(
            "--batch-size {batch_size}: expected a positive number"
        )));
    }
    let pg = store(config, table.clone()).await?;
    let total = pg
        .cleanup(older_than, batch_size, |n| {
            eprintln!("cleanup: removed {n} rows so far")
        })
        .await?;
    info!(removed = total, older_than = %outbox_core::duration::format(older_than), "cleanup done");
    println!(
        "removed {total} published rows older than {} from {}",
        outbox_core::duration::format(older_than),
        table.qualified()
    );
    Ok(())
}

async fn cmd_publish_test(
    config: &Config,
    event_type: String,
    aggregate_type: String,
    destination: Option<String>,
) -> Result<(), Failure> {
    let publisher = build_publisher(config).await?;
    let sent_at = chrono::Utc::now();
    let mut new = NewEvent::new(
        aggregate_type,
        "publish-test",
        event_type,
        serde_json::json!({ "test": true, "sent_at": sent_at }),
    );
    if let Some(d) = destination {
        new = new.with_destination(d);
    }
    new.validate()?;
    let event = outbox_core::Event {
        id: new.id,
        aggregate_type: new.aggregate_type,
        aggregate_id: new.aggregate_id,
        event_type: new.event_type,
        payload: match &new.payload {
            outbox_core::Payload::Json(v) => v.to_string().into_bytes(),
            outbox_core::Payload::Binary { data, .. } => data.clone(),
        },
        content_type: new.payload.content_type().to_string(),
        headers: new.headers,
        destination: new.destination,
        created_at: sent_at,
        attempts: 0,
    };
    let outcome = publisher
        .publish(std::slice::from_ref(&event))
        .await
        .pop()
        .unwrap_or_else(|| {
            Err(Error::new(
                ErrorKind::Unexpected,
                "the publisher returned no outcome",
            ))
        });
    match outcome {
        Ok(()) => {
            println!(
                "published test event {} ({}) via {}",
                event.id,
                event.event_type,
                publisher.name()
            );
            Ok(())
        }
        Err(e) => Err(Failure {
            code: 1,
            message: format!(
                "publishing the test event via {} failed: {e}",
                publisher.name()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_per_aggregate_order_nothing_is_held_back() {
        let stats = StoreStats {
            held_back: 5,
            held_back_aggregates: 2,
            dead_letters: 2,
            ..StoreStats::default()
        };
        let ordered = held_back_under(outbox_core::OrderingPolicy::PerAggregate, stats.clone());
        assert_eq!((ordered.held_back, ordered.held_back_aggregates), (5, 2));
        let unordered = held_back_under(outbox_core::OrderingPolicy::Unordered, stats);
        assert_eq!(
            (
                unordered.held_back,
                unordered.held_back_aggregates,
                unordered.dead_letters
            ),
            (0, 0, 2)
        );
    }
}
