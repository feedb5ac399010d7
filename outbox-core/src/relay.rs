//! The relay engine: claim a batch, publish it, settle every outcome in one call; repeat.
//!
//! - **Batched**: one claim and one settle call per batch, never one round trip per event; one publish
//!   call per batch, or a few when the batch holds several events of one aggregate that the broker
//!   cannot keep in order within a call (see [`Publisher::keeps_order`]).
//! - **Pipelined**: up to `max_in_flight` batches are in flight at once, so the next claim overlaps the
//!   current publish. Under per-aggregate ordering the store never hands two live batches events of one
//!   aggregate, so pipelining keeps the order.
//! - **Adaptive polling**: while batches come back full the relay claims again at once; after a partial
//!   batch it pauses `min_poll_interval`; while they come back empty the pause doubles up to
//!   `poll_interval`. A [`Wake`] handle (given to the writer side) ends a pause at once.
//! - **Retry policy**: failed events are retried with backoff or dead-lettered, as classified by the
//!   publisher; under per-aggregate ordering a failure holds back the rest of that aggregate's run.
//! - **Broker outages**: a batch whose failures are all connection errors or timeouts (whatever it
//!   published before them) marks the broker unreachable; the relay then claims no batch until the
//!   publisher's readiness check passes, checking after `retry.initial_backoff`, then twice as long
//!   each time (between 100 ms and 10 s, at most `retry.max_backoff`). While the check fails, each round sends
//!   one event as a probe (a check can fail where publishing works); a probe that finds the broker
//!   still unreachable counts no attempt and waits a pause, so the next probe takes another event.
//!   Events written meanwhile keep their attempts (a long outage does not dead-letter them), and the
//!   relay neither spins nor floods its log (a warning a minute).
//! - **Graceful shutdown**: on cancellation the relay stops claiming, lets in-flight batches finish
//!   until `shutdown_timeout`, then aborts the rest (their events are released, not lost).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn, Instrument};

use crate::error::{Error, ErrorKind};
use crate::event::Event;
use crate::policy::{OrderingPolicy, RetryPolicy};
use crate::ports::{Action, Batch, ClaimRequest, PublishOutcome, Publisher, Settlement, Store};

/// The default of [`RelayConfig::max_batch_bytes`]: 8 MiB.
pub const DEFAULT_MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// Settings of the relay engine. Every field has a documented default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// Most events claimed and published per batch. Default 500.
    pub batch_size: usize,
    /// Most payload bytes claimed per batch: a batch stops before the event that would exceed it (an
    /// event larger than this is claimed alone). With `max_in_flight` batches in flight, each payload
    /// held about three times (the database's rows, the events, the broker client's copy), the relay's
    /// payload memory stays under about `3 x max_in_flight x max_batch_bytes`. Default 8 MiB (about
    /// 48 MiB of payloads at the default two batches in flight).
    pub max_batch_bytes: usize,
    /// Batches in flight at once (claim of the next overlaps the publish of the current). Default 2.
    pub max_in_flight: usize,
    /// Longest pause between polls of an idle outbox. Default 500 ms.
    #[serde(with = "crate::duration::serde_str")]
    pub poll_interval: Duration,
    /// Pause after a partial batch, and the first pause once the outbox is empty. Default 10 ms.
    #[serde(with = "crate::duration::serde_str")]
    pub min_poll_interval: Duration,
    /// Longest time one publish call may take; past it every event of the call fails with a
    /// retryable timeout. It must exceed the publisher's own limit of a call (for Kafka
    /// `kafka.enqueue_timeout + kafka.delivery_timeout + 5s`), so that the publisher's own timeout
    /// and recovery act first: [`Relay::new`] refuses a shorter one, naming both settings. A batch
    /// starts no new call (see [`Publisher::keeps_order`]) once this much time has passed since its
    /// first, so a batch is held at most twice this long. Default 60 s.
    #[serde(with = "crate::duration::serde_str")]
    pub publish_timeout: Duration,
    /// Time in-flight batches get to finish after shutdown was asked; then they are aborted and
    /// their events released. Default 30 s.
    #[serde(with = "crate::duration::serde_str")]
    pub shutdown_timeout: Duration,
    /// Longest pause between attempts to reach a failing store (the pause doubles from 100 ms). Default 5 s.
    #[serde(with = "crate::duration::serde_str")]
    pub store_retry_max_backoff: Duration,
    /// Retry policy of failed publishes.
    pub retry: RetryPolicy,
    /// Ordering policy. Default `per_aggregate`.
    pub ordering: OrderingPolicy,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            batch_size: 500,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            max_in_flight: 2,
            poll_interval: Duration::from_millis(500),
            min_poll_interval: Duration::from_millis(10),
            publish_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(30),
            store_retry_max_backoff: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            ordering: OrderingPolicy::PerAggregate,
        }
    }
}

