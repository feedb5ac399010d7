//! Topic administration for tools (`outbox bench`, set-up scripts): create and delete a topic with
//! the brokers and security properties of a [`KafkaConfig`].

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::types::RDKafkaErrorCode;

use txoutbox_core::{Error, ErrorKind};

use crate::config::KafkaConfig;
use crate::error::map_kafka;

/// Producer-only properties librdkafka rejects or warns about on an admin client.
const PRODUCER_ONLY: [&str; 7] = [
    "acks",
    "enable.idempotence",
    "enable.gapless.guarantee",
    "max.in.flight.requests.per.connection",
    "compression.type",
    "linger.ms",
    "message.timeout.ms",
];

fn admin(config: &KafkaConfig) -> Result<AdminClient<DefaultClientContext>, Error> {
    let mut client = ClientConfig::new();
    for (k, v) in config.producer_properties() {
        if !PRODUCER_ONLY.contains(&k.as_str()) {
            client.set(k, v);
        }
    }
    client
        .create()
        .map_err(|e| map_kafka("create admin client", e))
}

fn options() -> AdminOptions {
    AdminOptions::new()
        .operation_timeout(Some(Duration::from_secs(30)))
        .request_timeout(Some(Duration::from_secs(30)))
}

/// The first per-topic refusal of an admin call, ignoring `fine` (the state asked for already holds).
fn refused(
    results: Vec<rdkafka::admin::TopicResult>,
    verb: &str,
    fine: RDKafkaErrorCode,
) -> Result<(), Error> {
    for r in results {
        if let Err((t, code)) = r {
            if code != fine {
                return Err(Error::new(
                    ErrorKind::Unexpected,
                    format!("the broker refused to {verb} topic {t:?}: {code}"),
                )
                .with_context("adapter", "kafka"));
            }
        }
    }
    Ok(())
}

/// Creates `topic` with `partitions` partitions and replication factor `replication`; a topic that
/// already exists is left as it is.
///
/// # Errors
/// The broker's refusal, or an unreachable broker.
pub async fn create_topic(
    config: &KafkaConfig,
    topic: &str,
    partitions: i32,
    replication: i32,
) -> Result<(), Error> {
    crate::publisher::check_topic(topic)?;
    let results = admin(config)?
        .create_topics(
            &[NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(replication),
            )],
            &options(),
        )
        .await
        .map_err(|e| map_kafka("create topic", e))?;
    refused(results, "create", RDKafkaErrorCode::TopicAlreadyExists)
}

/// The number of partitions of `topic`, from the brokers' metadata (`None` when the topic does not
/// exist).
///
/// # Errors
/// An unreachable broker, or a metadata request that fails.
pub async fn partition_count(config: &KafkaConfig, topic: &str) -> Result<Option<usize>, Error> {
    let admin = admin(config)?;
    let topic_name = topic.to_string();
    let metadata = tokio::task::spawn_blocking(move || {
        admin
            .inner()
            .fetch_metadata(Some(&topic_name), Duration::from_secs(10))
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Unexpected, format!("metadata task failed: {e}")))?
    .map_err(|e| map_kafka("metadata request", e))?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().len()))
}

/// Deletes `topic` (a missing topic is not an error).
///
/// # Errors
/// The broker's refusal, or an unreachable broker.
pub async fn delete_topic(config: &KafkaConfig, topic: &str) -> Result<(), Error> {
    let results = admin(config)?
        .delete_topics(&[topic], &options())
        .await
        .map_err(|e| map_kafka("delete topic", e))?;
    refused(results, "delete", RDKafkaErrorCode::UnknownTopicOrPartition)
}
