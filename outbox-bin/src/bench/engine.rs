//! The measurements behind `outbox bench`: load generators for the writer and the relay, a reference
//! relay that works like the classic design, and the figures they produce.
//!
//! Everything runs against a real PostgreSQL and whatever [`BenchTarget`] the caller provides (a
//! broker publisher, or [`DiscardTarget`] for the database-only ceiling). The benchmark owns its own
//! schema (dropped and created again at the start, dropped at the end), so it never touches a
//! service's outbox table.
//!
//! ```no_run
//! # async fn demo() -> Result<(), outbox_core::Error> {
//! use outbox_bin::bench::engine::{self as bench, BenchOptions, DiscardTarget};
//! let options = BenchOptions { backlog: 20_000, ..BenchOptions::default() };
//! let report = bench::run("postgres://postgres@127.0.0.1:5432/test", &DiscardTarget, &options, &|line: &str| eprintln!("{line}")).await?;
//! println!("{}", report.table());
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use outbox_core::{
    BatchReport, Error, ErrorKind, Event, NewEvent, OrderingPolicy, PublishOutcome, Publisher,
    Relay, RelayConfig, RelayObserver, Store,
};

use outbox_postgres::wal::{check_wal_level, wal_level, WalConfig, WalSlot, WalStore};
use outbox_postgres::{
    connect, decode_event, map_sqlx, migrate, notify, OutboxTable, PostgresStore, Retention,
    Writer, EVENT_COLUMNS,
};

use crate::target::DiscardPublisher;
pub use crate::target::{BenchTarget, DiscardTarget};

/// The parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Business transactions per second with and without the outbox insert.
    Writer,
    /// Draining a pre-filled backlog: the yardstick (one `DELETE ... RETURNING` after another), then
    /// the target and the discard ceiling, with 1 and N relays.
    Drain,
    /// The classic relay (claim 100, publish one at a time, one `UPDATE` per row) on the target.
    Reference,
    /// Commit-to-acknowledgement latency at a steady offered rate, polling and with NOTIFY.
    Latency,
    /// Claim cost over an empty history, a large processed history and a large pending backlog.
    Claim,
}

impl Phase {
    /// Every phase, in the order they run.
    pub const ALL: [Phase; 5] = [
        Phase::Writer,
        Phase::Drain,
        Phase::Reference,
        Phase::Latency,
        Phase::Claim,
    ];

    /// Parses `writer`, `drain`, `reference`, `latency` or `claim`.
    ///
    /// # Errors
    /// A config error naming the accepted values.
    pub fn parse(s: &str) -> Result<Phase, Error> {
        match s.trim() {
            "writer" => Ok(Phase::Writer),
            "drain" => Ok(Phase::Drain),
            "reference" => Ok(Phase::Reference),
            "latency" => Ok(Phase::Latency),
            "claim" => Ok(Phase::Claim),
            other => Err(Error::config(format!(
                "bench phase {other:?}: expected writer, drain, reference, latency or claim"
            ))),
        }
    }
}

/// Sizes, rates and durations of a benchmark run. Every field has a documented default.
#[derive(Debug, Clone, Serialize)]
pub struct BenchOptions {
    /// The schema the benchmark creates and drops; must start with `outbox_bench`. Default `outbox_bench`.
    pub schema: String,
    /// The phases to run. Default: all of them.
    pub phases: Vec<Phase>,
    /// Concurrent writers in the writer phase. Default 8.
    pub writers: usize,
    /// Length of each writer run (two without the outbox insert, two with it, two with `SELECT 1`
    /// instead, alternating). Default 5 s.
    #[serde(with = "outbox_core::duration::serde_str")]
    pub writer_duration: Duration,
    /// Events in the pre-filled backlog of each drain run. Default 200,000.
    pub backlog: usize,
    /// N, the number of relays of the multi-relay drain runs. Default 4.
    pub relays: usize,
    /// Distinct aggregates the events are spread over. Default 1,000.
    pub aggregates: usize,
    /// Size of the padding in each event's JSON payload, in bytes. Default 256.
    pub payload_bytes: usize,
    /// Events drained by the reference relay (it is slow; its rate is what counts). Default 20,000.
    pub reference_events: usize,
    /// Offered rate of the latency runs, events per second. Default 2,000.
    pub rate: u32,
    /// Length of each latency run. Default 10 s.
    #[serde(with = "outbox_core::duration::serde_str")]
    pub latency_duration: Duration,
    /// Processed rows kept in the table for the claim-cost phase. Default 10,000,000.
    pub claim_processed_rows: u64,
    /// Pending rows for the claim-cost phase's large backlog. Default 1,000,000.
    pub claim_pending_rows: u64,
    /// Claims timed per state in the claim-cost phase. Default 200.
    pub claim_samples: usize,
    /// Time each publisher call of the drain runs (and of the publisher alone) takes on top of the
    /// target's own: a slow broker, against which relays must scale out. Default 0.
    #[serde(with = "outbox_core::duration::serde_str")]
    pub publish_delay: Duration,
    /// The relay settings of the drain and latency runs. Default: the relay's defaults.
    pub relay: RelayConfig,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            schema: "outbox_bench".into(),
            phases: Phase::ALL.to_vec(),
            writers: 8,
            writer_duration: Duration::from_secs(5),
            backlog: 200_000,
            relays: 4,
            aggregates: 1_000,
            payload_bytes: 256,
            reference_events: 20_000,
            rate: 2_000,
            latency_duration: Duration::from_secs(10),
            claim_processed_rows: 10_000_000,
            claim_pending_rows: 1_000_000,
            claim_samples: 200,
            publish_delay: Duration::ZERO,
            relay: RelayConfig::default(),
        }
    }
}

impl BenchOptions {
    /// Checks the values.
    ///
    /// # Errors
    /// A config error naming the option, the value and what is expected.
    pub fn validate(&self) -> Result<(), Error> {
        if !self.schema.starts_with("outbox_bench") {
            return Err(Error::config(format!(
                "bench schema {:?}: expected a name starting with outbox_bench (the benchmark drops and recreates it)",
                self.schema
            )));
        }
        OutboxTable::new(&self.schema, "outbox_events")?;
        let positive = [
            ("--writers", self.writers as u64),
            ("--backlog", self.backlog as u64),
            ("--relays", self.relays as u64),
            ("--aggregates", self.aggregates as u64),
            ("--reference-events", self.reference_events as u64),
            ("--rate", u64::from(self.rate)),
            ("--claim-samples", self.claim_samples as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::config(format!(
                    "{name} = 0: expected a positive number"
                )));
            }
        }
        if self.writer_duration.is_zero() || self.latency_duration <= Duration::from_secs(1) {
            return Err(Error::config(
                "--writer-duration must be positive and --latency-duration longer than 1s (the first second is warm-up)",
            ));
        }
        self.relay.validate()
    }
}

/// Writer throughput: business transactions per second.
#[derive(Debug, Clone, Serialize)]
pub struct WriterFigures {
    /// Concurrent writers.
    pub writers: usize,
    /// Business transactions per second without the outbox insert.
    pub without_outbox_tps: f64,
    /// The same transactions with one outbox insert each.
    pub with_outbox_tps: f64,
    /// `1 - with / without`: the share of throughput the outbox insert costs.
    pub overhead: f64,
    /// The same transactions with one no-op statement (`SELECT 1`) instead of the outbox insert: what
    /// one more statement round trip costs by itself, whatever it does.
    pub with_noop_statement_tps: f64,
    /// `1 - with_noop_statement / without`: the share of throughput the round trip alone costs, the
    /// floor of any insert made with a statement of its own.
    pub noop_statement_overhead: f64,
    /// The same transactions with the outbox insert, the table's writer-order trigger disabled (the
    /// per-aggregate lock and late `seq` of the ordering rule left out).
    pub with_outbox_without_ordering_tps: f64,
    /// `1 - with_outbox / with_outbox_without_ordering`: the share of the writer's throughput the
    /// ordering rule costs when writers do not share aggregates (every transaction here writes its
    /// own; writers of one aggregate also wait for each other, by design).
    pub ordering_rule_overhead: f64,
    /// The same transactions with a table-less event instead of the outbox insert (the WAL source's
    /// `pg_logical_emit_message`, `outbox_postgres::wal::MessageWriter`).
    pub with_message_tps: f64,
    /// `1 - with_message / without`: the share of throughput the table-less event costs.
    pub message_overhead: f64,
    /// The same transactions with the table-less event written by the business statement itself
    /// (`WITH o AS (INSERT ... RETURNING id) SELECT pg_logical_emit_message(...) FROM o`): no round
    /// trip of its own.
    pub with_message_in_statement_tps: f64,
    /// `1 - with_message_in_statement / without`.
    pub message_in_statement_overhead: f64,
}

