//! The adapter table: every publisher the binary knows, each in a module of its own that holds its
//! configuration section, its publisher builder and its benchmark destination.
//!
//! An adapter implements [`Adapter`] over its own section and never sees the rest of the
//! configuration. The configuration binds each to its section (`Config::adapter`), giving a
//! [`Configured`] adapter that callers choose at run time by `publisher.type` or `--broker`.
//!
//! Adding a broker takes its crate, a module here implementing [`Named`] and [`Adapter`] (with a
//! `Section` type and an `ADAPTER` value), its feature in `Cargo.toml`, a [`PublisherType`] variant
//! mapped in [`adapter`], and in the configuration its field, its arm in `Config::adapter` and its
//! line in `Config::to_redacted_toml`. An adapter left out of the build is an [`Absent`] one: its
//! section is still accepted (so one configuration file serves every build) and selecting it is a
//! configuration error that names the missing feature.

use std::sync::Arc;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use txoutbox_core::format::Formatter;
use txoutbox_core::{Error, Publisher};

use crate::target::{BenchTarget, Progress, TargetOptions};

pub mod stdout;

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(not(feature = "amqp"))]
pub mod amqp {
    //! RabbitMQ: not in this build (feature `amqp`).
    /// `[amqp]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent { name: "amqp" };
}

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(not(feature = "kafka"))]
pub mod kafka {
    //! Kafka: not in this build (feature `kafka`).
    /// `[kafka]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent { name: "kafka" };
}

#[cfg(feature = "sqs")]
pub mod sqs;
#[cfg(not(feature = "sqs"))]
pub mod sqs {
    //! Amazon SQS: not in this build (feature `sqs`).
    /// `[sqs]`, kept as written.
    pub type Section = Option<serde_json::Value>;
    /// The placeholder.
    pub static ADAPTER: super::Absent = super::Absent { name: "sqs" };
}

/// Which publisher the relay uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[derive(schemars::JsonSchema)]
pub enum PublisherType {
    /// JSON lines on standard output (the default: needs no broker).
    #[default]
    Stdout,
    /// RabbitMQ, settings in `[amqp]`.
    Amqp,
    /// Kafka, settings in `[kafka]`.
    Kafka,
    /// Amazon SQS, settings in `[sqs]`.
    Sqs,
}

impl PublisherType {
    /// Its adapter's name, as in `publisher.type` and `--broker`.
    pub fn name(self) -> &'static str {
        adapter(self).name()
    }
}

/// Every publisher type, in the order they are listed to users.
pub const ALL: [PublisherType; 4] = [
    PublisherType::Stdout,
    PublisherType::Amqp,
    PublisherType::Kafka,
    PublisherType::Sqs,
];

/// The adapter of a publisher type.
pub fn adapter(kind: PublisherType) -> &'static dyn Named {
    match kind {
        PublisherType::Stdout => &stdout::ADAPTER,
        PublisherType::Amqp => &amqp::ADAPTER,
        PublisherType::Kafka => &kafka::ADAPTER,
        PublisherType::Sqs => &sqs::ADAPTER,
    }
}

/// The publisher type named `name` (as in `publisher.type` or `--broker`), built into this binary
/// or not.
pub fn by_name(name: &str) -> Option<PublisherType> {
    ALL.into_iter().find(|kind| adapter(*kind).name() == name)
}

/// The names of the publishers this binary includes.
pub fn available() -> Vec<&'static str> {
    ALL.into_iter()
        .map(adapter)
        .filter(|a| a.built())
        .map(|a| a.name())
        .collect()
}

/// An adapter as the table lists it, whatever its section: its name and whether this build
/// includes it.
pub trait Named: Sync {
    /// Its name in `publisher.type`, `--broker` and the configuration section.
    fn name(&self) -> &'static str;

    /// Whether this build includes it.
    fn built(&self) -> bool {
        true
    }
}

/// One publisher the binary can run: its section of the configuration, the publisher built from it,
/// and the benchmark's own destination on its broker.
#[async_trait]
pub trait Adapter: Named {
    /// Its section of the configuration (`[amqp]`...; `()` for one that has none).
    type Section: Section;

    /// Checks its section.
    ///
    /// # Errors
    /// A config error naming the key, or the missing feature for an adapter not built in.
    fn validate(&self, section: &Self::Section) -> Result<(), Error>;

    /// The publisher's own limit of one call, from its section alone (`Publisher::call_limit`);
    /// none for a publisher without one.
    fn call_limit(&self, section: &Self::Section) -> Option<txoutbox_core::CallLimit> {
        let _ = section;
        None
    }

