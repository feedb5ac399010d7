//! What the adapters and the benchmark share: the benchmark's destination on a broker
//! ([`BenchTarget`], and [`DiscardTarget`] for the database's ceiling), the options a broker's
//! destination is made with ([`TargetOptions`]) and where progress lines go ([`Progress`]).
//! It depends on no other module of this crate, so that both can import it.

use std::sync::Arc;

use async_trait::async_trait;

use txoutbox_core::{Error, Event, PublishOutcome, Publisher};

/// Where the benchmark's progress lines go.
pub type Progress = dyn for<'a> Fn(&'a str) + Send + Sync;

/// The options of `outbox bench` a broker's destination is made with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetOptions {
    /// Partitions of the Kafka benchmark topic (`--kafka-partitions`).
    pub kafka_partitions: i32,
}

/// Where a benchmark publishes.
#[async_trait]
pub trait BenchTarget: Send + Sync {
    /// The name shown in the report, such as `amqp`.
    fn name(&self) -> &str;

    /// A new publisher. Each relay of a run gets its own, as separate relay processes would.
    ///
    /// # Errors
    /// When the publisher cannot be built (configuration, unreachable broker).
    async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error>;

    /// Called before each run that publishes here, for instance to purge the benchmark's queue so
    /// that runs do not pile messages onto the broker. Default: nothing.
    ///
    /// # Errors
    /// When the destination cannot be reset.
    async fn reset(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Removes the destination the benchmark created for itself (best effort: reports a failure on
    /// standard error, never fails). Called once, after the last run. Default: nothing.
    async fn teardown(&self) {}
}

/// A target whose publisher acknowledges every event at once without sending it anywhere: the drain
/// rate against it is the database's ceiling for the relay.
#[derive(Debug, Default, Clone, Copy)]
pub struct DiscardTarget;

/// The publisher of [`DiscardTarget`].
pub(crate) struct DiscardPublisher;

#[async_trait]
impl Publisher for DiscardPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        vec![Ok(()); events.len()]
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }

    fn name(&self) -> &str {
        "discard"
    }

    fn keeps_order(&self) -> bool {
        true
    }
}

#[async_trait]
impl BenchTarget for DiscardTarget {
    fn name(&self) -> &str {
        "discard"
    }

    async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(DiscardPublisher))
    }
}
