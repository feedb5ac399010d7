//! Prometheus metrics: a [`RelayObserver`] that counts what the relay does, and gauges refreshed from
//! the store's statistics.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use txoutbox_core::{BatchReport, Error, Event, FailureDecision, RelayObserver, StoreStats};

mod wal;

pub use wal::ReasonLabel;
use wal::WalGauges;

/// Label set of per-event-type metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventTypeLabel {
    /// The event type.
    pub event_type: String,
}

/// Label set of store errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    /// `claim` or `settle`.
    pub operation: String,
}

/// Label set of `outbox_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    /// The crate version.
    pub version: String,
    /// The commit built from.
    pub commit: String,
    /// The publishers compiled in.
    pub adapters: String,
}

/// What `outbox_build_info` says about the running build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildInfo {
    /// The version of what runs (the `outbox` binary's, or the service's).
    pub version: String,
    /// The commit it was built from, or `unknown`.
    pub commit: String,
    /// The publishers compiled in (the binary), or the one in use (a composed relay).
    pub adapters: String,
}

impl Default for BuildInfo {
    /// This library's version; commit and adapters `unknown`.
    fn default() -> Self {
        BuildInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            commit: "unknown".into(),
            adapters: "unknown".into(),
        }
    }
}

/// Label set of the cleanup rounds.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// How the round ended: `done`, `busy`, `failed` or `stopped` ([`CleanupOutcome::label`]).
    pub outcome: String,
}

/// How an automatic cleanup round ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CleanupOutcome {
    /// No expired row is left.
    Done,
    /// Another relay (or `outbox cleanup`) was cleaning; this round was skipped.
    Busy,
    /// A statement failed (the error is logged); the next round tries again.
    Failed,
    /// The relay is stopping.
    Stopped,
}

impl CleanupOutcome {
    /// The `outcome` label value.
    pub fn label(self) -> &'static str {
        match self {
            CleanupOutcome::Done => "done",
            CleanupOutcome::Busy => "busy",
            CleanupOutcome::Failed => "failed",
            CleanupOutcome::Stopped => "stopped",
        }
    }
}

/// The label value that stands for every event type past the cap.
pub const OTHER_EVENT_TYPES: &str = "other";

/// The default cap on distinct `event_type` label values (`http.max_event_type_labels`).
pub const DEFAULT_MAX_EVENT_TYPE_LABELS: usize = 100;

/// Every metric the relay exports.
///
/// Per-event-type series are capped: any writer can insert any event type, and a label value never
/// seen again would stay in `/metrics` for ever. The first `max_event_type_labels` types seen keep
/// their own series in `outbox_events_failed`; later ones count under `event_type="other"`. The
/// pending gauge by type shows the types with the most pending events, the rest summed under
/// `other`.
pub struct Metrics {
    registry: std::sync::Mutex<Registry>,
    max_event_type_labels: usize,
    failed_types: std::sync::Mutex<std::collections::HashSet<String>>,
    counters: Counters,
    gauges: OutboxGauges,
    /// The event types `gauges.pending_by_type` has a series of (those of the last refresh).
    pending_types: std::sync::Mutex<std::collections::BTreeSet<String>>,
    timings: Timings,
    cleanup: CleanupMetrics,
    wal: WalGauges,
    build_info: Family<BuildLabel, Gauge>,
    liveness: Option<std::sync::Arc<super::health::Liveness>>,
}

/// Registers `metric` as `name` with `help`; returns it (a handle to the same series).
fn registered<M: prometheus_client::registry::Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// What the relay did: events published, failed, retried, pushed back, dead-lettered; store errors.
struct Counters {
    published: Counter,
    failed: Family<EventTypeLabel, Counter>,
    retried: Counter,
    backpressured: Counter,
    dead_lettered_total: Counter,
    store_errors: Family<OperationLabel, Counter>,
}

