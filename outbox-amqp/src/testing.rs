//! Helpers for tests against a real RabbitMQ (feature `test-utils`): a consumer fixture that reads
//! what the publisher sent, and the Publisher conformance fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{AmqpConfig, AmqpPublisher};
use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use txoutbox_core::testkit::{
    publisher_suite, BrokerFixture, Built, CloudEventsBinding, Outage, PublisherFixture, Received,
    Setup, TcpProxy,
};
use txoutbox_core::{ErrorKind, Event, Publisher};

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string())
}

pub async fn connect() -> Connection {
    let url = amqp_url();
    match Connection::connect(&url, ConnectionProperties::default().with_connection_name("outbox test consumer".into())).await {
        Ok(c) => c,
        Err(e) => panic!(
            "RabbitMQ is required for this test and is unreachable at {}: {e}\n\
             Start it with `bash scripts/test-env.sh` (it runs `rabbitmq-server -detached` and waits), \
             or point AMQP_URL at a running broker.",
            crate::redact_url(&url)
        ),
    }
}

/// A message as the consumer saw it, with its AMQP properties.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub received: Received,
    pub properties: BasicProperties,
    pub routing_key: String,
}

/// An exchange of its own, bound to an exclusive queue with `#`, consumed in the background.
pub struct Fixture {
    pub exchange: String,
    pub connection: Connection,
    pub got: Arc<Mutex<Vec<Delivered>>>,
    /// What ended the consumer early, if anything (a consumer error is not a lost message).
    pub errors: Arc<Mutex<Vec<String>>>,
    /// `amqp.cloudevents_prefix` of the publishers this fixture builds.
    pub cloudevents_prefix: String,
}

fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.to_string(),
        other => format!("{other:?}"),
    }
}

impl Fixture {
    /// A new exchange of its own.
    pub async fn new() -> Fixture {
        Fixture::on_exchange(&format!("outbox.test.{}", uuid::Uuid::new_v4().simple())).await
    }

    /// Declares the durable topic exchange `exchange` (if missing) and consumes it through a new
    /// exclusive queue: after a broker restart, say, which dropped the earlier queue.
    pub async fn on_exchange(exchange: &str) -> Fixture {
        Fixture::declare(exchange, FieldTable::default(), None).await
    }

