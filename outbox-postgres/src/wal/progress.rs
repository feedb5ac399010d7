//! What the WAL source counts of its fallbacks to the outbox table, shared by the reader (which
//! counts) and the store (which reports): [`Fallbacks`], and its snapshot [`FallbackProgress`], whose
//! counters the binary's metrics export as they are listed here ([`FallbackProgress::COUNTERS`]).
//! A new counter is a field of both, a line of that list, and the place that counts it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The fallbacks of this relay's reader: whether it publishes from the outbox table now and why,
/// and what it counted.
#[derive(Debug, Default)]
pub(super) struct Fallbacks {
    /// Why the reader publishes from the outbox table instead of the slot (`None`: it does not).
    reason: Mutex<Option<String>>,
    /// Times the reader fell back, by reason.
    by_reason: Mutex<BTreeMap<FallbackReason, u64>>,
    /// Rows moved from the outbox table to the held table while falling back.
    pub(super) moved: AtomicU64,
    /// The slot's confirmed position as last seen readable (the start of the WAL no slot read,
    /// should it be lost).
    pub(super) slot_confirmed: AtomicU64,
    /// Times table-less events may have gone unread (a slot made again), and the WAL bytes of
    /// those ranges that are known.
    pub(super) tableless_gaps: AtomicU64,
    pub(super) tableless_gap_bytes: AtomicU64,
}

impl Fallbacks {
    /// Marks the reader as publishing from the outbox table, for `reason` (counted under `kind`);
    /// true when it was not.
    pub(super) fn enter(&self, kind: FallbackReason, reason: &str) -> bool {
        let mut now = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        let entered = now.is_none();
        if entered {
            *self
                .by_reason
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(kind)
                .or_default() += 1;
        }
        *now = Some(reason.to_string());
        entered
    }

    /// Marks the reader as streaming the slot again.
    pub(super) fn leave(&self) {
        *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Why the reader publishes from the outbox table, if it does.
    pub(super) fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// What was counted so far.
    pub(super) fn progress(&self) -> FallbackProgress {
        let by_reason: Vec<(&'static str, u64)> = {
            let counts = self.by_reason.lock().unwrap_or_else(|p| p.into_inner());
            FallbackReason::ALL
                .iter()
                .map(|r| (r.label(), counts.get(r).copied().unwrap_or(0)))
                .collect()
        };
        FallbackProgress {
            reason: self.reason(),
            total: by_reason.iter().map(|(_, n)| n).sum(),
            by_reason,
            moved: self.moved.load(Ordering::SeqCst),
            tableless_gaps: self.tableless_gaps.load(Ordering::SeqCst),
            tableless_gap_bytes: self.tableless_gap_bytes.load(Ordering::SeqCst),
        }
    }
}

/// What a relay's reader counted of its fallbacks to the outbox table (see
/// [`super::WalConfig::auto_recreate`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct FallbackProgress {
    /// Why this relay publishes from the outbox table instead of the slot now (`None`: it streams
    /// the slot, or stands by).
    pub reason: Option<String>,
    /// Times this relay fell back to the outbox table.
    pub total: u64,
    /// Those times by reason (each of [`super::FALLBACK_REASONS`], in that order).
    pub by_reason: Vec<(&'static str, u64)>,
    /// Rows this relay moved from the outbox table to the held table while falling back.
    pub moved: u64,
    /// Times a slot was made again after one was lost: table-less events committed in between
    /// were not read by any slot.
    pub tableless_gaps: u64,
    /// The WAL bytes of those ranges, where this relay knew where the old slot stood.
    pub tableless_gap_bytes: u64,
}

impl FallbackProgress {
    /// The counters the metrics export, besides the fallbacks by reason: each one's family name
    /// (`_total` is added) and help, in the order of [`FallbackProgress::counter_values`].
    pub const COUNTERS: [(&'static str, &'static str); 3] = [
        (
            "outbox_wal_fallback_moved_events",
            "Rows this relay moved from the outbox table to the held table while falling back",
        ),
        (
            "outbox_wal_tableless_gaps",
            "Times a replication slot was made again after one this relay read was lost: table-less events committed in between were not read by any slot",
        ),
        (
            "outbox_wal_tableless_gap_bytes",
            "Bytes of WAL in which table-less events were not read by any slot (where the old slot's position was known)",
        ),
    ];

    /// The values of [`FallbackProgress::COUNTERS`], in their order.
    pub fn counter_values(&self) -> [u64; 3] {
        [self.moved, self.tableless_gaps, self.tableless_gap_bytes]
    }
}

/// Why a reader falls back to the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FallbackReason {
    /// The slot is missing (dropped, or not made after a failover).
    SlotMissing,
    /// The slot lost WAL it needed (invalidated by `max_slot_wal_keep_size`).
    SlotLost,
    /// The publication is missing.
    NoPublication,
    /// The publication does not hold the outbox table.
    TableNotPublished,
    /// Rows were written before the slot was made (after `outbox wal setup`, or a fallback another
    /// relay did not finish).
    RowsBeforeSlot,
}

impl FallbackReason {
    /// Every reason, in the order the metrics list them.
    pub const ALL: [FallbackReason; 5] = [
        FallbackReason::SlotMissing,
        FallbackReason::SlotLost,
        FallbackReason::NoPublication,
        FallbackReason::TableNotPublished,
        FallbackReason::RowsBeforeSlot,
    ];

    /// Its label, as the metrics (`reason`) and the alerts name it.
    pub const fn label(self) -> &'static str {
        match self {
            FallbackReason::SlotMissing => "slot_missing",
            FallbackReason::SlotLost => "slot_lost",
            FallbackReason::NoPublication => "no_publication",
            FallbackReason::TableNotPublished => "table_not_published",
            FallbackReason::RowsBeforeSlot => "rows_before_slot",
        }
    }
}

/// The labels of [`FallbackReason::ALL`], in that order.
pub const FALLBACK_REASONS: [&str; 5] = [
    FallbackReason::SlotMissing.label(),
    FallbackReason::SlotLost.label(),
    FallbackReason::NoPublication.label(),
    FallbackReason::TableNotPublished.label(),
    FallbackReason::RowsBeforeSlot.label(),
];
