//! The WAL source's [`Store`] ([`WalStore`]) and its leases: claims take events from the reader's
//! buffer (or the held table), settling marks them there. How the source works as a whole: see
//! the `wal` module's documentation.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use txoutbox_core::{
    Action, Batch, ClaimRequest, Error, EventTypeStats, Lease, OrderingPolicy, Settlement, Store,
    StoreStats, Wake,
};

use super::buffer::{EntryState, State};
use super::check::{check_slot, not_ready};
use super::config::WalConfig;
use super::confirm::check_reader_privileges;
use super::conninfo::{ReplicationHealth, ReplicationTarget};
use super::decode::WalReader;
use super::progress::{FallbackProgress, Fallbacks};
use super::reader::{run_reader, runtime_supported};
use super::shared::{HeldPoll, Inner, Settings};
use super::slot::WalSlot;
use crate::error::map_sqlx;
use crate::store::{EmptyLease, PostgresStore};

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
    /// The fallbacks to the outbox table: now, and counted.
    pub fallback: FallbackProgress,
}

/// The WAL source: a [`Store`] over a replication slot, with its held table (see the module's
/// documentation). Cheap to clone; start its reader with [`WalStore::start`].
#[derive(Clone)]
pub struct WalStore {
    inner: Arc<Inner>,
}

/// The running reader of a [`WalStore`]; [`ReaderHandle::stop`] settles what it can and ends it.
/// Dropping the handle tells the reader to stop as well (without waiting for it), so a reader
/// never outlives what started it and keeps the slot's lock from a standby.
pub struct ReaderHandle {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl ReaderHandle {
    /// Moves failed events to the held table, confirms what is settled, and ends the reader (its
    /// lock is freed with its connection, for a standby to take over).
    pub async fn stop(mut self) {
        self.stop.cancel();
        let _ = (&mut self.task).await;
    }
}

impl Drop for ReaderHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl WalStore {
    /// The WAL source of `slot`'s table, moving what it cannot publish at once to `held` (an
    /// outbox table migrated like any other; `outbox wal setup` makes it).
    ///
    /// The slot is streamed over a replication connection made with exactly the settings of
    /// `pool`'s sessions (host, port, role, password, database, TLS mode and certificate
    /// authority, as sqlx resolved them from the URL and the libpq environment). The role needs
    /// the `REPLICATION` attribute, as for any logical slot. `pool` must reach the server itself,
    /// not a pooler in transaction mode (the reader holds a session lock).
    ///
    /// # Errors
    /// A configuration error naming a setting of the pool the replication connection cannot use
    /// as the pool does (a Unix socket, a TLS client certificate, startup options, a certificate
    /// authority given as PEM text).
    pub fn new(
        pool: PgPool,
        slot: WalSlot,
        held: PostgresStore,
        config: &WalConfig,
    ) -> Result<Self, Error> {
        let source = slot.table().clone();
        let replication = ReplicationTarget::of(&pool.connect_options())?;
        Ok(WalStore {
            inner: Arc::new(Inner {
                pool,
                replication,
                replication_health: ReplicationHealth::default(),
                reader: WalReader::new(slot),
                source,
                held,
                settings: Settings {
                    delete_published: config.delete_published,
                    read_ahead: config.read_ahead.max(1),
                    read_ahead_bytes: config.read_ahead_bytes.max(1),
                    held_poll_interval_ms: std::sync::atomic::AtomicU64::new(500),
                    auto_recreate: config.auto_recreate,
                    retained_wal_warning: config.retained_wal_warning,
                },
                state: Mutex::new(State::default()),
                held_poll: Mutex::new(HeldPoll {
                    dirty: true,
                    next_check: Instant::now(),
                    last_from_held: false,
                }),
                reader_wake: Arc::new(Notify::new()),
                relay_wake: Mutex::new(None),
                fallbacks: Fallbacks::default(),
                last_claim: Mutex::new(Instant::now()),
                left_unconfirmed: AtomicBool::new(false),
                left_taken: Mutex::new(Default::default()),
            }),
        })
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
    pub fn with_held_poll_interval(self, every: Duration) -> Self {
        let ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1);
        self.inner
            .settings
            .held_poll_interval_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
        self
    }

    /// `wal.retained_wal_warning`: the bytes of retained WAL above which the slot is warned about.
    pub fn retained_wal_warning(&self) -> u64 {
        self.inner.settings.retained_wal_warning
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
            fallback: self.inner.fallbacks.progress(),
        }
    }

