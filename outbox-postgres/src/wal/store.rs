//! The WAL source's [`Store`]: events read from the slot in commit order, published by the same
//! relay engine as the polling source's.
//!
//! # How it works
//! - **One reader per slot.** A background task ([`WalStore::start`]) opens a connection of its
//!   own and takes a session advisory lock for the slot; other relays wait (hot standbys, trying
//!   every [`STANDBY_RETRY`]) and take over when the reader's session ends (a crash, `kill -9`, a
//!   dropped connection: PostgreSQL frees the lock with the session). Every statement of the
//!   reader (hand-overs to the held table, deletes of published rows) runs on that connection, so
//!   a reader that lost its lock lost the connection it would write with; the slot itself is
//!   streamed over a replication connection (`START_REPLICATION`, which the slot admits one at a
//!   time), opened once the lock is held, and confirmed with standby status updates.
//! - **Claims.** The reader keeps the transactions it read, whole and in commit order, in memory
//!   (bounded: `wal.read_ahead` events and `wal.read_ahead_bytes`). A claim takes, per aggregate,
//!   the first unsettled event and the ready ones after it, never an aggregate another batch holds.
//! - **Failures go to the held table.** An event the relay could not publish (to retry, or a dead
//!   letter), the later events of its aggregate, and every event of an aggregate that still has
//!   events in that table, are moved to the *held table* (`wal.held_table`, an outbox table of its
//!   own), in commit order. The same relay claims from it with the polling machinery (backoff,
//!   dead letters, `outbox dead-letters`), so a failing aggregate holds back only itself and the
//!   slot moves on.
//! - **Confirms.** The slot's confirmed position moves past a transaction only once each of its
//!   events is published or in the held table (and, with `wal.delete_published`, its outbox rows
//!   deleted): a crash replays from there (at least once). A replayed event already in the held
//!   table is not moved twice.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use outbox_core::Wake;
use outbox_core::{
    Action, Batch, ClaimRequest, Error, Event, Lease, OrderingPolicy, Settlement, Store, StoreStats,
};

use pg_walstream::stream::{LogicalReplicationStream, ReplicationStreamConfig};
use pg_walstream::SharedLsnFeedback;
use tokio::sync::mpsc;

use super::decode::{Decoder, Origin};
use super::{WalConfig, WalItem, WalReader, WalSlot, WalTransaction};
use crate::error::map_sqlx;
use crate::store::{EmptyLease, PostgresStore};
use crate::table::OutboxTable;

/// How often a standby tries to take the reader lock.
pub const STANDBY_RETRY: Duration = Duration::from_millis(500);

/// The reader stops reading the slot when the relay has not asked for events for this long, or
/// twice the held table's poll interval (`relay.poll_interval` in the binary) if longer: a relay
/// does not claim while its broker is down, and reads would only move events to the held table,
/// each read decoding again what is not confirmed. The relay's next claim wakes it.
pub const CLAIMS_PAUSED_AFTER: Duration = Duration::from_secs(1);

/// The longest the reader waits to confirm settled transactions (see `confirm_settled`).
const CONFIRM_EVERY: Duration = Duration::from_millis(50);

/// How often the reader runs a statement on its lock connection at least (a dead one ends the
/// reading spell, so that a reader that lost its lock stops).
const LOCK_PING: Duration = Duration::from_secs(10);

/// How often the reader looks whether the held table is empty again, while it may not be.
const HELD_EMPTY_CHECK: Duration = Duration::from_secs(1);

/// How long the reader waits between two looks at what it holds while the relay does not claim.
const PAUSED_WAIT: Duration = Duration::from_secs(1);

/// How long the reader waits before connecting again after its connection failed.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// Events the reader could not read as events are dead-lettered under this aggregate type.
pub const UNDECODABLE_AGGREGATE_TYPE: &str = "(undecodable)";

/// The WAL source's settings the store uses (from `[wal]`).
#[derive(Debug, Clone)]
struct Settings {
    delete_published: bool,
    read_ahead: usize,
    read_ahead_bytes: usize,
    held_poll_interval: Duration,
}

impl Settings {
    fn claims_paused_after(&self) -> Duration {
        CLAIMS_PAUSED_AFTER.max(self.held_poll_interval * 2)
    }
}

/// Where one event of the buffer stands.
#[derive(Debug, Clone, PartialEq)]
enum EntryState {
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
struct Entry {
    event: Event,
    /// A hash of the aggregate: equal aggregates have equal keys (a collision only holds an
    /// aggregate back with another within one claim).
    key: u64,
    state: EntryState,
}

#[derive(Debug)]
struct Txn {
    end_lsn: u64,
    commit_time: DateTime<Utc>,
    entries: Vec<Entry>,
    row_ids: Vec<Uuid>,
}

impl Txn {
    fn settled(&self) -> bool {
        self.entries.iter().all(|e| e.state == EntryState::Done)
    }
}

#[derive(Debug, Default)]
struct State {
    /// Bumped whenever the reader starts or stops reading: leases of another generation are void.
    generation: u64,
    active: bool,
    txns: VecDeque<Txn>,
    next_lease: u64,
    /// Events not yet published nor moved, and their payload bytes.
    unsettled: usize,
    unsettled_bytes: usize,
    in_flight: usize,
    /// Events settled as failures, not yet being moved.
    failed: usize,
    /// The position last confirmed by this reader.
    confirmed: u64,
}

impl State {
    fn entry_mut(&mut self, end_lsn: u64, index: usize) -> Option<&mut Entry> {
        let t = self
            .txns
            .binary_search_by_key(&end_lsn, |t| t.end_lsn)
            .ok()?;
        self.txns.get_mut(t)?.entries.get_mut(index)
    }

