//! The configuration: a TOML file (`--config`, default `outbox.toml` when present), then environment
//! overrides (`OUTBOX_<SECTION>__<KEY>`, and `DATABASE_URL`), then validation that names the key.
//!
//! Every section and key has a default, so no file is needed on a machine with a local PostgreSQL:
//! the relay then publishes JSON lines to standard output.
//!
//! [`Config`] and its checks are here; loading is in `load.rs`, the binary's own sections in
//! `sections.rs`. Each adapter's section is its own type ([`crate::adapters`]), and
//! [`Config::adapter`] binds an adapter to it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use txoutbox_core::{Error, RelayConfig};
use txoutbox_postgres::DatabaseConfig;

use crate::adapters::{self, Adapter, Bound, Configured};

mod load;
pub mod reference;
mod sections;
mod source;
#[cfg(test)]
mod tests;

pub use load::{ignored, service_link, setting};

pub use crate::adapters::PublisherType;
pub use sections::{HttpConfig, LogConfig, LogFormat, PublisherSection};

/// The file read when `--config` is not given, if it exists.
pub const DEFAULT_CONFIG_FILE: &str = "outbox.toml";
/// Prefix of environment overrides: `OUTBOX_RELAY__BATCH_SIZE=1000` sets `relay.batch_size`.
pub const ENV_PREFIX: &str = "OUTBOX_";

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct Config {
    /// `[database]`.
    pub database: DatabaseConfig,
    /// `[relay]`, with `[relay.retry]`.
    pub relay: RelayConfig,
    /// `[publisher]`.
    pub publisher: PublisherSection,
    /// `[amqp]`: RabbitMQ settings, used when `publisher.type = "amqp"` (in a build without
    /// RabbitMQ support: accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub amqp: adapters::amqp::Section,
    /// `[kafka]`: Kafka settings, used when `publisher.type = "kafka"` (in a build without Kafka
    /// support: accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub kafka: adapters::kafka::Section,
    /// `[sqs]`: SQS settings, used when `publisher.type = "sqs"` (in a build without SQS support:
    /// accepted, then refused if selected).
    #[serde(skip_serializing_if = "adapters::is_unset")]
    pub sqs: adapters::sqs::Section,
    /// `[http]`.
    pub http: HttpConfig,
    /// `[log]`.
    pub log: LogConfig,
    /// `[wal]`: the WAL source's slot and publication (`outbox wal`).
    pub wal: txoutbox_postgres::wal::WalConfig,
}

impl Config {
    /// The liveness timeout in force: `http.liveness_timeout`, or when unset the larger of 5 min and
    /// the relay's hold time + 1 min.
    pub fn liveness_timeout(&self) -> Duration {
        self.ops().liveness_timeout_for(&self.relay)
    }

    /// The relay's operations side as `[http]` and `[database]` set it: statistics, readiness and
    /// liveness, the event-type label cap, the automatic cleanup, and this build's labels.
    pub fn ops(&self) -> txoutbox_postgres::ops::OpsConfig {
        txoutbox_postgres::ops::OpsConfig {
            stats_interval: self.http.stats_interval,
            ready_timeout: self.http.ready_timeout,
            liveness_timeout: self.http.liveness_timeout,
            max_event_type_labels: self.http.max_event_type_labels,
            cleanup: match (self.database.keep_processed_for, self.database.auto_cleanup) {
                (Some(older_than), true) => Some(txoutbox_postgres::ops::CleanupSchedule {
                    older_than,
                    interval: self.database.cleanup_interval,
                    batch_size: self.database.cleanup_batch_size,
                }),
                _ => None,
            },
            build: crate::build_info::labels(),
        }
    }

