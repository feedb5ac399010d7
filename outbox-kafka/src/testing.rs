//! Helpers for tests against a real Kafka-protocol broker (feature `test-utils`): a topic of its own,
//! a consumer that reads it from the beginning, and the Publisher conformance fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

use txoutbox_core::testkit::{
    BrokerFixture, Built, CloudEventsBinding, Outage, OwnServer, PublisherFixture, Received, Setup,
};
use txoutbox_core::{ErrorKind, Event, Publisher};

use crate::{KafkaConfig, KafkaPublisher};

/// `KAFKA_BROKERS`, or the local broker.
pub fn brokers() -> String {
    std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| crate::DEFAULT_BROKERS.to_string())
}

/// A client of `brokers` with `properties`.
fn client_config(brokers: &str, properties: &[(String, String)]) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    for (k, v) in properties {
        c.set(k, v);
    }
    c
}

fn unreachable(at: &str, e: impl std::fmt::Display) -> ! {
    panic!(
        "a Kafka-protocol broker is required for this test and is unreachable at {}: {e}\n\
         Start one with `bash scripts/test-env.sh` (it installs and starts Tansu on 127.0.0.1:9092), \
         or point KAFKA_BROKERS at a running broker.",
        at
    )
}

/// Starts a Tansu broker of the test's own on `127.0.0.1:<port>` (in-memory storage), its log going
/// to `stderr`: `$TANSU_BIN`, else the one `scripts/test-env.sh` installed in `.tools/bin`.
pub fn spawn_tansu(port: u16, stderr: std::process::Stdio) -> std::process::Child {
    start_tansu(port, None, stderr)
}

/// As [`spawn_tansu`], validating records against the JSON schemas in `schemas` (a directory of
/// `<topic>.json` files): Tansu refuses a record that does not match (`InvalidRecord`), a broker-side
/// rejection of one message next to accepted ones.
pub fn spawn_tansu_with_schemas(
    port: u16,
    schemas: &std::path::Path,
    stderr: std::process::Stdio,
) -> std::process::Child {
    start_tansu(port, Some(schemas), stderr)
}

fn start_tansu(
    port: u16,
    schemas: Option<&std::path::Path>,
    stderr: std::process::Stdio,
) -> std::process::Child {
    let url = format!("tcp://127.0.0.1:{port}");
    let mut args = vec![
        "broker".to_string(),
        "--listener-url".into(),
        url.clone(),
        "--advertised-listener-url".into(),
        url,
        "--storage-engine".into(),
        "memory://tansu/".into(),
    ];
    // Tansu reads a file:// registry relative to its working directory.
    let cwd = schemas.and_then(|dir| {
        let name = dir.file_name()?.to_string_lossy().into_owned();
        args.extend(["--schema-registry".into(), format!("file://./{name}")]);
        dir.parent()
    });
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    txoutbox_core::testkit::spawn_tool_in(
        cwd,
        "TANSU_BIN",
        "tansu",
        "a Tansu broker",
        &args,
        stderr,
    )
}

/// A message as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub received: Received,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
}

/// The key of the records [`Fixture::mark_ends`] writes.
pub const END_MARKER: &[u8] = b"(outbox test: end mark)";

/// A consumer of its own group reading every partition of `topic` from the beginning.
fn from_the_beginning(
    brokers: &str,
    properties: &[(String, String)],
    topic: &str,
    partitions: i32,
) -> BaseConsumer {
    let group = format!("outbox-test-{}", uuid::Uuid::new_v4().simple());
    let consumer: BaseConsumer = client_config(brokers, properties)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap_or_else(|e| unreachable(brokers, e));
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    consumer
}

/// What a test reads of the message `m`.
fn delivered(m: &rdkafka::message::BorrowedMessage<'_>) -> Delivered {
    let mut headers = BTreeMap::new();
    if let Some(h) = m.headers() {
        for header in h.iter() {
            let value = header
                .value
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            headers.insert(header.key.to_string(), value);
        }
    }
    let key = m.key().map(<[u8]>::to_vec);
    let received = Received {
        // The consumer-side helper users call: every check of the suite reads ids with it.
        event_id: crate::event_id(m),
        aggregate_id: key
            .as_ref()
            .map(|k| String::from_utf8_lossy(k).into_owned()),
        event_type: headers.get(txoutbox_core::header::EVENT_TYPE).cloned(),
        payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        content_type: headers.get(txoutbox_core::header::CONTENT_TYPE).cloned(),
        headers,
        destination: m.topic().to_string(),
    };
    Delivered {
        received,
        partition: m.partition(),
        offset: m.offset(),
        key,
    }
}

