//! `outbox bench`: the configured broker wired into [`engine`], which does the
//! measuring. Each broker gets a destination of the benchmark's own (an exchange bound to a queue, a
//! topic, a queue), so a benchmark never publishes into a service's topics or queues.

#[cfg(any(feature = "amqp", feature = "kafka", feature = "sqs"))]
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use clap::Args;

use outbox_core::Error;
#[cfg(any(feature = "amqp", feature = "kafka", feature = "sqs"))]
use outbox_core::Publisher;

pub mod engine;

use engine::{self as bench, BenchOptions, BenchTarget, DiscardTarget, Phase};

use crate::cli::Failure;
use crate::config::{Config, PublisherType};

/// `outbox bench` options. Sizes, rates and durations default to the figures the targets are stated
/// for; relay settings (batch size, in-flight batches, polling) come from `[relay]` as for `outbox relay`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Broker to publish to: amqp, kafka, sqs, or discard (the database ceiling only). Default:
    /// publisher.type of the configuration.
    #[arg(long, value_name = "BROKER")]
    pub broker: Option<String>,
    /// Phases to run, comma-separated: writer, drain, reference, latency, claim. Default: all.
    #[arg(long, value_delimiter = ',', value_name = "PHASES")]
    pub phases: Option<Vec<String>>,
    /// Concurrent writers of the writer phase.
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Length of each writer run.
    #[arg(long, default_value = "5s", value_parser = outbox_core::duration::parse)]
    pub writer_duration: Duration,
    /// Events pre-filled for each drain run.
    #[arg(long, default_value_t = 200_000)]
    pub backlog: usize,
    /// N of the multi-relay drain runs.
    #[arg(long, default_value_t = 4)]
    pub relays: usize,
    /// Distinct aggregates the events are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub aggregates: usize,
    /// Padding in each event's JSON payload, in bytes.
    #[arg(long, default_value_t = 256)]
    pub payload_bytes: usize,
    /// Events drained by the reference (classic) relay.
    #[arg(long, default_value_t = 20_000)]
    pub reference_events: usize,
    /// Offered rate of the latency runs, events per second.
    #[arg(long, default_value_t = 2_000)]
    pub rate: u32,
    /// Length of each latency run (the first second is warm-up).
    #[arg(long, default_value = "10s", value_parser = outbox_core::duration::parse)]
    pub latency_duration: Duration,
    /// Processed rows kept in the table for the claim-cost phase.
    #[arg(long, default_value_t = 10_000_000)]
    pub claim_processed_rows: u64,
    /// Pending rows of the claim-cost phase's large backlog.
    #[arg(long, default_value_t = 1_000_000)]
    pub claim_pending_rows: u64,
    /// Claims timed per table state.
    #[arg(long, default_value_t = 200)]
    pub claim_samples: usize,
    /// Partitions of the Kafka benchmark topic (librdkafka sends one produce request per partition,
    /// so a batch spread over more partitions takes more requests).
    #[arg(long, default_value_t = 8)]
    pub kafka_partitions: i32,
    /// Schema the benchmark creates and drops (must start with outbox_bench).
    #[arg(long, default_value = "outbox_bench")]
    pub schema: String,
    /// Print the figures as JSON on standard output instead of the table.
    #[arg(long)]
    pub json: bool,
}

impl BenchArgs {
    fn options(&self, config: &Config) -> Result<BenchOptions, Error> {
        let phases = match &self.phases {
            None => Phase::ALL.to_vec(),
            Some(list) => list
                .iter()
                .map(|p| Phase::parse(p))
                .collect::<Result<Vec<_>, _>>()?,
        };
        Ok(BenchOptions {
            schema: self.schema.clone(),
            phases,
            writers: self.writers,
            writer_duration: self.writer_duration,
            backlog: self.backlog,
            relays: self.relays,
            aggregates: self.aggregates,
            payload_bytes: self.payload_bytes,
            reference_events: self.reference_events,
            rate: self.rate,
            latency_duration: self.latency_duration,
            claim_processed_rows: self.claim_processed_rows,
            claim_pending_rows: self.claim_pending_rows,
            claim_samples: self.claim_samples,
            relay: config.relay.clone(),
        })
    }
}