    fn set_state(&mut self, end_lsn: u64, index: usize, state: EntryState) {
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

/// What the reader has in hand, for metrics and `outbox status`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WalProgress {
    /// Whether this process reads the slot (false: a standby, or reconnecting).
    pub active: bool,
    /// Events read and not yet published nor moved to the held table.
    pub unsettled: usize,
    /// Of those, events in a batch being published.
    pub in_flight: usize,
    /// Seconds since the commit of the oldest transaction read and not confirmed (0 when none).
    pub lag_seconds: f64,
    /// The position this reader last confirmed (0: none yet).
    pub confirmed_lsn: u64,
}

struct HeldPoll {
    /// The reader moved events there since the last empty claim.
    dirty: bool,
    /// When to look again for due events (retry delays, operators' retries).
    next_check: Instant,
    /// The last batch came from the held table: the next looks at the slot's events first.
    last_from_held: bool,
}

struct Inner {
    pool: PgPool,
    replication_url: String,
    reader: WalReader,
    source: OutboxTable,
    held: PostgresStore,
    settings: Settings,
    state: Mutex<State>,
    held_poll: Mutex<HeldPoll>,
    /// Wakes the reader (a batch was settled; new events may be there).
    reader_wake: Arc<Notify>,
    relay_wake: Mutex<Option<Wake>>,
    slot_missing: Mutex<bool>,
    /// When the relay last asked for events.
    last_claim: Mutex<Instant>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wake_relay(&self) {
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

/// The WAL source: a [`Store`] over a replication slot, with its held table (see the module's
/// documentation). Cheap to clone; start its reader with [`WalStore::start`].
#[derive(Clone)]
pub struct WalStore {
    inner: Arc<Inner>,
}

/// The running reader of a [`WalStore`]; [`ReaderHandle::stop`] settles what it can and ends it.
pub struct ReaderHandle {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl ReaderHandle {
    /// Moves failed events to the held table, confirms what is settled, and ends the reader (its
    /// lock is freed with its connection, for a standby to take over).
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

fn aggregate_key(aggregate_type: &str, aggregate_id: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    aggregate_type.hash(&mut h);
    aggregate_id.hash(&mut h);
    h.finish()
}

impl WalStore {
    /// The WAL source of `slot`'s table, moving what it cannot publish at once to `held` (an
    /// outbox table migrated like any other; `outbox wal setup` makes it).
    ///
    /// The slot is streamed over a replication connection to `database_url` (the pool's URL; the
    /// role needs the `REPLICATION` attribute, as for any logical slot).
    pub fn new(
        pool: PgPool,
        database_url: &str,
        slot: WalSlot,
        held: PostgresStore,
        config: &WalConfig,
    ) -> Self {
        let source = slot.table().clone();
        let separator = if database_url.contains('?') { '&' } else { '?' };
        WalStore {
            inner: Arc::new(Inner {
                pool,
                replication_url: format!("{database_url}{separator}replication=database"),
                reader: WalReader::new(slot),
                source,
                held,
                settings: Settings {
                    delete_published: config.delete_published,
                    read_ahead: config.read_ahead.max(1),
                    read_ahead_bytes: config.read_ahead_bytes.max(1),
                    held_poll_interval: Duration::from_millis(500),
                },
                state: Mutex::new(State::default()),
                held_poll: Mutex::new(HeldPoll {
                    dirty: true,
                    next_check: Instant::now(),
                    last_from_held: false,
                }),
                reader_wake: Arc::new(Notify::new()),
                relay_wake: Mutex::new(None),
                slot_missing: Mutex::new(false),
                last_claim: Mutex::new(Instant::now()),
            }),
        }
    }

    /// Wakes `wake` (the relay's) when events are there to claim.
    pub fn with_wake(self, wake: Wake) -> Self {
        *self
            .inner
            .relay_wake
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(wake);
        self
    }

    /// How often the held table is looked at for due events when nothing was moved there (retry
    /// delays, dead letters retried by an operator). Default 500 ms; the `outbox` binary uses
    /// `relay.poll_interval`.
    pub fn with_held_poll_interval(mut self, every: Duration) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.settings.held_poll_interval = every;
        }
        self
    }

    /// The held table's store (dead letters, statistics, cleanup).
    pub fn held(&self) -> &PostgresStore {
        &self.inner.held
    }

    /// The slot.
    pub fn slot(&self) -> &WalSlot {
        self.inner.reader.slot()
    }

    /// A handle that makes the reader look at the slot at once (for example on a NOTIFY from the
    /// outbox table's writers).
    pub fn reader_wake(&self) -> Arc<Notify> {
        self.inner.reader_wake.clone()
    }

    /// What the reader has in hand.
    pub fn progress(&self) -> WalProgress {
        let st = self.inner.state();
        let oldest = st.txns.iter().find(|t| !t.settled()).map(|t| t.commit_time);
        WalProgress {
            active: st.active,
            unsettled: st.unsettled,
            in_flight: st.in_flight,
            lag_seconds: oldest.map_or(0.0, |t| {
                (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
            }),
            confirmed_lsn: st.confirmed,
        }
    }

    /// Starts the reader: it waits for the slot's reader lock (a standby meanwhile), then reads.
    ///
    /// Needs a multi-thread tokio runtime (the replication transport's worker on a current-thread
    /// runtime drops frames when a wait for data is cut): on another, the reader logs why and
    /// does not read, and [`Store::check`] fails.
    pub fn start(&self) -> ReaderHandle {
        let stop = CancellationToken::new();
        let task = tokio::spawn(run_reader(self.inner.clone(), stop.clone()));
        ReaderHandle { stop, task }
    }

    fn claim_from_buffer(&self, request: &ClaimRequest) -> Option<Batch> {
        let inner = &self.inner;
        let mut st = inner.state();
        if !st.active || st.unsettled == st.in_flight {
            return None;
        }
        st.next_lease += 1;
        let lease_id = st.next_lease;
        let generation = st.generation;
        let per_aggregate = request.ordering == OrderingPolicy::PerAggregate;
        let mut blocked: HashSet<u64> = HashSet::new();
        let mut taken: Vec<(u64, usize)> = Vec::new();
        let mut events = Vec::new();
        let mut bytes = 0usize;
        'txns: for txn in st.txns.iter() {
            for (i, e) in txn.entries.iter().enumerate() {
                if e.state == EntryState::Done {
                    continue;
                }
                if per_aggregate && blocked.contains(&e.key) {
                    continue;
                }
                if e.state != EntryState::Ready {
                    blocked.insert(e.key);
                    continue;
                }
                let size = e.event.payload.len();
                if !request.fits(events.len(), bytes, size) {
                    break 'txns;
                }
                bytes = bytes.saturating_add(size);
                events.push(e.event.clone());
                taken.push((txn.end_lsn, i));
                if events.len() >= request.limit.max(1) {
                    break 'txns;
                }
            }
        }
        if events.is_empty() {
            return None;
        }
        for (end, i) in &taken {
            st.set_state(*end, *i, EntryState::InFlight(lease_id));
        }
        let positions = events
            .iter()
            .zip(taken.iter())
            .map(|(e, p)| (e.id, *p))
            .collect();
        Some(Batch {
            events,
            lease: Box::new(WalLease {
                inner: inner.clone(),
                generation,
                lease_id,
                positions,
                open: true,
            }),
        })
    }

    /// Whether to look at the held table for this claim.
    fn held_turn(&self) -> bool {
        let mut p = self
            .inner
            .held_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let due = p.dirty || Instant::now() >= p.next_check;
        if !due {
            return false;
        }
        // Both have work: take turns.
        let buffered = {
            let st = self.inner.state();
            st.unsettled > st.in_flight
        };
        if buffered && p.last_from_held {
            p.last_from_held = false;
            return false;
        }
        true
    }

    fn held_result(&self, got_events: bool) {
        let mut p = self
            .inner
            .held_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        p.last_from_held = got_events;
        if !got_events {
            p.dirty = false;
            p.next_check = Instant::now() + self.inner.settings.held_poll_interval;
        }
    }
}

#[async_trait]
impl Store for WalStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error> {
        // A probe of an unreachable broker does not keep the reader reading.
        let paused = !request.probe && {
            let mut last = self
                .inner
                .last_claim
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let paused = last.elapsed() >= self.inner.settings.claims_paused_after();
            *last = Instant::now();
            paused
        };
        if paused {
            // The reader stopped reading meanwhile: it reads again.
            self.inner.reader_wake.notify_one();
        }
        if self.held_turn() {
            let batch = self.inner.held.claim(request).await?;
            let got = !batch.events.is_empty();
            self.held_result(got);
            if got {
                return Ok(batch);
            }
        }
        if let Some(batch) = self.claim_from_buffer(&request) {
            return Ok(batch);
        }
        Ok(Batch {
            events: Vec::new(),
            lease: Box::new(EmptyLease),
        })
    }

    /// The held table's counts, with the events read from the slot and not yet settled counted as
    /// pending (their age from their commit).
    async fn stats(&self) -> Result<StoreStats, Error> {
        let mut stats = self.inner.held.stats().await?;
        let progress = self.progress();
        stats.pending += progress.unsettled as u64;
        if progress.unsettled > 0 {
            let age = progress.lag_seconds;
            stats.oldest_pending_age_seconds = Some(
                stats
                    .oldest_pending_age_seconds
                    .map_or(age, |held| held.max(age)),
            );
        }
        Ok(stats)
    }

    /// The held table answers and the slot exists.
    async fn check(&self) -> Result<(), Error> {
        runtime_supported()?;
        self.inner.held.check().await?;
        let slot = self.inner.reader.slot();
        let exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database())",
        )
        .bind(slot.slot())
        .fetch_one(&self.inner.pool)
        .await
        .map_err(|e| map_sqlx("check", e))?;
        *self
            .inner
            .slot_missing
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = !exists;
        if !exists {
            return Err(Error::config(format!(
                "the replication slot {} does not exist: run `outbox wal setup` (events committed while it is missing are not read by it)",
                slot.slot()
            )));
        }
        Ok(())
    }
}

/// A batch of the slot's events: settling it marks them in the reader's buffer, which moves the
/// failed ones to the held table and confirms what is settled.
struct WalLease {
    inner: Arc<Inner>,
    generation: u64,
    lease_id: u64,
    /// Each event of the batch and where it is (two events may share an id: both are settled).
    positions: Vec<(Uuid, (u64, usize))>,
    open: bool,
}

impl WalLease {
    fn apply(&mut self, actions: HashMap<Uuid, Action>) {
        self.open = false;
        let mut st = self.inner.state();
        if st.generation != self.generation {
            // The reader lost the slot meanwhile: what this batch held is read again.
            return;
        }
        for (id, (end, i)) in std::mem::take(&mut self.positions) {
            let holds = matches!(
                st.entry_mut(end, i).map(|e| &e.state),
                Some(EntryState::InFlight(l)) if *l == self.lease_id
            );
            if !holds {
                continue;
            }
            let state = match actions.get(&id) {
                Some(Action::Published) => EntryState::Done,
                Some(a @ (Action::Retry { .. } | Action::DeadLetter { .. })) => {
                    EntryState::Failed(a.clone())
                }
                Some(Action::Release) | None => EntryState::Ready,
            };
            st.set_state(end, i, state);
        }
        drop(st);
        self.inner.reader_wake.notify_one();
        self.inner.wake_relay();
    }
}

#[async_trait]
impl Lease for WalLease {
    async fn settle(mut self: Box<Self>, settlements: Vec<Settlement>) -> Result<(), Error> {
        let actions = settlements.into_iter().map(|s| (s.id, s.action)).collect();
        self.apply(actions);
        Ok(())
    }

