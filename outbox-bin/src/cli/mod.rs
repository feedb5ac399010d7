//! The command line: argument parsing ([`Cli`], [`Command`]), configuration and logging, and the
//! dispatch to the subcommands, each in a file of its own (`relay.rs`, `status.rs`,
//! `dead_letters.rs`, `wal.rs`, ...). Failures carry their exit code ([`Failure`]).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};

use txoutbox_core::{Error, ErrorKind, Publisher};
use txoutbox_postgres::{connect_config, OutboxTable, PostgresStore, Source};

use crate::config::{Config, LogFormat};

mod check;
mod cleanup;
mod dead_letters;
mod healthcheck;
mod migrate;
mod publish_test;
mod relay;
mod signals;
mod status;
mod wal;

pub use dead_letters::{DeadLetterCommand, Selection};
pub use wal::WalCommand;

use check::cmd_check;
use cleanup::cmd_cleanup;
use dead_letters::cmd_dead_letters;
use healthcheck::cmd_healthcheck;
use migrate::cmd_migrate;
use publish_test::cmd_publish_test;
use relay::cmd_relay;
use status::cmd_status;
use wal::cmd_wal;

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
#[command(name = "outbox", version = crate::build_info::LONG_VERSION, about = ABOUT, after_help = AFTER_HELP)]
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
        #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = txoutbox_core::duration::parse)]
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
        #[arg(long, value_name = "DURATION", value_parser = txoutbox_core::duration::parse)]
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
    /// Print the configuration in force (defaults, file and environment merged; secrets redacted),
    /// then check it as the relay does at start without connecting to anything (exit 2 when the
    /// relay would refuse it).
    Config {
        /// Print instead the reference of every key (type, default, environment variable) as a
        /// Markdown table, generated from the configuration's own definitions.
        #[arg(long)]
        reference: bool,
    },
    /// Check what the relay needs, as it does at start and more, one line per check with the fix:
    /// the configuration, the database (connection, TLS, a pooler, the schema, the role's grants,
    /// the WAL source's prerequisites) and the broker. Claims, writes and publishes nothing. Exit
    /// 0 when every check passes, 2 on a configuration problem, 1 otherwise.
    Check,
    /// Measure the writer, the relay and the database on this machine, against the configured
    /// database and broker, in a schema of its own (outbox_bench, dropped at the end); prints a table
    /// (or JSON) of throughputs, latencies, ratios and the relay's peak memory. Build with --release.
    Bench(crate::bench::BenchArgs),
}

/// A failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    /// 1 runtime, 2 usage or configuration.
    pub code: u8,
    /// What to print.
    pub message: String,
}

/// The exit code of a command that failed with `e`: 2 for a setting to fix, 1 otherwise. The
/// settings to fix are what the configuration's checks find (a bad value, a publisher not built in)
/// and a server's certificate refused (the CA, the host name: at run time a connection error,
/// retried, since a certificate can change under a relay). What the servers report otherwise, a
/// missing table included (`ErrorKind::Schema`), is a runtime failure.
pub(crate) fn exit_code(e: &Error) -> u8 {
    if e.kind() == ErrorKind::Config || txoutbox_core::tls::is_certificate_error(e) {
        2
    } else {
        1
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure {
            code: exit_code(&e),
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
    // Docker reserves exit code 2 of a health check: every failure of one is 1.
    let usage_code: u8 = if matches!(cli.command, Command::Healthcheck { .. }) {
        1
    } else {
        2
    };
    // The benchmark's progress lines are its log; the relays it runs log warnings only unless the
    // level is set explicitly.
    let quiet = matches!(cli.command, Command::Bench(_))
        && !env
            .iter()
            .any(|(k, _)| k == "RUST_LOG" || k == "OUTBOX_LOG__LEVEL");
    let env_names: Vec<String> = env.iter().map(|(k, _)| k.clone()).collect();
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
    for name in crate::config::ignored(env_names.iter().map(String::as_str)) {
        if crate::config::service_link(name) {
            tracing::debug!(
                variable = name,
                "ignored: a Kubernetes service link, not of the form OUTBOX_<SECTION>__<KEY>"
            );
        } else {
            tracing::warn!(
                variable = name,
                "ignored: not of the form OUTBOX_<SECTION>__<KEY> (two underscores between the \
                 section and the key, such as OUTBOX_RELAY__BATCH_SIZE)"
            );
        }
    }
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
    if matches!(
        command,
        Command::Status { .. } | Command::DeadLetters(_) | Command::Cleanup { .. }
    ) && config.database.source == Source::Wal
    {
        let pool = connect_config(&config.database).await?;
        txoutbox_postgres::wal::held_table_exists(&pool, &kept).await?;
        pool.close().await;
    }
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
        Command::Config { reference: true } => {
            print!("{}", crate::config::reference::markdown());
            Ok(())
        }
        Command::Config { reference: false } => {
            print!("{}", config.to_redacted_toml());
            check::offline(&config)?;
            Ok(())
        }
        Command::Check => cmd_check(&config, table).await,
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
