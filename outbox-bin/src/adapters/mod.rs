//! The adapter table: every publisher the binary knows, each in a module of its own that holds its
//! configuration section, its publisher builder and its benchmark destination.
//!
//! Adding a broker takes its crate, a module here implementing [`Adapter`] (with a `Section` type and
//! an `ADAPTER` value), its feature in `Cargo.toml`, a [`PublisherType`] variant mapped in [`adapter`],
//! and its `Config` field. An adapter left out of the build is an [`Absent`] one: its section is still
//! accepted (so one configuration file serves every build) and selecting it is a configuration error
//! that names the missing feature.

use std::sync::Arc;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use outbox_core::{Error, Publisher};

use crate::bench::engine::{BenchTarget, DiscardTarget};
use crate::bench::BenchArgs;
use crate::config::{Config, PublisherType};

pub mod stdout;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(not(feature = "amqp"))]
pub mod amqp {
    //! RabbitMQ: not in this build (feature `amqp`).
    /// `[amqp]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent {
        name: "amqp",
        section: |config| &mut config.amqp,
    };
}

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(not(feature = "kafka"))]
pub mod kafka {
    //! Kafka: not in this build (feature `kafka`).
    /// `[kafka]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent {
        name: "kafka",
        section: |config| &mut config.kafka,
    };
}

#[cfg(feature = "sqs")]
pub mod sqs;
#[cfg(not(feature = "sqs"))]
pub mod sqs {
    //! Amazon SQS: not in this build (feature `sqs`).
    /// `[sqs]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent {
        name: "sqs",
        section: |config| &mut config.sqs,
    };
}

/// Every publisher type, in the order they are listed to users.
pub const ALL: [PublisherType; 4] = [
    PublisherType::Stdout,
    PublisherType::Amqp,
    PublisherType::Kafka,
    PublisherType::Sqs,
];

/// The adapter of a publisher type.
pub fn adapter(kind: PublisherType) -> &'static dyn Adapter {
    match kind {
        PublisherType::Stdout => &stdout::ADAPTER,
        PublisherType::Amqp => &amqp::ADAPTER,
        PublisherType::Kafka => &kafka::ADAPTER,
        PublisherType::Sqs => &sqs::ADAPTER,
    }
}

/// The adapter named `name` (as in `publisher.type` or `--broker`), built into this binary or not.
pub fn by_name(name: &str) -> Option<&'static dyn Adapter> {
    ALL.into_iter().map(adapter).find(|a| a.name() == name)
}

/// The names of the publishers this binary includes.
pub fn available() -> Vec<&'static str> {
    ALL.into_iter()
        .map(adapter)
        .filter(|a| a.built())
        .map(|a| a.name())
        .collect()
}

/// The benchmark's destination: `--broker` (`discard`, the database's ceiling, or an adapter's
/// name), else the configured publisher's.
///
/// # Errors
/// A config error for an unknown broker, one not in this build, or the standard output; what the
/// broker reports when the destination cannot be made.
pub async fn bench_target(
    config: &Config,
    args: &BenchArgs,
    progress: &Progress,
) -> Result<Box<dyn BenchTarget>, Error> {
    let adapter = match args.broker.as_deref() {
        Some("discard") => return Ok(Box::new(DiscardTarget)),
        Some(name) => by_name(name).ok_or_else(|| {
            Error::config(format!(
                "--broker {name:?}: expected one of {}, or discard",
                available().join(", ")
            ))
        })?,
        None => adapter(config.publisher.kind),
    };
    adapter.bench_target(config, args, progress).await
}

/// One publisher the binary can run: its section of the configuration, the publisher built from it,
/// and the benchmark's own destination on its broker.
#[async_trait]
pub trait Adapter: Sync {
    /// Its name in `publisher.type`, `--broker` and the configuration section.
    fn name(&self) -> &'static str;

    /// Whether this build includes it.
    fn built(&self) -> bool {
        true
    }

    /// Checks its section of `config`.
    ///
    /// # Errors
    /// A config error naming the key, or the missing feature for an adapter not built in.
    fn validate(&self, config: &Config) -> Result<(), Error>;

    /// Hides the secrets of its section in `shown`, a copy of the configuration to be displayed.
    fn redact(&self, shown: &mut Config) {
        let _ = shown;
    }