    async fn release(mut self: Box<Self>) -> Result<(), Error> {
        self.apply(HashMap::new());
        Ok(())
    }
}

impl Drop for WalLease {
    fn drop(&mut self) {
        if self.open {
            self.apply(HashMap::new());
        }
    }
}

/// The reader: waits for the lock, reads while it holds it, reconnects after failures.
async fn run_reader(inner: Arc<Inner>, stop: CancellationToken) {
    let slot = inner.reader.slot().slot().to_string();
    if let Err(e) = runtime_supported() {
        tracing::error!(error = %e, slot = %slot, "the WAL reader does not read");
        return;
    }
    let mut waiting_logged = false;
    let mut failures = RepeatedWarning::default();
    loop {
        if stop.is_cancelled() {
            return;
        }
        let conn = tokio::select! {
            c = connect(&inner) => c,
            _ = stop.cancelled() => return,
        };
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                if failures.should_log(&e.to_string()) {
                    warn!(error = %e, slot = %slot, "the WAL reader cannot connect; trying again (a failure that repeats is logged once a minute)");
                }
                if pause(&stop, RECONNECT_PAUSE).await {
                    return;
                }
                continue;
            }
        };
        // Standby until the lock is ours.
        let locked = loop {
            match try_lock(&mut conn, &slot).await {
                Ok(true) => break Ok(()),
                Ok(false) => {
                    if !waiting_logged {
                        info!(slot = %slot, "another relay reads the slot; standing by to take over");
                        waiting_logged = true;
                    }
                    if pause(&stop, STANDBY_RETRY).await {
                        return;
                    }
                }
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = locked {
            warn!(error = %e, slot = %slot, "the WAL reader lost its connection while standing by; reconnecting");
            if pause(&stop, RECONNECT_PAUSE).await {
                return;
            }
            continue;
        }
        waiting_logged = false;
        {
            let mut st = inner.state();
            *st = State {
                generation: st.generation + 1,
                active: true,
                next_lease: st.next_lease,
                ..State::default()
            };
        }
        info!(slot = %slot, "reading the slot");
        let result = read_slot(&inner, &mut conn, &stop).await;
        {
            let mut st = inner.state();
            *st = State {
                generation: st.generation + 1,
                active: false,
                next_lease: st.next_lease,
                confirmed: st.confirmed,
                ..State::default()
            };
        }
        match result {
            Ok(()) => {
                let _ = conn.close().await;
                info!(slot = %slot, "stopped reading the slot");
                return;
            }
            Err(e) => {
                if failures.should_log(&e.to_string()) {
                    warn!(error = %e, slot = %slot, "the WAL reader stopped reading; what it held is read again once it holds the slot (a failure that repeats is logged once a minute)");
                }
                drop(conn);
                if pause(&stop, RECONNECT_PAUSE).await {
                    return;
                }
            }
        }
    }
}

/// The WAL source reads on a multi-thread tokio runtime only (see [`WalStore::start`]).
fn runtime_supported() -> Result<(), Error> {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => Ok(()),
        _ => Err(Error::config(
            "the WAL source needs a multi-thread tokio runtime (#[tokio::main] or \
             #[tokio::test(flavor = \"multi_thread\")])",
        )),
    }
}

