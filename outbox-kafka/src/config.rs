//! Settings of the Kafka publisher, with documented defaults.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{duration, Error};

/// The default bootstrap servers: a local broker.
pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
/// The default topic template, as Debezium's outbox router names topics.
pub const DEFAULT_TOPIC: &str = "outbox.event.{aggregate_type}";

/// Settings of [`crate::KafkaPublisher`].
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Section")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port]`. Default `127.0.0.1:9092`.
    pub brokers: String,
    /// Topic template over `{aggregate_type}`, `{aggregate_id}`, `{event_type}`. Default
    /// `outbox.event.{aggregate_type}`. An event's own destination names its topic instead.
    pub topic: String,
    /// `acks`: `all` (default), `1` or `0`. Idempotence requires `all`.
    pub acks: String,
    /// Idempotent producer: no duplicates or reordering from producer retries, and no gap in what
    /// is written (`enable.gapless.guarantee`), so that an aggregate's run of events goes to the
    /// broker in one call ([`txoutbox_core::Publisher::keeps_order`]). Default true; without it, an
    /// aggregate's next event is sent only once the one before is acknowledged.
    pub idempotence: bool,
    /// `max.in.flight.requests.per.connection`: at most 5 with idempotence (order kept). Default 5.
    pub max_in_flight: u32,
    /// `compression.type`: `none` (default), `gzip`, `snappy`, `lz4` or `zstd`.
    pub compression: String,
    /// `linger.ms`: time the producer waits to fill a batch. Default 5.
    pub linger_ms: u32,
    /// `message.max.bytes`: larger messages fail permanently, without being sent. Default 1000000.
    pub max_message_bytes: usize,
    /// Time an event may take to be acknowledged, retries included; then the publish call reports
    /// it failed (retryably). Default 30 s. With the idempotent producer the call itself bounds the
    /// wait and librdkafka's `message.timeout.ms` is infinite: a record reported failed may still be
    /// written once the broker answers (a duplicate; the aggregate's next event is sent only once
    /// this one is acknowledged or dead-lettered, so only a dead-lettered event's copy can land after
    /// it). The producer is replaced, dropping what it still holds, when two calls in a row time out
    /// entirely, when it holds 20,000 records (or twice a call's) after a call with timeouts, or
    /// when its queue takes none of a call's records within `enqueue_timeout`. Without
    /// idempotence, this is `message.timeout.ms`.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub delivery_timeout: Duration,
    /// How long one publish call waits, in all, for room in the producer's local queue before reporting back-pressure
    /// (the relay then retries the event shortly, without counting an attempt). Default 5 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub enqueue_timeout: Duration,
    /// Any other librdkafka producer property, passed through as is: `security.protocol`,
    /// `sasl.mechanisms`, `sasl.username`, `sasl.password`, `ssl.ca.location`... Values of keys that
    /// look secret (`password`, `secret`, `key`) are never logged.
    pub properties: BTreeMap<String, String>,
    /// Destinations events may name besides the configured topic: names or patterns where `*`
    /// matches any run of characters (`["*"]` allows every topic). An event whose destination is
    /// neither is dead-lettered with an error naming this setting (permission denied), never sent:
    /// anyone who can write to the outbox could otherwise reach any topic the relay's credentials
    /// reach. Default: none (the configured topic only).
    pub allowed_destinations: Vec<String>,
}

/// The `[kafka]` section as written: [`KafkaConfig`]'s keys, and the former names of renamed keys,
/// each refused with an error naming its new name (not serde's unknown-field error). Unknown keys
/// are refused as in every section. Its fields are [`KafkaConfig`]'s: both conversions name every
/// field, so one added to either and not to the other does not compile.
#[derive(Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(default, deny_unknown_fields)]
struct Section {
    brokers: String,
    topic: String,
    acks: String,
    idempotence: bool,
    max_in_flight: u32,
    compression: String,
    linger_ms: u32,
    max_message_bytes: usize,
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    delivery_timeout: Duration,
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    enqueue_timeout: Duration,
    properties: BTreeMap<String, String>,
    allowed_destinations: Vec<String>,
    /// The old name of `max_message_bytes`: refused.
    #[serde(deserialize_with = "renamed_to_max_message_bytes")]
    message_max_bytes: (),
}

