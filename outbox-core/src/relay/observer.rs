//! What the relay reports: the figures of each settled batch ([`BatchReport`]), the decision taken
//! for each failed event ([`FailureDecision`]), the [`RelayObserver`] hooks that receive them (for
//! metrics), and the totals of a run ([`RelaySummary`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Serialize;

use crate::error::Error;
use crate::event::Event;

/// Figures of one settled batch, handed to the [`RelayObserver`].
#[derive(Debug, Clone, Default)]
pub struct BatchReport {
    /// Events claimed.
    pub claimed: usize,
    /// Events acknowledged by the broker and marked published.
    pub published: usize,
    /// Events scheduled for another attempt.
    pub retried: usize,
    /// Events dead-lettered.
    pub dead_lettered: usize,
    /// Events given back unattempted (the rest of an aggregate's run after a failure).
    pub released: usize,
    /// Events given back unchanged because the publisher pushed back (no attempt counted).
    pub backpressured: usize,
    /// What the publisher said when it first pushed back in this batch.
    pub backpressure: Option<String>,
    /// Time spent in the publisher.
    pub publish_duration: Duration,
    /// Time spent settling the outcomes in the store.
    pub settle_duration: Duration,
    /// From the end of the claim to the end of the settlement.
    pub total_duration: Duration,
    /// Set when the settlement failed: the batch's events were released and will be published again.
    pub settle_error: Option<Error>,
}

/// What the relay decided for a failed event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureDecision {
    /// Retried after a delay.
    Retry,
    /// Dead-lettered.
    DeadLetter,
    /// Back-pressure: given back unchanged, without counting an attempt; claiming pauses.
    Backpressure,
}

/// Hooks for metrics. Every method has an empty default.
pub trait RelayObserver: Send + Sync {
    /// A claim returned `count` events after `duration`.
    fn claimed(&self, count: usize, duration: Duration) {
        let _ = (count, duration);
    }
    /// Publishing `event` failed with `error`; the relay decided `decision`.
    fn event_failed(&self, event: &Event, error: &Error, decision: FailureDecision) {
        let _ = (event, error, decision);
    }
    /// A batch was settled (or its settlement failed: see [`BatchReport::settle_error`]).
    fn batch_settled(&self, report: &BatchReport) {
        let _ = report;
    }
    /// A store operation (`claim`, `settle`) failed.
    fn store_error(&self, operation: &'static str, error: &Error) {
        let _ = (operation, error);
    }
    /// While the broker is unreachable, the relay checked it again (readiness check): it answered
    /// (`reachable`, claiming resumes) or not. A relay waiting out an outage calls this every pause
    /// (at most 10 s apart): it is waiting, not stuck.
    fn broker_checked(&self, reachable: bool) {
        let _ = reachable;
    }
}

/// An observer that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;

impl RelayObserver for NoopObserver {}

/// Totals of a relay run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RelaySummary {
    /// Batches settled.
    pub batches: u64,
    /// Events published.
    pub published: u64,
    /// Events scheduled for retry.
    pub retried: u64,
    /// Events dead-lettered.
    pub dead_lettered: u64,
    /// Events released unattempted.
    pub released: u64,
    /// Batches whose settlement failed (their events will be published again).
    pub settle_failures: u64,
    /// Batches aborted at the shutdown deadline (their events were released).
    pub aborted_batches: u64,
}

/// The running totals of a relay run, added to by every settled batch.
#[derive(Default)]
pub(super) struct Totals {
    batches: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    released: AtomicU64,
    settle_failures: AtomicU64,
}

impl Totals {
    pub(super) fn add(&self, r: &BatchReport) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        if r.settle_error.is_some() {
            self.settle_failures.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.published
            .fetch_add(r.published as u64, Ordering::Relaxed);
        self.retried.fetch_add(r.retried as u64, Ordering::Relaxed);
        self.dead_lettered
            .fetch_add(r.dead_lettered as u64, Ordering::Relaxed);
        self.released
            .fetch_add(r.released as u64, Ordering::Relaxed);
    }

    pub(super) fn summary(&self, aborted_batches: u64) -> RelaySummary {
        RelaySummary {
            batches: self.batches.load(Ordering::Relaxed),
            published: self.published.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            settle_failures: self.settle_failures.load(Ordering::Relaxed),
            aborted_batches,
        }
    }
}