impl Counters {
    fn register(r: &mut Registry) -> Self {
        Counters {
            published: registered(
                r,
                "outbox_events_published",
                "Events published (acknowledged by the broker)",
                Counter::default(),
            ),
            failed: registered(
                r,
                "outbox_events_failed",
                "Publish failures, by event type",
                Family::default(),
            ),
            retried: registered(
                r,
                "outbox_events_retried",
                "Failed events scheduled for another attempt",
                Counter::default(),
            ),
            backpressured: registered(
                r,
                "outbox_events_backpressured",
                "Events the publisher pushed back on (given back unchanged, no attempt counted; claims pause)",
                Counter::default(),
            ),
            dead_lettered_total: registered(
                r,
                "outbox_events_dead_lettered",
                "Events dead-lettered by the relay",
                Counter::default(),
            ),
            store_errors: registered(
                r,
                "outbox_store_errors",
                "Failed store operations, by operation",
                Family::default(),
            ),
        }
    }
}

/// What the outbox holds, from the store's statistics.
struct OutboxGauges {
    pending: Gauge,
    oldest_pending_age: Gauge<f64, AtomicU64>,
    stats_estimated: Gauge,
    dead_letters: Gauge,
    held_back: Gauge,
    held_back_aggregates: Gauge,
    pending_by_type: Family<EventTypeLabel, Gauge>,
}

impl OutboxGauges {
    fn register(r: &mut Registry) -> Self {
        OutboxGauges {
            pending: registered(
                r,
                "outbox_events_pending",
                "Events waiting to be published (including backing off and held back)",
                Gauge::default(),
            ),
            oldest_pending_age: registered(
                r,
                "outbox_oldest_pending_age_seconds",
                "Age of the oldest pending event",
                Gauge::default(),
            ),
            stats_estimated: registered(
                r,
                "outbox_stats_estimated",
                "1 when the pending and dead-letter counts come from a count taken over several refreshes (more rows than database.stats_max_rows)",
                Gauge::default(),
            ),
            dead_letters: registered(
                r,
                "outbox_dead_letters",
                "Dead letters in the outbox",
                Gauge::default(),
            ),
            held_back: registered(
                r,
                "outbox_events_held_back",
                "Pending events behind a dead letter of their aggregate (they wait until it is retried or discarded); a lower bound when outbox_stats_estimated is 1",
                Gauge::default(),
            ),
            held_back_aggregates: registered(
                r,
                "outbox_aggregates_held_back",
                "Aggregates with events held back behind a dead letter",
                Gauge::default(),
            ),
            pending_by_type: registered(
                r,
                "outbox_events_pending_by_type",
                "Pending events, by event type",
                Family::default(),
            ),
        }
    }
}

/// How long batches, publishes and claims took, and how large batches were.
struct Timings {
    batch_duration: Histogram,
    publish_duration: Histogram,
    claim_duration: Histogram,
    batch_size: Histogram,
}

impl Timings {
    fn register(r: &mut Registry) -> Self {
        let seconds = || Histogram::new(exponential_buckets(0.0005, 2.0, 18));
        Timings {
            batch_duration: registered(
                r,
                "outbox_batch_duration_seconds",
                "From claim to settlement of a batch",
                seconds(),
            ),
            publish_duration: registered(
                r,
                "outbox_publish_duration_seconds",
                "Time the publisher took for a batch",
                seconds(),
            ),
            claim_duration: registered(
                r,
                "outbox_claim_duration_seconds",
                "Time a claim took",
                seconds(),
            ),
            batch_size: registered(
                r,
                "outbox_batch_size",
                "Events per claimed batch",
                Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            ),
        }
    }
}

/// The automatic cleanup's rounds.
struct CleanupMetrics {
    cleanup_removed: Counter,
    cleanup_runs: Family<OutcomeLabel, Counter>,
    cleanup_last_success: Gauge<f64, AtomicU64>,
}

impl CleanupMetrics {
    fn register(r: &mut Registry) -> Self {
        CleanupMetrics {
            cleanup_removed: registered(
                r,
                "outbox_cleanup_rows_removed",
                "Expired published rows removed by this relay's automatic cleanup (database.keep_processed_for)",
                Counter::default(),
            ),
            cleanup_runs: registered(
                r,
                "outbox_cleanup_runs",
                "Automatic cleanup rounds, by outcome: done, busy (another relay was cleaning), failed, stopped",
                Family::default(),
            ),
            cleanup_last_success: registered(
                r,
                "outbox_cleanup_last_success_timestamp_seconds",
                "Unix time at which this relay last finished a cleanup round with no expired row left, or started its automatic cleanup (0: automatic cleanup is off)",
                Gauge::default(),
            ),
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_TYPE_LABELS)
    }
}

