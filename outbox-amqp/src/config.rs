//! Settings of the AMQP publisher, with documented defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{duration, Error};

/// The default broker URL (a local RabbitMQ with its default account).
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The default exchange.
pub const DEFAULT_EXCHANGE: &str = "outbox.events";
/// The default routing key template: the event type.
pub const DEFAULT_ROUTING_KEY: &str = "{event_type}";

/// The kind of exchange declared at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum ExchangeType {
    /// Routing keys matched against binding patterns (`order.*`, `#`). The default.
    #[default]
    Topic,
    /// Exact routing-key match.
    Direct,
    /// Every bound queue gets every message.
    Fanout,
    /// Routing on headers.
    Headers,
}

/// Settings of [`crate::AmqpPublisher`].
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct AmqpConfig {
    /// Broker URL, `amqp://user:password@host:port/vhost` (`amqps://` for TLS). Default
    /// `amqp://guest:guest@127.0.0.1:5672/%2f`. The password is never logged.
    pub url: String,
    /// A CA certificate file (PEM) to trust for `amqps://` besides the public web roots: the
    /// private or provider CA that signed the broker's certificate (Amazon MQ, a corporate CA).
    /// Default: unset, only the public roots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Exchange events are published to. Default `outbox.events`. An event's own `destination`
    /// (set by the writer) names another exchange for that event.
    pub exchange: String,
    /// Type of the exchange when it is declared. Default `topic`.
    pub exchange_type: ExchangeType,
    /// Declare the exchange (durable) at start-up. When false the exchange must already exist, and a
    /// missing one is reported (events wait, retrying, until it exists). Default true.
    pub declare_exchange: bool,
    /// Routing key template over `{aggregate_type}`, `{aggregate_id}`, `{event_type}`. Default `{event_type}`.
    pub routing_key: String,
    /// Publish as `mandatory`, so that a message no queue is bound for comes back as a failure
    /// instead of vanishing. Default true.
    pub mandatory: bool,
    /// Treat an unroutable (returned) message as retryable instead of permanent (dead-lettered).
    /// Default false.
    pub unroutable_is_retryable: bool,
    /// Persistent delivery mode (survives a broker restart in durable queues). Default true.
    pub persistent: bool,
    /// Largest message body accepted; larger events fail permanently without being sent. Default
    /// 128 MiB, RabbitMQ's default `max_message_size`.
    pub max_message_bytes: usize,
    /// Time allowed to connect and open the channel. Default 10 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub connect_timeout: Duration,
    /// Time allowed for the broker to confirm a batch; unconfirmed events then fail (retryably) and
    /// the channel is reopened. Default 30 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub confirm_timeout: Duration,
    /// First pause before reconnecting after a connection failure (it doubles). Default 500 ms.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub reconnect_initial_backoff: Duration,
    /// Longest pause between reconnection attempts. Default 30 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub reconnect_max_backoff: Duration,
    /// Destinations events may name besides the configured exchange: names or patterns where `*`
    /// matches any run of characters (`["*"]` allows every exchange). An event whose destination is
    /// neither is dead-lettered with an error naming this setting (permission denied), never sent:
    /// anyone who can write to the outbox could otherwise reach any exchange the relay's credentials
    /// reach. Default: none (the configured exchange only).
    #[serde(default)]
    pub allowed_destinations: Vec<String>,
    /// The header prefix of CloudEvents attributes in binary mode (`publisher.format =
    /// "cloudevents-binary"`): `cloudEvents_` (the AMQP protocol binding, read by the CloudEvents SDKs'
    /// AMQP codecs and Spring AMQP; RabbitMQ passes these headers to AMQP 1.0 consumers as
    /// application properties), `cloudEvents:` (the binding's 1.0.2 form), `ce-` (Knative's
    /// RabbitMQ binding), or `ce_` (the Kafka binding's names, for consumers that read RabbitMQ
    /// messages as they read Kafka records; no CloudEvents SDK's AMQP codec reads it). Default
    /// `cloudEvents_`.
    pub cloudevents_prefix: String,
}

/// The CloudEvents header prefixes an AMQP publisher may use (`amqp.cloudevents_prefix`).
pub const CLOUDEVENTS_PREFIXES: [&str; 4] = ["cloudEvents_", "cloudEvents:", "ce-", "ce_"];

impl Default for AmqpConfig {
    fn default() -> Self {
        AmqpConfig {
            url: DEFAULT_URL.into(),
            tls_ca_file: None,
            exchange: DEFAULT_EXCHANGE.into(),
            exchange_type: ExchangeType::Topic,
            declare_exchange: true,
            routing_key: DEFAULT_ROUTING_KEY.into(),
            mandatory: true,
            unroutable_is_retryable: false,
            persistent: true,
            max_message_bytes: 128 * 1024 * 1024,
            connect_timeout: Duration::from_secs(10),
            confirm_timeout: Duration::from_secs(30),
            reconnect_initial_backoff: Duration::from_millis(500),
            reconnect_max_backoff: Duration::from_secs(30),
            allowed_destinations: Vec::new(),
            cloudevents_prefix: CLOUDEVENTS_PREFIXES[0].into(),
        }
    }
}

pub use txoutbox_core::redact_url;

impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &redact_url(&self.url))
            .field("tls_ca_file", &self.tls_ca_file)
            .field("exchange", &self.exchange)
            .field("exchange_type", &self.exchange_type)
            .field("declare_exchange", &self.declare_exchange)
            .field("routing_key", &self.routing_key)
            .field("mandatory", &self.mandatory)
            .field("unroutable_is_retryable", &self.unroutable_is_retryable)
            .field("persistent", &self.persistent)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("reconnect_initial_backoff", &self.reconnect_initial_backoff)
            .field("reconnect_max_backoff", &self.reconnect_max_backoff)
            .field("allowed_destinations", &self.allowed_destinations)
            .field("cloudevents_prefix", &self.cloudevents_prefix)
            .finish()
    }
}

