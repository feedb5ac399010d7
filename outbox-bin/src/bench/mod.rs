//! `outbox bench`: its options, the destination it publishes to ([`target`]: `--broker`, else the
//! configured publisher), and the run through [`engine`], which does the measuring. Each broker's
//! adapter gives it a destination of the benchmark's own (an exchange bound to a queue, a topic, a
//! queue), so a benchmark never publishes into a service's topics or queues.
//!
//! The phases each have a file: `writer.rs`, `drain.rs` (with the publisher alone), `reference.rs`
//! (the classic relay), `latency.rs`, `wal.rs` (the WAL source), `claim.rs` and `transaction.rs`
//! (one large transaction on each source); they share
//! `fill.rs` (backlogs), `instruments.rs` (counting and timing relays) and `rss.rs` (memory). The
//! options are in `options.rs`, the figures in `report.rs`, their table in `table.rs`.

use std::time::Duration;

use clap::Args;

use txoutbox_core::{Error, ErrorKind};

pub mod engine;

mod claim;
mod drain;
mod fill;
mod instruments;
mod latency;
mod options;
mod reference;
mod report;
mod rss;
mod table;
mod transaction;
mod wal;
mod writer;

use engine::{self as bench, BenchOptions, BenchTarget, Phase};

use crate::adapters;
use crate::config::Config;
use crate::target::{DiscardTarget, Progress, TargetOptions};

/// `outbox bench` options. Sizes, rates and durations default to the figures the targets are stated
/// for; relay settings (batch size, in-flight batches, polling) come from `[relay]` as for `outbox relay`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Broker to publish to: amqp, kafka, sqs, or discard (the database ceiling only). Default:
    /// publisher.type of the configuration.
    #[arg(long, value_name = "BROKER")]
    pub broker: Option<String>,
    /// Phases to run, comma-separated: writer, drain, reference, latency, claim, transaction.
    /// Default: all.
    #[arg(long, value_delimiter = ',', value_name = "PHASES")]
    pub phases: Option<Vec<String>>,
    /// Concurrent writers of the writer phase.
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Length of each writer run.
    #[arg(long, default_value = "5s", value_parser = txoutbox_core::duration::parse)]
    pub writer_duration: Duration,
    /// Events pre-filled for each drain run.
    #[arg(long, default_value_t = 200_000)]
    pub backlog: usize,
    /// N of the multi-relay drain runs.
    #[arg(long, default_value_t = 4)]
    pub relays: usize,
    /// Distinct aggregates the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub aggregates: usize,
    /// Padding in each event's JSON payload, in bytes.
    #[arg(long, default_value_t = 256)]
    pub payload_bytes: usize,
    /// Events drained by the reference (classic) relay.
    #[arg(long, default_value_t = 20_000)]
    pub reference_events: usize,
    /// Offered rate of the latency runs, events per second.
    #[arg(long, default_value_t = 2_000)]
    pub rate: u32,
    /// Length of each latency run (the first second is warm-up).
    #[arg(long, default_value = "10s", value_parser = txoutbox_core::duration::parse)]
    pub latency_duration: Duration,
    /// Processed rows kept in the table for the claim-cost phase.
    #[arg(long, default_value_t = 10_000_000)]
    pub claim_processed_rows: u64,
    /// Pending rows of the claim-cost phase's large backlog.
    #[arg(long, default_value_t = 1_000_000)]
    pub claim_pending_rows: u64,
    /// Claims timed per table state.
    #[arg(long, default_value_t = 200)]
    pub claim_samples: usize,
    /// Time each publisher call of the drain runs takes on top of the broker's own (a slow broker,
    /// against which relays must scale out), such as 20ms. Default: none.
    #[arg(long, default_value = "0s", value_parser = txoutbox_core::duration::parse)]
    pub publish_delay: Duration,
    /// Partitions of the Kafka benchmark topic (librdkafka sends one produce request per partition,
    /// so a batch spread over more partitions takes more requests).
    #[arg(long, default_value_t = 8)]
    pub kafka_partitions: i32,
    /// The transactions of the transaction phase, comma-separated, each EVENTSxBYTESxAGGREGATES.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "TRANSACTIONS",
        default_value = "500000x4096x100,2000000x100x1000"
    )]
    pub transactions: Vec<String>,
    /// Schema the benchmark creates and drops (must start with outbox_bench).
    #[arg(long, default_value = "outbox_bench")]
    pub schema: String,
    /// Print the figures as JSON on standard output instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl BenchArgs {
    fn options(&self, config: &Config) -> Result<BenchOptions, Error> {
        let phases = match &self.phases {
            None => Phase::ALL.to_vec(),
            Some(list) => list
                .iter()
                .map(|p| Phase::parse(p))
                .collect::<Result<Vec<_>, _>>()?,
        };
        Ok(BenchOptions {
            schema: self.schema.clone(),
            phases,
            writers: self.writers,
            writer_duration: self.writer_duration,
            backlog: self.backlog,
            relays: self.relays,
            aggregates: self.aggregates,
            payload_bytes: self.payload_bytes,
            reference_events: self.reference_events,
            rate: self.rate,
            latency_duration: self.latency_duration,
            claim_processed_rows: self.claim_processed_rows,
            claim_pending_rows: self.claim_pending_rows,
            claim_samples: self.claim_samples,
            publish_delay: self.publish_delay,
            transactions: self
                .transactions
                .iter()
                .map(|t| engine::LargeTransaction::parse(t))
                .collect::<Result<_, _>>()?,
            relay: config.relay.clone(),
        })
    }

    /// What the broker's destination is made with.
    fn target_options(&self) -> TargetOptions {
        TargetOptions {
            kafka_partitions: self.kafka_partitions,
        }
    }
}

