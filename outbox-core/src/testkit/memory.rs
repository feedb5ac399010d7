//! An in-memory [`Store`] with the same claim semantics as the PostgreSQL store.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use chrono::Utc;
use tokio::time::Instant;
use uuid::Uuid;

use super::{lock, EventState, EventStatus, TestStore};
use crate::error::Error;
use crate::event::{Event, NewEvent, Payload};
use crate::policy::OrderingPolicy;
use crate::ports::{
    Action, Batch, ClaimRequest, EventTypeStats, Lease, Settlement, Store, StoreStats,
};

#[derive(Debug, Clone)]
struct Row {
    event: Event,
    status: EventStatus,
    retry_after: Option<Instant>,
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    rows: BTreeMap<u64, Row>,
    by_id: HashMap<Uuid, u64>,
    leased: HashSet<Uuid>,
    next_seq: u64,
}

/// An in-memory store for unit tests of relay logic. Time is tokio's clock, so tests can pause it.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds events, as the writer would after a commit.
    ///
    /// # Errors
    /// [`crate::ErrorKind::InvalidInput`] when an event does not validate or its id is taken.
    pub fn push(&self, events: impl IntoIterator<Item = NewEvent>) -> Result<Vec<Uuid>, Error> {
        let mut st = lock(&self.state);
        let mut ids = Vec::new();
        for ne in events {
            ne.validate()?;
            if st.by_id.contains_key(&ne.id) {
                return Err(Error::new(
                    crate::ErrorKind::InvalidInput,
                    format!("event id {} already exists", ne.id),
                ));
            }
            let (payload, content_type) = match ne.payload {
                Payload::Json(v) => (
                    v.to_string().into_bytes(),
                    crate::JSON_CONTENT_TYPE.to_string(),
                ),
                Payload::Binary { content_type, data } => (data, content_type),
            };
            let seq = st.next_seq;
            st.next_seq += 1;
            st.by_id.insert(ne.id, seq);
            ids.push(ne.id);
            st.rows.insert(
                seq,
                Row {
                    event: Event {
                        id: ne.id,
                        aggregate_type: ne.aggregate_type,
                        aggregate_id: ne.aggregate_id,
                        event_type: ne.event_type,
                        payload,
                        content_type,
                        headers: ne.headers,
                        destination: ne.destination,
                        created_at: Utc::now(),
                        attempts: 0,
                    },
                    status: EventStatus::Pending,
                    retry_after: None,
                    last_error: None,
                },
            );
        }
        Ok(ids)
    }

    /// The state of one event.
    pub fn get(&self, id: Uuid) -> Option<EventState> {
        let st = lock(&self.state);
        st.by_id
            .get(&id)
            .and_then(|s| st.rows.get(s))
            .map(|r| EventState {
                status: r.status,
                attempts: r.event.attempts,
                last_error: r.last_error.clone(),
            })
    }

    /// Ids of the dead letters, oldest first.
    pub fn dead_letters(&self) -> Vec<Uuid> {
        let st = lock(&self.state);
        st.rows
            .values()
            .filter(|r| r.status == EventStatus::DeadLettered)
            .map(|r| r.event.id)
            .collect()
    }

    /// Number of pending events (including those backing off or held back).
    pub fn pending(&self) -> usize {
        let st = lock(&self.state);
        st.rows
            .values()
            .filter(|r| r.status == EventStatus::Pending)
            .count()
    }

    /// Number of events currently held by a live lease.
    pub fn leased(&self) -> usize {
        lock(&self.state).leased.len()
    }

    /// Makes every dead letter pending again with its attempts reset, as an operator's retry would.
    pub fn retry_dead_letters(&self) -> usize {
        let mut st = lock(&self.state);
        let mut n = 0;
        for r in st.rows.values_mut() {
            if r.status == EventStatus::DeadLettered {
                r.status = EventStatus::Pending;
                r.event.attempts = 0;
                r.retry_after = None;
                n += 1;
            }
        }
        n
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error> {
        let now = Instant::now();
        let mut st = lock(&self.state);
        let mut blocked: HashSet<(String, String)> = HashSet::new();
        let mut events: Vec<Event> = Vec::new();
        let mut bytes = 0usize;
        for row in st.rows.values() {
            if events.len() >= request.limit {
                break;
            }
            // The byte budget: stop before the event that would exceed it (a first event is taken
            // whatever its size). Stopping keeps every aggregate's events a prefix of its run.
            let size = row.event.payload.len();
            let over = !request.fits(events.len(), bytes, size);
            if row.status == EventStatus::Processed {
                continue;
            }
            let ready = row.status == EventStatus::Pending
                && row.retry_after.is_none_or(|t| t <= now)
                && !st.leased.contains(&row.event.id);
            match request.ordering {
                OrderingPolicy::Unordered => {
                    if ready {
                        if over {
                            break;
                        }
                        bytes = bytes.saturating_add(size);
                        events.push(row.event.clone());
                    }
                }
                OrderingPolicy::PerAggregate => {
                    let key = (
                        row.event.aggregate_type.clone(),
                        row.event.aggregate_id.clone(),
                    );
                    if blocked.contains(&key) {
                        continue;
                    }
                    if ready {
                        if over {
                            break;
                        }
                        bytes = bytes.saturating_add(size);
                        events.push(row.event.clone());
                    } else {
                        blocked.insert(key);
                    }
                }
            }
        }
        for e in &events {
            st.leased.insert(e.id);
        }
        let ids = events.iter().map(|e| e.id).collect();
        Ok(Batch {
            events,
            lease: Box::new(MemoryLease {
                state: self.state.clone(),
                ids,
                open: true,
            }),
        })
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        let st = lock(&self.state);
        let now = Utc::now();
        let mut by_type: BTreeMap<String, EventTypeStats> = BTreeMap::new();
        let mut stats = StoreStats::default();
        for r in st.rows.values() {
            let t = by_type
                .entry(r.event.event_type.clone())
                .or_insert_with(|| EventTypeStats {
                    event_type: r.event.event_type.clone(),
                    ..EventTypeStats::default()
                });
            match r.status {
                EventStatus::Pending => {
                    let age = (now - r.event.created_at).num_milliseconds().max(0) as f64 / 1000.0;
                    stats.pending += 1;
                    t.pending += 1;
                    stats.oldest_pending_age_seconds =
                        Some(stats.oldest_pending_age_seconds.unwrap_or(0.0).max(age));
                    t.oldest_pending_age_seconds =
                        Some(t.oldest_pending_age_seconds.unwrap_or(0.0).max(age));
                }
                EventStatus::DeadLettered => {
                    stats.dead_letters += 1;
                    t.dead_letters += 1;
                }
                EventStatus::Processed => {}
            }
        }
        stats.by_event_type = by_type
            .into_values()
            .filter(|t| t.pending > 0 || t.dead_letters > 0)
            .collect();
        // Rows are in seq order: a pending row after a dead letter of its aggregate is held back.
        let mut dead: HashSet<(String, String)> = HashSet::new();
        let mut held: HashSet<(String, String)> = HashSet::new();
        for r in st.rows.values() {
            let key = (r.event.aggregate_type.clone(), r.event.aggregate_id.clone());
            match r.status {
                EventStatus::DeadLettered => {
                    dead.insert(key);
                }
                EventStatus::Pending if dead.contains(&key) => {
                    stats.held_back += 1;
                    held.insert(key);
                }
                _ => {}
            }
        }
        stats.held_back_aggregates = held.len() as u64;
        Ok(stats)
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }
}