/// Logs a failure that repeats once a minute rather than at every retry.
#[derive(Default)]
struct RepeatedWarning {
    last: Option<(String, Instant)>,
}

impl RepeatedWarning {
    fn should_log(&mut self, message: &str) -> bool {
        match &self.last {
            Some((m, at)) if m == message && at.elapsed() < Duration::from_secs(60) => false,
            _ => {
                self.last = Some((message.to_string(), Instant::now()));
                true
            }
        }
    }
}

/// Waits `d` or until `stop`; true when stopped.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.cancelled() => true,
    }
}

/// The reader's own connection (the pool's settings), with no statement or idle timeouts of the
/// role's: it waits on the slot and must outlive an idle spell.
async fn connect(inner: &Inner) -> Result<PgConnection, Error> {
    let options = inner.pool.connect_options();
    let mut conn = PgConnection::connect_with(&options)
        .await
        .map_err(|e| map_sqlx("wal reader connect", e))?;
    sqlx::query(
        "SELECT set_config('statement_timeout', '0', false), set_config('idle_session_timeout', '0', false)
         WHERE current_setting('server_version_num')::int >= 140000
         UNION ALL SELECT set_config('statement_timeout', '0', false), ''
         WHERE current_setting('server_version_num')::int < 140000",
    )
    .execute(&mut conn)
    .await
    .map_err(|e| map_sqlx("wal reader connect", e))?;
    // The pool's server-side TCP keepalives: a reader whose host vanished loses its session, and
    // the lock with it, within about 25 s instead of the kernel's two hours.
    {
        use sqlx::Executor;
        conn.execute(sqlx::raw_sql(crate::KEEPALIVES))
            .await
            .map_err(|e| map_sqlx("wal reader connect", e))?;
    }
    Ok(conn)
}

/// Takes the slot's reader lock if it is free (a session lock: freed when the session ends).
async fn try_lock(conn: &mut PgConnection, slot: &str) -> Result<bool, Error> {
    sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext('outbox-wal-reader'), hashtext($1))")
        .bind(slot)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal reader lock", e))
}

