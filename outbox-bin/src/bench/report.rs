//! The figures a benchmark run produces ([`BenchReport`] and its parts), the ratios computed from
//! them, and the statistics they are made of (nearest-rank percentiles). `table.rs` prints them.

use serde::Serialize;

use super::options::BenchOptions;

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
    /// `pg_logical_emit_message`, `txoutbox_postgres::wal::MessageWriter`).
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

/// One large transaction (a backfill) drained by one polling relay and by one relay over the WAL
/// source (`drains`, `relay` = `relay` or `wal`; `peak_rss_bytes` is the whole bench process's).
#[derive(Debug, Clone, Serialize)]
pub struct TransactionFigures {
    /// The transaction's size.
    pub transaction: super::options::LargeTransaction,
    /// The drains.
    pub drains: Vec<DrainFigures>,
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
    /// Median time of one statistics refresh ([`Store::stats`](txoutbox_core::Store::stats), what each
    /// relay runs every 5 s for `/metrics`), in milliseconds: bounded by `database.stats_max_rows`,
    /// estimated above it.
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
    /// One large transaction drained by each source (transaction phase).
    pub transactions: Vec<TransactionFigures>,
    /// Ratios of the figures above.
    pub ratios: Ratios,
    /// Largest resident set size sampled during the one-relay drains, in bytes (the whole bench
    /// process: one relay, its publisher and the load generator).
    pub relay_peak_rss_bytes: Option<u64>,
    /// What the run could not measure, and why.
    pub notes: Vec<String>,
}

pub(super) fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

impl BenchReport {
    fn drain_rate(&self, publisher: &str, relay: &str, relays: usize) -> Option<f64> {
        self.drain
            .iter()
            .find(|d| d.publisher == publisher && d.relay == relay && d.relays == relays)
            .map(|d| d.events_per_second)
    }

    pub(super) fn compute_ratios(&mut self) {
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
}

pub(super) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
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
}
