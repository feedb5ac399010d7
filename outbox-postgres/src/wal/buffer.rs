//! The reader's buffer: the transactions read from the slot and not yet confirmed, each event's
//! state (ready, in a lease, failed, moving to the held table, done), and what the store, its
//! leases and the reader task share ([`Inner`]).

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::Notify;
use uuid::Uuid;

use txoutbox_core::{Action, Event, Wake};

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
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) delete_published: bool,
    pub(super) read_ahead: usize,
    pub(super) read_ahead_bytes: usize,
    pub(super) held_poll_interval: Duration,
    /// `wal.auto_recreate`: the reader makes a missing or lost slot (and publication) again.
    pub(super) auto_recreate: bool,
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

    pub(super) fn claims_paused_after(&self) -> Duration {
        CLAIMS_PAUSED_AFTER.max(self.held_poll_interval * 2)
    }
}

/// Where one event of the buffer stands.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum EntryState {
    /// Claimable.
    Ready,
    /// In a live lease.
    InFlight(u64),
    /// Settled as a failure: to be moved to the held table with the later events of its aggregate.
    Failed(Action),
    /// Being moved to the held table.
    Moving,
    /// Published, or in the held table.
    Done,
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) event: Event,
    /// A hash of the aggregate: equal aggregates have equal keys (a collision only holds an
    /// aggregate back with another within one claim).
    pub(super) key: u64,
    pub(super) state: EntryState,
}

#[derive(Debug)]
pub(super) struct Txn {
    pub(super) end_lsn: u64,
    pub(super) commit_time: DateTime<Utc>,
    pub(super) entries: Vec<Entry>,
    pub(super) row_ids: Vec<Uuid>,
}

impl Txn {
    pub(super) fn settled(&self) -> bool {
        self.entries.iter().all(|e| e.state == EntryState::Done)
    }
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// Bumped whenever the reader starts or stops reading: leases of another generation are void.
    pub(super) generation: u64,
    pub(super) active: bool,
    pub(super) txns: VecDeque<Txn>,
    pub(super) next_lease: u64,
    /// Events not yet published nor moved, and their payload bytes.
    pub(super) unsettled: usize,
    pub(super) unsettled_bytes: usize,
    pub(super) in_flight: usize,
    /// Events settled as failures, not yet being moved.
    pub(super) failed: usize,
    /// The position last confirmed by this reader.
    pub(super) confirmed: u64,
    /// The server session (`pg_backend_pid()`) that holds the reader lock while reading; 0 when
    /// not reading.
    pub(super) session: i32,
}

impl State {
    pub(super) fn entry_mut(&mut self, end_lsn: u64, index: usize) -> Option<&mut Entry> {
        let t = self
            .txns
            .binary_search_by_key(&end_lsn, |t| t.end_lsn)
            .ok()?;
        self.txns.get_mut(t)?.entries.get_mut(index)
    }

    pub(super) fn set_state(&mut self, end_lsn: u64, index: usize, state: EntryState) {
        let Some(entry) = self.entry_mut(end_lsn, index) else {
            return;
        };
        let was_in_flight = matches!(entry.state, EntryState::InFlight(_));
        let was_done = entry.state == EntryState::Done;
        let bytes = entry.event.payload.len();
        let now_in_flight = matches!(state, EntryState::InFlight(_));
        let now_done = state == EntryState::Done;
        let was_failed = matches!(entry.state, EntryState::Failed(_));
        let now_failed = matches!(state, EntryState::Failed(_));
        entry.state = state;
        if was_failed && !now_failed {
            self.failed -= 1;
        } else if !was_failed && now_failed {
            self.failed += 1;
        }
        if was_in_flight && !now_in_flight {
            self.in_flight -= 1;
        } else if !was_in_flight && now_in_flight {
            self.in_flight += 1;
        }
        if !was_done && now_done {
            self.unsettled -= 1;
            self.unsettled_bytes = self.unsettled_bytes.saturating_sub(bytes);
        }
    }
}

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
    /// A reading of this relay ended after deleting rows of events it had not confirmed yet:
    /// later readings check what they read again ([`super::replay::ReplayGuard`]).
    pub(super) left_unconfirmed: AtomicBool,
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

/// The key of an aggregate in the buffer (see `Entry::key`).
pub(super) fn aggregate_key(aggregate_type: &str, aggregate_id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    aggregate_type.hash(&mut h);
    aggregate_id.hash(&mut h);
    h.finish()
}