/// The replication stream of one reading spell: decoded transactions come over `rx`; `feedback`
/// carries the confirmed position to the server; `settled` counts the transactions confirmed (the
/// stream's task reports its whole received position while every transaction it delivered is).
struct Stream {
    rx: mpsc::Receiver<Result<WalTransaction, Error>>,
    feedback: Arc<SharedLsnFeedback>,
    /// Makes the stream's task send the confirmed position now.
    feedback_now: Arc<Notify>,
    settled: Arc<AtomicU64>,
    /// Payload bytes of the transactions in the channel (the task waits while they pass
    /// `wal.read_ahead_bytes`).
    channel_bytes: Arc<AtomicU64>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl Stream {
    /// A transaction taken from the channel: its bytes leave the channel's count.
    fn taken(&self, t: Result<WalTransaction, Error>) -> Result<WalTransaction, Error> {
        let t = t?;
        self.channel_bytes
            .fetch_sub(transaction_bytes(&t), Ordering::SeqCst);
        Ok(t)
    }

    async fn close(self) {
        self.cancel.cancel();
        // The task may be waiting to hand over a transaction or an error: no one takes them now.
        drop(self.rx);
        let _ = self.task.await;
    }
}

/// Transactions decoded ahead of the reader (the stream's task waits beyond: backpressure).
const STREAM_CHANNEL: usize = 64;

/// How often the stream's task sends the server its position while no data arrives, and reports
/// the whole received position when everything it delivered is confirmed (an idle outbox on a busy
/// database: the slot still moves on).
const STREAM_FEEDBACK: Duration = Duration::from_secs(1);

fn stream_error(what: &str, e: pg_walstream::ReplicationError) -> Error {
    // Retryable: the reader connects again (a walsender still holding the slot for a reader
    // that just died answers 55006 for a moment).
    Error::new(outbox_core::ErrorKind::Connection, format!("{what}: {e}"))
}

/// Opens the slot's replication stream from its confirmed position, with a task of its own that
/// decodes whole transactions and hands them over.
async fn open_stream(inner: &Inner, origin: Origin) -> Result<Stream, Error> {
    let slot = inner.reader.slot();
    let mut config = ReplicationStreamConfig::builder(slot.slot(), slot.publication())
        .with_protocol_version(1)
        .with_messages(true)
        // Confirms reach the server within this while data flows (the stream checks every 128
        // messages): a new reader replays from there.
        .with_feedback_interval(CONFIRM_EVERY)
        .with_connection_timeout(Duration::from_secs(30));
    config.retry_config.max_attempts = 1;
    let mut stream = LogicalReplicationStream::new(&inner.replication_url, config)
        .await
        .map_err(|e| stream_error("wal stream connect", e))?;
    // From the slot's confirmed position.
    stream
        .start(None)
        .await
        .map_err(|e| stream_error("wal stream start", e))?;
    let feedback = stream.shared_lsn_feedback.clone();
    let settled = Arc::new(AtomicU64::new(0));
    let (tx, rx) = mpsc::channel(STREAM_CHANNEL);
    let cancel = CancellationToken::new();
    let decoder = Decoder::new(slot, origin);
    let feedback_now = Arc::new(Notify::new());
    let channel_bytes = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(stream_task(
        stream,
        decoder,
        StreamShared {
            tx,
            feedback: feedback.clone(),
            feedback_now: feedback_now.clone(),
            settled: settled.clone(),
            channel_bytes: channel_bytes.clone(),
            max_bytes: inner.settings.read_ahead_bytes as u64,
        },
        cancel.clone(),
    ));
    Ok(Stream {
        rx,
        feedback,
        feedback_now,
        settled,
        channel_bytes,
        cancel,
        task,
    })
}

/// What the stream's task shares with the reader.
struct StreamShared {
    tx: mpsc::Sender<Result<WalTransaction, Error>>,
    feedback: Arc<SharedLsnFeedback>,
    feedback_now: Arc<Notify>,
    settled: Arc<AtomicU64>,
    channel_bytes: Arc<AtomicU64>,
    max_bytes: u64,
}

/// The payload bytes of a transaction's events.
fn transaction_bytes(t: &WalTransaction) -> u64 {
    t.items
        .iter()
        .map(|item| match item {
            WalItem::Event(e) => e.payload.len() as u64,
            WalItem::Undecodable { raw, .. } => raw.len() as u64,
        })
        .sum()
}

async fn stream_task(
    mut stream: LogicalReplicationStream,
    mut decoder: Decoder,
    shared: StreamShared,
    cancel: CancellationToken,
) {
    let StreamShared {
        tx,
        feedback,
        feedback_now,
        settled,
        channel_bytes,
        max_bytes,
    } = shared;
    let mut delivered = 0u64;
    let mut last_answer = Instant::now();
    let mut period = cancel.child_token();
    let mut period_timer = spawn_period(period.clone(), feedback_now.clone());
    loop {
        let raw = match stream.next_raw_event(&period).await {
            Ok(raw) => raw,
            Err(e) if e.is_cancelled() => {
                if cancel.is_cancelled() {
                    period_timer.abort();
                    let _ = stream.stop().await;
                    return;
                }
                // A quiet second: report the whole received position (keepalives included:
                // everything committed below it was sent before) when all delivered is settled.
                if settled.load(Ordering::SeqCst) == delivered && !decoder.in_transaction() {
                    let at = stream.current_lsn();
                    feedback.update_flushed_lsn(at);
                    feedback.update_applied_lsn(at);
                }
                let _ = stream.send_feedback().await;
                period = cancel.child_token();
                period_timer = spawn_period(period.clone(), feedback_now.clone());
                continue;
            }
            Err(e) => {
                hand_over_error(&tx, &cancel, stream_error("wal stream", e)).await;
                return;
            }
        };
        let decoded = decoder.feed(raw.wal_start.value(), &raw.data);
        let transaction = match decoded {
            Ok(Some(t)) => t,
            Ok(None) => continue,
            Err(e) => {
                hand_over_error(&tx, &cancel, e).await;
                return;
            }
        };
        delivered += 1;
        let bytes = transaction_bytes(&transaction);
        let mut transaction = Some(transaction);
        // Wait for room (a place in the channel, and its bytes under the read-ahead unless it is
        // empty), answering the server meanwhile (it ends a silent connection).
        while let Some(t) = transaction.take() {
            let full = channel_bytes.load(Ordering::SeqCst) > 0
                && channel_bytes.load(Ordering::SeqCst) + bytes > max_bytes;
            if full {
                transaction = Some(t);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                    _ = cancel.cancelled() => {
                        let _ = stream.stop().await;
                        return;
                    }
                }
                if last_answer.elapsed() >= Duration::from_secs(10) {
                    last_answer = Instant::now();
                    let _ = stream.send_feedback().await;
                }
                continue;
            }
            tokio::select! {
                permit = tx.reserve() => match permit {
                    Ok(p) => {
                        channel_bytes.fetch_add(bytes, Ordering::SeqCst);
                        p.send(Ok(t));
                    }
                    Err(_) => return,
                },
                _ = tokio::time::sleep(Duration::from_secs(10)) => {
                    transaction = Some(t);
                    let _ = stream.send_feedback().await;
                }
                _ = cancel.cancelled() => {
                    let _ = stream.stop().await;
                    return;
                }
            }
        }
    }
}

/// Gives the reader the stream's error, unless it stops first.
async fn hand_over_error(
    tx: &mpsc::Sender<Result<WalTransaction, Error>>,
    cancel: &CancellationToken,
    e: Error,
) {
    tokio::select! {
        _ = tx.send(Err(e)) => {}
        _ = cancel.cancelled() => {}
    }
}