/// The options of `outbox bench`, checked before any destination is created.
///
/// # Errors
/// A config error naming the invalid option.
pub fn options(config: &Config, args: &BenchArgs) -> Result<BenchOptions, Error> {
    let options = args.options(config)?;
    options.validate()?;
    if !(1..=1000).contains(&args.kafka_partitions) {
        return Err(Error::config(format!(
            "--kafka-partitions {}: expected 1 to 1000",
            args.kafka_partitions
        )));
    }
    Ok(options)
}

/// Where the benchmark's progress lines go: standard error.
pub fn progress(line: &str) {
    eprintln!("[bench] {line}");
}

/// The benchmark's destination: `--broker` (`discard`, the database's ceiling, or an adapter's
/// name), else the configured publisher's.
///
/// # Errors
/// A config error for an unknown broker, one not in this build, or the standard output; what the
/// broker reports when the destination cannot be made.
pub async fn target(
    config: &Config,
    args: &BenchArgs,
    progress: &Progress,
) -> Result<Box<dyn BenchTarget>, Error> {
    let kind = match args.broker.as_deref() {
        Some("discard") => return Ok(Box::new(DiscardTarget)),
        Some(name) => adapters::by_name(name).ok_or_else(|| {
            Error::config(format!(
                "--broker {name:?}: expected one of {}, or discard",
                adapters::available().join(", ")
            ))
        })?,
        None => config.publisher.kind,
    };
    config
        .adapter(kind)
        .bench_target(&args.target_options(), progress)
        .await
}

/// Runs the phases of `options` on `target` (the destination [`target`] made),
/// removes the target's destination, and prints the report (a table, or JSON with `--json`).
///
/// # Errors
/// What failed in a phase.
pub async fn run(
    config: &Config,
    args: &BenchArgs,
    options: &BenchOptions,
    target: Box<dyn BenchTarget>,
) -> Result<(), Error> {
    let result = bench::run(&config.database.url, target.as_ref(), options, &progress).await;
    target.teardown().await;
    let report = result?;
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| {
            Error::new(
                ErrorKind::Unexpected,
                format!("cannot encode the report: {e}"),
            )
        })?;
        println!("{text}");
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