/// One drain of a pre-filled backlog.
#[derive(Debug, Clone, Serialize)]
pub struct DrainFigures {
    /// The publisher drained to (`discard` is the database ceiling).
    pub publisher: String,
    /// `relay` (this toolkit, polling), `wal` (this toolkit, the WAL source), `reference` (the
    /// classic design) or `yardstick` (one `DELETE ... RETURNING` statement after another: the
    /// database's own drain rate, no order kept).
    pub relay: String,
    /// Relays running side by side.
    pub relays: usize,
    /// Events drained.
    pub events: u64,
    /// Wall-clock seconds from the start of the relays to the last settlement.
    pub seconds: f64,
    /// Events per second.
    pub events_per_second: f64,
    /// Largest resident set size of this process sampled during the run, in bytes (relays,
    /// their publishers and the benchmark itself).
    pub peak_rss_bytes: Option<u64>,
    /// Where the relays spent the time of each batch (this toolkit's relay only).
    pub stages: Option<StageFigures>,
}

/// Commit-to-acknowledgement latency of one run.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyFigures {
    /// `poll` (the default wake-up), `notify` (LISTEN/NOTIFY enabled) or `wal` (the WAL source).
    pub wakeup: String,
    /// Events per second the writers aimed at.
    pub offered_rate: u32,
    /// Events per second they committed.
    pub achieved_rate: f64,
    /// Events measured (the first second is warm-up and not counted).
    pub events: usize,
    /// Median, in milliseconds.
    pub p50_ms: f64,
    /// 95th percentile, in milliseconds.
    pub p95_ms: f64,
    /// 99th percentile, in milliseconds.
    pub p99_ms: f64,
    /// Largest, in milliseconds.
    pub max_ms: f64,
    /// Where the relay spent the time of each batch, over the whole run (the warm-up second and the
    /// final drain included, unlike the percentiles above).
    pub stages: StageFigures,
}

/// The relay's batches during a run: how long each step took.
#[derive(Debug, Clone, Serialize)]
pub struct StageFigures {
    /// Batches the relay finished (settled, or given back when their settlement failed).
    pub batches: usize,
    /// Events per batch, on average.
    pub mean_batch_events: f64,
    /// Claims that returned events: median duration, in milliseconds.
    pub claim_p50_ms: f64,
    /// Claims that returned events: 99th percentile, in milliseconds.
    pub claim_p99_ms: f64,
    /// Publisher calls (broker acknowledgement included): median, in milliseconds.
    pub publish_p50_ms: f64,
    /// Publisher calls: 99th percentile, in milliseconds.
    pub publish_p99_ms: f64,
    /// Settlements (marking the batch published): median, in milliseconds.
    pub settle_p50_ms: f64,
    /// Settlements: 99th percentile, in milliseconds.
    pub settle_p99_ms: f64,
}

impl StageFigures {
    /// Claim, publish and settle, p50 / p99 ms each, in the table's columns.
    fn steps(&self) -> String {
        format!(
            "{:>7.1} /{:>6.1} {:>7.1} /{:>6.1} {:>7.1} /{:>6.1}",
            self.claim_p50_ms,
            self.claim_p99_ms,
            self.publish_p50_ms,
            self.publish_p99_ms,
            self.settle_p50_ms,
            self.settle_p99_ms
        )
    }
}

/// Claim cost in one table state.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimFigures {
    /// What the table held.
    pub state: String,
    /// Pending rows.
    pub pending_rows: u64,
    /// Processed rows kept.
    pub processed_rows: u64,
    /// Median claim time (claim of a batch, then release), in milliseconds.
    pub median_ms: f64,
    /// 95th percentile, in milliseconds.
    pub p95_ms: f64,
    /// `median / median of the first state`.
    pub vs_first: f64,
    /// Median time of one statistics refresh ([`Store::stats`], what each relay runs every 5 s for
    /// `/metrics`), in milliseconds: bounded by `database.stats_max_rows`, estimated above it.
    pub stats_ms: f64,
    /// Time of one exact count of the unpublished rows (what statistics cost without the bound),
    /// in milliseconds.
    pub exact_count_ms: f64,
}

/// The target's publisher alone, without the database: the broker's ceiling for this publisher.
#[derive(Debug, Clone, Serialize)]
pub struct PublisherFigures {
    /// Events published (built in memory, as the drain's rows).
    pub events: u64,
    /// Events per call, as the relay's batch size.
    pub batch_size: usize,
    /// Calls in flight at once, as the relay's `max_in_flight`.
    pub in_flight: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Events per second.
    pub events_per_second: f64,
    /// Median time of one call (send the batch, wait for every acknowledgement), in milliseconds.
    pub batch_p50_ms: f64,
    /// 99th percentile of the same, in milliseconds.
    pub batch_p99_ms: f64,
}

/// The ratios the targets are stated in, from figures of the same run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Ratios {
    /// Drain to the target / drain to the discard ceiling, one relay.
    pub target_vs_ceiling_1: Option<f64>,
    /// Drain to the target / drain to the discard ceiling, N relays.
    pub target_vs_ceiling_n: Option<f64>,
    /// Drain to the target (best of 1 and N relays) / the reference relay on the same target.
    pub target_vs_reference: Option<f64>,
    /// Drain to the target, one relay / the target's publisher alone (no database).
    pub target_vs_publisher: Option<f64>,
    /// Drain to the discard ceiling, one relay / the yardstick (one `DELETE ... RETURNING` of the
    /// oldest `batch_size` rows after another, no order kept: what the database itself can do).
    pub ceiling_vs_yardstick_1: Option<f64>,
    /// The same with N relays.
    pub ceiling_vs_yardstick_n: Option<f64>,
    /// The WAL source's drain to the discard ceiling / the polling relay's, one relay each.
    pub wal_vs_polling_ceiling: Option<f64>,
    /// The WAL source's drain to the target / the polling relay's, one relay each.
    pub wal_vs_polling_target: Option<f64>,
}

/// Everything a benchmark run measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// The target's name.
    pub target: String,
    /// The options of the run.
    pub options: BenchOptions,
    /// Writer throughput.
    pub writer: Option<WriterFigures>,
    /// Drain runs (relay and reference).
    pub drain: Vec<DrainFigures>,
    /// The target's publisher alone (drain phase, real targets only).
    pub publisher: Option<PublisherFigures>,
    /// Latency runs.
    pub latency: Vec<LatencyFigures>,
    /// Claim-cost states.
    pub claim: Vec<ClaimFigures>,
    /// Ratios of the figures above.
    pub ratios: Ratios,
    /// Largest resident set size sampled during the one-relay drains, in bytes (the whole bench
    /// process: one relay, its publisher and the load generator).
    pub relay_peak_rss_bytes: Option<u64>,
    /// What the run could not measure, and why.
    pub notes: Vec<String>,
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

fn mib(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "n/a".into(),
        |b| format!("{:.1} MiB", b as f64 / 1048576.0),
    )
}

impl BenchReport {
    fn drain_rate(&self, publisher: &str, relay: &str, relays: usize) -> Option<f64> {
        self.drain
            .iter()
            .find(|d| d.publisher == publisher && d.relay == relay && d.relays == relays)
            .map(|d| d.events_per_second)
    }