/// Ends the stream task's wait for data after [`STREAM_FEEDBACK`], or at once when the reader
/// confirmed something (so that a new reader replays as little as can be).
fn spawn_period(token: CancellationToken, now: Arc<Notify>) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(STREAM_FEEDBACK) => {}
            _ = now.notified() => {}
            _ = token.cancelled() => {}
        }
        token.cancel();
    })
}

/// The server's identity, for the ids of messages written without one.
async fn origin(conn: &mut PgConnection) -> Result<Origin, Error> {
    let (system, timeline): (i64, i32) = sqlx::query_as(
        "SELECT (SELECT system_identifier FROM pg_control_system()),
                (SELECT timeline_id FROM pg_control_checkpoint())",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal read", e))?;
    Ok(Origin {
        system: system as u64,
        timeline: timeline as u32,
    })
}

/// Reads, moves and confirms while the lock is held; returns on `stop` (after a last round) or
/// on a database or stream error.
async fn read_slot(
    inner: &Inner,
    conn: &mut PgConnection,
    stop: &CancellationToken,
) -> Result<(), Error> {
    // The replication library would make a missing slot (at the stream's current position,
    // skipping what was committed meanwhile): a missing slot is the operator's to set up.
    let slot = inner.reader.slot();
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database())",
    )
    .bind(slot.slot())
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal read", e))?;
    if !exists {
        return Err(Error::config(format!(
            "the replication slot {} does not exist: run `outbox wal setup`",
            slot.slot()
        )));
    }
    let origin = origin(conn).await?;
    let mut stream = open_stream(inner, origin).await?;
    let result = read_stream(inner, conn, &mut stream, stop).await;
    stream.close().await;
    result
}

async fn read_stream(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &mut Stream,
    stop: &CancellationToken,
) -> Result<(), Error> {
    let mut last_confirm = Instant::now();
    // Whether the held table may hold unpublished events: until it is seen empty, every event
    // read is checked against it (its aggregate may wait there; a replayed event may be there).
    // Only this reader adds to it.
    let mut held_may_have_rows = true;
    let mut held_checked = Instant::now();
    loop {
        if move_failed(inner, conn).await? {
            held_may_have_rows = true;
        }
        let stopping = stop.is_cancelled();
        confirm_settled(inner, conn, stream, &mut last_confirm, stopping).await?;
        if stopping {
            return Ok(());
        }
        if (held_may_have_rows && held_checked.elapsed() >= HELD_EMPTY_CHECK)
            || held_checked.elapsed() >= LOCK_PING
        {
            // Also proves the lock's session alive now and then (a reader of table-less events
            // only may run no other statement on it).
            held_checked = Instant::now();
            held_may_have_rows = sqlx::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE processed_at IS NULL)",
                inner.held.table().qualified()
            ))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map_sqlx("wal read", e))?;
        }
        // Take in while fewer than `read_ahead` events wait to be claimed: a relay that does not
        // claim (its broker is down) stops the reading, and the server waits.
        let room = {
            let st = inner.state();
            let claiming = inner
                .last_claim
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed()
                < inner.settings.claims_paused_after();
            claiming
                && st.unsettled - st.in_flight < inner.settings.read_ahead
                && st.unsettled_bytes < inner.settings.read_ahead_bytes
        };
        let mut new = Vec::new();
        if room {
            // Whatever is decoded already, without waiting, within the read-ahead.
            let (mut events, mut bytes) = {
                let st = inner.state();
                (st.unsettled - st.in_flight, st.unsettled_bytes)
            };
            while events < inner.settings.read_ahead && bytes < inner.settings.read_ahead_bytes {
                match stream.rx.try_recv() {
                    Ok(t) => {
                        let t = stream.taken(t)?;
                        for item in &t.items {
                            if let WalItem::Event(e) = item {
                                events += 1;
                                bytes += e.payload.len();
                            }
                        }
                        new.push(t);
                    }
                    Err(_) => break,
                }
            }
        }
        if !new.is_empty() {
            if take_in(inner, conn, new, held_may_have_rows).await? {
                held_may_have_rows = true;
            }
            continue;
        }
        // Nothing in hand: wait for a transaction, a settled batch, a confirm due (only while a
        // settled transaction waits for it), or the stop.
        let settled_waiting = inner.state().txns.front().is_some_and(|t| t.settled());
        let wait = if !room {
            PAUSED_WAIT
        } else if settled_waiting {
            CONFIRM_EVERY
                .saturating_sub(last_confirm.elapsed())
                .max(Duration::from_millis(1))
        } else {
            PAUSED_WAIT
        };
        if room {
            tokio::select! {
                t = stream.rx.recv() => match t {
                    Some(t) => {
                        let t = stream.taken(t)?;
                        if take_in(inner, conn, vec![t], held_may_have_rows).await? {
                            held_may_have_rows = true;
                        }
                    }
                    None => return Err(Error::new(outbox_core::ErrorKind::Connection, "the WAL stream ended")),
                },
                _ = inner.reader_wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => {}
            }
        } else {
            tokio::select! {
                _ = inner.reader_wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => {}
            }
        }
    }
}

/// One row for the held table.
struct HeldRow {
    event: Event,
    attempts: i32,
    retry_in: Option<f64>,
    error: Option<String>,
    dead: bool,
}

impl HeldRow {
    fn waiting(event: Event) -> Self {
        HeldRow {
            event,
            attempts: 0,
            retry_in: None,
            error: None,
            dead: false,
        }
    }

    fn failed(event: Event, action: &Action) -> Self {
        match action {
            Action::Retry {
                attempts,
                delay,
                error,
            } => HeldRow {
                event,
                attempts: i32::try_from(*attempts).unwrap_or(i32::MAX),
                retry_in: Some(delay.as_secs_f64()),
                error: Some(error.clone()),
                dead: false,
            },
            Action::DeadLetter { attempts, error } => HeldRow {
                event,
                attempts: i32::try_from(*attempts).unwrap_or(i32::MAX),
                retry_in: None,
                error: Some(error.clone()),
                dead: true,
            },
            Action::Published | Action::Release => HeldRow::waiting(event),
        }
    }
}