/// Runs `outbox bench`.
///
/// # Errors
/// A usage error for invalid options or a broker missing from this build; a runtime error when a
/// phase fails.
pub async fn cmd_bench(config: &Config, args: BenchArgs) -> Result<(), Failure> {
    let options = args.options(config)?;
    options.validate()?;
    if !(1..=1000).contains(&args.kafka_partitions) {
        return Err(Failure {
            code: 2,
            message: format!(
                "--kafka-partitions {}: expected 1 to 1000",
                args.kafka_partitions
            ),
        });
    }
    let broker = match args.broker.as_deref() {
        Some(b) => b.to_string(),
        None => match config.publisher.kind {
            PublisherType::Stdout => {
                return Err(Failure {
                    code: 2,
                    message: "outbox bench needs a broker: pass --broker amqp|kafka|sqs|discard, or set publisher.type".into(),
                })
            }
            PublisherType::Amqp => "amqp".into(),
            PublisherType::Kafka => "kafka".into(),
            PublisherType::Sqs => "sqs".into(),
        },
    };
    let progress = |line: &str| eprintln!("[bench] {line}");
    let target = target(config, &broker, &args, &progress).await?;
    let result = bench::run(&config.database.url, target.as_ref(), &options, &progress).await;
    target.teardown().await;
    let report = result?;
    if args.json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| Failure {
            code: 1,
            message: format!("cannot encode the report: {e}"),
        })?;
        println!("{text}");
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

/// A bench target with its own destination, removed again by `teardown`.
#[async_trait]
trait OwnedTarget: BenchTarget {
    /// Removes the benchmark's destination (best effort: reports, never fails).
    async fn teardown(&self) {}
}

#[async_trait]
impl OwnedTarget for DiscardTarget {}

async fn target(
    config: &Config,
    broker: &str,
    args: &BenchArgs,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Box<dyn OwnedTarget>, Failure> {
    let _ = (config, args, progress);
    match broker {
        "discard" => Ok(Box::new(DiscardTarget)),
        #[cfg(feature = "amqp")]
        "amqp" => Ok(Box::new(amqp::AmqpTarget::new(config, progress).await?)),
        #[cfg(feature = "kafka")]
        "kafka" => Ok(Box::new(
            kafka::KafkaTarget::new(config, args.kafka_partitions, progress).await?,
        )),
        #[cfg(feature = "sqs")]
        "sqs" => Ok(Box::new(sqs::SqsTarget::new(config, progress).await?)),
        other => Err(Failure {
            code: 2,
            message: format!(
                "--broker {other:?}: expected one of {} (or discard)",
                crate::config::available_publishers().join(", ")
            ),
        }),
    }
}

#[cfg(feature = "amqp")]
mod amqp {
    use super::*;
    use outbox_amqp::{AmqpPublisher, BoundQueue};

    /// Exchange `outbox.bench` (declared), bound with `#` to the durable queue `outbox.bench`;
    /// purged before each run, deleted at the end. URL and timeouts from `[amqp]`.
    pub(super) struct AmqpTarget {
        config: outbox_amqp::AmqpConfig,
        queue: tokio::sync::Mutex<Option<BoundQueue>>,
    }

    impl AmqpTarget {
        pub(super) async fn new(
            config: &Config,
            progress: &(dyn Fn(&str) + Send + Sync),
        ) -> Result<Self, Error> {
            let mut c = config.amqp.clone();
            c.exchange = "outbox.bench".into();
            c.declare_exchange = true;
            let queue = BoundQueue::declare(&c, "outbox.bench", "#").await?;
            progress(&format!(
                "amqp: exchange outbox.bench -> durable queue {} at {}",
                queue.name(),
                outbox_amqp::redact_url(&c.url)
            ));
            Ok(AmqpTarget {
                config: c,
                queue: tokio::sync::Mutex::new(Some(queue)),
            })
        }
    }

    #[async_trait]
    impl BenchTarget for AmqpTarget {
        fn name(&self) -> &str {
            "amqp"
        }

        async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
            let p = AmqpPublisher::new(self.config.clone())?;
            p.connect().await?;
            Ok(Arc::new(p))
        }

        async fn reset(&self) -> Result<(), Error> {
            if let Some(q) = self.queue.lock().await.as_ref() {
                q.purge().await?;
            }
            Ok(())
        }
    }

    #[async_trait]
    impl OwnedTarget for AmqpTarget {
        async fn teardown(&self) {
            if let Some(q) = self.queue.lock().await.take() {
                if let Err(e) = q.delete().await {
                    eprintln!("[bench] could not delete the queue outbox.bench: {e}");
                }
            }
        }
    }
}