/// Refuses `kafka.message_max_bytes`, whatever its value: the key is `kafka.max_message_bytes`, as
/// in the other adapters (`amqp.max_message_bytes`, `sqs.max_message_bytes`).
fn renamed_to_max_message_bytes<'de, D: Deserializer<'de>>(_: D) -> Result<(), D::Error> {
    Err(D::Error::custom(
        "kafka.message_max_bytes was renamed: use kafka.max_message_bytes",
    ))
}

impl Default for Section {
    fn default() -> Self {
        let KafkaConfig {
            brokers,
            topic,
            acks,
            idempotence,
            max_in_flight,
            compression,
            linger_ms,
            max_message_bytes,
            delivery_timeout,
            enqueue_timeout,
            properties,
            allowed_destinations,
        } = KafkaConfig::default();
        Section {
            brokers,
            topic,
            acks,
            idempotence,
            max_in_flight,
            compression,
            linger_ms,
            max_message_bytes,
            delivery_timeout,
            enqueue_timeout,
            properties,
            allowed_destinations,
            message_max_bytes: (),
        }
    }
}

impl From<Section> for KafkaConfig {
    fn from(section: Section) -> Self {
        let Section {
            brokers,
            topic,
            acks,
            idempotence,
            max_in_flight,
            compression,
            linger_ms,
            max_message_bytes,
            delivery_timeout,
            enqueue_timeout,
            properties,
            allowed_destinations,
            message_max_bytes: (),
        } = section;
        KafkaConfig {
            brokers,
            topic,
            acks,
            idempotence,
            max_in_flight,
            compression,
            linger_ms,
            max_message_bytes,
            delivery_timeout,
            enqueue_timeout,
            properties,
            allowed_destinations,
        }
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: DEFAULT_BROKERS.into(),
            topic: DEFAULT_TOPIC.into(),
            acks: "all".into(),
            idempotence: true,
            max_in_flight: 5,
            compression: "none".into(),
            linger_ms: 5,
            max_message_bytes: 1_000_000,
            delivery_timeout: Duration::from_secs(30),
            enqueue_timeout: Duration::from_secs(5),
            properties: BTreeMap::new(),
            allowed_destinations: Vec::new(),
        }
    }
}

/// True for property names whose values must not be shown (`sasl.password`,
/// `sasl.oauthbearer.config`, `ssl.key.pem`...): the toolkit's rule, [`txoutbox_core::redact::is_secret_name`].
pub fn is_secret(key: &str) -> bool {
    txoutbox_core::redact::is_secret_name(key)
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let props: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("acks", &self.acks)
            .field("idempotence", &self.idempotence)
            .field("max_in_flight", &self.max_in_flight)
            .field("compression", &self.compression)
            .field("linger_ms", &self.linger_ms)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("enqueue_timeout", &self.enqueue_timeout)
            .field("properties", &props)
            .field("allowed_destinations", &self.allowed_destinations)
            .finish()
    }
}

/// Properties the dedicated keys own: setting them in `properties` is ambiguous.
const OWNED: &[(&str, &str)] = &[
    ("bootstrap.servers", "kafka.brokers"),
    ("metadata.broker.list", "kafka.brokers"),
    ("acks", "kafka.acks"),
    ("request.required.acks", "kafka.acks"),
    ("enable.idempotence", "kafka.idempotence"),
    (
        "max.in.flight.requests.per.connection",
        "kafka.max_in_flight",
    ),
    ("max.in.flight", "kafka.max_in_flight"),
    ("compression.type", "kafka.compression"),
    ("compression.codec", "kafka.compression"),
    ("linger.ms", "kafka.linger_ms"),
    ("queue.buffering.max.ms", "kafka.linger_ms"),
    ("message.max.bytes", "kafka.max_message_bytes"),
    ("message.timeout.ms", "kafka.delivery_timeout"),
    ("delivery.timeout.ms", "kafka.delivery_timeout"),
];