impl RelayConfig {
    /// Checks the values.
    ///
    /// # Errors
    /// A config error naming the key, the value and what is expected.
    pub fn validate(&self) -> Result<(), Error> {
        if !(1..=100_000).contains(&self.batch_size) {
            return Err(Error::config(format!(
                "relay.batch_size = {}: expected 1 to 100000",
                self.batch_size
            )));
        }
        if self.max_batch_bytes < 1024 {
            return Err(Error::config(format!(
                "relay.max_batch_bytes = {}: expected at least 1024 (bytes of payload per batch; default {DEFAULT_MAX_BATCH_BYTES})",
                self.max_batch_bytes
            )));
        }
        if !(1..=64).contains(&self.max_in_flight) {
            return Err(Error::config(format!(
                "relay.max_in_flight = {}: expected 1 to 64",
                self.max_in_flight
            )));
        }
        if self.poll_interval.is_zero() {
            return Err(Error::config(
                "relay.poll_interval = 0s: expected a positive duration such as 500ms",
            ));
        }
        if self.min_poll_interval > self.poll_interval {
            return Err(Error::config(format!(
                "relay.min_poll_interval = {} exceeds relay.poll_interval = {}: expected min <= max",
                crate::duration::format(self.min_poll_interval),
                crate::duration::format(self.poll_interval)
            )));
        }
        if self.publish_timeout.is_zero() {
            return Err(Error::config(
                "relay.publish_timeout = 0s: expected a positive duration such as 30s",
            ));
        }
        self.retry.validate()
    }

    /// Checks the values against the publisher they will drive: `publish_timeout` must exceed the
    /// publisher's own limit of one call ([`Publisher::call_limit`]).
    ///
    /// # Errors
    /// A config error naming `relay.publish_timeout` and the publisher's settings.
    pub fn validate_with(&self, publisher: &dyn Publisher) -> Result<(), Error> {
        self.validate()?;
        if let Some(limit) = publisher.call_limit() {
            if self.publish_timeout <= limit.limit {
                return Err(Error::config(format!(
                    "relay.publish_timeout = {} does not exceed the {} publisher's own limit of one call, {} ({}): \
                     the relay would cut calls short before the publisher times out and recovers; \
                     raise relay.publish_timeout above {} or lower those settings",
                    crate::duration::format(self.publish_timeout),
                    publisher.name(),
                    crate::duration::format(limit.limit),
                    limit.settings,
                    crate::duration::format(limit.limit),
                )));
            }
        }
        Ok(())
    }

    /// The longest a batch is held before it is settled: every call the batch starts begins within
    /// `publish_timeout` of its first and lasts at most `publish_timeout`, plus 10 s for the settlement.
    pub fn hold_for(&self) -> Duration {
        self.publish_timeout
            .saturating_mul(2)
            .saturating_add(Duration::from_secs(10))
    }

    /// The claim request this relay sends to `publisher`: `batch_size`, `max_batch_bytes`,
    /// `ordering`, [`RelayConfig::hold_for`], and whether the publisher keeps an aggregate's events
    /// in order within a call ([`Publisher::keeps_order`]).
    pub fn claim_request(&self, publisher: &dyn Publisher) -> ClaimRequest {
        ClaimRequest {
            limit: self.batch_size,
            ordering: self.ordering,
            hold_for: self.hold_for(),
            max_bytes: self.max_batch_bytes,
            probe: false,
            whole_runs: publisher.keeps_order(),
        }
    }
}

/// Wakes an idle relay at once (for instance after the writer committed new events).
///
/// Cheap to clone; waking a busy relay makes its next pause end immediately.
#[derive(Debug, Clone, Default)]
pub struct Wake(Arc<Notify>);

impl Wake {
    /// A new handle, not yet attached to a relay.
    pub fn new() -> Self {
        Wake::default()
    }

    /// Ends the relay's current (or next) pause.
    pub fn wake(&self) {
        self.0.notify_one();
    }

    /// Waits until woken (consumes the wake-up). The relay waits on this between polls.
    pub async fn notified(&self) {
        self.0.notified().await;
    }
}

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
    /// Back-pressure: retried shortly without counting an attempt.
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

#[derive(Default)]
struct Totals {
    batches: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    released: AtomicU64,
    settle_failures: AtomicU64,
}

