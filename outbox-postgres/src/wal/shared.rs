//! What the store, its leases and the reader task share ([`Inner`]): the connections and the
//! tables, the `[wal]` settings the store uses, the buffer's state, the held table's poll, the
//! wake-ups, and the fallbacks' progress.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Notify;

use txoutbox_core::Wake;

use super::buffer::State;
use super::conninfo::{ReplicationHealth, ReplicationTarget};
use super::decode::WalReader;
use super::progress::Fallbacks;
use crate::store::PostgresStore;
use crate::table::OutboxTable;

/// The reader stops reading the slot when the relay has not asked for events for this long, or
/// twice the held table's poll interval (`relay.poll_interval` in the binary) if longer: a relay
/// does not claim while its broker is down, and reads would only move events to the held table,
/// each read decoding again what is not confirmed. The relay's next claim wakes it.
pub const CLAIMS_PAUSED_AFTER: Duration = Duration::from_secs(1);

/// The WAL source's settings the store uses (from `[wal]`).
#[derive(Debug)]
pub(super) struct Settings {
    pub(super) delete_published: bool,
    pub(super) read_ahead: usize,
    pub(super) read_ahead_bytes: usize,
    /// How often the held table is looked at for due events, in milliseconds (set after the store
    /// is shared: [`WalStore::with_held_poll_interval`](super::WalStore::with_held_poll_interval)).
    pub(super) held_poll_interval_ms: std::sync::atomic::AtomicU64,
    /// `wal.auto_recreate`: the reader makes a missing or lost slot (and publication) again.
    pub(super) auto_recreate: bool,
    /// `wal.retained_wal_warning`: retained WAL above this many bytes is warned about.
    pub(super) retained_wal_warning: u64,
}

impl Settings {
    /// A transaction with more events than this (or more payload bytes than
    /// [`Settings::part_bytes`]) is not held in memory whole: it comes in parts, which go to the
    /// held table.
    pub(super) fn part_events(&self) -> usize {
        self.read_ahead.saturating_mul(10)
    }

    /// Half the read-ahead's bytes: a part is held by the stream's task, then the channel, then
    /// the reader while it goes to the held table (copied into the statement's parameters).
    pub(super) fn part_bytes(&self) -> usize {
        (self.read_ahead_bytes / 2).max(1)
    }

    pub(super) fn held_poll_interval(&self) -> Duration {
        Duration::from_millis(
            self.held_poll_interval_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        )
    }

    pub(super) fn claims_paused_after(&self) -> Duration {
        CLAIMS_PAUSED_AFTER.max(self.held_poll_interval() * 2)
    }
}

/// When the store looks at the held table for a claim.
pub(super) struct HeldPoll {
    /// The reader moved events there since the last empty claim.
    pub(super) dirty: bool,
    /// When to look again for due events (retry delays, operators' retries).
    pub(super) next_check: Instant,
    /// The last batch came from the held table: the next looks at the slot's events first.
    pub(super) last_from_held: bool,
}

/// What the store, its leases and the reader task share.
pub(super) struct Inner {
    pub(super) pool: PgPool,
    /// The replication connection's settings (the pool's), and whether it opens.
    pub(super) replication: ReplicationTarget,
    pub(super) replication_health: ReplicationHealth,
    pub(super) reader: WalReader,
    pub(super) source: OutboxTable,
    pub(super) held: PostgresStore,
    pub(super) settings: Settings,
    pub(super) state: Mutex<State>,
    pub(super) held_poll: Mutex<HeldPoll>,
    /// Wakes the reader (a batch was settled; new events may be there).
    pub(super) reader_wake: Arc<Notify>,
    pub(super) relay_wake: Mutex<Option<Wake>>,
    /// The fallbacks to the outbox table: now, and counted.
    pub(super) fallbacks: Fallbacks,
    /// When the relay last asked for events.
    pub(super) last_claim: Mutex<Instant>,
    /// A reading of this relay failed, having deleted rows of events the server may not have
    /// seen confirmed: later readings check what they read again
    /// ([`super::replay::ReplayGuard`]).
    pub(super) left_unconfirmed: AtomicBool,
    /// The transactions a failed reading had settled and not confirmed: their table-less events
    /// (published or in the held table) are not taken again by the next reading.
    pub(super) left_taken: Mutex<super::taken::Taken>,
}

impl Inner {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn wake_relay(&self) {
        if let Some(w) = self
            .relay_wake
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            w.wake();
        }
    }
}