/// Writes `rows` to the held table, in order, in one statement (events already there are left as
/// they are: a replay after a crash).
async fn insert_held(
    inner: &Inner,
    conn: &mut PgConnection,
    rows: &[HeldRow],
) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let n = rows.len();
    let mut ids = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut agg_ids = Vec::with_capacity(n);
    let mut event_types = Vec::with_capacity(n);
    let mut payloads: Vec<String> = Vec::with_capacity(n);
    let mut payload_bytes: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
    let mut content_types = Vec::with_capacity(n);
    let mut headers = Vec::with_capacity(n);
    let mut destinations = Vec::with_capacity(n);
    let mut created = Vec::with_capacity(n);
    let mut attempts = Vec::with_capacity(n);
    let mut retry_in: Vec<Option<f64>> = Vec::with_capacity(n);
    let mut errors: Vec<Option<String>> = Vec::with_capacity(n);
    let mut dead = Vec::with_capacity(n);
    for r in rows {
        let e = &r.event;
        ids.push(e.id);
        types.push(e.aggregate_type.clone());
        agg_ids.push(e.aggregate_id.clone());
        event_types.push(e.event_type.clone());
        // JSON stays JSON (as the writer stores it); anything else is kept as bytes.
        let json = e.is_json()
            && serde_json::from_slice::<&serde_json::value::RawValue>(&e.payload).is_ok();
        if json {
            payloads.push(String::from_utf8_lossy(&e.payload).into_owned());
            payload_bytes.push(None);
        } else {
            payloads.push("null".into());
            payload_bytes.push(Some(e.payload.clone()));
        }
        content_types.push(e.content_type.clone());
        headers.push(serde_json::to_string(&e.headers).unwrap_or_else(|_| "{}".into()));
        destinations.push(e.destination.clone());
        created.push(e.created_at);
        attempts.push(r.attempts);
        retry_in.push(r.retry_in);
        errors.push(r.error.clone());
        dead.push(r.dead);
    }
    let sql = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type,
                         headers, destination, created_at, attempts, retry_after, last_error, dead_lettered_at)
         SELECT u.id, u.t, u.a, u.et, u.p::jsonb, u.pb, u.ct, u.h::jsonb, u.d, u.c, u.n,
                CASE WHEN u.r IS NULL THEN NULL ELSE now() + u.r * interval '1 second' END,
                u.err, CASE WHEN u.dead THEN now() END
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[], $7::text[],
                     $8::text[], $9::text[], $10::timestamptz[], $11::int4[], $12::float8[], $13::text[], $14::bool[])
              WITH ORDINALITY AS u(id, t, a, et, p, pb, ct, h, d, c, n, r, err, dead, ord)
         ORDER BY u.ord
         ON CONFLICT (id) DO NOTHING",
        inner.held.table().qualified()
    );
    sqlx::query(&sql)
        .bind(&ids)
        .bind(&types)
        .bind(&agg_ids)
        .bind(&event_types)
        .bind(&payloads)
        .bind(&payload_bytes)
        .bind(&content_types)
        .bind(&headers)
        .bind(&destinations)
        .bind(&created)
        .bind(&attempts)
        .bind(&retry_in)
        .bind(&errors)
        .bind(&dead)
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal move to the held table", e))?;
    Ok(())
}

/// Moves each failed event, with the later events of its aggregate in hand, to the held table.
async fn move_failed(inner: &Inner, conn: &mut PgConnection) -> Result<bool, Error> {
    // Under the lock: pick the groups and mark them moving (claims skip them).
    let (rows, moved, previous) = {
        let mut st = inner.state();
        if st.failed == 0 {
            return Ok(false);
        }
        let mut failed_aggs: Vec<(String, String)> = Vec::new();
        for t in &st.txns {
            for e in &t.entries {
                if let EntryState::Failed(_) = e.state {
                    let a = (e.event.aggregate_type.clone(), e.event.aggregate_id.clone());
                    if !failed_aggs.contains(&a) {
                        failed_aggs.push(a);
                    }
                }
            }
        }
        if failed_aggs.is_empty() {
            return Ok(false);
        }
        let mut rows = Vec::new();
        let mut moved = Vec::new();
        let mut previous = Vec::new();
        for (at, ai) in &failed_aggs {
            let mut group = Vec::new();
            let mut busy = false;
            let mut started = false;
            for t in &st.txns {
                for (i, e) in t.entries.iter().enumerate() {
                    if &e.event.aggregate_type != at || &e.event.aggregate_id != ai {
                        continue;
                    }
                    match &e.state {
                        EntryState::Done => {}
                        EntryState::Failed(_) => {
                            started = true;
                            group.push((t.end_lsn, i));
                        }
                        EntryState::InFlight(_) | EntryState::Moving => busy = true,
                        EntryState::Ready => {
                            if started {
                                group.push((t.end_lsn, i));
                            }
                        }
                    }
                }
            }
            if busy {
                // Another batch still holds some of it: next round.
                continue;
            }
            for (end, i) in group {
                let Some(e) = st.entry_mut(end, i) else {
                    continue;
                };
                let row = match &e.state {
                    EntryState::Failed(a) => HeldRow::failed(e.event.clone(), a),
                    _ => HeldRow::waiting(e.event.clone()),
                };
                previous.push(e.state.clone());
                st.set_state(end, i, EntryState::Moving);
                rows.push(row);
                moved.push((end, i));
            }
        }
        (rows, moved, previous)
    };
    if rows.is_empty() {
        return Ok(false);
    }
    let result = insert_held(inner, conn, &rows).await;
    let mut st = inner.state();
    match result {
        Ok(()) => {
            for (end, i) in &moved {
                st.set_state(*end, *i, EntryState::Done);
            }
            drop(st);
            debug!(events = rows.len(), "moved to the held table");
            inner
                .held_poll
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .dirty = true;
            inner.wake_relay();
            Ok(true)
        }
        Err(e) => {
            for ((end, i), state) in moved.iter().zip(previous) {
                st.set_state(*end, *i, state);
            }
            Err(e)
        }
    }
}

