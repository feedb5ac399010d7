//! Kafka (feature `kafka`): section `[kafka]`, [`txoutbox_kafka::KafkaPublisher`].

use std::sync::Arc;

use async_trait::async_trait;

use txoutbox_core::format::Formatter;
use txoutbox_core::{Error, Publisher};
use txoutbox_kafka::{admin, KafkaConfig, KafkaPublisher};

use super::{Adapter, Named};
use crate::target::{BenchTarget, Progress, TargetOptions};

/// `[kafka]`.
pub type Section = KafkaConfig;

impl super::Section for KafkaConfig {}

/// The Kafka adapter.
#[derive(Debug, Clone, Copy)]
pub struct Kafka;

/// The table's entry.
pub static ADAPTER: Kafka = Kafka;

/// The benchmark's topic.
const TOPIC: &str = "outbox.bench";

impl Named for Kafka {
    fn name(&self) -> &'static str {
        "kafka"
    }
}

#[async_trait]
impl Adapter for Kafka {
    type Section = KafkaConfig;

    fn call_limit(&self, section: &KafkaConfig) -> Option<txoutbox_core::CallLimit> {
        Some(section.call_limit())
    }

    fn validate(&self, section: &KafkaConfig) -> Result<(), Error> {
        section.validate().map(|_| ())
    }

    fn redact(&self, shown: &mut KafkaConfig) {
        for (k, v) in shown.properties.iter_mut() {
            if txoutbox_kafka::is_secret(k) {
                *v = "***".into();
            }
        }
    }

    async fn publisher(
        &self,
        section: &KafkaConfig,
        format: Formatter,
    ) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(
            KafkaPublisher::new(section.clone())?.with_format(format),
        ))
    }

    async fn bench_target(
        &self,
        section: &KafkaConfig,
        options: &TargetOptions,
        progress: &Progress,
    ) -> Result<Box<dyn BenchTarget>, Error> {
        let partitions = options.kafka_partitions;
        let mut c = section.clone();
        c.topic = TOPIC.into();
        admin::create_topic(&c, TOPIC, partitions, 1).await?;
        // A topic left by an interrupted run keeps its partition count: say so, not a wrong one.
        let actual = admin::partition_count(&c, TOPIC).await?;
        if actual != usize::try_from(partitions).ok() {
            return Err(Error::config(format!(
                "kafka: topic {TOPIC} has {} partitions, not the {partitions} asked for with \
                 --kafka-partitions (left by an earlier run?): delete it, it is the benchmark's own, \
                 or pass --kafka-partitions {}",
                actual.map_or_else(|| "no".to_string(), |n| n.to_string()),
                actual.unwrap_or(0)
            )));
        }
        progress(&format!(
            "kafka: topic {TOPIC} ({partitions} partitions) at {}",
            c.brokers
        ));
        Ok(Box::new(KafkaTarget { config: c }))
    }
}

/// Topic `outbox.bench` (`--kafka-partitions`, created for the run, deleted at the end); brokers,
/// producer settings and properties from `[kafka]`.
struct KafkaTarget {
    config: KafkaConfig,
}

#[async_trait]
impl BenchTarget for KafkaTarget {
    fn name(&self) -> &str {
        "kafka"
    }

    async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
        Ok(Arc::new(KafkaPublisher::new(self.config.clone())?))
    }

    async fn teardown(&self) {
        if let Err(e) = admin::delete_topic(&self.config, TOPIC).await {
            eprintln!("[bench] could not delete the topic {TOPIC}: {e}");
        }
    }
}
