//! The sections of the configuration that belong to the binary itself: `[publisher]` (which
//! adapter, and the shape of its messages), `[http]` (the operations endpoint) and `[log]`. The
//! library crates define `[database]`, `[relay]` and `[wal]`; each adapter defines its own.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use txoutbox_core::format::{Formatter, MessageFormat, DEFAULT_CLOUDEVENTS_SOURCE};
use txoutbox_core::{duration, Error};

use crate::adapters::PublisherType;

/// `[publisher]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct PublisherSection {
    /// `stdout` (default), `amqp`, `kafka` or `sqs`; the broker's own settings are in its section
    /// ([`crate::adapters`] maps each to its adapter).
    #[serde(rename = "type")]
    pub kind: PublisherType,
    /// The shape of the messages (brokers only; [`txoutbox_core::format`]): `outbox` (default),
    /// `cloudevents-binary`, `cloudevents-structured` or `debezium`.
    pub format: MessageFormat,
    /// The CloudEvents `source` attribute, a template with `{aggregate_type}`, `{event_type}`,
    /// `{aggregate_id}`. Default `/outbox/{aggregate_type}`.
    pub cloudevents_source: String,
}

impl Default for PublisherSection {
    fn default() -> Self {
        PublisherSection {
            kind: PublisherType::default(),
            format: MessageFormat::default(),
            cloudevents_source: DEFAULT_CLOUDEVENTS_SOURCE.into(),
        }
    }
}

impl PublisherSection {
    /// The formatter of `format` and `cloudevents_source`.
    ///
    /// # Errors
    /// A config error naming `publisher.cloudevents_source` when the template does not parse, or
    /// `publisher.format` when the stdout publisher is asked for another format than `outbox`.
    pub fn formatter(&self) -> Result<Formatter, Error> {
        if self.kind == PublisherType::Stdout && self.format != MessageFormat::Outbox {
            return Err(Error::config(format!(
                "publisher.format = \"{}\" applies to brokers; the stdout publisher prints each event as a JSON line: remove it or choose publisher.type = \"amqp\", \"kafka\" or \"sqs\"",
                self.format
            )));
        }
        Formatter::new(
            self.format,
            "publisher.cloudevents_source",
            &self.cloudevents_source,
        )
    }
}

/// `[http]`: metrics and health endpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct HttpConfig {
    /// Serve `/metrics`, `/healthz` and `/readyz` while the relay runs. Default true.
    pub enabled: bool,
    /// Listen address. Default `127.0.0.1:9464`.
    pub listen: SocketAddr,
    /// How often the outbox is counted for the pending / age / dead-letter gauges. Default 5 s.
    #[schemars(with = "String", extend("format" = "duration"))]
    #[serde(with = "duration::serde_str")]
    pub stats_interval: Duration,
    /// Time a `/readyz` probe waits for the readiness check (one check runs at a time, its result
    /// reused for 1 s). Default 2 s.
    #[schemars(with = "String", extend("format" = "duration"))]
    #[serde(with = "duration::serde_str")]
    pub ready_timeout: Duration,
    /// `/healthz` answers 503 once the relay has, for this long, neither settled a batch nor found
    /// nothing to claim nor checked an unreachable broker, while the oldest pending event is older
    /// than this: a wedged relay, for the orchestrator to restart. Must exceed the relay's hold time
    /// (2 x `relay.publish_timeout` + 10 s), the longest a healthy batch may take. Default (unset):
    /// the larger of 5 min and the hold time + 1 min
    /// ([`Config::liveness_timeout`](super::Config::liveness_timeout)).
    #[schemars(with = "Option<String>", extend("format" = "duration"))]
    #[serde(
        default,
        with = "duration::serde_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub liveness_timeout: Option<Duration>,
    /// Distinct `event_type` label values per metric (`outbox_events_failed`,
    /// `outbox_events_pending_by_type`); further types count under `event_type="other"`, so that
    /// writers inserting ever new types cannot grow `/metrics` without bound. Default 100.
    pub max_event_type_labels: usize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            stats_interval: Duration::from_secs(5),
            ready_timeout: Duration::from_secs(2),
            liveness_timeout: None,
            max_event_type_labels: txoutbox_postgres::ops::DEFAULT_MAX_EVENT_TYPE_LABELS,
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(schemars::JsonSchema)]
pub enum LogFormat {
    /// Human-readable text (the default).
    #[default]
    Text,
    /// One JSON object per line, fields included.
    Json,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct LogConfig {
    /// `text` (default) or `json`.
    pub format: LogFormat,
    /// A tracing filter: `info` (default), `debug`, `txoutbox_core=debug,info`... `RUST_LOG` wins.
    pub level: String,
}

impl LogConfig {
    /// Checks `level`: each comma-separated directive is a level (`trace`, `debug`, `info`, `warn`,
    /// `error`, `off`) alone or for a target (`txoutbox_core=debug`). Anything else would be read as
    /// the name of a target to trace, leaving every other target silent.
    ///
    /// # Errors
    /// A config error naming the directive and the forms expected.
    pub fn validate(&self) -> Result<(), Error> {
        const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
        for directive in self
            .level
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
        {
            let level = directive
                .rsplit_once('=')
                .map_or(directive, |(_, l)| l)
                .trim();
            let known = LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level))
                || matches!(level, "0" | "1" | "2" | "3" | "4" | "5");
            if !known {
                return Err(Error::config(format!(
                    "log.level = {:?}: {directive:?} is not a level: expected trace, debug, info, \
                     warn, error or off, alone or for a target (such as \"txoutbox_core=debug,info\")",
                    self.level
                )));
            }
        }
        Ok(())
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}
