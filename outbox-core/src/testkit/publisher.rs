//! A scriptable publisher: succeeds, or fails retryably or permanently, per event.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::{lock, PublisherFixture, Received};
use crate::error::{Error, ErrorKind};
use crate::event::{header, Event};
use crate::ports::{PublishOutcome, Publisher};

/// What the scripted publisher does with a matching event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// Acknowledge it.
    Succeed,
    /// Fail with a retryable connection error, every time.
    FailRetryable,
    /// Fail with a permanent error, every time.
    FailPermanent,
    /// Report back-pressure (local queue full), every time.
    Backpressure,
    /// Fail retryably on the first `n` attempts of each matching event, then succeed.
    FailRetryableTimes(u32),
}

type Matcher = Box<dyn Fn(&Event) -> bool + Send + Sync>;

/// A publisher driven by rules; it records every acknowledged event in order.
///
/// Rules are checked in the order they were added; an event matching none succeeds.
#[derive(Default)]
pub struct ScriptedPublisher {
    rules: Mutex<Vec<(Matcher, Behavior)>>,
    delivered: Mutex<Vec<Event>>,
    tries: Mutex<HashMap<Uuid, u32>>,
    latency: Mutex<Duration>,
    calls: AtomicU64,
    unfenced: std::sync::atomic::AtomicBool,
    down: std::sync::atomic::AtomicBool,
    check_fails: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ScriptedPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedPublisher")
            .field("calls", &self.calls.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl ScriptedPublisher {
    /// A publisher that acknowledges everything.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Applies `behavior` to events matching `matcher`.
    pub fn when(
        &self,
        matcher: impl Fn(&Event) -> bool + Send + Sync + 'static,
        behavior: Behavior,
    ) -> &Self {
        lock(&self.rules).push((Box::new(matcher), behavior));
        self
    }

    /// Applies `behavior` to the event with this id.
    pub fn on_event(&self, id: Uuid, behavior: Behavior) -> &Self {
        self.when(move |e| e.id == id, behavior)
    }

    /// Applies `behavior` to every event of this aggregate id.
    pub fn on_aggregate(&self, aggregate_id: impl Into<String>, behavior: Behavior) -> &Self {
        let a = aggregate_id.into();
        self.when(move |e| e.aggregate_id == a, behavior)
    }

    /// Removes every rule: from now on everything succeeds.
    pub fn clear_rules(&self) {
        lock(&self.rules).clear();
    }

    /// Waits this long (tokio time) in every publish call.
    pub fn set_latency(&self, latency: Duration) {
        *lock(&self.latency) = latency;
    }

    /// By default the publisher behaves like an order-preserving broker: once an event of an aggregate
    /// fails in a call, the later events of that aggregate in the same call are not sent (they fail
    /// retryably). `false` turns that off, so every event gets its own scripted outcome.
    pub fn set_fencing(&self, fencing: bool) {
        self.unfenced.store(!fencing, Ordering::Relaxed);
    }

    /// A broker that is down (`true`): every publish fails every event with a connection error, and
    /// the readiness check fails; `false` brings it back.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::Relaxed);
    }

    /// A readiness check that fails (`true`) whatever publishing does: a role allowed to send but
    /// not to read the destination's attributes, say.
    pub fn set_check_failing(&self, failing: bool) {
        self.check_fails.store(failing, Ordering::Relaxed);
    }

    /// Every acknowledged event, in the order it was acknowledged.
    pub fn delivered(&self) -> Vec<Event> {
        lock(&self.delivered).clone()
    }

    /// Number of publish calls.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Number of times the event was handed to the publisher.
    pub fn tries(&self, id: Uuid) -> u32 {
        lock(&self.tries).get(&id).copied().unwrap_or(0)
    }

    fn outcome(&self, event: &Event) -> PublishOutcome {
        let tries = {
            let mut t = lock(&self.tries);
            let n = t.entry(event.id).or_insert(0);
            *n += 1;
            *n
        };
        let behavior = lock(&self.rules)
            .iter()
            .find(|(m, _)| m(event))
            .map(|(_, b)| *b)
            .unwrap_or(Behavior::Succeed);
        let fail = |kind: ErrorKind, msg: &str| {
            Err(Error::new(kind, msg.to_string())
                .with_context("adapter", "scripted")
                .with_context("event_id", event.id))
        };
        match behavior {
            Behavior::Succeed => Ok(()),
            Behavior::FailRetryable => fail(ErrorKind::Connection, "scripted retryable failure"),
            Behavior::FailPermanent => {
                fail(ErrorKind::PayloadTooLarge, "scripted permanent failure")
            }
            Behavior::Backpressure => fail(ErrorKind::Backpressure, "scripted back-pressure"),
            Behavior::FailRetryableTimes(n) if tries <= n => {
                fail(ErrorKind::Connection, "scripted retryable failure")
            }
            Behavior::FailRetryableTimes(_) => Ok(()),
        }
    }
}

#[async_trait]
impl Publisher for ScriptedPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let latency = *lock(&self.latency);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if self.down.load(Ordering::Relaxed) {
            return events
                .iter()
                .map(|e| {
                    Err(Error::new(ErrorKind::Connection, "scripted broker down")
                        .with_context("adapter", "scripted")
                        .with_context("event_id", e.id))
                })
                .collect();
        }
        let fencing = !self.unfenced.load(Ordering::Relaxed);
        let mut failed: std::collections::HashSet<(&str, &str)> = Default::default();
        let mut outcomes: Vec<PublishOutcome> = Vec::with_capacity(events.len());
        for e in events {
            let key = (e.aggregate_type.as_str(), e.aggregate_id.as_str());
            if fencing && failed.contains(&key) {
                outcomes.push(Err(crate::publishers::Fence::not_sent("scripted")));
                continue;
            }
            let o = self.outcome(e);
            if o.is_err() {
                failed.insert(key);
            }
            outcomes.push(o);
        }
        let mut delivered = lock(&self.delivered);
        for (e, o) in events.iter().zip(&outcomes) {
            if o.is_ok() {
                delivered.push(e.clone());
            }
        }
        outcomes
    }

    async fn check(&self) -> Result<(), Error> {
        if self.down.load(Ordering::Relaxed) || self.check_fails.load(Ordering::Relaxed) {
            return Err(Error::new(ErrorKind::Connection, "scripted broker down"));
        }
        Ok(())
    }

    fn name(&self) -> &str {
        "scripted"
    }

    /// With fencing (the default), a failure stops the later events of its aggregate in the call, as
    /// an order-keeping broker would; without it, each event has its own outcome.
    fn keeps_order(&self) -> bool {
        !self.unfenced.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl PublisherFixture for Arc<ScriptedPublisher> {
    async fn publisher(&self) -> Arc<dyn Publisher> {
        self.clone()
    }

    async fn receive(&self, count: usize, timeout: Duration) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let got = self.delivered();
            if got.len() >= count || tokio::time::Instant::now() >= deadline {
                return got
                    .into_iter()
                    .map(|e| {
                        let mut headers = e.headers.clone();
                        headers.insert(header::EVENT_ID.into(), e.id.to_string());
                        Received {
                            event_id: Some(e.id),
                            aggregate_id: Some(e.aggregate_id),
                            event_type: Some(e.event_type),
                            payload: e.payload,
                            headers,
                            destination: e.destination.unwrap_or_default(),
                            content_type: Some(e.content_type),
                        }
                    })
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
