//! The ports: [`Store`] (used only by the relay) and [`Publisher`] (talks only to a broker).
//!
//! The writer that enqueues events inside the caller's transaction lives with the store that defines
//! the table (for PostgreSQL: `txoutbox_postgres::Writer`).

use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use uuid::Uuid;

use crate::error::Error;
use crate::event::Event;
use crate::policy::OrderingPolicy;

/// What the relay asks the store for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The most events to return.
    pub limit: usize,
    /// Which events may be claimed together and side by side with other relays.
    pub ordering: OrderingPolicy,
    /// The longest the relay may hold the batch before settling it. The store keeps the lease alive
    /// at least this long (PostgreSQL: the claim transaction outlives any shorter
    /// `idle_in_transaction_session_timeout` of the role or database).
    pub hold_for: Duration,
    /// The most payload bytes to return, summed over the batch's events: a batch stops before the
    /// event that would take it past this budget, except that a first event larger than the budget
    /// is still returned, alone (so it can be published or dead-lettered). `usize::MAX`: no budget.
    pub max_bytes: usize,
    /// The relay found the broker unreachable and claims one event to probe it (`limit` is 1). A
    /// store that reads ahead of the claims (the WAL source) need not read further for such a
    /// claim: the relay is not publishing.
    pub probe: bool,
    /// The publisher keeps an aggregate's events in order within one call
    /// ([`Publisher::keeps_order`]), so a batch may hold several events of an aggregate at no cost
    /// in calls. A store that shares the aggregates out between leases may then fill a batch from
    /// fewer aggregates and leave the others to other leases (PostgreSQL's ordered claim does so
    /// for a while after a claim found other leases holding every aggregate it could take: the
    /// relay's other batches in flight, other relays); without it, a batch holds one event of as
    /// many aggregates as it can (the fewest calls). Ordering is kept either way.
    pub whole_runs: bool,
}

/// A claimed batch: the events, and the lease that holds them until it is settled or released.
pub struct Batch {
    /// The claimed events, in insertion order (per aggregate, the oldest first).
    pub events: Vec<Event>,
    /// The lease on the events. Dropping it without settling releases the events (as a crashed relay
    /// would), so they become claimable again.
    pub lease: Box<dyn Lease>,
}

impl ClaimRequest {
    /// A request with `hold_for` = [`ClaimRequest::DEFAULT_HOLD`] (the relay derives its own from
    /// `relay.publish_timeout`: see `RelayConfig::claim_request`) and no byte budget.
    pub fn new(limit: usize, ordering: OrderingPolicy) -> Self {
        ClaimRequest {
            limit,
            ordering,
            hold_for: Self::DEFAULT_HOLD,
            max_bytes: usize::MAX,
            probe: false,
            whole_runs: false,
        }
    }

    /// The same request with a byte budget ([`ClaimRequest::max_bytes`]).
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The byte budget's rule, the one every store applies: whether an event of `size` payload
    /// bytes joins a batch that holds `taken` events of `taken_bytes` bytes so far. A first event
    /// joins whatever its size (alone, it can still be published or dead-lettered); a later one
    /// only while the total stays within [`ClaimRequest::max_bytes`]. A store stops at the first
    /// event that does not join, so that every aggregate's events stay a prefix of its run.
    pub fn fits(&self, taken: usize, taken_bytes: usize, size: usize) -> bool {
        taken == 0 || taken_bytes.saturating_add(size) <= self.max_bytes
    }

    /// The default of [`ClaimRequest::hold_for`]: two minutes.
    pub const DEFAULT_HOLD: Duration = Duration::from_secs(120);
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("events", &self.events.len())
            .finish_non_exhaustive()
    }
}

/// What becomes of one claimed event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The broker acknowledged it: mark processed (or delete it, as the store is configured).
    Published,
    /// Try again after `delay`; the event has now been attempted `attempts` times in all and failed
    /// with `error` the last time.
    Retry {
        /// Attempts made so far, this one included.
        attempts: u32,
        /// Time to wait before the event is claimable again.
        delay: Duration,
        /// The error text kept on the row.
        error: String,
    },
    /// Give up: keep the event as a dead letter with its last error.
    DeadLetter {
        /// Attempts made, this one included.
        attempts: u32,
        /// The error text kept on the row.
        error: String,
    },
    /// Not attempted (or not to be counted): give it back unchanged.
    Release,
}

/// The outcome of one claimed event, as the relay settles it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    /// The event id.
    pub id: Uuid,
    /// What becomes of it.
    pub action: Action,
}

