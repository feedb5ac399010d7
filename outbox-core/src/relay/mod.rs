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
//! - **Back-pressure**: an event the publisher cannot take right now (`ErrorKind::Backpressure`) goes
//!   back unchanged, counting no attempt and moving nothing, and claiming pauses (50 ms, doubling to
//!   1 s while the publisher keeps pushing back).
//! - **Graceful shutdown**: on cancellation the relay stops claiming, lets in-flight batches finish
//!   until `shutdown_timeout`, then aborts the rest (their events are released, not lost).
//!
//! Where each part lives: `config` (the settings and their validation), `wake` (the wake-up
//! handle), `observer` (batch reports, observer hooks, run totals), `outage` (the broker outage
//! state machine), `pressure` (the pause after back-pressure), `run` (the claim loop and each batch's task), `publish` (a batch's publish
//! calls), `decide` (retry, dead-letter or release for each outcome).

mod config;
mod decide;
mod observer;
mod outage;
mod pressure;
mod publish;
mod run;
#[cfg(test)]
mod tests;
mod wake;

use std::sync::Arc;

use crate::error::Error;
use crate::ports::{Publisher, Store};

pub use config::{RelayConfig, DEFAULT_MAX_BATCH_BYTES};
pub use observer::{BatchReport, FailureDecision, NoopObserver, RelayObserver, RelaySummary};
pub use wake::Wake;

use observer::Totals;
use outage::Outage;
use pressure::Pressure;

/// What the claim loop and its batch tasks share.
struct Shared {
    store: Arc<dyn Store>,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
    observer: Arc<dyn RelayObserver>,
    totals: Totals,
    /// Whether the broker was found unreachable, and how long to wait before checking it again.
    outage: Outage,
    /// Whether the publisher pushed back, and until when claiming waits.
    pressure: Pressure,
}

/// The relay: moves events from a [`Store`] to a [`Publisher`].
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn txoutbox_core::Store>, publisher: std::sync::Arc<dyn txoutbox_core::Publisher>) -> Result<(), txoutbox_core::Error> {
/// use txoutbox_core::{Relay, RelayConfig};
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
    /// A config error when `config` does not validate, or the store cannot hold
    /// `config.max_in_flight` leases at once ([`Store::check_capacity`]).
    pub fn new(
        store: Arc<dyn Store>,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
    ) -> Result<Self, Error> {
        config.validate_with(publisher.as_ref())?;
        store.check_capacity(config.max_in_flight)?;
        Ok(Relay {
            shared: Arc::new(Shared {
                store,
                publisher,
                observer: Arc::new(NoopObserver),
                totals: Totals::default(),
                outage: Outage::new(&config.retry),
                pressure: Pressure::default(),
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
            pressure: Pressure::default(),
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
}