    /// Hides the secrets of its section in `shown`, a copy to be displayed.
    fn redact(&self, shown: &mut Self::Section) {
        let _ = shown;
    }

    /// The publisher `section` describes, shaping its messages with `format` (`[publisher]`).
    ///
    /// # Errors
    /// A config error for invalid settings; a connection error when it must reach the broker first.
    async fn publisher(
        &self,
        section: &Self::Section,
        format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error>;

    /// A destination of the benchmark's own on this broker (created now, removed by
    /// [`BenchTarget::teardown`]), so a benchmark never publishes into a service's destinations.
    ///
    /// # Errors
    /// A config error when this adapter cannot be benchmarked; what the broker reports otherwise.
    async fn bench_target(
        &self,
        section: &Self::Section,
        options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error>;
}

/// An adapter with its section of a configuration, one type whatever the section's: what callers
/// that choose the adapter at run time (`publisher.type`, `--broker`) use.
#[async_trait]
pub trait Configured: Named {
    /// Checks the section ([`Adapter::validate`]).
    ///
    /// # Errors
    /// A config error naming the key, or the missing feature for an adapter not built in.
    fn validate(&self) -> Result<(), Error>;

    /// The publisher's own limit of one call ([`Adapter::call_limit`]).
    fn call_limit(&self) -> Option<txoutbox_core::CallLimit>;

    /// The publisher the section describes ([`Adapter::publisher`]).
    ///
    /// # Errors
    /// A config error for invalid settings; a connection error when it must reach the broker first.
    async fn publisher(&self, format: Formatter) -> Result<Arc<dyn Publisher>, Error>;

    /// The benchmark's own destination on this broker ([`Adapter::bench_target`]).
    ///
    /// # Errors
    /// A config error when this adapter cannot be benchmarked; what the broker reports otherwise.
    async fn bench_target(
        &self,
        options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error>;
}

/// An adapter bound to its section: its [`Configured`] form.
#[derive(Debug)]
pub struct Bound<'a, A: Adapter> {
    adapter: &'a A,
    section: &'a A::Section,
}

impl<'a, A: Adapter> Bound<'a, A> {
    /// `adapter` with `section`.
    pub fn new(adapter: &'a A, section: &'a A::Section) -> Self {
        Bound { adapter, section }
    }
}

impl<A: Adapter> Named for Bound<'_, A> {
    fn name(&self) -> &'static str {
        self.adapter.name()
    }

    fn built(&self) -> bool {
        self.adapter.built()
    }
}

#[async_trait]
impl<'a, A: Adapter> Configured for Bound<'a, A> {
    fn validate(&self) -> Result<(), Error> {
        self.adapter.validate(self.section)
    }

    fn call_limit(&self) -> Option<txoutbox_core::CallLimit> {
        self.adapter.call_limit(self.section)
    }

    async fn publisher(&self, format: Formatter) -> Result<Arc<dyn Publisher>, Error> {
        self.adapter.publisher(self.section, format).await
    }

    async fn bench_target(
        &self,
        options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        self.adapter
            .bench_target(self.section, options, progress)
            .await
    }
}

/// The configuration section of an adapter (its `Section` type).
pub trait Section:
    Serialize + DeserializeOwned + Default + Clone + PartialEq + std::fmt::Debug + Send + Sync
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

/// The section of an adapter that has none.
impl Section for () {}

/// `skip_serializing_if` for adapter sections.
pub(crate) fn is_unset<S: Section>(section: &S) -> bool {
    section.is_unset()
}

/// An adapter this binary was built without: its section is kept as written.
#[derive(Debug, Clone, Copy)]
pub struct Absent {
    /// The adapter's name (and feature).
    pub name: &'static str,
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
                if txoutbox_core::redact::is_secret_name(key) {
                    *v = Value::String("***".into());
                } else {
                    redact_value(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(redact_value),
        Value::String(text) => *text = txoutbox_core::redact::redact_url(text),
        _ => {}
    }
}

impl Named for Absent {
    fn name(&self) -> &'static str {
        self.name
    }

    fn built(&self) -> bool {
        false
    }
}

#[async_trait]
impl Adapter for Absent {
    type Section = Option<Value>;

    fn validate(&self, _section: &Option<Value>) -> Result<(), Error> {
        Err(self.not_built())
    }

    fn redact(&self, shown: &mut Option<Value>) {
        if let Some(section) = shown {
            redact_value(section);
        }
    }

    async fn publisher(
        &self,
        _section: &Option<Value>,
        _format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error> {
        Err(self.not_built())
    }

    async fn bench_target(
        &self,
        _section: &Option<Value>,
        _options: &TargetOptions,
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