/// The hold a relay has on a claimed batch.
#[async_trait]
pub trait Lease: Send {
    /// Records the outcome of every event of the batch and ends the lease.
    ///
    /// # Behavior
    /// - All settlements are applied atomically, in one round trip where the store allows: either all
    ///   take effect or none does (and then the events are released, as on a crash).
    /// - `Published` events are never claimed again. `Retry` events are claimable again after their
    ///   delay, with their attempts and last error stored. `DeadLetter` events are never claimed
    ///   again until an operator retries them; under [`OrderingPolicy::PerAggregate`] they hold back the
    ///   later events of their aggregate. `Release` events are claimable again at once, unchanged.
    /// - An event of the batch missing from `settlements` is released.
    /// - Ids that are not part of the batch are ignored.
    async fn settle(self: Box<Self>, settlements: Vec<Settlement>) -> Result<(), Error>;

    /// Gives every event of the batch back, unchanged.
    ///
    /// # Behavior
    /// The events become claimable again at once. Dropping the lease has the same effect, later.
    async fn release(self: Box<Self>) -> Result<(), Error>;
}

/// Counts of one event type, part of [`StoreStats`].
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EventTypeStats {
    /// The event type.
    pub event_type: String,
    /// Events waiting to be published (including those backing off or held back).
    pub pending: u64,
    /// Dead letters.
    pub dead_letters: u64,
    /// Age of the oldest pending event of this type, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
}

impl EventTypeStats {
    /// Zero counts for `event_type`.
    pub fn new(event_type: impl Into<String>) -> Self {
        EventTypeStats {
            event_type: event_type.into(),
            ..EventTypeStats::default()
        }
    }
}

/// What the outbox holds, for metrics and the `status` command.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StoreStats {
    /// Events waiting to be published (including those backing off or held back).
    pub pending: u64,
    /// Age of the oldest pending event, in seconds.
    pub oldest_pending_age_seconds: Option<f64>,
    /// Dead letters.
    pub dead_letters: u64,
    /// Pending events that come after a dead letter of their aggregate: under
    /// [`OrderingPolicy::PerAggregate`] they wait until it is retried or discarded.
    pub held_back: u64,
    /// Aggregates with events held back that way.
    pub held_back_aggregates: u64,
    /// The same figures per event type, sorted by event type.
    pub by_event_type: Vec<EventTypeStats>,
    /// Whether the counts are estimates (a store may bound what one call reads, as the PostgreSQL
    /// store does above `database.stats_max_rows` rows).
    pub estimated: bool,
}

impl StoreStats {
    /// These figures as a relay with `ordering` sees them: without per-aggregate order a dead letter
    /// holds nothing back, so the held-back counts are 0.
    pub fn under(mut self, ordering: OrderingPolicy) -> Self {
        if ordering == OrderingPolicy::Unordered {
            self.held_back = 0;
            self.held_back_aggregates = 0;
        }
        self
    }
}

/// The relay's view of the outbox.
#[async_trait]
pub trait Store: Send + Sync {
    /// Claims up to `request.limit` publishable events.
    ///
    /// # Behavior
    /// - Returns the oldest publishable events first; fewer (or none) when fewer are ready. An empty
    ///   batch is not an error.
    /// - A publishable event is pending, its retry delay (if any) has passed, and no live lease holds it.
    ///   Under [`OrderingPolicy::PerAggregate`] it must also have no earlier event of its aggregate that
    ///   is pending, backing off, claimed or dead-lettered; the batch may then hold a run of consecutive
    ///   events of one aggregate, in order. No two live leases ever hold events of one aggregate.
    /// - Claimed events stay claimed until the lease is settled, released or dropped, or the process
    ///   holding it dies; then they are claimable again without waiting for a timeout.
    /// - Several relays (processes) may claim concurrently; they never receive the same event while a
    ///   lease on it is live.
    async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error>;

    /// Counts pending events and dead letters.
    ///
    /// # Behavior
    /// Read-only; may be slower than `claim` on large outboxes (call it every few seconds, not per batch).
    async fn stats(&self) -> Result<StoreStats, Error>;

    /// Checks that the store is reachable (for readiness probes).
    ///
    /// # Behavior
    /// Returns `Ok` when a trivial query succeeds.
    async fn check(&self) -> Result<(), Error>;

    /// Checks, when a relay is made ([`Relay::new`](crate::Relay::new)), that the store can hold
    /// `batches_in_flight` leases at once (a store whose leases are connections: that its pool has
    /// that many). Default: `Ok`.
    ///
    /// # Errors
    /// A configuration error naming what is too small and how to fix it.
    fn check_capacity(&self, batches_in_flight: usize) -> Result<(), Error> {
        let _ = batches_in_flight;
        Ok(())
    }
}

/// The outcome of publishing one event.
pub type PublishOutcome = Result<(), Error>;