impl Metrics {
    /// Registers every metric, with at most `max_event_type_labels` distinct event types per metric
    /// (plus `other`).
    pub fn new(max_event_type_labels: usize) -> Self {
        let mut registry = Registry::default();
        let wal = WalGauges::register(&mut registry);
        let build_info = registered(
            &mut registry,
            "outbox_build_info",
            "Always 1; the labels say which build runs: version, commit, adapters compiled in",
            Family::<BuildLabel, Gauge>::default(),
        );
        let counters = Counters::register(&mut registry);
        let gauges = OutboxGauges::register(&mut registry);
        let timings = Timings::register(&mut registry);
        let cleanup = CleanupMetrics::register(&mut registry);
        // Every outcome's series exists from the start, so that the first of each counts in rates.
        for outcome in [
            CleanupOutcome::Done,
            CleanupOutcome::Busy,
            CleanupOutcome::Failed,
            CleanupOutcome::Stopped,
        ] {
            cleanup
                .cleanup_runs
                .get_or_create(&OutcomeLabel {
                    outcome: outcome.label().to_string(),
                })
                .inc_by(0);
        }
        let metrics = Metrics {
            registry: std::sync::Mutex::new(registry),
            build_info,
            counters,
            gauges,
            timings,
            cleanup,
            wal,
            max_event_type_labels,
            failed_types: Default::default(),
            pending_types: Default::default(),
            liveness: None,
        };
        metrics.set_build(&BuildInfo::default());
        metrics
    }

    /// Sets what `outbox_build_info` says (by default [`BuildInfo::default`]: this library's
    /// version).
    pub fn set_build(&self, build: &BuildInfo) {
        self.build_info.clear();
        self.build_info
            .get_or_create(&BuildLabel {
                version: build.version.clone(),
                commit: build.commit.clone(),
                adapters: build.adapters.clone(),
            })
            .set(1);
    }

    /// Reports the relay's progress and the statistics to `liveness` too.
    pub fn with_liveness(mut self, liveness: std::sync::Arc<super::health::Liveness>) -> Self {
        self.liveness = Some(liveness);
        self
    }

    /// A statistics refresh starts (for the liveness check: one that never ends is a sign of a wedge).
    pub fn stats_refreshing(&self) {
        if let Some(l) = &self.liveness {
            l.refreshing();
        }
    }

    /// A statistics refresh failed.
    pub fn stats_failed(&self) {
        if let Some(l) = &self.liveness {
            l.refresh_failed();
        }
    }

    fn progressed(&self) {
        if let Some(l) = &self.liveness {
            l.progressed();
        }
    }

    /// Updates the gauges from the store's statistics.
    pub fn record_stats(&self, stats: &StoreStats) {
        if let Some(l) = &self.liveness {
            l.saw_stats(stats.oldest_pending_age_seconds);
        }
        self.gauges
            .pending
            .set(stats.pending.min(i64::MAX as u64) as i64);
        self.gauges
            .dead_letters
            .set(stats.dead_letters.min(i64::MAX as u64) as i64);
        self.gauges
            .held_back
            .set(stats.held_back.min(i64::MAX as u64) as i64);
        self.gauges
            .held_back_aggregates
            .set(stats.held_back_aggregates.min(i64::MAX as u64) as i64);
        self.gauges
            .oldest_pending_age
            .set(stats.oldest_pending_age_seconds.unwrap_or(0.0));
        self.gauges.stats_estimated.set(i64::from(stats.estimated));
        let mut by_type: Vec<(&str, u64)> = stats
            .by_event_type
            .iter()
            .filter(|t| t.pending > 0)
            .map(|t| (t.event_type.as_str(), t.pending))
            .collect();
        by_type.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let shown = by_type.len().min(self.max_event_type_labels);
        let rest: u64 = by_type[shown..].iter().map(|(_, n)| n).sum();
        // A real type named "other" shares the bucket.
        let mut series: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
        for (event_type, pending) in &by_type[..shown] {
            *series.entry(event_type).or_default() += pending;
        }
        if rest > 0 {
            *series.entry(OTHER_EVENT_TYPES).or_default() += rest;
        }
        // The new figures are set before the types no longer pending are removed, so that a scrape
        // during a refresh never finds the family without the series that stay.
        let mut shown = self
            .pending_types
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (event_type, pending) in &series {
            self.gauges
                .pending_by_type
                .get_or_create(&EventTypeLabel {
                    event_type: event_type.to_string(),
                })
                .set((*pending).min(i64::MAX as u64) as i64);
        }
        for gone in shown.iter().filter(|t| !series.contains_key(t.as_str())) {
            self.gauges.pending_by_type.remove(&EventTypeLabel {
                event_type: gone.clone(),
            });
        }
        *shown = series.keys().map(|t| t.to_string()).collect();
    }