/// Properties the idempotent producer's ordering depends on (see [`KafkaConfig::idempotence`]): the
/// gapless guarantee, and the retries (a record that runs out of them is not covered by it).
const IDEMPOTENCE_OWNED: &[&str] = &[
    "enable.gapless.guarantee",
    "retries",
    "message.send.max.retries",
];

/// librdkafka's bound on the bytes its producer queue holds.
const QUEUE_KBYTES: &str = "queue.buffering.max.kbytes";

/// The name librdkafka resolves a property key to, as far as the checks below need it: a topic-level
/// property may be set on the producer with a `topic.` prefix, which librdkafka strips.
fn property_name(key: &str) -> &str {
    key.trim().strip_prefix("topic.").unwrap_or(key.trim())
}

/// Time allowed, past the delivery timeout, for the delivery reports of a call to come in.
pub(crate) const REPORT_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

impl KafkaConfig {
    /// How long a metadata request of the publisher's check may take (also run by a call that
    /// finds the producer stalled): the delivery timeout, at most 10 s.
    pub fn check_timeout(&self) -> std::time::Duration {
        self.delivery_timeout
            .min(std::time::Duration::from_secs(10))
    }

    /// The publisher's own limit of one call (`Publisher::call_limit`): the enqueue and delivery
    /// timeouts, the reports' margin, and a stalled producer's metadata check.
    pub fn call_limit(&self) -> txoutbox_core::CallLimit {
        txoutbox_core::CallLimit {
            limit: self.enqueue_timeout + self.delivery_timeout + REPORT_MARGIN + self.check_timeout(),
            settings: format!(
                "kafka.enqueue_timeout {} + kafka.delivery_timeout {} + {} + a stalled producer's metadata check {}",
                txoutbox_core::duration::format(self.enqueue_timeout),
                txoutbox_core::duration::format(self.delivery_timeout),
                txoutbox_core::duration::format(REPORT_MARGIN),
                txoutbox_core::duration::format(self.check_timeout())
            ),
        }
    }

    /// The destinations this publisher may send to: the configured topic and `allowed_destinations`.
    ///
    /// # Errors
    /// A config error naming `kafka.allowed_destinations` when a pattern is empty.
    pub fn allow_list(&self) -> Result<AllowList, Error> {
        AllowList::new(
            "kafka.allowed_destinations",
            Template::parse("kafka.topic", &self.topic)?.pattern(),
            &self.allowed_destinations,
        )
    }