    /// The publisher `config` describes.
    ///
    /// # Errors
    /// A config error for invalid settings; a connection error when it must reach the broker first.
    async fn publisher(&self, config: &Config) -> Result<Arc<dyn Publisher>, Error>;

    /// A destination of the benchmark's own on this broker (created now, removed by
    /// [`BenchTarget::teardown`]), so a benchmark never publishes into a service's destinations.
    ///
    /// # Errors
    /// A config error when this adapter cannot be benchmarked; what the broker reports otherwise.
    async fn bench_target(
        &self,
        config: &Config,
        args: &BenchArgs,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error>;
}

/// Where the benchmark's progress lines go.
pub type Progress = dyn for<'a> Fn(&'a str) + Send + Sync;

/// The configuration section of an adapter (its `Section` type).
pub trait Section:
    Serialize + DeserializeOwned + Default + Clone + PartialEq + std::fmt::Debug
{
    /// True when the section is not worth showing (an absent adapter's section that was not given).
    fn is_unset(&self) -> bool {
        false
    }
}

impl Section for Option<Value> {
    fn is_unset(&self) -> bool {
        self.is_none()
    }
}

/// `skip_serializing_if` for adapter sections.
pub(crate) fn is_unset<S: Section>(section: &S) -> bool {
    section.is_unset()
}

/// An adapter this binary was built without: its section is kept as written.
#[derive(Debug, Clone, Copy)]
pub struct Absent {
    /// The adapter's name (and feature).
    pub name: &'static str,
    /// Its section of the configuration.
    pub section: fn(&mut Config) -> &mut Option<Value>,
}

impl Absent {
    fn not_built(&self) -> Error {
        let name = self.name;
        Error::config(format!(
            "\"{name}\": this outbox binary was built without the `{name}` feature (build it with \
             `--features {name}`); expected one of {}",
            available().join(", ")
        ))
    }
}

/// Hides, in a section kept as written, every value of a key whose name says it is a secret and the
/// passwords of every URL.
fn redact_value(value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                if outbox_core::redact::is_secret_name(key) {
                    *v = Value::String("***".into());
                } else {
                    redact_value(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact_value),
        Value::String(text) => *text = outbox_core::redact::redact_url(text),
        _ => {}
    }
}

#[async_trait]
impl Adapter for Absent {
    fn name(&self) -> &'static str {
        self.name
    }

    fn built(&self) -> bool {
        false
    }

    fn validate(&self, _config: &Config) -> Result<(), Error> {
        Err(self.not_built())
    }

    fn redact(&self, shown: &mut Config) {
        if let Some(section) = (self.section)(shown) {
            redact_value(section);
        }
    }

    async fn publisher(&self, _config: &Config) -> Result<Arc<dyn Publisher>, Error> {
        Err(self.not_built())
    }

    async fn bench_target(
        &self,
        _config: &Config,
        _args: &BenchArgs,
        _progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        Err(self.not_built())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_kept_as_written_shows_no_secret() {
        let mut section = serde_json::json!({
            "url": "amqp://relay:s3cret@rabbit:5672/%2f",
            "properties": {"sasl.password": "hunter2", "sasl.mechanism": "PLAIN"},
            "brokers": ["kafka://user:pw@k1:9092"],
        });
        redact_value(&mut section);
        let text = section.to_string();
        for secret in ["s3cret", "hunter2", ":pw@"] {
            assert!(!text.contains(secret), "{secret} in {text}");
        }
        assert!(text.contains("PLAIN") && text.contains("rabbit"), "{text}");
    }

    #[test]
    fn every_type_has_its_adapter_under_its_own_name() {
        for kind in ALL {
            let name = serde_json::to_value(kind).unwrap();
            assert_eq!(Some(adapter(kind).name()), name.as_str(), "{kind:?}");
            assert_eq!(
                by_name(adapter(kind).name()).map(|a| a.name()),
                name.as_str()
            );
        }
        assert!(by_name("nats").is_none());
        assert_eq!(available().first(), Some(&"stdout"));
        assert_eq!(available().contains(&"amqp"), cfg!(feature = "amqp"));
        assert_eq!(available().contains(&"kafka"), cfg!(feature = "kafka"));
        assert_eq!(available().contains(&"sqs"), cfg!(feature = "sqs"));
    }
}