impl Totals {
    fn add(&self, r: &BatchReport) {
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

    fn summary(&self, aborted_batches: u64) -> RelaySummary {
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

struct Shared {
    store: Arc<dyn Store>,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    observer: Arc<dyn RelayObserver>,
    totals: Totals,
    /// Whether the broker was found unreachable, and how long to wait before checking it again.
    outage: Outage,
}

/// What the relay knows of an unreachable broker: while it is down, no batch is claimed until the
/// publisher's readiness check passes (see [`Relay::wait_for_broker`]).
struct Outage {
    /// Set when a batch found the broker unreachable.
    down: std::sync::atomic::AtomicBool,
    /// The pause before the next check, in milliseconds.
    pause_ms: AtomicU64,
    /// The first pause, in milliseconds: from the retry policy's `initial_backoff`.
    first_pause_ms: u64,
    /// When the relay last warned that the broker is unreachable.
    warned: std::sync::Mutex<Option<Instant>>,
    /// When the broker was last marked down.
    down_since: std::sync::Mutex<Option<Instant>>,
}

/// The longest pause between two checks of an unreachable broker (shorter when
/// `relay.retry.max_backoff` is).
const BROKER_CHECK_MAX_PAUSE: Duration = Duration::from_secs(10);

/// The shortest pause between two checks of an unreachable broker, whatever the retry policy says.
const BROKER_CHECK_MIN_PAUSE: Duration = Duration::from_millis(100);

/// How often the relay repeats that the broker is still unreachable.
const BROKER_WARN_EVERY: Duration = Duration::from_secs(60);

impl Outage {
    fn new(retry: &RetryPolicy) -> Self {
        let first_pause_ms = retry
            .initial_backoff
            .clamp(BROKER_CHECK_MIN_PAUSE, BROKER_CHECK_MAX_PAUSE)
            .as_millis() as u64;
        Outage {
            down: Default::default(),
            pause_ms: AtomicU64::new(first_pause_ms),
            first_pause_ms,
            warned: Default::default(),
            down_since: Default::default(),
        }
    }

    fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// The pause before the next check.
    fn pause(&self) -> Duration {
        Duration::from_millis(self.pause_ms.load(Ordering::SeqCst))
    }

    /// Doubles the pause before the next check (within the policy's `max_backoff`, 100 ms..10 s);
    /// returns the new pause.
    fn lengthen_pause(&self, retry: &RetryPolicy) -> Duration {
        let next = (self.pause() * 2)
            .min(retry.max_backoff)
            .clamp(BROKER_CHECK_MIN_PAUSE, BROKER_CHECK_MAX_PAUSE);
        self.pause_ms
            .store(next.as_millis() as u64, Ordering::SeqCst);
        next
    }

    /// The time the broker was last marked down; held while the state changes, so that a mark-down
    /// and a mark-up never interleave (see [`Outage::took_event`]).
    fn down_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.down_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks the broker down; true when it was up (the warning is then due, and given).
    fn mark_down(&self) -> bool {
        let mut since = self.down_since();
        *since = Some(Instant::now());
        let was_up = !self.down.swap(true, Ordering::SeqCst);
        drop(since);
        if was_up {
            *self.warned_at() = Some(Instant::now());
        }
        was_up
    }

    /// A call that began at `call_started` had an event taken: the broker is up again, unless the
    /// call began before the broker was last found unreachable (a batch in flight at the outage
    /// whose first records went through before it: no news of the broker since). Returns whether
    /// it was down and is up now.
    fn took_event(&self, call_started: Instant) -> bool {
        let since = self.down_since();
        if since.is_some_and(|down| call_started < down) {
            return false;
        }
        self.pause_ms.store(self.first_pause_ms, Ordering::SeqCst);
        self.down.swap(false, Ordering::SeqCst)
    }

    /// Marks the broker up after a passing readiness check; true when it was down.
    fn checked_up(&self) -> bool {
        let _since = self.down_since();
        self.down.swap(false, Ordering::SeqCst)
    }

    /// Whether a minute has passed since the last warning (and if so, counts this one as given).
    fn warning_due(&self) -> bool {
        let mut warned = self.warned_at();
        let due = warned.is_none_or(|at| at.elapsed() >= BROKER_WARN_EVERY);
        if due {
            *warned = Some(Instant::now());
        }
        due
    }

    fn warned_at(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The relay: moves events from a [`Store`] to a [`Publisher`].
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn outbox_core::Store>, publisher: std::sync::Arc<dyn outbox_core::Publisher>) -> Result<(), outbox_core::Error> {
/// use outbox_core::{Relay, RelayConfig};
/// let relay = Relay::new(store, publisher, RelayConfig::default())?;
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let summary = relay.run(shutdown).await;
/// println!("published {}", summary.published);
/// # Ok(()) }
/// ```
pub struct Relay {
    shared: Arc<Shared>,
    wake: Wake,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("publisher", &self.shared.publisher.name())
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// A relay with the given settings and no observer.
    ///
    /// # Errors
    /// A config error when `config` does not validate.
    pub fn new(
        store: Arc<dyn Store>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Result<Self, Error> {
        config.validate_with(publisher.as_ref())?;
        Ok(Relay {
            shared: Arc::new(Shared {
                store,
                publisher,
                observer: Arc::new(NoopObserver),
                totals: Totals::default(),
                outage: Outage::new(&config.retry),
                config,
            }),
            wake: Wake::new(),
        })
    }

    /// Sets the observer that receives per-batch figures (metrics).
    pub fn with_observer(self, observer: Arc<dyn RelayObserver>) -> Self {
        let shared = Shared {
            store: self.shared.store.clone(),
            publisher: self.shared.publisher.clone(),
            config: self.shared.config.clone(),
            observer,
            totals: Totals::default(),
            outage: Outage::new(&self.shared.config.retry),
        };
        Relay {
            shared: Arc::new(shared),
            wake: self.wake,
        }
    }

    /// Uses `wake` as this relay's wake-up handle (so a writer created earlier can wake it).
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.wake = wake;
        self
    }

    /// The handle that ends the relay's idle pause at once.
    pub fn wake_handle(&self) -> Wake {
        self.wake.clone()
    }

    /// The settings in force.
    pub fn config(&self) -> &RelayConfig {
        &self.shared.config
    }

    /// Runs until `shutdown` is cancelled, then shuts down gracefully (see the module docs).
    pub async fn run(&self, shutdown: CancellationToken) -> RelaySummary {
        self.run_inner(shutdown, false).await
    }

    /// Publishes until no event is publishable (the outbox is empty, or what is left is backing off,
    /// held back or dead), then returns. For tests, benchmarks and one-shot jobs.
    pub async fn drain(&self) -> RelaySummary {
        self.run_inner(CancellationToken::new(), true).await
    }

    async fn pause(&self, d: Duration, shutdown: &CancellationToken) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.wake.notified() => {}
            _ = shutdown.cancelled() => {}
        }
    }

    /// With the broker found unreachable: waits a pause (the retry policy's `initial_backoff`,
    /// doubling while the broker stays unreachable, up to its `max_backoff`; between 100 ms and 10 s),
    /// then checks the publisher (its readiness check). Returns whether the check passed; when it did
    /// not, the caller claims one event as a probe (a check can fail where publishing works, e.g. a
    /// role allowed to send but not to read queue attributes).
    async fn wait_for_broker(&self, shutdown: &CancellationToken) -> bool {
        let cfg = &self.shared.config;
        let publisher = &self.shared.publisher;
        let outage = &self.shared.outage;
        tokio::select! {
            _ = tokio::time::sleep(outage.pause()) => {}
            _ = shutdown.cancelled() => return false,
        }
        let checked = tokio::select! {
            r = tokio::time::timeout(cfg.publish_timeout, publisher.check()) => r,
            _ = shutdown.cancelled() => return false,
        };
        let next = outage.lengthen_pause(&cfg.retry);
        self.shared
            .observer
            .broker_checked(matches!(checked, Ok(Ok(()))));
        let error = match checked {
            Ok(Ok(())) => {
                info!(
                    publisher = publisher.name(),
                    "the broker answers its readiness check; claiming resumes"
                );
                outage.checked_up();
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "the readiness check took longer than relay.publish_timeout".to_string(),
        };
        if outage.warning_due() {
            warn!(
                publisher = publisher.name(),
                error = %error,
                check_every_ms = next.as_millis() as u64,
                "the broker is still unreachable; probing it with one event at a time"
            );
        } else {
            debug!(error = %error, retry_in_ms = next.as_millis() as u64, "the broker is still unreachable");
        }
        false
    }

    async fn run_inner(&self, shutdown: CancellationToken, until_idle: bool) -> RelaySummary {
        let cfg = &self.shared.config;
        let request = cfg.claim_request(self.shared.publisher.as_ref());
        let permits = Arc::new(Semaphore::new(cfg.max_in_flight));
        let mut tasks: JoinSet<()> = JoinSet::new();
        let mut idle_pause = cfg.min_poll_interval;
        let mut store_pause = Duration::from_millis(100);
        info!(
            publisher = self.shared.publisher.name(),
            batch_size = cfg.batch_size,
            max_in_flight = cfg.max_in_flight,
            ordering = cfg.ordering.as_str(),
            "relay started"
        );
        loop {
            while let Some(done) = tasks.try_join_next() {
                report_join(done);
            }
            if shutdown.is_cancelled() {
                break;
            }
            // While the broker is unreachable: a pause and a readiness check each round; while the
            // check fails, one event goes as a probe instead of a batch.
            let mut probe = false;
            if !until_idle && self.shared.outage.is_down() {
                probe = !self.wait_for_broker(&shutdown).await;
                if shutdown.is_cancelled() {
                    break;
                }
            }
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = shutdown.cancelled() => break,
            };
            // A batch in flight may have found the broker unreachable while this one waited.
            if !until_idle && !probe && self.shared.outage.is_down() {
                drop(permit);
                continue;
            }
            let started = Instant::now();
            let this_request = if probe {
                ClaimRequest {
                    limit: 1,
                    probe: true,
                    ..request
                }
            } else {
                request
            };
            let claimed = tokio::select! {
                r = self.shared.store.claim(this_request) => r,
                _ = shutdown.cancelled() => break,
            };
            match claimed {
                Err(e) => {
                    drop(permit);
                    self.shared.observer.store_error("claim", &e);
                    warn!(error = %e, retry_in_ms = store_pause.as_millis() as u64, "claim failed; retrying");
                    self.pause(store_pause, &shutdown).await;
                    store_pause = (store_pause * 2).min(cfg.store_retry_max_backoff);
                }
                Ok(batch) if batch.events.is_empty() => {
                    drop(permit);
                    store_pause = Duration::from_millis(100);
                    self.shared.observer.claimed(0, started.elapsed());
                    if let Err(e) = batch.lease.release().await {
                        debug!(error = %e, "releasing an empty claim failed");
                    }
                    if until_idle {
                        if tasks.is_empty() {
                            break;
                        }
                        while let Some(done) = tasks.join_next().await {
                            report_join(done);
                        }
                        continue;
                    }
                    self.pause(idle_pause, &shutdown).await;
                    idle_pause = (idle_pause * 2).min(cfg.poll_interval);
                }
                Ok(batch) => {
                    store_pause = Duration::from_millis(100);
                    idle_pause = cfg.min_poll_interval;
                    let full = batch.events.len() >= cfg.batch_size;
                    self.shared
                        .observer
                        .claimed(batch.events.len(), started.elapsed());
                    let shared = self.shared.clone();
                    let span = tracing::debug_span!("outbox.batch", size = batch.events.len());
                    tasks.spawn(process_batch(shared, batch, permit, probe).instrument(span));
                    if !full && !until_idle {
                        self.pause(cfg.min_poll_interval, &shutdown).await;
                    }
                }
            }
        }
        let aborted = self.finish(tasks).await;
        let summary = self.shared.totals.summary(aborted);
        info!(
            published = summary.published,
            retried = summary.retried,
            dead_lettered = summary.dead_lettered,
            aborted_batches = summary.aborted_batches,
            "relay stopped"
        );
        summary
    }

    /// Lets in-flight batches finish until the shutdown deadline, then aborts the rest.
    async fn finish(&self, mut tasks: JoinSet<()>) -> u64 {
        if tasks.is_empty() {
            return 0;
        }
        let deadline = Instant::now() + self.shared.config.shutdown_timeout;
        info!(in_flight = tasks.len(), "finishing in-flight batches");
        loop {
            tokio::select! {
                next = tasks.join_next() => match next {
                    Some(done) => report_join(done),
                    None => return 0,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let aborted = tasks.len() as u64;
                    warn!(aborted_batches = aborted, "shutdown deadline reached; releasing the batches still in flight");
                    tasks.abort_all();
                    while tasks.join_next().await.is_some() {}
                    return aborted;
                }
            }
        }
    }
}

fn report_join(result: Result<(), tokio::task::JoinError>) {
    if let Err(e) = result {
        if e.is_panic() {
            error!(error = %e, "a batch task panicked; its events were released and will be published again");
        }
    }
}

/// Publishes and settles one batch. A `probe` (one event sent while the broker is unreachable) that
/// finds the broker still unreachable is put back without counting an attempt (the outage is not the
/// event's fault, and probing must not use up its attempts), behind a delay, so that the next probe
/// takes another event.
async fn process_batch(
    shared: Arc<Shared>,
    batch: Batch,
    permit: OwnedSemaphorePermit,
    probe: bool,
) {
    let Batch { events, lease } = batch;
    let cfg = &shared.config;
    let started = Instant::now();
    let publish_span = tracing::info_span!(
        "outbox.publish",
        publisher = shared.publisher.name(),
        events = events.len()
    );
    #[cfg(feature = "opentelemetry")]
    crate::trace::link_events(&publish_span, &events);
    let (events, outcomes) = publish_in_calls(&shared, events)
        .instrument(publish_span)
        .await;
    let publish_duration = started.elapsed();
    let unreachable = note_broker_state(&shared, &outcomes, started);
    let mut report = BatchReport {
        claimed: events.len(),
        publish_duration,
        ..BatchReport::default()
    };
    let settlements = if probe && unreachable {
        // Put back without an attempt, for twice the pause before the next probe: that probe finds
        // this event not yet due and takes another, so one event whose own destination never
        // answers cannot hold every probe (nor be sent again and again if a timeout hid a delivery).
        let delay = shared.outage.pause() * 2;
        report.retried = events.len();
        events
            .iter()
            .zip(&outcomes)
            .map(|(e, o)| Settlement {
                id: e.id,
                action: Action::Retry {
                    attempts: e.attempts,
                    delay,
                    error: match o {
                        Err(err) => format!("probe while the broker is unreachable: {err}"),
                        Ok(()) => "probe while the broker is unreachable".to_string(),
                    },
                },
            })
            .collect()
    } else {
        decide(
            &events,
            outcomes,
            &cfg.retry,
            cfg.ordering,
            shared.observer.as_ref(),
            &mut report,
        )
    };
    let settle_started = Instant::now();
    let result = lease.settle(settlements).await;
    drop(permit);
    report.settle_duration = settle_started.elapsed();
    report.total_duration = started.elapsed();
    if let Err(e) = result {
        shared.observer.store_error("settle", &e);
        error!(
            error = %e,
            events = events.len(),
            "settling a batch failed; its events were released and will be published again"
        );
        report.settle_error = Some(e);
    } else {
        debug!(
            claimed = report.claimed,
            published = report.published,
            retried = report.retried,
            dead_lettered = report.dead_lettered,
            released = report.released,
            publish_ms = report.publish_duration.as_millis() as u64,
            settle_ms = report.settle_duration.as_millis() as u64,
            "batch settled"
        );
    }
    shared.totals.add(&report);
    shared.observer.batch_settled(&report);
}

/// Whether a batch's outcomes say the broker is unreachable: its events that failed failed with
/// connection errors or timeouts (the rest held back or not sent behind them), whatever it
/// published before (a batch in flight when the broker went away).
fn broker_unreachable(outcomes: &[PublishOutcome]) -> bool {
    let mut connection = false;
    for o in outcomes {
        match o {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::Connection | ErrorKind::Timeout) => {
                connection = true;
            }
            Err(e) if matches!(e.kind(), ErrorKind::Backpressure | ErrorKind::Rejected) => {}
            Err(_) => return false,
        }
    }
    connection
}

/// Marks the broker down when a batch found it unreachable (the claim loop then waits for the
/// publisher's check), and up again when a batch whose publish began after that published
/// something (`started`); returns whether it was found unreachable.
fn note_broker_state(shared: &Shared, outcomes: &[PublishOutcome], started: Instant) -> bool {
    let publisher = shared.publisher.name();
    if broker_unreachable(outcomes) {
        if shared.outage.mark_down() {
            warn!(
                publisher,
                "the broker is unreachable: no more batches are claimed until it answers its readiness check"
            );
        }
        return true;
    }
    if outcomes.iter().any(Result::is_ok) && shared.outage.took_event(started) {
        info!(
            publisher,
            "the broker took an event again; claiming resumes"
        );
    }
    false
}

/// The call each event travels in. Under [`OrderingPolicy::Unordered`] every event is in call 0.
/// Otherwise an aggregate's first event of the batch is in call 0, and each later one in the call of
/// the one before it when the publisher keeps the two in order within a call
/// ([`Publisher::keeps_order`], [`Publisher::same_call`]), else in the next call: for a publisher that
/// does not keep order, its position in its aggregate's run.
fn calls_of(publisher: &dyn Publisher, events: &[Event], ordering: OrderingPolicy) -> Vec<usize> {
    if ordering == OrderingPolicy::Unordered {
        return vec![0; events.len()];
    }
    let keeps = publisher.keeps_order();
    // Per aggregate: the call of its last event so far, and that event.
    let mut last: HashMap<(&str, &str), (usize, &Event)> = HashMap::new();
    events
        .iter()
        .map(|event| {
            let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
            let call = match last.get(&key) {
                None => 0,
                Some(&(call, before)) if keeps && publisher.same_call(before, event) => call,
                Some(&(call, _)) => call + 1,
            };
            last.insert(key, (call, event));
            call
        })
        .collect()
}

/// One publish call, bounded by `relay.publish_timeout`; checks the publisher returned one outcome
/// per event.
async fn call_publisher(shared: &Shared, events: &[Event]) -> Vec<PublishOutcome> {
    let cfg = &shared.config;
    match tokio::time::timeout(cfg.publish_timeout, shared.publisher.publish(events)).await {
        Ok(outcomes) if outcomes.len() == events.len() => outcomes,
        Ok(outcomes) => {
            let e = Error::new(
                ErrorKind::Unexpected,
                format!(
                    "publisher `{}` returned {} outcomes for {} events; every event of the call is retried",
                    shared.publisher.name(),
                    outcomes.len(),
                    events.len()
                ),
            )
            .temporary();
            vec![Err(e); events.len()]
        }
        Err(_) => {
            let e = Error::new(
                ErrorKind::Timeout,
                format!(
                    "a publish call took longer than relay.publish_timeout = {}",
                    crate::duration::format(cfg.publish_timeout)
                ),
            )
            .with_context("publisher", shared.publisher.name());
            vec![Err(e); events.len()]
        }
    }
}

/// Publishes a batch and returns its events (in their order) with one outcome each.
///
/// Usually one call. When the batch holds two events of one aggregate that the publisher cannot keep
/// in order within a call ([`Publisher::keeps_order`]), the later one goes in a later call, and only
/// if every earlier event of its aggregate was acknowledged; otherwise it is not sent (and released
/// by [`decide`]). No call starts once `publish_timeout` has passed since the first: the events left
/// are given back as back-pressure (no attempt counted).
async fn publish_in_calls(
    shared: &Shared,
    events: Vec<Event>,
) -> (Vec<Event>, Vec<PublishOutcome>) {
    let cfg = &shared.config;
    let call = calls_of(shared.publisher.as_ref(), &events, cfg.ordering);
    let calls = call.iter().max().map_or(0, |m| m + 1);
    if calls <= 1 {
        let outcomes = call_publisher(shared, &events).await;
        return (events, outcomes);
    }
    let started = Instant::now();
    let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
    let mut failed: HashSet<(String, String)> = HashSet::new();
    let mut slots: Vec<Option<Event>> = events.into_iter().map(Some).collect();
    for c in 0..calls {
        let mut sending: Vec<usize> = Vec::new();
        for i in (0..slots.len()).filter(|&i| call[i] == c) {
            let Some(event) = slots[i].as_ref() else {
                continue;
            };
            let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
            if failed.contains(&key) {
                outcomes[i] = Some(Err(crate::publishers::Fence::not_sent("relay")));
            } else if c > 0 && started.elapsed() >= cfg.publish_timeout {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Backpressure,
                    "not sent: the batch used up relay.publish_timeout before this event's turn",
                )));
                failed.insert(key);
            } else {
                sending.push(i);
            }
        }
        if sending.is_empty() {
            continue;
        }
        let batch: Vec<Event> = sending.iter().filter_map(|&i| slots[i].take()).collect();
        let results = call_publisher(shared, &batch).await;
        for ((i, event), result) in sending.iter().zip(batch).zip(results) {
            if result.is_err() {
                failed.insert((event.aggregate_type.clone(), event.aggregate_id.clone()));
            }
            outcomes[*i] = Some(result);
            slots[*i] = Some(event);
        }
    }
    let events = slots.into_iter().flatten().collect();
    (events, crate::publishers::finish(outcomes))
}

