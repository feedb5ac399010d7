//! The brokers a scenario runs against and the independent consumer of each (the sink),
//! which records what the broker delivered and judges it against what was committed.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::Publisher;
use txoutbox_postgres::testing::database_url;
use txoutbox_postgres::OutboxTable;
use uuid::Uuid;

use crate::{check, Verdict};

use super::load::Load;
use super::scenario::wait_until;

/// The brokers a scenario can run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    Amqp,
    Kafka,
    Sqs,
}

impl Broker {
    pub const ALL: [Broker; 3] = [Broker::Amqp, Broker::Kafka, Broker::Sqs];

    /// A write load the broker's test server keeps up with: moto (the SQS emulator) slows down past
    /// a few hundred messages per second, so SQS scenarios write less.
    pub async fn load(self, table: &OutboxTable) -> Load {
        self.load_at(&database_url(), table).await
    }

    /// As [`Broker::load`], the writers connecting to `url` (the test database through a pooler).
    pub async fn load_at(self, url: &str, table: &OutboxTable) -> Load {
        match self {
            Broker::Sqs => Load::start_at(url, table, 1, 40, 5, Duration::from_millis(60)).await,
            _ => Load::start_at(url, table, 2, 40, 5, Duration::from_millis(15)).await,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Broker::Amqp => "rabbitmq",
            Broker::Kafka => "kafka",
            Broker::Sqs => "sqs",
        }
    }
}

/// A destination of its own on one broker, with a consumer reading it.
pub enum Sink {
    Amqp(txoutbox_amqp::testing::Fixture),
    Kafka(txoutbox_kafka::testing::Fixture),
    Sqs(txoutbox_sqs::testing::Fixture),
}

impl Sink {
    pub async fn new(broker: Broker) -> Sink {
        match broker {
            Broker::Amqp => Sink::Amqp(txoutbox_amqp::testing::Fixture::new().await),
            Broker::Kafka => Sink::Kafka(txoutbox_kafka::testing::Fixture::new(4).await),
            // An endpoint of its own that records every send: the FIFO queue hides re-sent events.
            Broker::Sqs => Sink::Sqs(txoutbox_sqs::testing::Fixture::recording().await),
        }
    }

    /// The same destination (exchange, topic or queue name on the same broker) declared again, with a
    /// new consumer: after a broker restart that lost it (Tansu and moto keep nothing; RabbitMQ drops
    /// the consumer's exclusive queue, not the durable exchange).
    pub async fn recreate(&self) -> Sink {
        match self {
            Sink::Amqp(fx) => {
                Sink::Amqp(txoutbox_amqp::testing::Fixture::on_exchange(&fx.exchange).await)
            }
            Sink::Kafka(fx) => Sink::Kafka(
                txoutbox_kafka::testing::Fixture::create_at(&fx.brokers, &fx.topic, fx.partitions)
                    .await,
            ),
            Sink::Sqs(fx) => Sink::Sqs(fx.recreate().await),
        }
    }

    /// Stops the consumer (Kafka, SQS; a RabbitMQ consumer ends with its connection), so that it
    /// reads nothing of a destination declared again under the same name.
    pub fn stop_consuming(&self) {
        match self {
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.stop(),
            Sink::Sqs(fx) => fx.stop(),
        }
    }

    /// Stops the consumer and waits until its last read is done: what it received is then final.
    pub async fn stop_and_join(&self) {
        match self {
            // The consumer ends with its connection; it pushes each delivery as it arrives.
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.stop_and_join().await,
            Sink::Sqs(fx) => fx.stop_and_join().await,
        }
    }

    /// Waits (at most `within`) until the consumer has read everything the broker holds for it:
    /// every partition up to its high watermark (Kafka), an empty queue (SQS); RabbitMQ pushes to its
    /// consumer without a backlog to measure, so there the quiet window of
    /// [`Sink::received_settled`] stands alone.
    pub async fn drained(&self, within: Duration) {
        match self {
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.wait_until_read_all(within).await,
            Sink::Sqs(fx) => fx.wait_until_empty(within).await,
        }
    }

