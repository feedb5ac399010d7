//! The reader's buffer: the transactions read from the slot and not yet confirmed, and each
//! event's state (ready, in a lease, failed, moving to the held table, done). Shared through
//! `shared::Inner`.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

use chrono::{DateTime, Utc};
use uuid::Uuid;

use txoutbox_core::{Action, Event};

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
    /// A reading starts on the lock holder `session`: a new generation, the buffer empty.
    pub(super) fn start_reading(&mut self, session: i32) {
        *self = State {
            generation: self.generation + 1,
            active: true,
            next_lease: self.next_lease,
            session,
            ..State::default()
        };
    }

    /// A reading ended: a new generation (its leases void), the buffer empty, the confirmed
    /// position kept.
    pub(super) fn stop_reading(&mut self) {
        *self = State {
            generation: self.generation + 1,
            active: false,
            next_lease: self.next_lease,
            confirmed: self.confirmed,
            ..State::default()
        };
    }

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

/// The key of an aggregate in the buffer (see `Entry::key`).
pub(super) fn aggregate_key(aggregate_type: &str, aggregate_id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    aggregate_type.hash(&mut h);
    aggregate_id.hash(&mut h);
    h.finish()
}