/// Sends events to a broker.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publishes a batch and reports one outcome per event, in input order.
    ///
    /// # Behavior
    /// - Returns exactly `events.len()` outcomes; outcome `i` belongs to `events[i]`.
    /// - `Ok(())` only once the broker acknowledged the event (delivery report, publisher confirm,
    ///   per-entry success); never before.
    /// - Events of one aggregate reach the broker in input order. The publisher may (and should) have
    ///   many events in flight at once rather than awaiting each.
    /// - Once an event fails, later events of the same aggregate in the same call should not reach the
    ///   broker where the publisher can prevent it (report them as retryable failures). The relay gives
    ///   them back unattempted in any case, and publishes them again after the failed event.
    /// - The relay hands one call two events of one aggregate only when [`Publisher::keeps_order`]
    ///   says the broker itself keeps them in order.
    /// - Errors are classified: [`Error::is_retryable`] is true only when trying again may succeed.
    ///   An error for one event does not fail the others.
    /// - Must not panic on any event content; content the broker cannot carry is a permanent error
    ///   for that event.
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome>;

    /// Checks that the broker is reachable and usable (for readiness probes and `publish-test`).
    ///
    /// # Behavior
    /// Returns `Ok` when the broker answers; does not publish anything.
    async fn check(&self) -> Result<(), Error>;

    /// A short name for logs and metrics, such as `kafka`.
    fn name(&self) -> &str;

    /// Whether the broker keeps an aggregate's events in order within one call: a later event of an
    /// aggregate is never acknowledged when an earlier one of the same call was refused.
    ///
    /// # Behavior
    /// - `true` only when that holds for every event: a publisher that succeeds or fails a whole call
    ///   at once (standard output, a discarding sink), or a broker that writes an aggregate's events
    ///   in the order sent and never one past an event it refused (Kafka's idempotent producer with
    ///   its gapless guarantee, within one topic: see [`Publisher::same_call`]). The relay may then
    ///   hand one call a whole run.
    /// - `false` (the default) when events can fail one by one, a later one acknowledged after an
    ///   earlier one was refused: a RabbitMQ queue in `reject-publish` overflow nacks one message and
    ///   acks the next; an SQS batch fails per entry. The relay then sends a later event of an
    ///   aggregate only in a later call, once the earlier one is acknowledged.
    fn keeps_order(&self) -> bool {
        false
    }

    /// Whether `later`, a later event of `earlier`'s aggregate, may travel in the same call as
    /// `earlier`: asked only when [`Publisher::keeps_order`] is true, for each two events of an
    /// aggregate next to each other in a batch.
    ///
    /// # Behavior
    /// - `true` (the default) when the broker keeps the two in order within a call.
    /// - `false` when it keeps order only within something the two do not share: Kafka keeps an
    ///   aggregate's records in order within one partition of one topic, so two events routed to
    ///   different topics go in separate calls. The relay then sends `later` in a later call, once
    ///   `earlier` is acknowledged (as for a publisher that does not keep order).
    fn same_call(&self, earlier: &Event, later: &Event) -> bool {
        let _ = (earlier, later);
        true
    }

    /// The longest one call can take by the publisher's own limits, with the settings that set it,
    /// after which the publisher reports its failures (and recovers its connection) itself.
    ///
    /// # Behavior
    /// `None` when the publisher has no limit of its own. The relay refuses a `relay.publish_timeout`
    /// that would cut a call short before this limit (see `RelayConfig::validate_with`): its own
    /// timeout would pre-empt the publisher's recovery and count attempts for events the broker may
    /// still deliver.
    fn call_limit(&self) -> Option<CallLimit> {
        None
    }
}

/// A publisher's own bound on one publish call (see [`Publisher::call_limit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallLimit {
    /// The bound.
    pub limit: Duration,
    /// The settings that make it, for error messages, such as
    /// `kafka.enqueue_timeout + kafka.delivery_timeout + 5s`.
    pub settings: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_per_aggregate_order_nothing_is_held_back() {
        let stats = StoreStats {
            held_back: 5,
            held_back_aggregates: 2,
            dead_letters: 2,
            ..StoreStats::default()
        };
        let ordered = stats.clone().under(OrderingPolicy::PerAggregate);
        assert_eq!((ordered.held_back, ordered.held_back_aggregates), (5, 2));
        let unordered = stats.under(OrderingPolicy::Unordered);
        assert_eq!(
            (
                unordered.held_back,
                unordered.held_back_aggregates,
                unordered.dead_letters
            ),
            (0, 0, 2)
        );
    }

    #[test]
    fn the_byte_budget_takes_a_first_event_of_any_size_and_later_ones_within_it() {
        let r = ClaimRequest::new(10, OrderingPolicy::PerAggregate).with_max_bytes(100);
        assert!(
            r.fits(0, 0, 1_000),
            "a first event goes alone, whatever its size"
        );
        assert!(r.fits(1, 60, 40), "up to the budget exactly");
        assert!(!r.fits(1, 60, 41), "not past it");
        assert!(
            !r.fits(1, 1_000, 0),
            "nothing after an event over the budget"
        );
        let unbounded = ClaimRequest::new(10, OrderingPolicy::PerAggregate);
        assert!(unbounded.fits(5, usize::MAX - 1, usize::MAX));
    }
}
