//! The WAL source's gauges and counters: the reader's mode, its backlog and lag, the slot's WAL,
//! and the fallbacks to the outbox table by reason.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::wal::{FallbackProgress, SlotPositions, WalProgress};

/// Label set of the WAL source's fallbacks.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why the reader fell back to the outbox table (one of [`crate::wal::FALLBACK_REASONS`]).
    pub reason: String,
}

/// The WAL source's gauges (0 under the polling source).
pub(super) struct WalGauges {
    active: Gauge,
    unsettled: Gauge,
    lag_seconds: Gauge<f64, AtomicU64>,
    slot_present: Gauge,
    lag_bytes: Gauge,
    retained_bytes: Gauge,
    retained_warning: Gauge,
    fallback: Gauge,
    fallbacks: Family<ReasonLabel, Counter>,
    /// [`FallbackProgress::COUNTERS`], in that order.
    counters: Vec<Counter>,
}

impl WalGauges {
    /// Sets the gauges and advances the counters to the reader's `progress`, the slot's
    /// `positions` (`None`: the slot is missing, or could not be read) and `wal.retained_wal_warning`.
    pub(super) fn record(
        &self,
        wal: &WalProgress,
        positions: Option<&SlotPositions>,
        retained_warning: u64,
    ) {
        let g = self;
        g.active.set(i64::from(wal.active));
        g.unsettled
            .set(i64::try_from(wal.unsettled).unwrap_or(i64::MAX));
        g.lag_seconds.set(wal.lag_seconds);
        g.slot_present.set(i64::from(positions.is_some()));
        g.lag_bytes.set(positions.map_or(0, |p| p.lag_bytes));
        g.retained_bytes
            .set(positions.map_or(0, |p| p.retained_bytes));
        g.retained_warning
            .set(i64::try_from(retained_warning).unwrap_or(i64::MAX));
        g.fallback.set(i64::from(wal.fallback.reason.is_some()));
        // Counters of the reader's own totals: what was added since the last refresh.
        for (reason, total) in &wal.fallback.by_reason {
            let counter = g.fallbacks.get_or_create(&ReasonLabel {
                reason: (*reason).to_string(),
            });
            counter.inc_by(total.saturating_sub(counter.get()));
        }
        for (counter, total) in g.counters.iter().zip(wal.fallback.counter_values()) {
            counter.inc_by(total.saturating_sub(counter.get()));
        }
    }

    pub(super) fn register(registry: &mut Registry) -> WalGauges {
        let g = WalGauges {
            active: Gauge::default(),
            unsettled: Gauge::default(),
            lag_seconds: Gauge::default(),
            slot_present: Gauge::default(),
            lag_bytes: Gauge::default(),
            retained_bytes: Gauge::default(),
            retained_warning: Gauge::default(),
            fallback: Gauge::default(),
            fallbacks: Family::default(),
            counters: FallbackProgress::COUNTERS
                .iter()
                .map(|_| Counter::default())
                .collect(),
        };
        registry.register(
            "outbox_wal_reader_active",
            "1 while this relay reads the replication slot (the WAL source); 0 for a standby, or under the polling source",
            g.active.clone(),
        );
        registry.register(
            "outbox_wal_unsettled_events",
            "Events this relay read from the slot and has not yet published nor moved to the held table",
            g.unsettled.clone(),
        );
        registry.register(
            "outbox_wal_lag_seconds",
            "Seconds since the commit of the oldest transaction this relay read from the slot and has not confirmed",
            g.lag_seconds.clone(),
        );
        registry.register(
            "outbox_wal_slot_present",
            "1 when the replication slot exists (the WAL source); 0 when it is missing or under the polling source",
            g.slot_present.clone(),
        );
        registry.register(
            "outbox_wal_slot_lag_bytes",
            "Bytes of WAL written since the slot's confirmed position",
            g.lag_bytes.clone(),
        );
        registry.register(
            "outbox_wal_slot_retained_bytes",
            "Bytes of WAL the slot keeps on the database server's disk (from its restart position)",
            g.retained_bytes.clone(),
        );
        registry.register(
            "outbox_wal_retained_warning_bytes",
            "wal.retained_wal_warning: retained WAL above this is an alert (0 under the polling source)",
            g.retained_warning.clone(),
        );
        registry.register(
            "outbox_wal_fallback",
            "1 while this relay publishes from the outbox table because the slot cannot be streamed (missing, lost WAL, or its publication lacks the table; the log says which)",
            g.fallback.clone(),
        );
        // Every reason from the start (0 under the polling source), so that a rate or an
        // increase sees a fallback's first one.
        for reason in crate::wal::FALLBACK_REASONS {
            drop(g.fallbacks.get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            }));
        }
        registry.register(
            "outbox_wal_fallbacks",
            "Times this relay fell back to publishing from the outbox table, by reason: slot_missing, slot_lost (invalidated), no_publication, table_not_published (removed from the publication, or dropped and made again), rows_before_slot (rows written before the slot was made)",
            g.fallbacks.clone(),
        );
        for ((name, help), counter) in FallbackProgress::COUNTERS.iter().zip(&g.counters) {
            registry.register(*name, *help, counter.clone());
        }
        g
    }
}