    /// A new exchange whose queue holds at most `max_length` ready messages and refuses more
    /// (`x-overflow = reject-publish`: the broker nacks a message while the queue is full and acks the
    /// next once there is room), read by a consumer that takes one message at a time and acks it
    /// after `ack_delay`: a broker that rejects some messages after accepting others.
    pub async fn bounded(max_length: i64, ack_delay: Duration) -> Fixture {
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_length));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        let exchange = format!("outbox.test.{}", uuid::Uuid::new_v4().simple());
        Fixture::declare(&exchange, args, Some(ack_delay)).await
    }

    async fn declare(
        exchange: &str,
        queue_args: FieldTable,
        ack_delay: Option<Duration>,
    ) -> Fixture {
        let exchange = exchange.to_string();
        let connection = connect().await;
        let ch = connection.create_channel().await.unwrap();
        ch.exchange_declare(
            exchange.clone().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
        let q = ch
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                queue_args,
            )
            .await
            .unwrap();
        if ack_delay.is_some() {
            ch.basic_qos(1, lapin::options::BasicQosOptions::default())
                .await
                .unwrap();
        }
        ch.queue_bind(
            q.name().clone(),
            exchange.clone().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let mut consumer = ch
            .basic_consume(
                q.name().clone(),
                "outbox-test".into(),
                BasicConsumeOptions {
                    no_ack: ack_delay.is_none(),
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let got: Arc<Mutex<Vec<Delivered>>> = Arc::default();
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let (sink, failures) = (got.clone(), errors.clone());
        tokio::spawn(async move {
            while let Some(next) = consumer.next().await {
                let d = match next {
                    Ok(d) => d,
                    Err(e) => {
                        failures.lock().unwrap().push(e.to_string());
                        break;
                    }
                };
                let props = d.properties.clone();
                let mut headers = BTreeMap::new();
                if let Some(h) = props.headers() {
                    for (k, v) in h.inner() {
                        headers.insert(k.to_string(), text(v));
                    }
                }
                let received = Received {
                    // The consumer-side helper users call: every check of the suite reads ids with it.
                    event_id: crate::event_id(&props),
                    aggregate_id: headers.get("outbox-aggregate-id").cloned(),
                    event_type: props.kind().as_ref().map(|t| t.to_string()),
                    payload: d.data.clone(),
                    headers,
                    destination: d.exchange.to_string(),
                    content_type: props.content_type().as_ref().map(|t| t.to_string()),
                };
                sink.lock().unwrap().push(Delivered {
                    received,
                    properties: props,
                    routing_key: d.routing_key.to_string(),
                });
                if let Some(delay) = ack_delay {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    if d.ack(lapin::options::BasicAckOptions::default())
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        });
        Fixture {
            exchange,
            connection,
            got,
            errors,
            cloudevents_prefix: AmqpConfig::default().cloudevents_prefix,
        }
    }

    /// Publishers built by this fixture name CloudEvents attributes with `prefix`.
    pub fn with_cloudevents_prefix(mut self, prefix: &str) -> Fixture {
        self.cloudevents_prefix = prefix.to_string();
        self
    }

    pub fn config(&self) -> AmqpConfig {
        AmqpConfig {
            url: amqp_url(),
            exchange: self.exchange.clone(),
            cloudevents_prefix: self.cloudevents_prefix.clone(),
            ..AmqpConfig::default()
        }
    }

    pub fn publisher(&self) -> Arc<AmqpPublisher> {
        Arc::new(AmqpPublisher::new(self.config()).unwrap())
    }

    pub async fn wait_for(&self, count: usize, timeout: Duration) -> Vec<Delivered> {
        txoutbox_core::testkit::wait_for_items(&self.got, count, timeout).await
    }

    pub async fn cleanup(self) {
        self.dispose().await;
    }

    async fn delete_exchange(&self) {
        if let Ok(ch) = self.connection.create_channel().await {
            let _ = ch
                .exchange_delete(
                    self.exchange.clone().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await;
        }
        let _ = self.connection.close(200, "done".into()).await;
    }
}

#[async_trait]
impl PublisherFixture for Fixture {
    async fn publisher(&self) -> Arc<dyn Publisher> {
        Fixture::publisher(self)
    }

    async fn receive(&self, count: usize, timeout: Duration) -> Vec<Received> {
        self.wait_for(count, timeout)
            .await
            .into_iter()
            .map(|d| d.received)
            .collect()
    }
}

#[async_trait]
impl BrokerFixture for Fixture {
    async fn build(&self, setup: Setup) -> Built {
        let defaults = AmqpConfig::default();
        let publisher = AmqpPublisher::new(AmqpConfig {
            max_message_bytes: setup
                .max_message_bytes
                .unwrap_or(defaults.max_message_bytes),
            allowed_destinations: setup.allowed_destinations,
            ..self.config()
        })
        .unwrap()
        .with_format(setup.format);
        let publisher = Arc::new(match setup.destination_cache {
            Some(n) => publisher.with_exchange_cache(n),
            None => publisher,
        });
        let view = publisher.clone();
        Built {
            publisher,
            cached_destinations: Some(Box::new(move || view.cached_exchanges())),
        }
    }

    fn destination(&self) -> String {
        self.exchange.clone()
    }

    fn missing_destination(&self) -> String {
        format!("{}.does-not-exist", self.exchange)
    }

    /// AMQP short strings: a header name or a type of more than 255 bytes.
    fn poison(&self) -> Vec<(Event, ErrorKind, &'static str)> {
        let mut long_header = publisher_suite::event("long-header", 0);
        long_header.headers.insert("h".repeat(300), "v".into());
        let mut long_type = publisher_suite::event("long-type", 0);
        long_type.event_type = "t".repeat(300);
        vec![
            (
                long_header,
                ErrorKind::InvalidInput,
                "header name is 300 bytes long",
            ),
            (long_type, ErrorKind::InvalidInput, "is 300 bytes long"),
        ]
    }

    async fn sibling(&self) -> Box<dyn BrokerFixture> {
        Box::new(Fixture::new().await)
    }

    /// The path to the broker through a proxy of the test's own, cut and restored (the broker itself
    /// keeps serving the other tests).
    async fn outage(&self) -> Box<dyn Outage> {
        let url = amqp_url();
        let mut uri: lapin::uri::AMQPUri = url.parse().unwrap_or_else(|e| {
            panic!(
                "AMQP_URL {} is not an AMQP URL: {e}",
                crate::redact_url(&url)
            )
        });
        assert!(
            matches!(uri.scheme, lapin::uri::AMQPScheme::AMQP),
            "the outage check forwards plain AMQP through a proxy of its own: set AMQP_URL to an \
             amqp:// URL (not amqps://)"
        );
        // The broker's address: the first one that accepts a connection (`localhost` may resolve
        // to an IPv6 address the broker does not listen on).
        let authority = (uri.authority.host.clone(), uri.authority.port);
        let mut target = None;
        for address in tokio::net::lookup_host(authority.clone())
            .await
            .unwrap_or_else(|e| panic!("cannot resolve the RabbitMQ host {authority:?}: {e}"))
        {
            if tokio::net::TcpStream::connect(address).await.is_ok() {
                target = Some(address);
                break;
            }
        }
        let target = target.unwrap_or_else(|| panic!("RabbitMQ does not answer at {authority:?}"));
        let proxy = TcpProxy::start(target).await;
        uri.authority.host = "127.0.0.1".into();
        uri.authority.port = proxy.port();
        Box::new(ProxiedBroker {
            config: AmqpConfig {
                url: uri.to_string(),
                reconnect_initial_backoff: Duration::from_millis(100),
                reconnect_max_backoff: Duration::from_millis(500),
                ..self.config()
            },
            proxy,
        })
    }

    fn cloudevents_binding(&self) -> CloudEventsBinding {
        if self.cloudevents_prefix == "ce-" {
            CloudEventsBinding::RabbitMq
        } else {
            CloudEventsBinding::Amqp
        }
    }

    async fn dispose(&self) {
        self.delete_exchange().await;
    }
}

/// RabbitMQ behind a [`TcpProxy`].
struct ProxiedBroker {
    proxy: TcpProxy,
    config: AmqpConfig,
}

#[async_trait]
impl Outage for ProxiedBroker {
    async fn publisher(&self) -> Arc<dyn Publisher> {
        Arc::new(AmqpPublisher::new(self.config.clone()).unwrap())
    }

    async fn stop(&self) {
        self.proxy.cut();
    }

    async fn start(&self) {
        self.proxy.restore();
    }
}

/// Runs `rabbitmqctl` (on the local node) with `args`; returns its output. Panics, saying what
/// failed, when it is missing or fails.
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl is required for this test (it ships with rabbitmq-server)");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The connections of the local RabbitMQ node named "outbox relay" (the publisher's): one
/// `field` of each (as `rabbitmqctl list_connections` names it, e.g. `pid` or `peer_port`).
pub fn publisher_connections(field: &str) -> Vec<String> {
    rabbitmqctl(&[
        "list_connections",
        field,
        "client_properties",
        "--no-table-headers",
        "-q",
    ])
    .lines()
    .filter(|l| l.contains("outbox relay"))
    .filter_map(|l| l.split_whitespace().next().map(str::to_string))
    .collect()
}

/// Closes every connection of the local RabbitMQ node named "outbox relay" (the publisher's), with
/// `rabbitmqctl close_connection`, as an operator or a broker restart would; returns how many. Every
/// relay's connection on the node goes: only for a test binary whose tests may all lose theirs.
pub fn close_publisher_connections() -> usize {
    let pids = publisher_connections("pid");
    for pid in &pids {
        rabbitmqctl(&["close_connection", pid, "fault injection"]);
    }
    pids.len()
}