    /// Every id received, once the consumer has read what the broker holds and nothing more arrived
    /// for a second (late re-deliveries included).
    pub async fn received_settled(&self) -> Vec<Uuid> {
        self.drained(Duration::from_secs(120)).await;
        txoutbox_core::testkit::read_until_quiet(|| self.received(usize::MAX, Duration::ZERO)).await
    }

    /// What the consumer's own reads failed with: surfaced next to a verdict, so that a consumer
    /// error is not mistaken for a lost event.
    pub fn consumer_errors(&self) -> Vec<String> {
        match self {
            Sink::Amqp(fx) => fx.errors.lock().unwrap().clone(),
            Sink::Kafka(fx) => fx.errors.lock().unwrap().clone(),
            Sink::Sqs(fx) => fx.errors.lock().unwrap().clone(),
        }
    }

    /// Every event id sent to the destination, re-sends included, where the broker cannot show a
    /// re-sent event to its consumer (an SQS FIFO queue deduplicates it); `None` elsewhere, where
    /// every send reaches the consumer.
    pub fn sends(&self) -> Option<Vec<Uuid>> {
        match self {
            Sink::Sqs(fx) => fx.sends(),
            _ => None,
        }
    }

    /// The loopback port the relay reaches this sink's broker on (its first broker, for Kafka).
    pub fn broker_port(&self) -> u16 {
        let addr = match self {
            Sink::Amqp(_) => txoutbox_amqp::testing::amqp_url(),
            Sink::Kafka(fx) => fx.brokers.clone(),
            Sink::Sqs(fx) => fx.endpoint.clone(),
        };
        let first = addr.split(',').next().unwrap_or(&addr);
        let host_port = first
            .split("://")
            .last()
            .unwrap_or(first)
            .split(['/', '?'])
            .next()
            .unwrap_or(first);
        let host_port = host_port.rsplit('@').next().unwrap_or(host_port);
        host_port
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in the broker address {addr:?}"))
    }