#[async_trait]
impl TestStore for MemoryStore {
    async fn insert(&self, events: Vec<NewEvent>) -> Result<(), Error> {
        self.push(events).map(|_| ())
    }

    async fn state(&self, id: Uuid) -> Result<Option<EventState>, Error> {
        Ok(self.get(id))
    }
}

struct MemoryLease {
    state: Arc<Mutex<State>>,
    ids: Vec<Uuid>,
    open: bool,
}

impl MemoryLease {
    fn close(&mut self, settlements: Vec<Settlement>) {
        let mut st = lock(&self.state);
        let mine: HashSet<Uuid> = self.ids.iter().copied().collect();
        let now = Instant::now();
        for s in settlements {
            if !mine.contains(&s.id) {
                continue;
            }
            let Some(seq) = st.by_id.get(&s.id).copied() else {
                continue;
            };
            let Some(row) = st.rows.get_mut(&seq) else {
                continue;
            };
            match s.action {
                Action::Published => row.status = EventStatus::Processed,
                Action::Retry {
                    attempts,
                    delay,
                    error,
                } => {
                    row.event.attempts = attempts;
                    row.retry_after = Some(now + delay);
                    row.last_error = Some(error);
                }
                Action::DeadLetter { attempts, error } => {
                    row.event.attempts = attempts;
                    row.status = EventStatus::DeadLettered;
                    row.last_error = Some(error);
                }
                Action::Release => {}
            }
        }
        for id in &self.ids {
            st.leased.remove(id);
        }
        self.open = false;
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        if self.open {
            self.close(Vec::new());
        }
    }
}

#[async_trait]
impl Lease for MemoryLease {
    async fn settle(mut self: Box<Self>, settlements: Vec<Settlement>) -> Result<(), Error> {
        self.close(settlements);
        Ok(())
    }

    async fn release(mut self: Box<Self>) -> Result<(), Error> {
        self.close(Vec::new());
        Ok(())
    }
}