    /// Updates the WAL source's gauges from the reader's `progress`, the slot's `positions`
    /// (`None`: missing, or not read) and `wal.retained_wal_warning`.
    pub fn record_wal(
        &self,
        progress: &crate::wal::WalProgress,
        positions: Option<&crate::wal::SlotPositions>,
        retained_warning: u64,
    ) {
        self.wal.record(progress, positions, retained_warning);
    }

    /// `rows` expired rows were removed by the automatic cleanup.
    pub fn cleanup_removed(&self, rows: u64) {
        self.cleanup.cleanup_removed.inc_by(rows);
    }

    /// The automatic cleanup starts: its last success counts from now (an alert on a cleanup that
    /// never succeeds then fires as one that stopped succeeding).
    pub fn cleanup_started(&self) {
        self.cleanup.cleanup_last_success.set(unix_now());
    }

    /// An automatic cleanup round ended.
    pub fn cleanup_ran(&self, outcome: CleanupOutcome) {
        self.cleanup
            .cleanup_runs
            .get_or_create(&OutcomeLabel {
                outcome: outcome.label().to_string(),
            })
            .inc();
        if outcome == CleanupOutcome::Done {
            self.cleanup.cleanup_last_success.set(unix_now());
        }
    }

    /// The label value for `event_type` in `outbox_events_failed`: itself while fewer than the cap
    /// have been seen (or it was seen before), else `other`.
    fn failed_label(&self, event_type: &str) -> String {
        let mut seen = self
            .failed_types
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(event_type) {
            return event_type.to_string();
        }
        if seen.len() < self.max_event_type_labels && event_type != OTHER_EVENT_TYPES {
            seen.insert(event_type.to_string());
            return event_type.to_string();
        }
        OTHER_EVENT_TYPES.to_string()
    }

    /// Registers a metric of the service's own, rendered with the relay's by [`Metrics::render`]
    /// (and so on the same `/metrics`). `name` and `help` follow `prometheus_client`'s
    /// [`Registry::register`]; a name the relay uses (every one starts with `outbox_`) would be
    /// exported twice.
    pub fn register(
        &self,
        name: impl Into<String>,
        help: impl Into<String>,
        metric: impl prometheus_client::registry::Metric,
    ) {
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .register(name, help, metric);
    }