    /// Where the reader's buffer has the event `id`: `None` when it is not there (not read yet,
    /// in the held table, or settled and confirmed); `Some(true)` while it waits to be moved to the
    /// held table (settled as a failure), `Some(false)` otherwise. For tests.
    #[cfg(feature = "test-utils")]
    pub(crate) fn buffered(&self, id: Uuid) -> Option<bool> {
        let st = self.inner.state();
        st.txns.iter().flat_map(|t| t.entries.iter()).find_map(|e| {
            (e.event.id == id && e.state != EntryState::Done).then_some(matches!(
                e.state,
                EntryState::Failed(_) | EntryState::Moving
            ))
        })
    }

    /// Whether the reader's buffer has events settled as failures not yet in the held table. For
    /// tests.
    #[cfg(feature = "test-utils")]
    pub(crate) fn moving(&self) -> bool {
        let st = self.inner.state();
        st.txns
            .iter()
            .flat_map(|t| t.entries.iter())
            .any(|e| matches!(e.state, EntryState::Failed(_) | EntryState::Moving))
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
            p.next_check = Instant::now() + self.inner.settings.held_poll_interval();
        }
    }
}

#[async_trait]
impl Store for WalStore {
    /// The held table's batches hold connections of its pool, as [`PostgresStore`]'s do.
    fn check_capacity(&self, batches_in_flight: usize) -> Result<(), Error> {
        self.inner.held.check_capacity(batches_in_flight)
    }

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
        // The events in the reader's buffer, with the held table's: those settled as dead letters
        // (moving to the held table in a moment) as dead letters, the rest as pending.
        let in_memory: Vec<(String, DateTime<Utc>, bool)> = {
            let st = self.inner.state();
            st.txns
                .iter()
                .flat_map(|t| t.entries.iter().map(move |e| (e, t.commit_time)))
                .filter(|(e, _)| e.state != EntryState::Done)
                .map(|(e, at)| {
                    let dead = matches!(e.state, EntryState::Failed(Action::DeadLetter { .. }));
                    (e.event.event_type.clone(), at, dead)
                })
                .collect()
        };
        let now = Utc::now();
        for (event_type, at, dead) in in_memory {
            let i = match stats
                .by_event_type
                .iter()
                .position(|t| t.event_type == event_type)
            {
                Some(i) => i,
                None => {
                    stats.by_event_type.push(EventTypeStats::new(event_type));
                    stats.by_event_type.len() - 1
                }
            };
            let t = &mut stats.by_event_type[i];
            if dead {
                t.dead_letters += 1;
                stats.dead_letters += 1;
                continue;
            }
            let age = (now - at).num_milliseconds().max(0) as f64 / 1000.0;
            t.pending += 1;
            t.oldest_pending_age_seconds =
                Some(t.oldest_pending_age_seconds.map_or(age, |a| a.max(age)));
            stats.pending += 1;
            stats.oldest_pending_age_seconds =
                Some(stats.oldest_pending_age_seconds.map_or(age, |a| a.max(age)));
        }
        Ok(stats)
    }

    /// The held table answers, the role has `REPLICATION` and may delete what it publishes
    /// (`wal.delete_published`), the slot can be streamed (it exists, has not lost WAL, and its
    /// publication holds the outbox table), and the replication connection opens with the relay's
    /// settings (the reader streams, or a probe connection opens). While it cannot, the relay publishes from the outbox table (and makes the slot
    /// again with `wal.auto_recreate`), and this fails saying so.
    async fn check(&self) -> Result<(), Error> {
        runtime_supported()?;
        self.inner.held.check().await?;
        let mut conn = self
            .inner
            .pool
            .acquire()
            .await
            .map_err(|e| map_sqlx("check", e))?;
        check_reader_privileges(&self.inner, &mut conn).await?;
        if let Some(problem) = check_slot(&self.inner, &mut conn).await?.problem {
            return Err(not_ready(&self.inner, problem));
        }
        if let Some(reason) = self.inner.fallbacks.reason() {
            return Err(Error::new(
                txoutbox_core::ErrorKind::Connection,
                format!("the relay publishes from the outbox table until every row written before the slot's position is in the held table: {reason}"),
            ));
        }
        // What delivers: the replication connection itself, with the relay's role and settings.
        let reading = self.inner.state().active;
        self.inner
            .replication_health
            .ready(&self.inner.replication, reading)
            .await
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