/// Turns the publisher's outcomes into settlements, applying the retry and ordering policies.
fn decide(
    events: &[Event],
    outcomes: Vec<PublishOutcome>,
    retry: &RetryPolicy,
    ordering: OrderingPolicy,
    observer: &dyn RelayObserver,
    report: &mut BatchReport,
) -> Vec<Settlement> {
    let mut held: HashSet<(&str, &str)> = HashSet::new();
    let mut settlements = Vec::with_capacity(events.len());
    let mut first_retry: Option<(&Event, String)> = None;
    for (event, outcome) in events.iter().zip(outcomes) {
        let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
        if ordering == OrderingPolicy::PerAggregate && held.contains(&key) {
            report.released += 1;
            settlements.push(Settlement {
                id: event.id,
                action: Action::Release,
            });
            continue;
        }
        let action = match outcome {
            Ok(()) => {
                report.published += 1;
                Action::Published
            }
            Err(err) => {
                held.insert(key);
                let (action, decision) = failure_action(event, &err, retry);
                match decision {
                    FailureDecision::DeadLetter => {
                        report.dead_lettered += 1;
                        error!(
                            event_id = %event.id,
                            event_type = %event.event_type,
                            aggregate_id = %event.aggregate_id,
                            attempt = event.attempt(),
                            error = %err,
                            "event dead-lettered"
                        );
                    }
                    FailureDecision::Retry | FailureDecision::Backpressure => {
                        report.retried += 1;
                        // One warning per batch (below), however many events failed: a broker
                        // outage must not flood the log. Each event is at debug level.
                        debug!(
                            event_id = %event.id,
                            event_type = %event.event_type,
                            aggregate_id = %event.aggregate_id,
                            attempt = event.attempt(),
                            error = %err,
                            "publish failed; will retry"
                        );
                        if first_retry.is_none() {
                            first_retry = Some((event, err.to_string()));
                        }
                    }
                }
                observer.event_failed(event, &err, decision);
                action
            }
        };
        settlements.push(Settlement {
            id: event.id,
            action,
        });
    }
    if let Some((event, error)) = first_retry {
        warn!(
            failed = report.retried,
            batch = events.len(),
            first_event_id = %event.id,
            first_aggregate_id = %event.aggregate_id,
            attempt = event.attempt(),
            error = %error,
            "publish failed for events of the batch; they will be retried"
        );
    }
    settlements
}

