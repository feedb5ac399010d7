//! Automatic cleanup: with [`Retention::Keep`](crate::Retention::Keep) and a [`CleanupSchedule`]
//! (the binary's `database.keep_processed_for`), the relay removes expired published rows itself,
//! so no cron job is needed.
//!
//! A round runs when the relay starts and then every [`CleanupSchedule::interval`]: batches of
//! [`CleanupSchedule::batch_size`] rows, each its own short transaction under the table's cleanup lock
//! ([`PostgresStore::cleanup_batch`] with [`CleanupLock::Try`]), until none are left or the relay
//! stops. One cleanup batch runs at a time: a relay that finds another relay (or `outbox cleanup`)
//! deleting ends its round there (`busy`), so replicas never delete side by side (between two of
//! one relay's batches another may take its turn). Outcomes go to the metrics
//! (`outbox_cleanup_rows_removed_total`, `outbox_cleanup_runs_total{outcome}`,
//! `outbox_cleanup_last_success_timestamp_seconds`).

use std::time::Duration;

use tracing::{info, warn};
use txoutbox_core::CancellationToken;

use crate::{CleanupBatch, CleanupLock, PostgresStore};

use super::metrics::{CleanupOutcome, Metrics};

/// What the cleanup task needs to know.
#[derive(Debug, Clone, Copy)]
pub struct CleanupSchedule {
    /// Rows published longer ago than this are removed.
    pub older_than: Duration,
    /// Time between two rounds.
    pub interval: Duration,
    /// Rows per statement.
    pub batch_size: u32,
}

impl CleanupSchedule {
    /// Removes rows published longer ago than `older_than`, in rounds every
    /// [`DEFAULT_CLEANUP_INTERVAL`](crate::DEFAULT_CLEANUP_INTERVAL) (or every `older_than` when
    /// shorter), [`DEFAULT_CLEANUP_BATCH_SIZE`](crate::DEFAULT_CLEANUP_BATCH_SIZE) rows per
    /// statement.
    pub fn keeping(older_than: Duration) -> Self {
        CleanupSchedule {
            older_than,
            interval: crate::DEFAULT_CLEANUP_INTERVAL.min(older_than.max(Duration::from_secs(1))),
            batch_size: crate::DEFAULT_CLEANUP_BATCH_SIZE,
        }
    }
}

/// Runs one cleanup round: batches until no expired row is left, the lock is held by another
/// session, a batch fails, or `shutdown` is cancelled. Returns the outcome and the rows removed.
pub async fn round(
    store: &PostgresStore,
    schedule: &CleanupSchedule,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> (CleanupOutcome, u64) {
    let mut removed = 0u64;
    loop {
        if shutdown.is_cancelled() {
            return (CleanupOutcome::Stopped, removed);
        }
        let batch = store
            .cleanup_batch(
                schedule.older_than,
                i64::from(schedule.batch_size),
                CleanupLock::Try,
            )
            .await;
        match batch {
            Ok(CleanupBatch::Removed(0)) => return (CleanupOutcome::Done, removed),
            Ok(CleanupBatch::Removed(n)) => {
                removed += n;
                metrics.cleanup_removed(n);
            }
            Ok(CleanupBatch::Busy) => return (CleanupOutcome::Busy, removed),
            Err(e) => {
                warn!(error = %e, removed, "automatic cleanup failed; it is tried again next round");
                return (CleanupOutcome::Failed, removed);
            }
        }
    }
}

/// Runs a round now and then every `schedule.interval` until `shutdown` is cancelled.
pub async fn run(
    store: PostgresStore,
    schedule: CleanupSchedule,
    metrics: std::sync::Arc<Metrics>,
    shutdown: CancellationToken,
) {
    info!(
        older_than = %txoutbox_core::duration::format(schedule.older_than),
        every = %txoutbox_core::duration::format(schedule.interval),
        "automatic cleanup of published rows is on"
    );
    metrics.cleanup_started();
    loop {
        let (outcome, removed) = round(&store, &schedule, &metrics, &shutdown).await;
        metrics.cleanup_ran(outcome);
        if removed > 0 {
            info!(removed, outcome = outcome.label(), "cleanup round ended");
        }
        tokio::select! {
            _ = tokio::time::sleep(schedule.interval) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
