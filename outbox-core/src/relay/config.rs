//! The relay's settings ([`RelayConfig`]): their documented defaults, their validation (alone and
//! against the publisher they drive), and the claim request they make of the store.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::policy::{OrderingPolicy, RetryPolicy};
use crate::ports::{ClaimRequest, Publisher};

/// The default of [`RelayConfig::max_batch_bytes`]: 8 MiB.
pub const DEFAULT_MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// Settings of the relay engine. Every field has a documented default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub poll_interval: Duration,
    /// Pause after a partial batch, and the first pause once the outbox is empty. Default 10 ms.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub min_poll_interval: Duration,
    /// Longest time one publish call may take; past it every event of the call fails with a
    /// retryable timeout. It must exceed the publisher's own limit of a call (for Kafka
    /// `kafka.enqueue_timeout + kafka.delivery_timeout + 5s`), so that the publisher's own timeout
    /// and recovery act first: [`Relay::new`](super::Relay::new) refuses a shorter one, naming both
    /// settings. A batch starts no new call (see [`Publisher::keeps_order`]) once this much time has
    /// passed since its first, so a batch is held at most twice this long. Default 60 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub publish_timeout: Duration,
    /// Time in-flight batches get to finish after shutdown was asked; then they are aborted and
    /// their events released. Default 30 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub shutdown_timeout: Duration,
    /// Longest pause between attempts to reach a failing store (the pause doubles from 100 ms). Default 5 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
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
        self.validate_against(publisher.name(), publisher.call_limit().as_ref())
    }

    /// [`RelayConfig::validate_with`] for the publisher named `publisher` whose own limit of one
    /// call is `limit`, without the publisher itself (a configuration checked offline).
    ///
    /// # Errors
    /// As [`RelayConfig::validate_with`].
    pub fn validate_against(
        &self,
        publisher: &str,
        limit: Option<&crate::CallLimit>,
    ) -> Result<(), Error> {
        self.validate()?;
        if let Some(limit) = limit {
            if self.publish_timeout <= limit.limit {
                return Err(Error::config(format!(
                    "relay.publish_timeout = {} does not exceed the {} publisher's own limit of one call, {} ({}): \
                     the relay would cut calls short before the publisher times out and recovers; \
                     raise relay.publish_timeout above {} or lower those settings",
                    crate::duration::format(self.publish_timeout),
                    publisher,
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

#[cfg(test)]
mod tests {
    use super::*;

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