    /// Checks every section.
    ///
    /// # Errors
    /// The first problem found, naming its key.
    pub fn validate(&self) -> Result<(), Error> {
        self.database.validate()?;
        self.relay.validate()?;
        self.log.validate()?;
        if self.http.max_event_type_labels == 0 {
            return Err(Error::config(
                "http.max_event_type_labels = 0: expected at least 1 (event types past it count as \"other\")",
            ));
        }
        if self.http.stats_interval.is_zero() || self.http.ready_timeout.is_zero() {
            return Err(Error::config(
                "http.stats_interval and http.ready_timeout must be positive durations such as 5s",
            ));
        }
        if let Some(timeout) = self.http.liveness_timeout {
            if timeout <= self.relay.hold_for() {
                return Err(Error::config(format!(
                    "http.liveness_timeout = {} does not exceed the relay's hold time, {} (2 x relay.publish_timeout + 10s): \
                     a healthy relay may take that long over a batch; raise http.liveness_timeout above it, \
                     or leave it unset (then it is the larger of 5m and the hold time + 1m)",
                    txoutbox_core::duration::format(timeout),
                    txoutbox_core::duration::format(self.relay.hold_for()),
                )));
            }
        }
        self.publisher.formatter()?;
        self.adapter(self.publisher.kind).validate()
    }

    /// Checks that `database.pool_size` holds every connection the relay uses at once
    /// ([`Config::pool_connections_needed`]). Only `outbox relay` needs it: the other subcommands
    /// (`migrate` in an init container, `status`, `cleanup`...) use one or two connections.
    ///
    /// # Errors
    /// A config error naming each user of the pool, the total and the fix.
    pub fn check_relay_pool(&self) -> Result<(), Error> {
        let needed = self.pool_connections_needed();
        if needed > self.database.pool_size {
            let mut extra = String::new();
            if self.database.notify {
                extra += " + 1 (the NOTIFY listener, database.notify = true)";
            }
            if self.database.cleans_automatically() {
                extra += " + 1 (automatic cleanup, database.keep_processed_for with database.auto_cleanup = true)";
            }
            return Err(Error::config(format!(
                "database.pool_size = {} is too small: the relay uses relay.max_in_flight = {} (one connection per batch in flight) + 1 (statistics) + 1 (readiness check){extra} = {needed} connections at once; set database.pool_size to at least {needed}, or lower relay.max_in_flight",
                self.database.pool_size, self.relay.max_in_flight
            )));
        }
        Ok(())
    }

    /// The connections the relay's pool must hold so that nothing waits for one: one per batch in
    /// flight (its claim stays open while the batch is published and settled), one for the
    /// statistics task, one for the readiness check, one for the NOTIFY listener when
    /// `database.notify` is on, and one for the automatic cleanup when it runs.
    pub fn pool_connections_needed(&self) -> u32 {
        txoutbox_postgres::ops::RelayService::connections_needed(&self.relay, &self.ops())
            // The listener's connection, unless it comes from database.direct_url's pool.
            .saturating_add(u32::from(
                self.database.notify && self.database.direct_url.is_none(),
            ))
    }

    /// The configuration as TOML, secrets redacted (for `outbox config`).
    /// (Derived values, such as the liveness timeout when unset, are shown as they are in force.)
    pub fn to_redacted_toml(&self) -> String {
        let mut shown = self.clone();
        shown.database.url = txoutbox_postgres::redact_url(&shown.database.url);
        shown.database.direct_url = shown
            .database
            .direct_url
            .as_deref()
            .map(txoutbox_postgres::redact_url);
        // The value in force, also when it is derived from the relay's settings.
        shown.http.liveness_timeout = Some(self.liveness_timeout());
        adapters::amqp::ADAPTER.redact(&mut shown.amqp);
        adapters::kafka::ADAPTER.redact(&mut shown.kafka);
        adapters::sqs::ADAPTER.redact(&mut shown.sqs);
        toml::to_string_pretty(&shown).unwrap_or_else(|e| format!("# cannot render: {e}"))
    }

    /// The adapter of `kind` with its section of this configuration.
    pub fn adapter(&self, kind: PublisherType) -> Box<dyn Configured + '_> {
        match kind {
            PublisherType::Stdout => Box::new(Bound::new(&adapters::stdout::ADAPTER, &())),
            PublisherType::Amqp => Box::new(Bound::new(&adapters::amqp::ADAPTER, &self.amqp)),
            PublisherType::Kafka => Box::new(Bound::new(&adapters::kafka::ADAPTER, &self.kafka)),
            PublisherType::Sqs => Box::new(Bound::new(&adapters::sqs::ADAPTER, &self.sqs)),
        }
    }
}