    fn compute_ratios(&mut self) {
        let t = self.target.clone();
        let n = self.options.relays;
        let ceiling = |k| self.drain_rate("discard", "relay", k);
        let target = |k| self.drain_rate(&t, "relay", k);
        let best = match (target(1), target(n)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let reference = self.drain_rate(&t, "reference", 1);
        self.ratios = Ratios {
            target_vs_ceiling_1: target(1).zip(ceiling(1)).and_then(|(a, b)| ratio(a, b)),
            target_vs_ceiling_n: target(n).zip(ceiling(n)).and_then(|(a, b)| ratio(a, b)),
            target_vs_reference: best.zip(reference).and_then(|(a, b)| ratio(a, b)),
            target_vs_publisher: target(1)
                .zip(self.publisher.as_ref().map(|p| p.events_per_second))
                .and_then(|(a, b)| ratio(a, b)),
            ceiling_vs_yardstick_1: ceiling(1)
                .zip(self.drain_rate("none", "yardstick", 1))
                .and_then(|(a, b)| ratio(a, b)),
            ceiling_vs_yardstick_n: ceiling(n)
                .zip(self.drain_rate("none", "yardstick", 1))
                .and_then(|(a, b)| ratio(a, b)),
            wal_vs_polling_ceiling: self
                .drain_rate("discard", "wal", 1)
                .zip(ceiling(1))
                .and_then(|(a, b)| ratio(a, b)),
            wal_vs_polling_target: self
                .drain_rate(&t, "wal", 1)
                .zip(target(1))
                .and_then(|(a, b)| ratio(a, b)),
        };
        // One relay's figure: the N-relay runs hold N relays (and N publishers) in this process.
        self.relay_peak_rss_bytes = self
            .drain
            .iter()
            .filter(|d| d.relay == "relay" && d.relays == 1)
            .filter_map(|d| d.peak_rss_bytes)
            .max();
    }

    /// The figures as a plain-text table.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        for note in &self.notes {
            let _ = writeln!(s, "note: {note}");
        }
        let o = &self.options;
        let _ = writeln!(
            s,
            "outbox bench: target {}, batch_size {}, max_in_flight {}, payload {} B, {} aggregates",
            self.target, o.relay.batch_size, o.relay.max_in_flight, o.payload_bytes, o.aggregates
        );
        if !o.publish_delay.is_zero() {
            let _ = writeln!(
                s,
                "  every publisher call of the drains takes {} more (--publish-delay)",
                outbox_core::duration::format(o.publish_delay)
            );
        }
        if let Some(w) = &self.writer {
            let _ = writeln!(s, "\nwriter ({} concurrent writers)", w.writers);
            // (label, value, a percentage?, note)
            let rows: [(&str, f64, bool, &str); 11] = [
                (
                    "business tx/s without outbox",
                    w.without_outbox_tps,
                    false,
                    "",
                ),
                ("business tx/s with outbox", w.with_outbox_tps, false, ""),
                (
                    "business tx/s with SELECT 1",
                    w.with_noop_statement_tps,
                    false,
                    "one more round trip, no insert",
                ),
                ("overhead of the outbox insert", w.overhead, true, ""),
                (
                    "overhead of SELECT 1",
                    w.noop_statement_overhead,
                    true,
                    "the round trip alone",
                ),
                (
                    "business tx/s, no ordering",
                    w.with_outbox_without_ordering_tps,
                    false,
                    "outbox insert, writer-order trigger off",
                ),
                (
                    "overhead of the ordering rule",
                    w.ordering_rule_overhead,
                    true,
                    "of the tx/s with outbox",
                ),
                (
                    "business tx/s, table-less",
                    w.with_message_tps,
                    false,
                    "a pg_logical_emit_message event, the WAL source's",
                ),
                (
                    "overhead of a table-less event",
                    w.message_overhead,
                    true,
                    "",
                ),
                (
                    "business tx/s, in statement",
                    w.with_message_in_statement_tps,
                    false,
                    "the table-less event written by the business statement",
                ),
                (
                    "overhead, in statement",
                    w.message_in_statement_overhead,
                    true,
                    "",
                ),
            ];
            for (label, value, percent, note) in rows {
                let figure = if percent {
                    format!("{:>11.1}%", value * 100.0)
                } else {
                    format!("{value:>12.0}")
                };
                let note = if note.is_empty() {
                    String::new()
                } else {
                    format!("   ({note})")
                };
                let _ = writeln!(s, "  {label:<30} {figure}{note}");
            }
        }
        if !self.drain.is_empty() {
            let _ = writeln!(s, "\ndrain of a pre-filled backlog");
            let _ = writeln!(
                s,
                "  {:<10} {:<10} {:>6} {:>9} {:>8} {:>12} {:>12}",
                "relay", "publisher", "relays", "events", "seconds", "events/s", "peak RSS"
            );
            for d in &self.drain {
                let _ = writeln!(
                    s,
                    "  {:<10} {:<10} {:>6} {:>9} {:>8.2} {:>12.0} {:>12}",
                    d.relay,
                    d.publisher,
                    d.relays,
                    d.events,
                    d.seconds,
                    d.events_per_second,
                    mib(d.peak_rss_bytes)
                );
            }
            let _ = writeln!(s, "  relay steps of the drains (p50 / p99 ms)");
            let _ = writeln!(
                s,
                "  {:<10} {:>6} {:>8} {:>12} {:>15} {:>15} {:>15}",
                "publisher", "relays", "batches", "events/batch", "claim", "publish", "settle"
            );
            for d in &self.drain {
                if let Some(g) = &d.stages {
                    let _ = writeln!(
                        s,
                        "  {:<10} {:>6} {:>8} {:>12.1} {}",
                        d.publisher,
                        d.relays,
                        g.batches,
                        g.mean_batch_events,
                        g.steps()
                    );
                }
            }
            if let Some(p) = &self.publisher {
                let _ = writeln!(
                    s,
                    "  publisher alone (no database): {:.0} events/s in calls of {} ({} in flight); \
                     call p50 {:.1} ms, p99 {:.1} ms",
                    p.events_per_second, p.batch_size, p.in_flight, p.batch_p50_ms, p.batch_p99_ms
                );
            }
            let r = &self.ratios;
            let show = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.2}x"));
            let t = &self.target;
            let n = o.relays;
            let mut ratios = vec![(
                "discard ceiling / yardstick, 1 relay".to_string(),
                r.ceiling_vs_yardstick_1,
            )];
            if n != 1 {
                ratios.push((
                    format!("discard ceiling / yardstick, {n} relays"),
                    r.ceiling_vs_yardstick_n,
                ));
            }
            ratios.push((
                format!("{t} / discard ceiling, 1 relay"),
                r.target_vs_ceiling_1,
            ));
            if n != 1 {
                ratios.push((
                    format!("{t} / discard ceiling, {n} relays"),
                    r.target_vs_ceiling_n,
                ));
            }
            ratios.push((
                format!("{t} / publisher alone, 1 relay"),
                r.target_vs_publisher,
            ));
            ratios.push((format!("{t} / reference relay"), r.target_vs_reference));
            ratios.push((
                "WAL source / polling, discard, 1 relay".to_string(),
                r.wal_vs_polling_ceiling,
            ));
            if t != "discard" {
                ratios.push((
                    format!("WAL source / polling, {t}, 1 relay"),
                    r.wal_vs_polling_target,
                ));
            }
            for (label, value) in ratios {
                let _ = writeln!(s, "  {label:<38} {}", show(value));
            }
            let _ = writeln!(
                s,
                "  {:<38} {}",
                "relay peak RSS (1 relay)",
                mib(self.relay_peak_rss_bytes)
            );
        }
        if !self.latency.is_empty() {
            let _ = writeln!(s, "\ncommit-to-ack latency");
            let _ = writeln!(
                s,
                "  {:<8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "wake-up",
                "offered/s",
                "achieved/s",
                "events",
                "p50 ms",
                "p95 ms",
                "p99 ms",
                "max ms"
            );
            for l in &self.latency {
                let _ = writeln!(
                    s,
                    "  {:<8} {:>9} {:>10.0} {:>8} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                    l.wakeup,
                    l.offered_rate,
                    l.achieved_rate,
                    l.events,
                    l.p50_ms,
                    l.p95_ms,
                    l.p99_ms,
                    l.max_ms
                );
            }
            let _ = writeln!(s, "\nrelay steps during the latency runs (p50 / p99 ms)");
            let _ = writeln!(
                s,
                "  {:<8} {:>12} {:>15} {:>15} {:>15}",
                "wake-up", "events/batch", "claim", "publish", "settle"
            );
            for l in &self.latency {
                let g = &l.stages;
                let _ = writeln!(
                    s,
                    "  {:<8} {:>12.1} {}",
                    l.wakeup,
                    g.mean_batch_events,
                    g.steps()
                );
            }
        }
        if !self.claim.is_empty() {
            let _ = writeln!(s, "\nclaim cost (batch of {})", o.relay.batch_size);
            let _ = writeln!(
                s,
                "  {:<34} {:>11} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9}",
                "table state",
                "pending",
                "processed",
                "median ms",
                "p95 ms",
                "vs first",
                "stats ms",
                "count ms"
            );
            for c in &self.claim {
                let _ = writeln!(
                    s,
                    "  {:<34} {:>11} {:>11} {:>9.2} {:>9.2} {:>8.2}x {:>9.2} {:>9.2}",
                    c.state,
                    c.pending_rows,
                    c.processed_rows,
                    c.median_ms,
                    c.p95_ms,
                    c.vs_first,
                    c.stats_ms,
                    c.exact_count_ms
                );
            }
        }
        s
    }
}