    /// The metrics in the OpenMetrics text format (`/metrics`), ending with `# EOF`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let registry = self
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if encode(&mut out, &registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl RelayObserver for Metrics {
    fn claimed(&self, count: usize, duration: Duration) {
        self.timings.claim_duration.observe(secs(duration));
        if count > 0 {
            self.timings.batch_size.observe(count as f64);
        } else {
            self.progressed();
        }
    }

    fn event_failed(&self, event: &Event, _error: &Error, decision: FailureDecision) {
        // Back-pressure is a wait, not a failure: the event goes back unchanged.
        if decision == FailureDecision::Backpressure {
            self.counters.backpressured.inc();
            return;
        }
        self.counters
            .failed
            .get_or_create(&EventTypeLabel {
                event_type: self.failed_label(&event.event_type),
            })
            .inc();
        match decision {
            FailureDecision::DeadLetter => {
                self.counters.dead_lettered_total.inc();
            }
            FailureDecision::Retry | FailureDecision::Backpressure => {
                self.counters.retried.inc();
            }
        }
    }

    fn batch_settled(&self, report: &BatchReport) {
        self.timings
            .batch_duration
            .observe(secs(report.total_duration));
        self.timings
            .publish_duration
            .observe(secs(report.publish_duration));
        if report.settle_error.is_none() {
            self.counters.published.inc_by(report.published as u64);
            self.progressed();
        }
    }

    fn broker_checked(&self, _reachable: bool) {
        self.progressed();
    }

    fn store_error(&self, operation: &'static str, error: &Error) {
        // A store call that could not reach the database: the relay is waiting for it, not stuck.
        // Other failures (time-outs, lock time-outs, errors of the statements) are no progress.
        if error.kind() == txoutbox_core::ErrorKind::Connection {
            self.progressed();
        }
        self.counters
            .store_errors
            .get_or_create(&OperationLabel {
                operation: operation.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wal_gauges_read_the_readers_progress_and_the_slot() {
        let m = Metrics::default();
        let mut progress = crate::wal::WalProgress {
            active: true,
            unsettled: 12,
            in_flight: 3,
            lag_seconds: 0.25,
            confirmed_lsn: 42,
            fallback: crate::wal::FallbackProgress {
                reason: Some("the publication lacks the table".into()),
                total: 2,
                by_reason: vec![("slot_missing", 0), ("table_not_published", 2)],
                moved: 150,
                tableless_gaps: 1,
                tableless_gap_bytes: 4096,
            },
        };
        let positions = crate::wal::SlotPositions {
            lag_bytes: 800,
            retained_bytes: 9000,
            wal_status: Some("reserved".into()),
        };
        m.record_wal(&progress, Some(&positions), 1 << 30);
        let text = m.render();
        for needle in [
            "outbox_wal_reader_active 1",
            "outbox_wal_unsettled_events 12",
            "outbox_wal_lag_seconds 0.25",
            "outbox_wal_slot_present 1",
            "outbox_wal_slot_lag_bytes 800",
            "outbox_wal_slot_retained_bytes 9000",
            "outbox_wal_retained_warning_bytes 1073741824",
            "outbox_wal_fallback 1",
            "outbox_wal_fallbacks_total{reason=\"table_not_published\"} 2",
            "outbox_wal_fallback_moved_events_total 150",
            "outbox_wal_tableless_gaps_total 1",
            "outbox_wal_tableless_gap_bytes_total 4096",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
        // Totals only grow by what was added; a missing slot reads as absent.
        progress.fallback.reason = None;
        progress.fallback.by_reason = vec![("slot_missing", 1), ("table_not_published", 2)];
        m.record_wal(&progress, None, 1 << 30);
        let text = m.render();
        for needle in [
            "outbox_wal_fallback 0",
            "outbox_wal_slot_present 0",
            "outbox_wal_fallbacks_total{reason=\"slot_missing\"} 1",
            "outbox_wal_fallbacks_total{reason=\"table_not_published\"} 2",
        ] {
            assert!(text.contains(needle), "{needle} missing from:\n{text}");
        }
    }

    #[test]
    fn renders_the_required_metrics() {
        let m = Metrics::default();
        m.batch_settled(&BatchReport {
            claimed: 3,
            published: 3,
            ..BatchReport::default()
        });
        m.record_stats(&StoreStats {
            pending: 7,
            oldest_pending_age_seconds: Some(1.5),
            dead_letters: 2,
            held_back: 5,
            held_back_aggregates: 2,
            by_event_type: vec![],
            estimated: true,
        });
        let text = m.render();
        for needle in [
            "outbox_events_published_total 3",
            "outbox_events_pending 7",
            "outbox_oldest_pending_age_seconds 1.5",
            "outbox_dead_letters 2",
            "outbox_events_held_back 5",
            "outbox_aggregates_held_back 2",
            "outbox_stats_estimated 1",
            "outbox_batch_duration_seconds_bucket",
            "outbox_publish_duration_seconds_count 1",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in\n{text}");
        }
        let build = format!(
            "outbox_build_info{{version=\"{}\",commit=\"unknown\",adapters=\"unknown\"}} 1",
            env!("CARGO_PKG_VERSION"),
        );
        assert!(text.contains(&build), "missing {build:?} in\n{text}");
        m.set_build(&BuildInfo {
            version: "9.9.9".into(),
            commit: "abc".into(),
            adapters: "amqp".into(),
        });
        let text = m.render();
        let builds: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("outbox_build_info{"))
            .collect();
        assert_eq!(
            builds,
            ["outbox_build_info{version=\"9.9.9\",commit=\"abc\",adapters=\"amqp\"} 1"],
            "one series, the build set last"
        );
    }

    #[test]
    fn a_metric_of_the_service_is_rendered_with_the_relays() {
        let m = Metrics::default();
        let orders = Counter::<u64>::default();
        m.register("shop_orders", "Orders taken", orders.clone());
        orders.inc_by(3);
        let text = m.render();
        assert!(text.contains("shop_orders_total 3"), "{text}");
        assert!(text.contains("outbox_events_published_total 0"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "one document: {text}");
    }

    #[test]
    fn backpressure_is_counted_apart_from_failures() {
        let m = Metrics::default();
        let event = txoutbox_core::testkit::publisher_suite::event("a", 1);
        let full = Error::new(txoutbox_core::ErrorKind::Backpressure, "queue full");
        m.event_failed(&event, &full, FailureDecision::Backpressure);
        m.event_failed(&event, &full, FailureDecision::Backpressure);
        let text = m.render();
        assert!(
            text.contains("outbox_events_backpressured_total 2"),
            "{text}"
        );
        assert!(text.contains("outbox_events_retried_total 0"), "{text}");
        assert!(!text.contains("outbox_events_failed_total{"), "{text}");
    }

    #[test]
    fn event_type_labels_are_capped() {
        let m = Metrics::new(3);
        let error = Error::new(txoutbox_core::ErrorKind::Connection, "down");
        for i in 0..1000 {
            let event = Event {
                event_type: format!("type.{}", i % 10),
                ..txoutbox_core::testkit::publisher_suite::event("a", i)
            };
            m.event_failed(&event, &error, FailureDecision::Retry);
        }
        let stats = StoreStats {
            pending: 60,
            by_event_type: (0..6)
                .map(|i| txoutbox_core::EventTypeStats {
                    event_type: format!("pending.{i}"),
                    pending: 10 + i,
                    ..Default::default()
                })
                .collect(),
            ..StoreStats::default()
        };
        m.record_stats(&stats);
        let text = m.render();
        let failed: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("outbox_events_failed_total{"))
            .collect();
        assert_eq!(failed.len(), 4, "three types and other:\n{text}");
        assert!(
            text.contains("outbox_events_failed_total{event_type=\"other\"} 700"),
            "{text}"
        );
        assert!(
            text.contains("outbox_events_failed_total{event_type=\"type.0\"} 100"),
            "{text}"
        );
        let pending: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("outbox_events_pending_by_type{"))
            .collect();
        assert_eq!(pending.len(), 4, "the three largest and other:\n{text}");
        assert!(
            text.contains("outbox_events_pending_by_type{event_type=\"pending.5\"} 15"),
            "{text}"
        );
        assert!(
            text.contains("outbox_events_pending_by_type{event_type=\"other\"} 33"),
            "{text}"
        );
        // A type no longer pending loses its series at the next refresh; the others keep theirs.
        let stats = StoreStats {
            pending: 15,
            by_event_type: vec![txoutbox_core::EventTypeStats {
                event_type: "pending.5".into(),
                pending: 15,
                ..Default::default()
            }],
            ..StoreStats::default()
        };
        m.record_stats(&stats);
        let text = m.render();
        let pending: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("outbox_events_pending_by_type{"))
            .collect();
        assert_eq!(
            pending,
            ["outbox_events_pending_by_type{event_type=\"pending.5\"} 15"],
            "{text}"
        );
    }
}