    /// Checks the values and parses the topic template.
    ///
    /// # Errors
    /// A config error naming the key (`kafka.<key>`), the value and what is expected.
    pub fn validate(&self) -> Result<Template, Error> {
        if self.brokers.trim().is_empty() {
            return Err(Error::config(
                "kafka.brokers is empty: expected host:port[,host:port]",
            ));
        }
        if !["all", "-1", "1", "0"].contains(&self.acks.as_str()) {
            return Err(Error::config(format!(
                "kafka.acks = {:?}: expected all, 1 or 0",
                self.acks
            )));
        }
        if self.idempotence && !["all", "-1"].contains(&self.acks.as_str()) {
            return Err(Error::config(format!(
                "kafka.acks = {:?} with kafka.idempotence = true: the idempotent producer needs acks = \"all\"",
                self.acks
            )));
        }
        if self.max_in_flight == 0 || (self.idempotence && self.max_in_flight > 5) {
            return Err(Error::config(format!(
                "kafka.max_in_flight = {}: expected 1 to 5 with the idempotent producer (more could reorder)",
                self.max_in_flight
            )));
        }
        if !["none", "gzip", "snappy", "lz4", "zstd"].contains(&self.compression.as_str()) {
            return Err(Error::config(format!(
                "kafka.compression = {:?}: expected none, gzip, snappy, lz4 or zstd",
                self.compression
            )));
        }
        if self.max_message_bytes < 1000 {
            return Err(Error::config(format!(
                "kafka.max_message_bytes = {}: expected at least 1000",
                self.max_message_bytes
            )));
        }
        if self.delivery_timeout < Duration::from_millis(100) || self.enqueue_timeout.is_zero() {
            return Err(Error::config(
                "kafka.delivery_timeout and kafka.enqueue_timeout must be positive durations (delivery_timeout at least 100ms)",
            ));
        }
        let set = |name: &str| {
            self.properties
                .iter()
                .find(|(key, _)| property_name(key) == name)
        };
        for (name, owner) in OWNED {
            if let Some((key, _)) = set(name) {
                return Err(Error::config(format!(
                    "kafka.properties.\"{key}\" is set by {owner}: set it there instead"
                )));
            }
        }
        // Every record is keyed by its aggregate id; a partitioner that ignores keys spreads an
        // aggregate's events over partitions, where no consumer sees them in order. (Every key that
        // names it: set twice, which one librdkafka applies is not fixed.)
        if let Some((key, _)) = self
            .properties
            .iter()
            .find(|(key, value)| property_name(key) == "partitioner" && value.trim() == "random")
        {
            return Err(Error::config(format!(
                "kafka.properties.\"{key}\" = \"random\" sends an aggregate's events to any \
                 partition, where Kafka cannot keep them in order: remove it (librdkafka's default, \
                 consistent_random, hashes the key) or choose a keyed partitioner (murmur2_random: \
                 the Java client's; consistent, murmur2, fnv1a and their _random forms)"
            )));
        }
        if self.idempotence {
            if let Some((key, _)) = IDEMPOTENCE_OWNED.iter().find_map(|name| set(name)) {
                return Err(Error::config(format!(
                    "kafka.properties.\"{key}\" is set with kafka.idempotence = true (an aggregate's \
                     events are written in order, without gaps, only as the idempotent producer sets it): \
                     remove it, or set kafka.idempotence = false"
                )));
            }
        }
        self.queue_holds_a_record()?;
        self.allow_list()?;
        Template::parse("kafka.topic", &self.topic)
    }

    /// The producer's queue (`queue.buffering.max.kbytes`) must hold one record of
    /// `kafka.max_message_bytes`: librdkafka answers "queue full" to a record larger than the whole
    /// queue on every try, which would hold its aggregate for ever as back-pressure.
    fn queue_holds_a_record(&self) -> Result<(), Error> {
        let Some((key, value)) = self
            .properties
            .iter()
            .find(|(key, _)| property_name(key) == QUEUE_KBYTES)
        else {
            return Ok(());
        };
        let Ok(kbytes) = value.trim().parse::<usize>() else {
            return Err(Error::config(format!(
                "kafka.properties.\"{key}\" = {value:?}: expected a number of kilobytes"
            )));
        };
        if kbytes.saturating_mul(1024) < self.max_message_bytes {
            let needed = self.max_message_bytes.div_ceil(1024);
            return Err(Error::config(format!(
                "kafka.properties.\"{key}\" = {kbytes} (KiB) holds less than one record of \
                 kafka.max_message_bytes = {}: the producer could never queue such a record; \
                 raise it to at least {needed}, or lower kafka.max_message_bytes",
                self.max_message_bytes
            )));
        }
        Ok(())
    }

    /// Whether the producer's partitioner may send a record with an empty key to any partition:
    /// librdkafka's default, `consistent_random`, does (the others hash an empty key like any other).
    /// Set under two names, either may be the one librdkafka applies.
    pub fn spreads_empty_keys(&self) -> bool {
        let mut set = self
            .properties
            .iter()
            .filter(|(key, _)| property_name(key) == "partitioner")
            .peekable();
        set.peek().is_none() || set.any(|(_, value)| value.trim() == "consistent_random")
    }