/// Runs the phases of `options` against the database at `url`, publishing to `target`; `progress`
/// receives a line at each step.
///
/// # Errors
/// A config error for invalid options; a database or publisher error that stops a phase (an event
/// the target dead-letters stops the drain with the row's error, since a benchmark of failures
/// measures nothing).
pub async fn run(
    url: &str,
    target: &dyn BenchTarget,
    options: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<BenchReport, Error> {
    options.validate()?;
    let admin = connect(url, 4).await?;
    let schema = options.schema.clone();
    exec(&admin, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await?;
    exec(&admin, &format!("CREATE SCHEMA {schema}")).await?;
    let mut report = BenchReport {
        target: target.name().to_string(),
        options: options.clone(),
        writer: None,
        drain: Vec::new(),
        latency: Vec::new(),
        claim: Vec::new(),
        ratios: Ratios::default(),
        notes: Vec::new(),
        relay_peak_rss_bytes: None,
        publisher: None,
    };
    let result = run_phases(url, &admin, target, options, progress, &mut report).await;
    // The schema goes whatever happened.
    let dropped = exec(&admin, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await;
    result?;
    dropped?;
    report.compute_ratios();
    Ok(report)
}

async fn run_phases(
    url: &str,
    admin: &PgPool,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
    report: &mut BenchReport,
) -> Result<(), Error> {
    let table = OutboxTable::new(&o.schema, "outbox_events")?;
    migrate(admin, &table).await?;
    let has = |p| o.phases.contains(&p);
    if has(Phase::Writer) {
        report.writer = Some(writer_phase(url, admin, &table, o, progress).await?);
    }
    let mut fill = 1;
    if has(Phase::Drain) {
        truncate(admin, &table).await?;
        progress(&format!("drain: filling {} events", o.backlog));
        prefill(admin, &table, o.backlog as u64, o, false, 99, None).await?;
        report
            .drain
            .push(yardstick_run(url, &table, o.backlog as u64, o, progress).await?);
        for relays in dedup([1, o.relays]) {
            for t in [&DiscardTarget as &dyn BenchTarget, target] {
                truncate(admin, &table).await?;
                progress(&format!("drain: filling {} events", o.backlog));
                prefill(admin, &table, o.backlog as u64, o, false, fill, None).await?;
                fill += 1;
                t.reset().await?;
                let d = drain_run(url, &table, t, relays, o.backlog as u64, o, progress).await?;
                report.drain.push(d);
            }
        }
    }
    if has(Phase::Drain) {
        match WalBench::prepare(url, admin, &table, progress).await? {
            Some(wal) => {
                for t in [&DiscardTarget as &dyn BenchTarget, target] {
                    let result = async {
                        wal.reset(admin).await?;
                        progress(&format!(
                            "drain (WAL source): filling {} events in transactions of {WAL_FILL_TX_ROWS}",
                            o.backlog
                        ));
                        prefill(admin, &table, o.backlog as u64, o, false, fill, Some(WAL_FILL_TX_ROWS)).await?;
                        fill += 1;
                        t.reset().await?;
                        wal_drain_run(url, &wal, t, o.backlog as u64, o, progress).await
                    }
                    .await;
                    match result {
                        Ok(d) => report.drain.push(d),
                        Err(e) => {
                            wal.drop(admin).await;
                            return Err(e);
                        }
                    }
                }
                wal.drop(admin).await;
            }
            None => report.notes.push(WAL_UNAVAILABLE.into()),
        }
    }
    if has(Phase::Drain) && target.name() != DiscardTarget.name() {
        target.reset().await?;
        report.publisher = Some(publisher_run(target, o.backlog as u64, o, progress).await?);
        target.reset().await?;
    }
    if has(Phase::Reference) {
        let reference = OutboxTable::new(&o.schema, "outbox_reference")?;
        migrate(admin, &reference).await?;
        // The classic design's own index (the claim orders by created_at).
        exec(
            admin,
            &format!(
                "CREATE INDEX IF NOT EXISTS idx_outbox_unprocessed ON {} (created_at) WHERE processed_at IS NULL",
                reference.qualified()
            ),
        )
        .await?;
        progress(&format!("reference: filling {} events", o.reference_events));
        prefill(
            admin,
            &reference,
            o.reference_events as u64,
            o,
            false,
            90,
            None,
        )
        .await?;
        target.reset().await?;
        report
            .drain
            .push(reference_run(url, &reference, target, o, progress).await?);
    }
    if has(Phase::Latency) {
        for notify_on in [false, true] {
            truncate(admin, &table).await?;
            target.reset().await?;
            report
                .latency
                .push(latency_run(url, admin, &table, target, o, notify_on, None, progress).await?);
        }
        match WalBench::prepare(url, admin, &table, progress).await? {
            Some(wal) => {
                wal.reset(admin).await?;
                target.reset().await?;
                let run =
                    latency_run(url, admin, &table, target, o, false, Some(&wal), progress).await;
                wal.drop(admin).await;
                report.latency.push(run?);
            }
            None => report.notes.push(WAL_UNAVAILABLE.into()),
        }
    }
    if has(Phase::Claim) {
        report.claim = claim_phase(admin, o, progress).await?;
    }
    Ok(())
}

fn dedup(v: [usize; 2]) -> Vec<usize> {
    if v[0] == v[1] {
        vec![v[0]]
    } else {
        v.to_vec()
    }
}

async fn exec(pool: &PgPool, sql: &str) -> Result<(), Error> {
    sqlx::query(sql)
        .execute(pool)
        .await
        .map_err(|e| map_sqlx("bench", e))?;
    Ok(())
}

async fn truncate(pool: &PgPool, table: &OutboxTable) -> Result<(), Error> {
    exec(pool, &format!("TRUNCATE {}", table.qualified())).await
}

fn payload(n: u64, pad: usize) -> serde_json::Value {
    serde_json::json!({ "order_id": n, "total": n % 1000, "pad": "x".repeat(pad) })
}

/// Inserts `count` events over `o.aggregates` aggregates in one statement per million rows (per
/// 2,000 rows over more than 2,000 aggregates), with time-ordered ids (as the writer's UUID v7),
/// then analyzes the table. `fill` keeps ids of different fills apart.
/// With `tx_rows`, that many rows per transaction instead (the WAL source reads a transaction
/// whole: a backlog written as writers write it, in small transactions).
async fn prefill(
    pool: &PgPool,
    table: &OutboxTable,
    count: u64,
    o: &BenchOptions,
    processed: bool,
    fill: u32,
    tx_rows: Option<u64>,
) -> Result<(), Error> {
    let sql = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, processed_at)
         SELECT (lpad(to_hex($1::bigint), 8, '0') || '-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
                'bench', 'a' || (g % $2), 'bench.event',
                jsonb_build_object('order_id', g, 'total', g % 1000, 'pad', repeat('x', $3)),
                CASE WHEN $4 THEN now() END
         FROM generate_series($5::bigint, $6::bigint) g",
        table.qualified()
    );
    // Each row takes its aggregate's transaction-scoped lock (the writer-order trigger): a
    // statement writing more distinct aggregates than the server's lock table holds fails with
    // "out of shared memory", so a fill over many aggregates goes a few thousand rows at a time.
    let chunk = match tx_rows {
        Some(rows) => rows.max(1),
        None if o.aggregates <= 2_000 => 1_000_000u64,
        None => 2_000,
    };
    let mut from = 1u64;
    while from <= count {
        let to = (from + chunk - 1).min(count);
        sqlx::query(&sql)
            .bind(i64::from(fill))
            .bind(o.aggregates as i64)
            .bind(o.payload_bytes as i32)
            .bind(processed)
            .bind(from as i64)
            .bind(to as i64)
            .execute(pool)
            .await
            .map_err(|e| map_sqlx("bench prefill", e))?;
        from = to + 1;
    }
    exec(pool, &format!("VACUUM ANALYZE {}", table.qualified())).await
}

// ---------------------------------------------------------------------------------------------
// Writer throughput

async fn writer_phase(
    url: &str,
    admin: &PgPool,
    table: &OutboxTable,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<WriterFigures, Error> {
    let orders = format!("{}.bench_orders", o.schema);
    exec(
        admin,
        &format!(
            "CREATE TABLE {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             customer text NOT NULL, total bigint NOT NULL, body jsonb NOT NULL)"
        ),
    )
    .await?;
    let pool = connect(url, o.writers as u32).await?;
    let (mut without, mut with, mut noop, mut unordered, mut message, mut in_statement) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let trigger = format!(
        "ALTER TABLE {} {{}} TRIGGER \"{}_writer_order\"",
        table.qualified(),
        table.table()
    );
    // Alternating runs, so that drift in the machine's state affects every variant alike.
    for round in 1..=2 {
        for extra in [
            Extra::None,
            Extra::Outbox,
            Extra::Noop,
            Extra::OutboxUnordered,
            Extra::Message,
            Extra::MessageInStatement,
        ] {
            exec(admin, &format!("TRUNCATE {orders}, {}", table.qualified())).await?;
            let unordered_run = matches!(extra, Extra::OutboxUnordered);
            if unordered_run {
                exec(admin, &trigger.replace("{}", "DISABLE")).await?;
            }
            let run = writer_run(&pool, &orders, table, o, extra).await;
            if unordered_run {
                exec(admin, &trigger.replace("{}", "ENABLE")).await?;
            }
            let tps = run?;
            progress(&format!(
                "writer: round {round}, {}: {tps:.0} tx/s",
                extra.label()
            ));
            match extra {
                Extra::None => without += tps / 2.0,
                Extra::Outbox => with += tps / 2.0,
                Extra::Noop => noop += tps / 2.0,
                Extra::OutboxUnordered => unordered += tps / 2.0,
                Extra::Message => message += tps / 2.0,
                Extra::MessageInStatement => in_statement += tps / 2.0,
            }
        }
    }
    pool.close().await;
    Ok(WriterFigures {
        writers: o.writers,
        without_outbox_tps: without,
        with_outbox_tps: with,
        overhead: ratio(with, without).map_or(0.0, |r| 1.0 - r),
        with_noop_statement_tps: noop,
        noop_statement_overhead: ratio(noop, without).map_or(0.0, |r| 1.0 - r),
        with_outbox_without_ordering_tps: unordered,
        ordering_rule_overhead: ratio(with, unordered).map_or(0.0, |r| 1.0 - r),
        with_message_tps: message,
        message_overhead: ratio(message, without).map_or(0.0, |r| 1.0 - r),
        with_message_in_statement_tps: in_statement,
        message_in_statement_overhead: ratio(in_statement, without).map_or(0.0, |r| 1.0 - r),
    })
}

/// What a writer run adds to each business transaction.
#[derive(Debug, Clone, Copy)]
enum Extra {
    None,
    Outbox,
    /// `SELECT 1`: the cost of one more statement round trip alone.
    Noop,
    /// The outbox insert with the writer-order trigger disabled.
    OutboxUnordered,
    /// A table-less event (a transactional logical decoding message) instead of the insert.
    Message,
    /// The table-less event written by the business statement itself.
    MessageInStatement,
}

impl Extra {
    fn label(self) -> &'static str {
        match self {
            Extra::None => "without outbox",
            Extra::Outbox => "with outbox",
            Extra::Noop => "with SELECT 1",
            Extra::OutboxUnordered => "with outbox, no ordering trigger",
            Extra::Message => "with a table-less event",
            Extra::MessageInStatement => "with a table-less event in the business statement",
        }
    }
}

async fn writer_run(
    pool: &PgPool,
    orders: &str,
    table: &OutboxTable,
    o: &BenchOptions,
    extra: Extra,
) -> Result<f64, Error> {
    let prefix = format!("{}-bench", o.schema);
    let insert = Arc::<str>::from(match extra {
        // What a plain-SQL writer of table-less events would write: the business row and its event
        // in one statement.
        Extra::MessageInStatement => format!(
            "WITH o AS (INSERT INTO {orders} (customer, total, body) VALUES ($1, $2, $3::jsonb) RETURNING id)
             SELECT o.id FROM o, LATERAL (SELECT pg_logical_emit_message(true, '{prefix}',
                 json_build_object('aggregate_type', 'order', 'aggregate_id', o.id::text,
                                   'event_type', 'order.created', 'payload', $3::jsonb)::text)) m"
        ),
        _ => format!(
            "INSERT INTO {orders} (customer, total, body) VALUES ($1, $2, $3::jsonb) RETURNING id"
        ),
    });
    let writer = Writer::new(table.clone());
    // A prefix of the benchmark's own: no outbox's reader takes these messages.
    let messages = outbox_postgres::wal::MessageWriter::new(prefix);
    let started = Instant::now();
    let deadline = started + o.writer_duration;
    let mut tasks = Vec::new();
    for w in 0..o.writers {
        let (pool, insert, writer, messages, pad) = (
            pool.clone(),
            insert.clone(),
            writer.clone(),
            messages.clone(),
            o.payload_bytes,
        );
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < deadline {
                let n = done * 64 + w as u64;
                let body = payload(n, pad);
                let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
                let id: i64 = sqlx::query_scalar(&insert)
                    .bind(format!("customer-{}", n % 1000))
                    .bind((n % 1000) as i64)
                    .bind(body.to_string())
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx("bench", e))?;
                match extra {
                    Extra::None | Extra::MessageInStatement => {}
                    Extra::Outbox | Extra::OutboxUnordered => {
                        writer
                            .enqueue(
                                &mut tx,
                                NewEvent::new("order", id.to_string(), "order.created", body),
                            )
                            .await?;
                    }
                    Extra::Message => {
                        messages
                            .emit(
                                &mut tx,
                                NewEvent::new("order", id.to_string(), "order.created", body),
                            )
                            .await?;
                    }
                    Extra::Noop => {
                        sqlx::query("SELECT 1")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| map_sqlx("bench", e))?;
                    }
                }
                tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
                done += 1;
            }
            Ok::<u64, Error>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += join(t).await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Every committed business transaction left exactly one event (none for the other variants).
    let events: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("bench", e))?;
    let expected = match extra {
        Extra::Outbox | Extra::OutboxUnordered => total,
        Extra::None | Extra::Noop | Extra::Message | Extra::MessageInStatement => 0,
    };
    if u64::try_from(events).ok() != Some(expected) {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!(
                "writer run `{}` committed {total} business transactions but the outbox holds {events} events (expected {expected})",
                extra.label()
            ),
        ));
    }
    Ok(total as f64 / elapsed)
}