    /// Points an `outbox` command at this sink.
    pub fn configure(&self, c: &mut Command) {
        match self {
            Sink::Amqp(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "amqp")
                    .env("OUTBOX_AMQP__URL", txoutbox_amqp::testing::amqp_url())
                    .env("OUTBOX_AMQP__EXCHANGE", &fx.exchange)
                    .env("OUTBOX_AMQP__RECONNECT_INITIAL_BACKOFF", "100ms")
                    .env("OUTBOX_AMQP__RECONNECT_MAX_BACKOFF", "1s");
            }
            Sink::Kafka(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "kafka")
                    .env("OUTBOX_KAFKA__BROKERS", &fx.brokers)
                    .env("OUTBOX_KAFKA__TOPIC", &fx.topic)
                    .env("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "5s");
            }
            Sink::Sqs(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "sqs")
                    .env("OUTBOX_SQS__QUEUE", &fx.queue_name)
                    .env("OUTBOX_SQS__REGION", "us-east-1")
                    .env("OUTBOX_SQS__ENDPOINT_URL", &fx.endpoint)
                    .env("OUTBOX_SQS__OPERATION_TIMEOUT", "5s")
                    .env("AWS_ACCESS_KEY_ID", "test")
                    .env("AWS_SECRET_ACCESS_KEY", "test");
            }
        }
    }

    /// A publisher to this sink, for in-process relays.
    pub fn publisher(&self) -> Arc<dyn Publisher> {
        match self {
            Sink::Amqp(fx) => fx.publisher(),
            Sink::Kafka(fx) => fx.publisher(),
            Sink::Sqs(fx) => fx.publisher(),
        }
    }

    /// A publisher to this sink that also lets events name the `allowed` destinations
    /// (`allowed_destinations`), for scenarios where the broker itself must refuse a destination.
    pub fn publisher_allowing(&self, allowed: Vec<String>) -> Arc<dyn Publisher> {
        match self {
            Sink::Amqp(fx) => Arc::new(
                txoutbox_amqp::AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
                    allowed_destinations: allowed,
                    ..fx.config()
                })
                .unwrap(),
            ),
            Sink::Kafka(fx) => Arc::new(
                txoutbox_kafka::KafkaPublisher::new(txoutbox_kafka::KafkaConfig {
                    allowed_destinations: allowed,
                    ..fx.config()
                })
                .unwrap(),
            ),
            Sink::Sqs(fx) => Arc::new(
                txoutbox_sqs::SqsPublisher::from_client(
                    txoutbox_sqs::testing::client_at(&fx.endpoint),
                    txoutbox_sqs::SqsConfig {
                        allowed_destinations: allowed,
                        ..fx.config()
                    },
                )
                .unwrap(),
            ),
        }
    }

    /// Event ids received so far, in reception order, waiting up to `timeout` for `count`.
    pub async fn received(&self, count: usize, timeout: Duration) -> Vec<Uuid> {
        match self {
            Sink::Amqp(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
            Sink::Kafka(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
            Sink::Sqs(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
        }
    }

    /// Waits until every id of `committed` was received, at most `timeout`.
    pub async fn wait_all(&self, committed: &[(String, Uuid)], timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let received = self
                .received(committed.len(), Duration::from_millis(200))
                .await;
            if check(committed, &received).lost == 0 || tokio::time::Instant::now() >= deadline {
                return;
            }
        }
    }

    /// The verdict over everything received once the consumer settled ([`Sink::received_settled`]):
    /// stop the relays first, so that a late re-delivery is counted too. Where the broker hides
    /// re-sent events ([`Sink::sends`]), duplicates are counted from the sends.
    pub async fn judge(&self, committed: &[(String, Uuid)]) -> Verdict {
        let received = self.received_settled().await;
        self.judge_received(committed, &received)
    }

    /// The verdict over `received`, with duplicates counted from the sends where the broker hides
    /// them, and the consumer's errors attached.
    pub fn judge_received(&self, committed: &[(String, Uuid)], received: &[Uuid]) -> Verdict {
        let mut v = check(committed, received);
        if let Some(sends) = self.sends() {
            let distinct: std::collections::HashSet<Uuid> = sends.iter().copied().collect();
            if let Some(id) = received.iter().find(|id| !distinct.contains(id)) {
                panic!("event {id} was received but the endpoint recorded no send of it");
            }
            v.duplicates = v.duplicates.max(sends.len() - distinct.len());
            // Order as the endpoint accepted the events. The consumer's order would judge the
            // endpoint's FIFO queue (moto): when a receive's answer is lost (a reset connection,
            // retried by the SDK) and its messages come back after the visibility timeout, moto
            // unblocks their group only once it has passed the first of them, and hands the second
            // out before it. Each group's order at the consumer, on an endpoint without faults, is
            // the publisher suite's (`fifo_groups_order_and_deduplication`).
            v.order_violations = check(committed, &sends).order_violations;
        }
        v.consumer_errors = self.consumer_errors();
        v
    }

    /// [`Sink::verdict`], asserting that nothing was lost and nothing arrived out of order.
    pub async fn assert_delivered(
        &self,
        committed: &[(String, Uuid)],
        timeout: Duration,
    ) -> Verdict {
        let verdict = self.verdict(committed, timeout).await;
        assert_eq!(
            (verdict.lost, verdict.order_violations),
            (0, 0),
            "{verdict}"
        );
        verdict
    }

    /// [`Sink::wait_all`], then [`Sink::judge`]: for relays that have already stopped.
    pub async fn verdict(&self, committed: &[(String, Uuid)], timeout: Duration) -> Verdict {
        self.wait_all(committed, timeout).await;
        self.judge(committed).await
    }

    /// How many messages the consumer has received so far.
    pub async fn received_count(&self) -> usize {
        self.received(usize::MAX, Duration::ZERO).await.len()
    }

    /// Waits (at most `within`) until the consumer has received more than `count` messages: progress.
    /// Panics with `what` otherwise.
    pub async fn wait_past(&self, count: usize, within: Duration, what: &str) {
        wait_until(within, what, || async {
            self.received_count().await > count
        })
        .await;
    }
}