fn failure_action(event: &Event, err: &Error, retry: &RetryPolicy) -> (Action, FailureDecision) {
    if err.kind() == ErrorKind::Backpressure && err.is_retryable() {
        return (
            Action::Retry {
                attempts: event.attempts,
                delay: retry.initial_backoff.min(Duration::from_secs(1)),
                error: err.to_string(),
            },
            FailureDecision::Backpressure,
        );
    }
    let attempts = event.attempt();
    if err.is_retryable() && retry.may_retry(attempts) {
        (
            Action::Retry {
                attempts,
                delay: retry.backoff(attempts),
                error: err.to_string(),
            },
            FailureDecision::Retry,
        )
    } else {
        let error = if err.is_retryable() {
            format!(
                "gave up after {attempts} attempts: {}",
                err.clone().persistent()
            )
        } else {
            err.to_string()
        };
        (
            Action::DeadLetter { attempts, error },
            FailureDecision::DeadLetter,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use std::collections::BTreeMap;
    use uuid::Uuid;

    /// A batch whose failures are all connection errors or timeouts finds the broker unreachable,
    /// also when it published some events before (in flight as the broker went away); a failure of
    /// an event's own says nothing of the broker.
    #[test]
    fn failures_of_the_connection_only_find_the_broker_unreachable() {
        let conn = || Err(Error::new(ErrorKind::Connection, "connection reset"));
        let own = || Err(Error::new(ErrorKind::InvalidInput, "header too long"));
        assert!(broker_unreachable(&[conn(), conn()]));
        assert!(broker_unreachable(&[Ok(()), conn()]));
        assert!(!broker_unreachable(&[Ok(()), Ok(())]));
        assert!(!broker_unreachable(&[conn(), own()]));
    }

    /// A batch in flight when another found the broker unreachable, whose first records went
    /// through before the outage, is no news that the broker is back: claiming stays paused (else
    /// full batches fail again, each counting an attempt). A call begun after the outage was noticed
    /// (a probe, a batch after a passing check) is.
    #[test]
    fn only_a_call_begun_after_the_outage_was_noticed_marks_the_broker_up() {
        let outage = Outage::new(&RetryPolicy::default());
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        assert!(outage.mark_down());
        assert!(!outage.took_event(before), "a call begun before the outage");
        assert!(outage.is_down());
        let after = Instant::now();
        assert!(outage.took_event(after), "a call begun after it");
        assert!(!outage.is_down());
    }

    fn event(agg: &str, attempts: u32) -> Event {
        Event {
            id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: agg.into(),
            event_type: "order.created".into(),
            payload: b"{}".to_vec(),
            content_type: "application/json".into(),
            headers: BTreeMap::new(),
            destination: None,
            created_at: Utc::now(),
            attempts,
        }
    }

    fn retryable() -> Error {
        Error::new(ErrorKind::Connection, "down")
    }

    #[test]
    fn failure_holds_back_the_rest_of_the_aggregate_only() {
        let evs = vec![event("a", 0), event("a", 0), event("b", 0), event("a", 0)];
        let outcomes = vec![Err(retryable()), Ok(()), Ok(()), Ok(())];
        let mut report = BatchReport::default();
        let s = decide(
            &evs,
            outcomes,
            &RetryPolicy::default(),
            OrderingPolicy::PerAggregate,
            &NoopObserver,
            &mut report,
        );
        assert!(matches!(s[0].action, Action::Retry { attempts: 1, .. }));
        assert_eq!(s[1].action, Action::Release);
        assert_eq!(s[2].action, Action::Published);
        assert_eq!(s[3].action, Action::Release);
        assert_eq!(
            (report.published, report.retried, report.released),
            (1, 1, 2)
        );
    }

    #[test]
    fn unordered_settles_each_outcome_on_its_own() {
        let evs = vec![event("a", 0), event("a", 0)];
        let outcomes = vec![Err(retryable()), Ok(())];
        let mut report = BatchReport::default();
        let s = decide(
            &evs,
            outcomes,
            &RetryPolicy::default(),
            OrderingPolicy::Unordered,
            &NoopObserver,
            &mut report,
        );
        assert!(matches!(s[0].action, Action::Retry { .. }));
        assert_eq!(s[1].action, Action::Published);
    }

    #[test]
    fn permanent_and_exhausted_errors_dead_letter() {
        let policy = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        let permanent = Error::new(ErrorKind::PayloadTooLarge, "too big");
        let (a, d) = failure_action(&event("a", 0), &permanent, &policy);
        assert_eq!(d, FailureDecision::DeadLetter);
        assert_eq!(
            a,
            Action::DeadLetter {
                attempts: 1,
                error: permanent.to_string()
            }
        );
        let (a, d) = failure_action(&event("a", 2), &retryable(), &policy);
        assert_eq!(d, FailureDecision::DeadLetter);
        match a {
            Action::DeadLetter { attempts, error } => {
                assert_eq!(attempts, 3);
                assert!(
                    error.starts_with("gave up after 3 attempts: connection (persistent)"),
                    "{error}"
                );
            }
            other => panic!("expected a dead letter, got {other:?}"),
        }
        let (a, _) = failure_action(&event("a", 1), &retryable(), &policy);
        assert!(matches!(a, Action::Retry { attempts: 2, .. }));
    }

    #[test]
    fn backpressure_does_not_count_an_attempt() {
        let e = Error::new(ErrorKind::Backpressure, "queue full");
        let (a, d) = failure_action(&event("a", 4), &e, &RetryPolicy::default());
        assert_eq!(d, FailureDecision::Backpressure);
        assert!(matches!(a, Action::Retry { attempts: 4, .. }));
    }

    #[test]
    fn config_validation_names_keys() {
        let lines = crate::publishers::JsonLinesPublisher::new(Box::new(std::io::sink()));
        let c = RelayConfig {
            batch_size: 0,
            ..RelayConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .message()
            .contains("relay.batch_size"));
        let c = RelayConfig {
            min_poll_interval: Duration::from_secs(5),
            poll_interval: Duration::from_secs(1),
            ..RelayConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .message()
            .contains("relay.min_poll_interval"));
        let c = RelayConfig {
            max_batch_bytes: 100,
            ..RelayConfig::default()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .message()
            .contains("relay.max_batch_bytes = 100"));
        assert_eq!(
            RelayConfig::default().claim_request(&lines).max_bytes,
            DEFAULT_MAX_BATCH_BYTES
        );
        // A publisher that keeps a run in order within a call gets whole runs; one that does not,
        // one event of each aggregate per call.
        assert!(RelayConfig::default().claim_request(&lines).whole_runs);
        let unfenced = crate::testkit::ScriptedPublisher::default();
        unfenced.set_fencing(false);
        assert!(!RelayConfig::default().claim_request(&unfenced).whole_runs);
        RelayConfig::default().validate().unwrap();
    }
}