async fn join<T>(t: tokio::task::JoinHandle<T>) -> Result<T, Error> {
    t.await.map_err(|e| {
        Error::new(
            ErrorKind::Unexpected,
            format!("a benchmark task failed: {e}"),
        )
        .with_source(e)
    })
}

// ---------------------------------------------------------------------------------------------
// Drain

/// Counts settled events across the relays of a run.
#[derive(Default)]
struct Counter {
    published: AtomicU64,
    dead_lettered: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Durations of the claims that returned events, in ms.
    claims_ms: Mutex<Vec<f64>>,
    /// Per settled batch: events, publish ms, settle ms.
    batches: Mutex<Vec<(usize, f64, f64)>>,
}

impl RelayObserver for Counter {
    fn claimed(&self, count: usize, duration: Duration) {
        if count > 0 {
            if let Ok(mut c) = self.claims_ms.lock() {
                c.push(duration.as_secs_f64() * 1000.0);
            }
        }
    }

    fn event_failed(&self, _event: &Event, error: &Error, _d: outbox_core::FailureDecision) {
        if let Ok(mut e) = self.last_error.lock() {
            *e = Some(error.to_string());
        }
    }

    fn batch_settled(&self, report: &BatchReport) {
        if let Ok(mut b) = self.batches.lock() {
            b.push((
                report.claimed,
                report.publish_duration.as_secs_f64() * 1000.0,
                report.settle_duration.as_secs_f64() * 1000.0,
            ));
        }
        if report.settle_error.is_none() {
            self.published
                .fetch_add(report.published as u64, Ordering::Relaxed);
            self.dead_lettered
                .fetch_add(report.dead_lettered as u64, Ordering::Relaxed);
        }
    }
}