impl AmqpConfig {
    /// The publisher's own limit of one call (`Publisher::call_limit`): connecting, then checking
    /// per-event exchanges, each within `connect_timeout`; sends and confirms within
    /// `confirm_timeout`; a margin for a reset's bounded close.
    pub fn call_limit(&self) -> txoutbox_core::CallLimit {
        let margin = Duration::from_secs(5);
        txoutbox_core::CallLimit {
            limit: self.connect_timeout * 2 + self.confirm_timeout + margin,
            settings: format!(
                "2 x amqp.connect_timeout {} + amqp.confirm_timeout {} + {}",
                txoutbox_core::duration::format(self.connect_timeout),
                txoutbox_core::duration::format(self.confirm_timeout),
                txoutbox_core::duration::format(margin)
            ),
        }
    }

    /// The destinations this publisher may send to: the configured exchange and `allowed_destinations`.
    ///
    /// # Errors
    /// A config error naming `amqp.allowed_destinations` when a pattern is empty.
    pub fn allow_list(&self) -> Result<AllowList, Error> {
        AllowList::new(
            "amqp.allowed_destinations",
            self.exchange.clone(),
            &self.allowed_destinations,
        )
    }

    /// Checks the values and parses the routing key template.
    ///
    /// # Errors
    /// A config error naming the key (`amqp.<key>`), the value and what is expected.
    pub fn validate(&self) -> Result<Template, Error> {
        if !CLOUDEVENTS_PREFIXES.contains(&self.cloudevents_prefix.as_str()) {
            return Err(Error::config(format!(
                "amqp.cloudevents_prefix = {:?}: expected one of {CLOUDEVENTS_PREFIXES:?}",
                self.cloudevents_prefix
            )));
        }
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(Error::config(format!(
                "amqp.url = {:?}: expected amqp://user:password@host:port/vhost (or amqps:// for TLS)",
                redact_url(&self.url)
            )));
        }
        if let Some(path) = &self.tls_ca_file {
            if !self.url.starts_with("amqps://") {
                return Err(Error::config(
                    "amqp.tls_ca_file is set but amqp.url is amqp:// (plain): use amqps://host:5671/vhost for TLS, or unset amqp.tls_ca_file",
                ));
            }
            txoutbox_core::tls::read_ca_file(path, "amqp.tls_ca_file")?;
        }
        if self.exchange.len() > 255 {
            return Err(Error::config(format!(
                "amqp.exchange is {} bytes long: expected at most 255",
                self.exchange.len()
            )));
        }
        if self.exchange.is_empty() && self.declare_exchange {
            return Err(Error::config(
                "amqp.exchange = \"\" (the default exchange) cannot be declared: set amqp.declare_exchange = false to publish straight to queues named by the routing key",
            ));
        }
        if self.max_message_bytes == 0 {
            return Err(Error::config(
                "amqp.max_message_bytes = 0: expected a positive size in bytes",
            ));
        }
        for (key, d) in [
            ("amqp.connect_timeout", self.connect_timeout),
            ("amqp.confirm_timeout", self.confirm_timeout),
            (
                "amqp.reconnect_initial_backoff",
                self.reconnect_initial_backoff,
            ),
        ] {
            if d.is_zero() {
                return Err(Error::config(format!(
                    "{key} = 0s: expected a positive duration"
                )));
            }
        }
        if self.reconnect_max_backoff < self.reconnect_initial_backoff {
            return Err(Error::config(
                "amqp.reconnect_max_backoff is below amqp.reconnect_initial_backoff: expected max >= initial",
            ));
        }
        self.allow_list()?;
        Template::parse("amqp.routing_key", &self.routing_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact_url("amqp://guest:s3cret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        let c = AmqpConfig {
            url: "amqps://app:hunter2@mq.internal/prod".into(),
            ..AmqpConfig::default()
        };
        let debug = format!("{c:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("app:***@mq.internal"), "{debug}");
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |c: AmqpConfig| c.validate().unwrap_err().message().to_string();
        assert!(bad(AmqpConfig {
            url: "http://x".into(),
            ..AmqpConfig::default()
        })
        .starts_with("amqp.url"));
        assert!(bad(AmqpConfig {
            routing_key: "{nope}".into(),
            ..AmqpConfig::default()
        })
        .starts_with("amqp.routing_key"));
        assert!(bad(AmqpConfig {
            exchange: String::new(),
            ..AmqpConfig::default()
        })
        .contains("amqp.declare_exchange"));
        assert!(bad(AmqpConfig {
            confirm_timeout: Duration::ZERO,
            ..AmqpConfig::default()
        })
        .starts_with("amqp.confirm_timeout"));
        assert!(AmqpConfig::default().validate().is_ok());
    }

    #[test]
    fn deserialises_with_defaults_and_rejects_unknown_keys() {
        let c: AmqpConfig = serde_json::from_value(
            serde_json::json!({"exchange": "orders", "confirm_timeout": "5s"}),
        )
        .unwrap();
        assert_eq!(c.exchange, "orders");
        assert_eq!(c.confirm_timeout, Duration::from_secs(5));
        assert_eq!(c.routing_key, DEFAULT_ROUTING_KEY);
        let err =
            serde_json::from_value::<AmqpConfig>(serde_json::json!({"exchnage": "x"})).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `exchnage`"),
            "{err}"
        );
    }
}