#[cfg(feature = "kafka")]
mod kafka {
    use super::*;
    use outbox_kafka::{admin, KafkaConfig, KafkaPublisher};

    const TOPIC: &str = "outbox.bench";

    /// Topic `outbox.bench` (`--kafka-partitions`, created for the run, deleted at the end);
    /// brokers, producer settings and properties from `[kafka]`.
    pub(super) struct KafkaTarget {
        config: KafkaConfig,
    }

    impl KafkaTarget {
        pub(super) async fn new(
            config: &Config,
            partitions: i32,
            progress: &(dyn Fn(&str) + Send + Sync),
        ) -> Result<Self, Error> {
            let mut c = config.kafka.clone();
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
            Ok(KafkaTarget { config: c })
        }
    }

    #[async_trait]
    impl BenchTarget for KafkaTarget {
        fn name(&self) -> &str {
            "kafka"
        }

        async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
            Ok(Arc::new(KafkaPublisher::new(self.config.clone())?))
        }
    }

    #[async_trait]
    impl OwnedTarget for KafkaTarget {
        async fn teardown(&self) {
            if let Err(e) = admin::delete_topic(&self.config, TOPIC).await {
                eprintln!("[bench] could not delete the topic {TOPIC}: {e}");
            }
        }
    }
}

#[cfg(feature = "sqs")]
mod sqs {
    use super::*;
    use outbox_sqs::{admin, SqsConfig, SqsPublisher};

    const QUEUE: &str = "outbox-bench";

    /// Standard queue `outbox-bench` (created for the run, deleted at the end); region, endpoint
    /// and timeouts from `[sqs]`.
    pub(super) struct SqsTarget {
        config: SqsConfig,
        admin: SqsPublisher,
        url: String,
    }

    impl SqsTarget {
        pub(super) async fn new(
            config: &Config,
            progress: &(dyn Fn(&str) + Send + Sync),
        ) -> Result<Self, Error> {
            let mut c = config.sqs.clone();
            c.queue = QUEUE.into();
            let admin = SqsPublisher::new(c.clone()).await?;
            let url = admin::create_queue(&admin, QUEUE).await?;
            progress(&format!("sqs: queue {url}"));
            Ok(SqsTarget {
                config: c,
                admin,
                url,
            })
        }
    }

    #[async_trait]
    impl BenchTarget for SqsTarget {
        fn name(&self) -> &str {
            "sqs"
        }

        async fn publisher(&self) -> Result<Arc<dyn Publisher>, Error> {
            Ok(Arc::new(SqsPublisher::new(self.config.clone()).await?))
        }
    }

    #[async_trait]
    impl OwnedTarget for SqsTarget {
        async fn teardown(&self) {
            if let Err(e) = admin::delete_queue(&self.admin, &self.url).await {
                eprintln!("[bench] could not delete the queue {}: {e}", self.url);
            }
        }
    }
}