impl Counter {
    /// Where the relay's time went: claim, publish and settle medians and 99th percentiles.
    fn stages(&self) -> StageFigures {
        let mut claims = self.claims_ms.lock().map(|c| c.clone()).unwrap_or_default();
        let batches = self.batches.lock().map(|b| b.clone()).unwrap_or_default();
        let mut publish: Vec<f64> = batches.iter().map(|b| b.1).collect();
        let mut settle: Vec<f64> = batches.iter().map(|b| b.2).collect();
        for v in [&mut claims, &mut publish, &mut settle] {
            v.sort_by(f64::total_cmp);
        }
        let events: usize = batches.iter().map(|b| b.0).sum();
        StageFigures {
            batches: batches.len(),
            mean_batch_events: ratio(events as f64, batches.len() as f64).unwrap_or(0.0),
            claim_p50_ms: percentile(&claims, 50.0),
            claim_p99_ms: percentile(&claims, 99.0),
            publish_p50_ms: percentile(&publish, 50.0),
            publish_p99_ms: percentile(&publish, 99.0),
            settle_p50_ms: percentile(&settle, 50.0),
            settle_p99_ms: percentile(&settle, 99.0),
        }
    }

    fn last_error(&self) -> String {
        self.last_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| "no error recorded".into())
    }
}

/// The resident set size of this process, from /proc (Linux); `None` elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Samples the RSS every 50 ms until dropped; `peak()` is the largest seen.
struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl RssSampler {
    fn start() -> Self {
        let peak = Arc::new(AtomicU64::new(rss_bytes().unwrap_or(0)));
        let stop = CancellationToken::new();
        let (p, s) = (peak.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                if let Some(r) = rss_bytes() {
                    p.fetch_max(r, Ordering::Relaxed);
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = s.cancelled() => return,
                }
            }
        });
        RssSampler { peak, stop }
    }

    fn peak(&self) -> Option<u64> {
        Some(self.peak.load(Ordering::Relaxed)).filter(|p| *p > 0)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn drain_run(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    relays: usize,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let counter = Arc::new(Counter::default());
    let shutdown = CancellationToken::new();
    let mut built = Vec::new();
    for _ in 0..relays {
        // One pool per relay, as separate processes have: a connection per batch in flight, one
        // for the claim.
        let pool = connect(url, o.relay.max_in_flight as u32 + 1).await?;
        let store = Arc::new(PostgresStore::with_retention(
            pool,
            table.clone(),
            Retention::Delete,
        ));
        let publisher = delayed(target.publisher().await?, o.publish_delay);
        publisher.check().await?;
        built.push(Relay::new(store, publisher, o.relay.clone())?.with_observer(counter.clone()));
    }
    progress(&format!(
        "drain: {} relay(s) -> {}, {events} events",
        relays,
        target.name()
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let handles: Vec<_> = built
        .into_iter()
        .map(|relay| {
            let s = shutdown.clone();
            tokio::spawn(async move { relay.run(s).await })
        })
        .collect();
    let outcome = wait_for_settled(&counter, events, progress).await;
    let seconds = started.elapsed().as_secs_f64();
    shutdown.cancel();
    for h in handles {
        join(h).await?;
    }
    outcome?;
    let rate = events as f64 / seconds;
    progress(&format!(
        "drain: {} relay(s) -> {}: {rate:.0} events/s",
        relays,
        target.name()
    ));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "relay".into(),
        relays,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: Some(counter.stages()),
    })
}

/// `publisher`, each call of which takes `delay` more (none when zero).
fn delayed(publisher: Arc<dyn Publisher>, delay: Duration) -> Arc<dyn Publisher> {
    if delay.is_zero() {
        publisher
    } else {
        Arc::new(Wrapped {
            inner: publisher,
            delay,
            acks: None,
        })
    }
}

/// The yardstick of the drain: one statement, run back to back on one connection until the table
/// is empty, that deletes the oldest `batch_size` pending rows it can lock and returns them to the
/// client, as a relay that keeps no order and publishes nothing would. What the database can drain
/// from this table, with its indexes, when nothing else is asked of it.
async fn yardstick_run(
    url: &str,
    table: &OutboxTable,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let pool = connect(url, 1).await?;
    let sql = format!(
        "WITH c AS (SELECT id FROM {t} WHERE processed_at IS NULL AND dead_lettered_at IS NULL \
                    ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
         DELETE FROM {t} o USING c WHERE o.id = c.id RETURNING o.*",
        t = table.qualified()
    );
    progress(&format!(
        "drain: yardstick (one DELETE ... RETURNING of {} rows after another), {events} events",
        o.relay.batch_size
    ));
    let started = Instant::now();
    let mut drained = 0u64;
    loop {
        let rows = sqlx::query(&sql)
            .bind(o.relay.batch_size as i64)
            .fetch_all(&pool)
            .await
            .map_err(|e| map_sqlx("bench yardstick", e))?;
        if rows.is_empty() {
            break;
        }
        drained += rows.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    if drained != events {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!("the yardstick drained {drained} events of the {events} filled"),
        ));
    }
    let rate = events as f64 / seconds;
    progress(&format!("drain: yardstick: {rate:.0} events/s"));
    Ok(DrainFigures {
        publisher: "none".into(),
        relay: "yardstick".into(),
        relays: 1,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: None,
        stages: None,
    })
}