/// A topic of its own with `partitions` partitions, consumed from the beginning in the background.
pub struct Fixture {
    pub brokers: String,
    pub topic: String,
    pub partitions: i32,
    pub got: Arc<Mutex<Vec<Delivered>>>,
    /// What the consumer's polls failed with (a consumer error is not a lost message).
    pub errors: Arc<Mutex<Vec<String>>>,
    /// The offset of the last end marker ([`Fixture::mark_ends`]) the consumer read, by partition.
    ends: Arc<Mutex<BTreeMap<i32, i64>>>,
    /// The clients' properties besides the brokers (TLS, ...).
    properties: Vec<(String, String)>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Fixture {
    /// A new topic on the test broker ([`brokers`]).
    pub async fn new(partitions: i32) -> Fixture {
        let topic = format!("outbox.test.{}", uuid::Uuid::new_v4().simple());
        Fixture::create_at(&brokers(), &topic, partitions).await
    }

    /// Creates `topic` on the broker at `brokers` (a broker of the test's own, say) and consumes it.
    pub async fn create_at(brokers: &str, topic: &str, partitions: i32) -> Fixture {
        Fixture::create_with(brokers, topic, partitions, &[]).await
    }

    /// As [`Fixture::create_at`], the admin client and the consumer also given `properties`
    /// (`security.protocol`, `ssl.ca.location`, ...).
    pub async fn create_with(
        brokers: &str,
        topic: &str,
        partitions: i32,
        properties: &[(&str, &str)],
    ) -> Fixture {
        let topic = topic.to_string();
        let properties: Vec<(String, String)> = properties
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let admin: AdminClient<DefaultClientContext> = client_config(brokers, &properties)
            .create()
            .unwrap_or_else(|e| unreachable(brokers, e));
        let created = admin
            .create_topics(
                &[NewTopic::new(
                    &topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new()
                    .operation_timeout(Some(Duration::from_secs(10)))
                    .request_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .unwrap_or_else(|e| unreachable(brokers, e));
        for r in created {
            if let Err((t, code)) = r {
                panic!("cannot create topic {t}: {code:?}");
            }
        }
        let consumer = from_the_beginning(brokers, &properties, &topic, partitions);
        let got: Arc<Mutex<Vec<Delivered>>> = Arc::default();
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let ends: Arc<Mutex<BTreeMap<i32, i64>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, halt, failures, markers) =
            (got.clone(), stop.clone(), errors.clone(), ends.clone());
        let thread = std::thread::spawn(move || {
            while !halt.load(Ordering::SeqCst) {
                match consumer.poll(Duration::from_millis(100)) {
                    None => {}
                    Some(Err(e)) => failures.lock().unwrap().push(e.to_string()),
                    Some(Ok(m)) if m.key() == Some(END_MARKER) => {
                        markers.lock().unwrap().insert(m.partition(), m.offset());
                    }
                    Some(Ok(m)) => sink.lock().unwrap().push(delivered(&m)),
                }
            }
        });
        Fixture {
            brokers: brokers.to_string(),
            topic,
            partitions,
            got,
            errors,
            ends,
            properties,
            stop,
            thread: Mutex::new(Some(thread)),
        }
    }

    pub fn config(&self) -> KafkaConfig {
        KafkaConfig {
            brokers: self.brokers.clone(),
            topic: self.topic.clone(),
            properties: self.properties.iter().cloned().collect(),
            ..KafkaConfig::default()
        }
    }

    pub fn publisher(&self) -> Arc<KafkaPublisher> {
        Arc::new(KafkaPublisher::new(self.config()).unwrap())
    }

    /// Stops the background consumer (as dropping the fixture does).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Stops the background consumer and waits until its last poll is done, so that
    /// [`Fixture::got`] holds everything it will ever read.
    pub async fn stop_and_join(&self) {
        self.stop();
        let thread = self.thread.lock().unwrap().take();
        if let Some(t) = thread {
            tokio::task::spawn_blocking(move || t.join())
                .await
                .unwrap()
                .expect("the Kafka test consumer panicked");
        }
    }

    /// Writes an end marker (a record keyed [`END_MARKER`], which the consumers set aside) to each
    /// partition and returns their offsets, by partition: every record written before it has a
    /// lower offset. (A partition's high watermark would say the same on Kafka, but Tansu reports
    /// the base offset of its last record batch plus one, short of the records after it in the
    /// batch.)
    pub async fn mark_ends(&self) -> Vec<i64> {
        let producer: FutureProducer = client_config(&self.brokers, &self.properties)
            .set("message.timeout.ms", "30000")
            .create()
            .unwrap_or_else(|e| unreachable(&self.brokers, e));
        let mut offsets = Vec::new();
        for p in 0..self.partitions {
            let record = FutureRecord::<[u8], [u8]>::to(&self.topic)
                .partition(p)
                .key(END_MARKER)
                .payload(&[]);
            let delivery = producer
                .send(record, Duration::from_secs(30))
                .await
                .unwrap_or_else(|(e, _)| unreachable(&self.brokers, e));
            offsets.push(delivery.offset);
        }
        offsets
    }

    /// Waits (up to `within`) until the consumer has read every message the topic holds: it marks
    /// each partition's end ([`Fixture::mark_ends`]) and waits until the consumer read the marks.
    pub async fn wait_until_read_all(&self, within: Duration) {
        let marks = self.mark_ends().await;
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let behind: Vec<(i32, i64)> = {
                let ends = self.ends.lock().unwrap();
                (0..self.partitions)
                    .zip(&marks)
                    .filter(|(p, mark)| ends.get(p).is_none_or(|read| read < *mark))
                    .map(|(p, mark)| (p, *mark))
                    .collect()
            };
            if behind.is_empty() {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the consumer of {} has not read the end marks of these partitions (partition, offset) after {within:?}: {behind:?}",
                self.topic
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Everything the topic holds, read again from the beginning by a consumer of its own up to
    /// an end mark written now in each partition (at most `within`): what is in the log, whatever
    /// the background consumer made of it. End marks are left out.
    pub async fn read_again(&self, within: Duration) -> Vec<Delivered> {
        let marks = self.mark_ends().await;
        let (brokers, topic, partitions) =
            (self.brokers.clone(), self.topic.clone(), self.partitions);
        let properties = self.properties.clone();
        tokio::task::spawn_blocking(move || {
            let consumer = from_the_beginning(&brokers, &properties, &topic, partitions);
            let mut next = vec![0i64; marks.len()];
            let mut got = Vec::new();
            let deadline = std::time::Instant::now() + within;
            while next.iter().zip(&marks).any(|(n, mark)| n <= mark) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "reading {topic} again: the end marks at {marks:?} not reached after {within:?} (next offsets {next:?})"
                );
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                    next[m.partition() as usize] = m.offset() + 1;
                    if m.key() != Some(END_MARKER) {
                        got.push(delivered(&m));
                    }
                }
            }
            got
        })
        .await
        .unwrap()
    }

    pub async fn wait_for(&self, count: usize, timeout: Duration) -> Vec<Delivered> {
        txoutbox_core::testkit::wait_for_items(&self.got, count, timeout).await
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
        let defaults = KafkaConfig::default();
        let publisher = KafkaPublisher::new(KafkaConfig {
            max_message_bytes: setup
                .max_message_bytes
                .unwrap_or(defaults.max_message_bytes),
            allowed_destinations: setup.allowed_destinations,
            ..self.config()
        })
        .unwrap()
        .with_format(setup.format);
        // The producer keeps no list of topics of its own (librdkafka's metadata cache is its).
        Built {
            publisher: Arc::new(publisher),
            cached_destinations: None,
        }
    }

    fn destination(&self) -> String {
        self.topic.clone()
    }

    /// A name Kafka refuses for a topic.
    fn missing_destination(&self) -> String {
        "no spaces allowed".into()
    }

    /// Kafka takes any bytes within its size limit.
    fn cloudevents_binding(&self) -> CloudEventsBinding {
        CloudEventsBinding::Kafka
    }

    fn poison(&self) -> Vec<(Event, ErrorKind, &'static str)> {
        Vec::new()
    }

    async fn sibling(&self) -> Box<dyn BrokerFixture> {
        Box::new(Fixture::new(1).await)
    }

    /// A Tansu of the test's own on a spare loopback port, stopped and started again on it.
    async fn outage(&self) -> Box<dyn Outage> {
        let broker = OwnBroker(OwnServer::new("Tansu"));
        broker.start().await;
        Box::new(broker)
    }
}

/// A Tansu broker of the test's own (in-memory: a restart forgets its topics, which the producer
/// creates again).
struct OwnBroker(OwnServer);

#[async_trait]
impl Outage for OwnBroker {
    async fn publisher(&self) -> Arc<dyn Publisher> {
        Arc::new(
            KafkaPublisher::new(KafkaConfig {
                brokers: format!("127.0.0.1:{}", self.0.port()),
                topic: "outbox.faults".into(),
                delivery_timeout: Duration::from_secs(3),
                ..KafkaConfig::default()
            })
            .unwrap(),
        )
    }

    async fn stop(&self) {
        self.0.stop();
    }

    async fn start(&self) {
        self.0
            .start(|port| spawn_tansu(port, std::process::Stdio::null()))
            .await;
    }
}