    /// The librdkafka producer properties.
    pub fn producer_properties(&self) -> BTreeMap<String, String> {
        let mut p = self.properties.clone();
        p.insert("bootstrap.servers".into(), self.brokers.clone());
        p.insert("acks".into(), self.acks.clone());
        p.insert("enable.idempotence".into(), self.idempotence.to_string());
        p.insert(
            "max.in.flight.requests.per.connection".into(),
            self.max_in_flight.to_string(),
        );
        p.insert("compression.type".into(), self.compression.clone());
        p.insert("linger.ms".into(), self.linger_ms.to_string());
        p.insert(
            "message.max.bytes".into(),
            self.max_message_bytes.to_string(),
        );
        if self.idempotence {
            // An aggregate's events go to the broker in one call, and its records must never be
            // written with a gap: librdkafka raises a fatal error (the publisher then starts a new
            // producer) rather than go on past a record the broker refused, and no message times
            // out in the producer's queue, which would let a later one be written without it (the
            // gapless guarantee does not cover that). The publish call bounds the wait itself
            // (`delivery_timeout`); what it reported failed may still be written later, in order.
            p.insert("enable.gapless.guarantee".into(), "true".into());
            p.insert("message.timeout.ms".into(), "0".into());
        } else {
            p.insert(
                "message.timeout.ms".into(),
                self.delivery_timeout.as_millis().to_string(),
            );
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_never_show() {
        let mut c = KafkaConfig::default();
        c.properties
            .insert("sasl.password".into(), "hunter2".into());
        c.properties.insert("ssl.key.password".into(), "k3y".into());
        c.properties.insert("sasl.username".into(), "relay".into());
        let d = format!("{c:?}");
        assert!(!d.contains("hunter2") && !d.contains("k3y"), "{d}");
        assert!(d.contains("relay"));
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |c: KafkaConfig| c.validate().unwrap_err().message().to_string();
        assert!(bad(KafkaConfig {
            acks: "1".into(),
            ..KafkaConfig::default()
        })
        .contains("idempotent producer needs acks"));
        assert!(bad(KafkaConfig {
            max_in_flight: 6,
            ..KafkaConfig::default()
        })
        .starts_with("kafka.max_in_flight"));
        assert!(bad(KafkaConfig {
            compression: "brotli".into(),
            ..KafkaConfig::default()
        })
        .starts_with("kafka.compression"));
        assert!(bad(KafkaConfig {
            topic: "{oops}".into(),
            ..KafkaConfig::default()
        })
        .starts_with("kafka.topic"));
        let mut c = KafkaConfig::default();
        c.properties.insert("linger.ms".into(), "1".into());
        assert!(bad(c).contains("kafka.linger_ms"));
        // A partitioner that ignores the key breaks every aggregate's order; keyed ones are fine.
        let mut c = KafkaConfig::default();
        c.properties.insert("partitioner".into(), "random".into());
        let e = bad(c.clone());
        assert!(
            e.contains("kafka.properties.\"partitioner\"") && e.contains("murmur2_random"),
            "{e}"
        );
        c.idempotence = false;
        c.acks = "1".into();
        assert!(bad(c).contains("partitioner"), "whatever the idempotence");
        let mut c = KafkaConfig::default();
        c.properties
            .insert("partitioner".into(), "murmur2_random".into());
        assert!(c.validate().is_ok());
        assert!(!c.spreads_empty_keys());
        assert!(KafkaConfig::default().spreads_empty_keys());
        let mut both = c.clone();
        both.properties
            .insert("topic.partitioner".into(), "consistent_random".into());
        assert!(
            both.spreads_empty_keys(),
            "either name may be the one applied"
        );
        c.properties
            .insert("topic.partitioner".into(), "random".into());
        assert!(
            bad(c).contains("topic.partitioner"),
            "a second name for the partitioner is checked too"
        );
        // librdkafka takes topic-level properties with a `topic.` prefix, and some under another
        // name: the checks see through both.
        for (key, value, names) in [
            ("topic.partitioner", "random", "partitioner"),
            ("topic.message.timeout.ms", "1000", "kafka.delivery_timeout"),
            (
                "topic.delivery.timeout.ms",
                "1000",
                "kafka.delivery_timeout",
            ),
            ("queue.buffering.max.ms", "1", "kafka.linger_ms"),
            ("request.required.acks", "1", "kafka.acks"),
            ("topic.compression.codec", "lz4", "kafka.compression"),
            ("message.send.max.retries", "3", "kafka.idempotence"),
        ] {
            let mut c = KafkaConfig::default();
            c.properties.insert(key.into(), value.into());
            let e = bad(c);
            assert!(e.contains(key) && e.contains(names), "{key}: {e}");
        }
        // A producer queue smaller than one record of max_message_bytes is refused, naming both
        // settings and the smallest queue that holds one.
        let mut c = KafkaConfig {
            max_message_bytes: 4_000_000,
            ..KafkaConfig::default()
        };
        c.properties
            .insert("queue.buffering.max.kbytes".into(), "2048".into());
        let e = bad(c.clone());
        assert!(
            e.contains("queue.buffering.max.kbytes")
                && e.contains("kafka.max_message_bytes = 4000000")
                && e.contains("at least 3907"),
            "{e}"
        );
        c.properties
            .insert("queue.buffering.max.kbytes".into(), "3907".into());
        assert!(c.validate().is_ok());
        c.properties
            .insert("queue.buffering.max.kbytes".into(), "lots".into());
        assert!(bad(c).contains("kilobytes"));
        // The retries belong to the idempotent producer, not to a plain one.
        let mut c = KafkaConfig::default();
        c.properties.insert("retries".into(), "3".into());
        assert!(bad(c.clone()).contains("kafka.idempotence"));
        c.idempotence = false;
        c.acks = "1".into();
        assert!(c.validate().is_ok());
        assert!(KafkaConfig {
            acks: "1".into(),
            idempotence: false,
            ..KafkaConfig::default()
        }
        .validate()
        .is_ok());
    }

    /// `kafka.message_max_bytes` is refused, naming the key's new name; the section is otherwise
    /// read as before: defaults for what is missing, unknown keys refused, what it writes read back.
    #[test]
    fn the_old_name_of_max_message_bytes_is_refused_naming_the_new_one() {
        let read = |v: serde_json::Value| serde_json::from_value::<KafkaConfig>(v);
        let e = read(serde_json::json!({ "message_max_bytes": 2_000_000 }))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("kafka.message_max_bytes was renamed: use kafka.max_message_bytes"),
            "{e}"
        );
        let c = read(serde_json::json!({ "max_message_bytes": 2_000_000 })).unwrap();
        assert_eq!(
            c,
            KafkaConfig {
                max_message_bytes: 2_000_000,
                ..KafkaConfig::default()
            }
        );
        assert_eq!(c.producer_properties()["message.max.bytes"], "2000000");
        let e = read(serde_json::json!({ "brokerz": "b:9092" }))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `brokerz`"), "{e}");
        assert_eq!(read(serde_json::json!({})).unwrap(), KafkaConfig::default());
        let mut written = KafkaConfig {
            delivery_timeout: Duration::from_secs(12),
            ..KafkaConfig::default()
        };
        written
            .properties
            .insert("client.id".into(), "relay".into());
        let back = read(serde_json::to_value(&written).unwrap()).unwrap();
        assert_eq!(back, written);
    }

    #[test]
    fn producer_properties_carry_the_settings() {
        let mut c = KafkaConfig {
            compression: "zstd".into(),
            ..KafkaConfig::default()
        };
        c.properties
            .insert("security.protocol".into(), "SASL_SSL".into());
        let p = c.producer_properties();
        assert_eq!(p["enable.idempotence"], "true");
        assert_eq!(p["compression.type"], "zstd");
        assert_eq!(p["security.protocol"], "SASL_SSL");
        // The idempotent producer: no gap in what is written, and no timeout in its queue.
        assert_eq!(p["enable.gapless.guarantee"], "true");
        assert_eq!(p["message.timeout.ms"], "0");
        let plain = KafkaConfig {
            idempotence: false,
            acks: "1".into(),
            ..KafkaConfig::default()
        }
        .producer_properties();
        assert_eq!(plain["message.timeout.ms"], "30000");
        assert!(!plain.contains_key("enable.gapless.guarantee"));
    }
}