/// Waits until `events` were published; fails on a dead letter or when nothing moves for 60 s.
async fn wait_for_settled(
    counter: &Counter,
    events: u64,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(), Error> {
    let mut last = (0, Instant::now());
    let mut last_report = Instant::now();
    loop {
        let published = counter.published.load(Ordering::Relaxed);
        let dead = counter.dead_lettered.load(Ordering::Relaxed);
        if dead > 0 {
            return Err(Error::new(
                ErrorKind::Unexpected,
                format!(
                    "{dead} events were dead-lettered during the benchmark (last error: {}); check the publisher's destination",
                    counter.last_error()
                ),
            ));
        }
        if published >= events {
            return Ok(());
        }
        if published != last.0 {
            last = (published, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "no progress for 60 s at {published} of {events} events (last error: {})",
                    counter.last_error()
                ),
            ));
        }
        if last_report.elapsed() >= Duration::from_secs(2) {
            progress(&format!("  {published} / {events}"));
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The reference relay: the classic design, as the article's relay loop does it.

async fn reference_run(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    const BATCH: i64 = 100;
    const MAX_ATTEMPTS: i32 = 10;
    let pool = connect(url, 2).await?;
    let publisher = target.publisher().await?;
    publisher.check().await?;
    let t = table.qualified();
    let select = format!(
        "SELECT {EVENT_COLUMNS} FROM {t} e
         WHERE e.processed_at IS NULL AND e.attempts < $1
         ORDER BY e.created_at
         LIMIT $2
         FOR UPDATE SKIP LOCKED"
    );
    let done = format!("UPDATE {t} SET processed_at = now() WHERE id = $1");
    let failed = format!("UPDATE {t} SET attempts = attempts + 1 WHERE id = $1");
    progress(&format!(
        "reference: 1 classic relay -> {}, {} events",
        target.name(),
        o.reference_events
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let mut published = 0u64;
    let mut last_report = Instant::now();
    let mut last_error = None;
    loop {
        let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
        let rows = sqlx::query(&select)
            .bind(MAX_ATTEMPTS)
            .bind(BATCH)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| map_sqlx("bench", e))?;
        if rows.is_empty() {
            tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
            break;
        }
        for row in &rows {
            let event = decode_event(row)?;
            let outcome = publisher.publish(std::slice::from_ref(&event)).await;
            let sql = match outcome.into_iter().next() {
                Some(Ok(())) => {
                    published += 1;
                    &done
                }
                Some(Err(e)) => {
                    last_error = Some(e.to_string());
                    &failed
                }
                None => &failed,
            };
            sqlx::query(sql)
                .bind(event.id)
                .execute(&mut *tx)
                .await
                .map_err(|e| map_sqlx("bench", e))?;
        }
        tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
        if last_report.elapsed() >= Duration::from_secs(2) {
            progress(&format!("  {published} / {}", o.reference_events));
            last_report = Instant::now();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if published < o.reference_events as u64 {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!(
                "the reference relay published {published} of {} events (last error: {})",
                o.reference_events,
                last_error.unwrap_or_else(|| "none".into())
            ),
        ));
    }
    let rate = published as f64 / seconds;
    progress(&format!("reference: {rate:.0} events/s"));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "reference".into(),
        relays: 1,
        events: published,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: None,
    })
}

// ---------------------------------------------------------------------------------------------
// Latency

/// Records when each event was acknowledged.
/// Publishes `events` events built in memory through the target's publisher, in calls of the
/// relay's batch size with its `max_in_flight` calls at once: what the broker takes from this
/// publisher when no database is involved.
async fn publisher_run(
    target: &dyn BenchTarget,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<PublisherFigures, Error> {
    let publisher = delayed(target.publisher().await?, o.publish_delay);
    publisher.check().await?;
    let batch_size = o.relay.batch_size.max(1);
    let in_flight = o.relay.max_in_flight.max(1);
    progress(&format!(
        "publisher alone: {events} events -> {}, calls of {batch_size}, {in_flight} in flight",
        target.name()
    ));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (publisher, next) = (publisher.clone(), next.clone());
        let (aggregates, pad) = (o.aggregates.max(1) as u64, o.payload_bytes);
        tasks.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            loop {
                let from = next.fetch_add(batch_size as u64, Ordering::Relaxed);
                if from >= events {
                    break;
                }
                let to = (from + batch_size as u64).min(events);
                let batch: Vec<Event> = (from..to)
                    .map(|g| Event {
                        id: Uuid::now_v7(),
                        aggregate_type: "bench".into(),
                        aggregate_id: format!("a{}", g % aggregates),
                        event_type: "bench.event".into(),
                        payload: payload(g, pad).to_string().into_bytes(),
                        content_type: "application/json".into(),
                        headers: Default::default(),
                        destination: None,
                        created_at: chrono::Utc::now(),
                        attempts: 0,
                    })
                    .collect();
                let call = Instant::now();
                let outcomes = publisher.publish(&batch).await;
                calls.push(call.elapsed().as_secs_f64() * 1000.0);
                if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
                    return Err(e);
                }
            }
            Ok::<Vec<f64>, Error>(calls)
        }));
    }
    let mut calls = Vec::new();
    for t in tasks {
        calls.extend(join(t).await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    calls.sort_by(f64::total_cmp);
    let figures = PublisherFigures {
        events,
        batch_size,
        in_flight,
        seconds,
        events_per_second: events as f64 / seconds,
        batch_p50_ms: percentile(&calls, 50.0),
        batch_p99_ms: percentile(&calls, 99.0),
    };
    progress(&format!(
        "publisher alone -> {}: {:.0} events/s, call p99 {:.1} ms",
        target.name(),
        figures.events_per_second,
        figures.batch_p99_ms
    ));
    Ok(figures)
}

/// The target's publisher as a benchmark run uses it: each call takes `delay` more
/// (`--publish-delay`), and the time of each acknowledgement is kept when `acks` is set.
struct Wrapped {
    inner: Arc<dyn Publisher>,
    delay: Duration,
    acks: Option<Mutex<Vec<(Uuid, Instant)>>>,
}

#[async_trait]
impl Publisher for Wrapped {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let outcomes = self.inner.publish(events).await;
        if let Some(Ok(mut acks)) = self.acks.as_ref().map(Mutex::lock) {
            let now = Instant::now();
            for (e, o) in events.iter().zip(&outcomes) {
                if o.is_ok() {
                    acks.push((e.id, now));
                }
            }
        }
        outcomes
    }

    async fn check(&self) -> Result<(), Error> {
        self.inner.check().await
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn keeps_order(&self) -> bool {
        self.inner.keeps_order()
    }

    fn same_call(&self, earlier: &Event, later: &Event) -> bool {
        self.inner.same_call(earlier, later)
    }

    fn call_limit(&self) -> Option<outbox_core::CallLimit> {
        self.inner.call_limit()
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[allow(clippy::too_many_arguments)]
async fn latency_run(
    url: &str,
    admin: &PgPool,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    notify_on: bool,
    wal: Option<&WalBench>,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<LatencyFigures, Error> {
    let wakeup = match (wal, notify_on) {
        (Some(_), _) => "wal",
        (None, true) => "notify",
        (None, false) => "poll",
    };
    if notify_on {
        notify::install_notify_trigger(admin, table).await?;
    }
    let result = latency_inner(url, table, target, o, notify_on, wal, progress).await;
    if notify_on {
        notify::remove_notify_trigger(admin, table).await?;
    }
    let (committed, acks, seconds, stages) = result?;
    let warm_up = committed
        .iter()
        .map(|(_, t)| *t)
        .min()
        .map(|t| t + Duration::from_secs(1));
    let acked: HashMap<Uuid, Instant> = acks.into_iter().collect();
    let mut ms: Vec<f64> = committed
        .iter()
        .filter(|(_, t)| Some(*t) >= warm_up)
        .filter_map(|(id, t)| {
            acked
                .get(id)
                .map(|a| a.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let figures = LatencyFigures {
        wakeup: wakeup.into(),
        offered_rate: o.rate,
        achieved_rate: committed.len() as f64 / seconds,
        events: ms.len(),
        p50_ms: percentile(&ms, 50.0),
        p95_ms: percentile(&ms, 95.0),
        p99_ms: percentile(&ms, 99.0),
        max_ms: ms.last().copied().unwrap_or(0.0),
        stages,
    };
    progress(&format!(
        "latency ({wakeup}): p50 {:.2} ms, p99 {:.2} ms at {:.0} events/s",
        figures.p50_ms, figures.p99_ms, figures.achieved_rate
    ));
    Ok(figures)
}

type Stamps = Vec<(Uuid, Instant)>;

async fn latency_inner(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    notify_on: bool,
    wal: Option<&WalBench>,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(Stamps, Stamps, f64, StageFigures), Error> {
    let relay_pool = connect(url, o.relay.max_in_flight as u32 + 2).await?;
    let clock = Arc::new(Wrapped {
        inner: target.publisher().await?,
        delay: Duration::ZERO,
        acks: Some(Mutex::new(Vec::new())),
    });
    clock.check().await?;
    let counter = Arc::new(Counter::default());
    let wake = outbox_core::Wake::new();
    let (store, reader): (Arc<dyn Store>, _) = match wal {
        Some(w) => {
            let store = w.store(relay_pool.clone(), wake.clone(), o);
            let reader = store.start();
            (Arc::new(store), Some(reader))
        }
        None => (
            Arc::new(PostgresStore::new(relay_pool.clone(), table.clone())),
            None,
        ),
    };
    let relay = Relay::new(store, clock.clone(), o.relay.clone())?
        .with_observer(counter.clone())
        .with_wake(wake);
    let shutdown = CancellationToken::new();
    if notify_on {
        let (pool, table, wake, s) = (
            relay_pool.clone(),
            table.clone(),
            relay.wake_handle(),
            shutdown.clone(),
        );
        tokio::spawn(async move { notify::listen(&pool, &table, wake, s).await });
    }
    let relay_task = {
        let s = shutdown.clone();
        tokio::spawn(async move { relay.run(s).await })
    };
    // The writers commit one event per transaction, spread over tasks so that commit flushes overlap;
    // they do not wake the relay (it stands for a relay in another process).
    let tasks_n = 8usize;
    let period = Duration::from_secs_f64(tasks_n as f64 / f64::from(o.rate));
    let writer_pool = connect(url, tasks_n as u32).await?;
    let writer = Writer::new(table.clone());
    progress(&format!(
        "latency ({}): {} events/s for {}",
        match (wal, notify_on) {
            (Some(_), _) => "wal",
            (None, true) => "notify",
            (None, false) => "poll",
        },
        o.rate,
        outbox_core::duration::format(o.latency_duration)
    ));
    let started = Instant::now();
    let deadline = started + o.latency_duration;
    let mut tasks = Vec::new();
    for w in 0..tasks_n {
        let (pool, writer, pad) = (writer_pool.clone(), writer.clone(), o.payload_bytes);
        let aggregates = o.aggregates as u64;
        tasks.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(
                started + period.mul_f64(w as f64 / tasks_n as f64),
                period,
            );
            let mut stamps = Vec::new();
            let mut n = 0u64;
            loop {
                ticks.tick().await;
                if Instant::now() >= deadline {
                    break;
                }
                let k = n * tasks_n as u64 + w as u64;
                let event = NewEvent::new(
                    "order",
                    format!("a{}", k % aggregates),
                    "order.created",
                    payload(k, pad),
                );
                let id = event.id;
                let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
                writer.enqueue(&mut tx, event).await?;
                tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
                stamps.push((id, Instant::now()));
                n += 1;
            }
            Ok::<Stamps, Error>(stamps)
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        committed.extend(join(t).await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let settled = wait_for_settled(&counter, committed.len() as u64, progress).await;
    shutdown.cancel();
    join(relay_task).await?;
    if let Some(reader) = reader {
        reader.stop().await;
    }
    settled?;
    let acks = clock
        .acks
        .as_ref()
        .and_then(|a| a.lock().ok().map(|mut a| std::mem::take(&mut *a)))
        .unwrap_or_default();
    Ok((committed, acks, seconds, counter.stages()))
}

// ---------------------------------------------------------------------------------------------
// The WAL source

/// Rows per transaction of the WAL source's drain backlog.
const WAL_FILL_TX_ROWS: u64 = 100;

/// Said in the report when the server cannot decode its WAL.
const WAL_UNAVAILABLE: &str =
    "WAL source not measured: the server's wal_level is not logical (set it and restart PostgreSQL)";

/// The bench's slot, publication and held table over its outbox table.
struct WalBench {
    slot: WalSlot,
    held: OutboxTable,
    config: WalConfig,
    url: String,
}

impl WalBench {
    /// A fresh slot (a leftover of an earlier run is dropped) and held table; `None` when the
    /// server's `wal_level` is not `logical`.
    async fn prepare(
        url: &str,
        admin: &PgPool,
        table: &OutboxTable,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<Option<WalBench>, Error> {
        if check_wal_level(&wal_level(admin).await?).is_err() {
            progress(WAL_UNAVAILABLE);
            return Ok(None);
        }
        // Named after the bench's schema (slots are server-wide: two benches at once in two
        // schemas each have their own), as `outbox wal setup` names them.
        let config = WalConfig {
            message_prefix: table.schema().to_string(),
            ..WalConfig::default()
        };
        let slot = config.slot(table)?;
        let held = config.held_table(table)?;
        migrate(admin, &held).await?;
        let wal = WalBench {
            slot,
            held,
            config,
            url: url.to_string(),
        };
        wal.drop(admin).await;
        Ok(Some(wal))
    }

    /// Empties the tables and makes the slot anew, so that it holds what is written next only.
    async fn reset(&self, admin: &PgPool) -> Result<(), Error> {
        self.drop(admin).await;
        truncate(admin, self.slot.table()).await?;
        truncate(admin, &self.held).await?;
        self.slot.setup(admin).await?;
        Ok(())
    }

    /// Drops the slot and publication (a slot left behind keeps WAL for ever).
    async fn drop(&self, admin: &PgPool) {
        if let Err(e) = self.slot.drop(admin).await {
            tracing::warn!(error = %e, slot = self.slot.slot(), "cannot drop the bench's slot: drop it with `outbox wal drop`");
        }
    }

    fn store(&self, pool: PgPool, wake: outbox_core::Wake, o: &BenchOptions) -> WalStore {
        WalStore::new(
            pool.clone(),
            &self.url,
            self.slot.clone(),
            PostgresStore::new(pool, self.held.clone()),
            &self.config,
        )
        .with_wake(wake)
        .with_held_poll_interval(o.relay.poll_interval)
    }
}

/// One relay over the WAL source drains the backlog the slot holds to `target`.
async fn wal_drain_run(
    url: &str,
    wal: &WalBench,
    target: &dyn BenchTarget,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let counter = Arc::new(Counter::default());
    let shutdown = CancellationToken::new();
    let pool = connect(url, o.relay.max_in_flight as u32 + 1).await?;
    let wake = outbox_core::Wake::new();
    let store = wal.store(pool, wake.clone(), o);
    let publisher = delayed(target.publisher().await?, o.publish_delay);
    publisher.check().await?;
    let relay = Relay::new(Arc::new(store.clone()), publisher, o.relay.clone())?
        .with_observer(counter.clone())
        .with_wake(wake);
    progress(&format!(
        "drain (WAL source): 1 relay -> {}, {events} events",
        target.name()
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let reader = store.start();
    let handle = {
        let s = shutdown.clone();
        tokio::spawn(async move { relay.run(s).await })
    };
    let outcome = wait_for_settled(&counter, events, progress).await;
    let seconds = started.elapsed().as_secs_f64();
    shutdown.cancel();
    join(handle).await?;
    reader.stop().await;
    outcome?;
    let rate = events as f64 / seconds;
    progress(&format!(
        "drain (WAL source): 1 relay -> {}: {rate:.0} events/s",
        target.name()
    ));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "wal".into(),
        relays: 1,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: Some(counter.stages()),
    })
}

// ---------------------------------------------------------------------------------------------
// Claim cost

async fn claim_phase(
    admin: &PgPool,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Vec<ClaimFigures>, Error> {
    let table = OutboxTable::new(&o.schema, "outbox_claim")?;
    migrate(admin, &table).await?;
    let store = PostgresStore::with_retention(admin.clone(), table.clone(), Retention::Keep);
    let small = 10_000u64;
    let mut out: Vec<ClaimFigures> = Vec::new();
    let mut push = |state: &str,
                    pending,
                    processed,
                    (median, p95): (f64, f64),
                    (stats_ms, exact_count_ms): (f64, f64)| {
        let first = out.first().map_or(median, |f| f.median_ms);
        progress(&format!(
            "claim: {state}: median {median:.2} ms; statistics {stats_ms:.2} ms (exact count {exact_count_ms:.2} ms)"
        ));
        out.push(ClaimFigures {
            state: state.into(),
            pending_rows: pending,
            processed_rows: processed,
            median_ms: median,
            p95_ms: p95,
            vs_first: ratio(median, first).unwrap_or(1.0),
            stats_ms,
            exact_count_ms,
        });
    };
    progress(&format!("claim: {small} pending rows, no history"));
    prefill(admin, &table, small, o, false, 100, None).await?;
    push(
        "pending only",
        small,
        0,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    progress(&format!(
        "claim: adding {} processed rows (keep-processed mode); this takes a while",
        o.claim_processed_rows
    ));
    prefill(admin, &table, o.claim_processed_rows, o, true, 101, None).await?;
    push(
        "pending + processed history",
        small,
        o.claim_processed_rows,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    truncate(admin, &table).await?;
    progress(&format!("claim: {} pending rows", o.claim_pending_rows));
    prefill(admin, &table, o.claim_pending_rows, o, false, 102, None).await?;
    push(
        "large pending backlog",
        o.claim_pending_rows,
        0,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    Ok(out)
}

/// Times five statistics refreshes (after one for warm-up) and one exact count of the unpublished
/// rows; returns the median refresh and the count, in milliseconds.
async fn time_stats(admin: &PgPool, store: &PostgresStore) -> Result<(f64, f64), Error> {
    let mut ms = Vec::with_capacity(5);
    for i in 0..6 {
        let started = Instant::now();
        store.stats().await?;
        if i > 0 {
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    ms.sort_by(f64::total_cmp);
    let started = Instant::now();
    sqlx::query(&format!(
        "SELECT count(*) FROM {} WHERE processed_at IS NULL",
        store.table().qualified()
    ))
    .execute(admin)
    .await
    .map_err(|e| map_sqlx("bench exact count", e))?;
    Ok((
        percentile(&ms, 50.0),
        started.elapsed().as_secs_f64() * 1000.0,
    ))
}

/// Times `claim_samples` claims of a batch (each released again), after a few for warm-up; returns
/// the median and the 95th percentile in milliseconds.
async fn time_claims(store: &PostgresStore, o: &BenchOptions) -> Result<(f64, f64), Error> {
    let request = o.relay.claim_request(&DiscardPublisher);
    let mut ms = Vec::with_capacity(o.claim_samples);
    for i in 0..o.claim_samples + 5 {
        let started = Instant::now();
        let batch = store.claim(request).await?;
        let elapsed = started.elapsed();
        if batch.events.is_empty() && request.ordering == OrderingPolicy::PerAggregate {
            return Err(Error::new(
                ErrorKind::Unexpected,
                "the claim-cost phase claimed nothing from a filled table",
            ));
        }
        batch.lease.release().await?;
        if i >= 5 {
            ms.push(elapsed.as_secs_f64() * 1000.0);
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 50.0), percentile(&ms, 95.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn options_refuse_a_schema_the_bench_would_drop_by_mistake() {
        let o = BenchOptions {
            schema: "public".into(),
            ..BenchOptions::default()
        };
        let e = o.validate().unwrap_err();
        assert!(e.to_string().contains("outbox_bench"), "{e}");
        assert!(BenchOptions::default().validate().is_ok());
        assert!(Phase::parse("drain").is_ok());
        assert!(Phase::parse("drains").is_err());
    }
}