/// Takes newly read transactions in: events of aggregates with events in the held table go there
/// (after them), so do changes that are not events (as dead letters); the rest wait in memory.
async fn take_in(
    inner: &Inner,
    conn: &mut PgConnection,
    new: Vec<WalTransaction>,
    check_held: bool,
) -> Result<bool, Error> {
    let mut keys_t = Vec::new();
    let mut keys_i = Vec::new();
    let mut seen = HashSet::new();
    let mut ids = Vec::new();
    for t in &new {
        for item in &t.items {
            if let WalItem::Event(e) = item {
                ids.push(e.id);
                if seen.insert((e.aggregate_type.as_str(), e.aggregate_id.as_str())) {
                    keys_t.push(e.aggregate_type.clone());
                    keys_i.push(e.aggregate_id.clone());
                }
            }
        }
    }
    let held = inner.held.table().qualified();
    let found: Vec<(String, String)> = if ids.is_empty() || !check_held {
        Vec::new()
    } else {
        sqlx::query_as(&format!(
            "SELECT 'a', k.t || chr(31) || k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)
             WHERE EXISTS (SELECT 1 FROM {held} h
                           WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i AND h.processed_at IS NULL)
             UNION ALL
             SELECT 'i', h.id::text FROM {held} h WHERE h.id = ANY($3)"
        ))
        .bind(&keys_t)
        .bind(&keys_i)
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal read", e))?
    };
    let mut held_aggs: HashSet<String> = HashSet::new();
    let mut held_ids: HashSet<Uuid> = HashSet::new();
    for (kind, value) in found {
        if kind == "a" {
            held_aggs.insert(value);
        } else if let Ok(id) = value.parse() {
            held_ids.insert(id);
        }
    }
    let mut to_held = Vec::new();
    let mut txns = Vec::with_capacity(new.len());
    for t in new {
        let mut entries = Vec::with_capacity(t.items.len());
        for item in t.items {
            let event = match item {
                WalItem::Event(e) => e,
                WalItem::Undecodable {
                    id,
                    lsn,
                    error,
                    raw,
                } => {
                    if !held_ids.contains(&id) {
                        warn!(lsn = format!("{lsn:X}"), error = %error, "a change of the slot is not an event: dead-lettered");
                        to_held.push(HeldRow {
                            event: undecodable_event(id, lsn, raw, t.commit_time),
                            attempts: 0,
                            retry_in: None,
                            error: Some(error),
                            dead: true,
                        });
                    }
                    continue;
                }
            };
            if held_ids.contains(&event.id) {
                // Moved there before a restart: its fate is the held table's.
                continue;
            }
            let agg = format!("{}\u{1f}{}", event.aggregate_type, event.aggregate_id);
            if held_aggs.contains(&agg) {
                to_held.push(HeldRow::waiting(event));
                continue;
            }
            entries.push(Entry {
                key: aggregate_key(&event.aggregate_type, &event.aggregate_id),
                event,
                state: EntryState::Ready,
            });
        }
        txns.push(Txn {
            end_lsn: t.end_lsn,
            commit_time: t.commit_time,
            entries,
            row_ids: t.row_ids,
        });
    }
    // Into the held table first: a transaction is confirmed only once it is in hand.
    insert_held(inner, conn, &to_held).await?;
    if !to_held.is_empty() {
        inner
            .held_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .dirty = true;
    }
    let mut st = inner.state();
    let mut claimable = false;
    for t in txns {
        for e in &t.entries {
            st.unsettled += 1;
            st.unsettled_bytes += e.event.payload.len();
        }
        claimable |= !t.entries.is_empty();
        st.txns.push_back(t);
    }
    drop(st);
    if claimable || !to_held.is_empty() {
        inner.wake_relay();
    }
    Ok(!to_held.is_empty())
}

/// The dead letter of a change that is not an event.
fn undecodable_event(id: Uuid, lsn: u64, raw: String, commit_time: DateTime<Utc>) -> Event {
    Event {
        id,
        aggregate_type: UNDECODABLE_AGGREGATE_TYPE.into(),
        aggregate_id: format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF),
        event_type: UNDECODABLE_AGGREGATE_TYPE.into(),
        payload: raw.into_bytes(),
        content_type: "text/plain; charset=utf-8".into(),
        headers: Default::default(),
        destination: None,
        created_at: commit_time,
        attempts: 0,
    }
}

/// Confirms the settled transactions at the front (deleting their outbox rows first when the
/// source table is emptied): the stream reports the position to the server.
async fn confirm_settled(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &Stream,
    last_confirm: &mut Instant,
    now: bool,
) -> Result<(), Error> {
    let (target, row_ids, count) = {
        let st = inner.state();
        let mut target = None;
        let mut row_ids = Vec::new();
        let mut count = 0u64;
        let mut events = 0;
        for t in &st.txns {
            if !t.settled() {
                break;
            }
            target = Some(t.end_lsn);
            row_ids.extend_from_slice(&t.row_ids);
            count += 1;
            events += t.entries.len();
        }
        // The outbox rows are deleted in batches: one statement every CONFIRM_EVERY, or sooner
        // when half the read-ahead is settled.
        let due = now
            || last_confirm.elapsed() >= CONFIRM_EVERY
            || events >= inner.settings.read_ahead / 2;
        if !due {
            target = None;
        }
        (target, row_ids, count)
    };
    let Some(target) = target else {
        return Ok(());
    };
    if inner.settings.delete_published && !row_ids.is_empty() {
        sqlx::query(&format!(
            "DELETE FROM {} WHERE id = ANY($1)",
            inner.source.qualified()
        ))
        .bind(&row_ids)
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal delete published rows", e))?;
    }
    stream.feedback.update_flushed_lsn(target);
    stream.feedback.update_applied_lsn(target);
    stream.feedback_now.notify_one();
    *last_confirm = Instant::now();
    let mut st = inner.state();
    for _ in 0..count {
        st.txns.pop_front();
    }
    st.confirmed = st.confirmed.max(target);
    drop(st);
    stream.settled.fetch_add(count, Ordering::SeqCst);
    Ok(())
}
