//! Helpers for tests against a real SQS endpoint (feature `test-utils`): a queue of its own, a
//! consumer that reads and deletes its messages, and the Publisher conformance fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::config::Credentials;
use aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, MessageSystemAttributeName, QueueAttributeName,
};
use aws_sdk_sqs::Client;
use base64::Engine;

use txoutbox_core::testkit::{
    publisher_suite, BrokerFixture, Built, CloudEventsBinding, Outage, OwnServer, PublisherFixture,
    Received, Setup,
};
use txoutbox_core::{ErrorKind, Event, Publisher};

use crate::{SqsConfig, SqsPublisher, DELAY_HEADER, ENCODING, FOLDED_HEADERS};

/// `SQS_ENDPOINT_URL`, or the local emulator.
pub fn endpoint() -> String {
    std::env::var("SQS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".to_string())
}

/// An SDK client for the test endpoint, with the emulator's fixed credentials.
pub fn client() -> Client {
    client_at(&endpoint())
}

/// An SDK client for the endpoint at `url` (an emulator of the test's own, say).
pub fn client_at(url: &str) -> Client {
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(url)
        .credentials_provider(Credentials::new("test", "test", None, None, "outbox-tests"))
        .http_client(crate::https_client())
        .build();
    Client::from_conf(conf)
}

/// Starts an SQS endpoint of the test's own (moto's server through `scripts/sqs-endpoint.py`) on
/// `127.0.0.1:<port>`, its log going to `stderr`: `$SQS_ENDPOINT_BIN`, else the launcher
/// `scripts/test-env.sh` installed in `.tools/bin`.
pub fn spawn_endpoint(port: u16, stderr: std::process::Stdio) -> std::process::Child {
    endpoint_tool().spawn(&["-H", "127.0.0.1", "-p", &port.to_string()], stderr)
}

/// As [`spawn_endpoint`], recording every message the endpoint accepts in `send_log` (one line
/// `<queue name> TAB <deduplication id>`, appended; see `scripts/sqs-endpoint.py`): read it with
/// [`sends`].
pub fn spawn_recording_endpoint(
    port: u16,
    stderr: std::process::Stdio,
    send_log: &Path,
) -> std::process::Child {
    let mut tool = endpoint_tool();
    tool.env
        .push(("SQS_SEND_LOG".into(), send_log.as_os_str().to_owned()));
    tool.spawn(&["-H", "127.0.0.1", "-p", &port.to_string()], stderr)
}

fn endpoint_tool() -> txoutbox_core::testkit::Tool {
    txoutbox_core::testkit::Tool::new("SQS_ENDPOINT_BIN", "sqs-endpoint", "an SQS endpoint")
}

/// The event ids sent to the queue `queue_name`, one per message the endpoint accepted (a re-sent
/// event id counts again, even where the FIFO queue dropped it), in the order accepted.
pub fn sends(send_log: &Path, queue_name: &str) -> Vec<uuid::Uuid> {
    let text = std::fs::read_to_string(send_log).unwrap_or_default();
    text.lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(queue, _)| *queue == queue_name)
        .map(|(_, id)| {
            uuid::Uuid::parse_str(id)
                .unwrap_or_else(|e| panic!("{}: deduplication id {id:?}: {e}", send_log.display()))
        })
        .collect()
}

/// An SQS endpoint of the test's own on a spare loopback port that records what it accepts
/// ([`spawn_recording_endpoint`]); killed when dropped.
pub struct RecordingEndpoint {
    pub url: String,
    pub send_log: PathBuf,
    _process: txoutbox_core::testkit::OwnedProcess,
}

impl RecordingEndpoint {
    /// Starts it and waits (up to 60 s) until it serves requests.
    pub async fn start() -> RecordingEndpoint {
        let port = txoutbox_core::testkit::free_port();
        let send_log = std::env::temp_dir().join(format!(
            "outbox-test-sqs-sends-{}.log",
            uuid::Uuid::new_v4().simple()
        ));
        let process = txoutbox_core::testkit::OwnedProcess(spawn_recording_endpoint(
            port,
            std::process::Stdio::null(),
            &send_log,
        ));
        let url = format!("http://127.0.0.1:{port}");
        wait_until_serving(&url).await;
        let mut process = process;
        assert!(
            process.0.try_wait().unwrap().is_none(),
            "the SQS endpoint of the test exited (port {port} taken by another program?): what answers \
             there is not it; run the test again"
        );
        RecordingEndpoint {
            url,
            send_log,
            _process: process,
        }
    }
}

impl Drop for RecordingEndpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.send_log);
    }
}

/// Waits (up to 60 s) until the endpoint at `url` answers an SQS request.
pub async fn wait_until_serving(url: &str) {
    let client = client_at(url);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match client.list_queues().send().await {
            Ok(_) => return,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                panic!("the SQS endpoint at {url} did not start serving within 60 s: {e:?}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A message as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub received: Received,
    pub group_id: Option<String>,
    pub attributes: BTreeMap<String, String>,
}

/// A queue of its own (FIFO or standard), drained in the background.
pub struct Fixture {
    pub endpoint: String,
    pub queue_url: String,
    pub queue_name: String,
    pub got: Arc<Mutex<Vec<Delivered>>>,
    /// What the consumer's requests failed with (a consumer error is not a lost message).
    pub errors: Arc<Mutex<Vec<String>>>,
    /// Where the endpoint records the messages it accepts, when it does ([`RecordingEndpoint`]).
    pub send_log: Option<PathBuf>,
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
    /// The consumer is paused with no receive in flight.
    holding: Arc<AtomicBool>,
    done: Arc<tokio::sync::Notify>,
    finished: Arc<AtomicBool>,
    _endpoint: Option<Arc<RecordingEndpoint>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Fixture {
    /// A new queue on the test endpoint ([`endpoint`]).
    pub async fn new(fifo: bool) -> Fixture {
        let mut name = format!("outbox-test-{}", uuid::Uuid::new_v4().simple());
        if fifo {
            name.push_str(".fifo");
        }
        Fixture::create_at(&endpoint(), &name).await
    }

    /// A new FIFO queue on an endpoint of its own that records every message it accepts, so that
    /// [`Fixture::sends`] sees re-sent events the queue deduplicates.
    pub async fn recording() -> Fixture {
        let endpoint = Arc::new(RecordingEndpoint::start().await);
        let name = format!("outbox-test-{}.fifo", uuid::Uuid::new_v4().simple());
        let mut fx = Fixture::create_at(&endpoint.url, &name).await;
        fx.send_log = Some(endpoint.send_log.clone());
        fx._endpoint = Some(endpoint);
        fx
    }

    /// Every event id the endpoint accepted for this queue, re-sends included; `None` when the
    /// endpoint does not record them.
    pub fn sends(&self) -> Option<Vec<uuid::Uuid>> {
        self.send_log
            .as_deref()
            .map(|log| sends(log, &self.queue_name))
    }

    /// The same queue name at the same endpoint, declared again and consumed by a new consumer,
    /// recording sends in the same log (after a restart of an endpoint that keeps nothing).
    pub async fn recreate(&self) -> Fixture {
        let mut fx = Fixture::create_at(&self.endpoint, &self.queue_name).await;
        fx.send_log.clone_from(&self.send_log);
        fx._endpoint.clone_from(&self._endpoint);
        fx
    }

    /// Creates the queue `name` (FIFO when it ends in `.fifo`) at the endpoint `url` and drains it.
    pub async fn create_at(endpoint: &str, name: &str) -> Fixture {
        let client = client_at(endpoint);
        let name = name.to_string();
        let mut create = client.create_queue();
        if name.ends_with(".fifo") {
            create = create
                .attributes(QueueAttributeName::FifoQueue, "true")
                .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
        }
        let out = create.queue_name(&name).send().await.unwrap_or_else(|e| {
            panic!(
                "an SQS endpoint is required for this test and is unreachable at {}: {e:?}\n\
                 Start one with `bash scripts/test-env.sh` (it installs and starts moto's server on 127.0.0.1:4566), \
                 or point SQS_ENDPOINT_URL at a running endpoint.",
                endpoint
            )
        });
        let queue_url = out.queue_url().unwrap().to_string();
        let got: Arc<Mutex<Vec<Delivered>>> = Arc::default();
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let holding = Arc::new(AtomicBool::new(false));
        let held = holding.clone();
        let done = Arc::new(tokio::sync::Notify::new());
        let finished = Arc::new(AtomicBool::new(false));
        let (sink, halt, hold, url) =
            (got.clone(), stop.clone(), paused.clone(), queue_url.clone());
        let (failures, ended, ended_flag) = (errors.clone(), done.clone(), finished.clone());
        tokio::spawn(async move {
            while !halt.load(Ordering::SeqCst) {
                if hold.load(Ordering::SeqCst) {
                    held.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                held.store(false, Ordering::SeqCst);
                let out = match client
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .message_attribute_names("All")
                    .message_system_attribute_names(MessageSystemAttributeName::All)
                    .send()
                    .await
                {
                    Ok(out) => out,
                    Err(e) => {
                        failures.lock().unwrap().push(format!("{e:?}"));
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                let mut deletes = Vec::new();
                for (i, m) in out.messages().iter().enumerate() {
                    let mut attributes = BTreeMap::new();
                    for (k, v) in m.message_attributes().cloned().unwrap_or_default() {
                        attributes.insert(k, v.string_value().unwrap_or_default().to_string());
                    }
                    let mut headers = attributes.clone();
                    if let Some(folded) = attributes.get(FOLDED_HEADERS) {
                        let more: BTreeMap<String, String> =
                            serde_json::from_str(folded).unwrap_or_default();
                        headers.extend(more);
                    }
                    let body = m.body().unwrap_or_default();
                    let payload = if attributes.get(ENCODING).map(String::as_str) == Some("base64")
                    {
                        base64::engine::general_purpose::STANDARD
                            .decode(body)
                            .unwrap_or_default()
                    } else {
                        body.as_bytes().to_vec()
                    };
                    let system: HashMap<_, _> = m.attributes().cloned().unwrap_or_default();
                    let received = Received {
                        // The consumer-side helper users call: every check of the suite reads ids with it.
                        event_id: crate::event_id(m),
                        aggregate_id: headers.get(txoutbox_core::header::AGGREGATE_ID).cloned(),
                        event_type: headers.get(txoutbox_core::header::EVENT_TYPE).cloned(),
                        payload,
                        content_type: headers.get(txoutbox_core::header::CONTENT_TYPE).cloned(),
                        headers,
                        destination: url.clone(),
                    };
                    sink.lock().unwrap().push(Delivered {
                        received,
                        group_id: system
                            .get(&MessageSystemAttributeName::MessageGroupId)
                            .cloned(),
                        attributes,
                    });
                    if let Some(h) = m.receipt_handle() {
                        deletes.push(
                            DeleteMessageBatchRequestEntry::builder()
                                .id(i.to_string())
                                .receipt_handle(h)
                                .build()
                                .unwrap(),
                        );
                    }
                }
                if !deletes.is_empty() {
                    if let Err(e) = client
                        .delete_message_batch()
                        .queue_url(&url)
                        .set_entries(Some(deletes))
                        .send()
                        .await
                    {
                        failures.lock().unwrap().push(format!("{e:?}"));
                    }
                }
            }
            ended_flag.store(true, Ordering::SeqCst);
            ended.notify_waiters();
        });
        Fixture {
            endpoint: endpoint.to_string(),
            queue_url,
            queue_name: name,
            got,
            errors,
            send_log: None,
            stop,
            paused,
            holding,
            done,
            finished,
            _endpoint: None,
        }
    }

    /// Stops reading (and deleting) messages until [`Fixture::resume`]: SQS emulators may only
    /// deduplicate against messages still in the queue. Returns once no receive is in flight.
    pub async fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self.holding.load(Ordering::SeqCst) && !self.finished.load(Ordering::SeqCst) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the SQS consumer did not pause within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Reads messages again.
    pub fn resume(&self) {
        self.holding.store(false, Ordering::SeqCst);
        self.paused.store(false, Ordering::SeqCst);
    }

    pub fn config(&self) -> SqsConfig {
        SqsConfig {
            queue: self.queue_name.clone(),
            endpoint_url: Some(self.endpoint.clone()),
            ..SqsConfig::default()
        }
    }

    pub fn publisher(&self) -> Arc<SqsPublisher> {
        Arc::new(SqsPublisher::from_client(client_at(&self.endpoint), self.config()).unwrap())
    }

    /// Stops the background consumer (as dropping the fixture does).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Stops the background consumer and waits (up to 30 s) until its last request is done, so that
    /// [`Fixture::got`] holds everything it will ever read.
    pub async fn stop_and_join(&self) {
        self.stop();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self.finished.load(Ordering::SeqCst) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the SQS test consumer did not stop within 30 s"
            );
            let _ = tokio::time::timeout(Duration::from_millis(100), self.done.notified()).await;
        }
    }

    /// Waits (up to `within`) until the queue holds no message, visible or in flight: the consumer
    /// has read and deleted everything sent so far.
    pub async fn wait_until_empty(&self, within: Duration) {
        let client = client_at(&self.endpoint);
        let deadline = tokio::time::Instant::now() + within;
        let mut empty_reads = 0;
        loop {
            let out = client
                .get_queue_attributes()
                .queue_url(&self.queue_url)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
                .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
                .send()
                .await
                .unwrap();
            let held: u64 = out
                .attributes()
                .map(|a| a.values().filter_map(|v| v.parse::<u64>().ok()).sum())
                .unwrap_or(0);
            // The endpoint keeps its counts 100 ms: two empty reads 150 ms apart.
            empty_reads = if held == 0 { empty_reads + 1 } else { 0 };
            if empty_reads >= 2 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the queue still holds {held} messages after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
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
        let defaults = SqsConfig::default();
        let publisher = SqsPublisher::from_client(
            client_at(&self.endpoint),
            SqsConfig {
                max_message_bytes: setup
                    .max_message_bytes
                    .unwrap_or(defaults.max_message_bytes),
                allowed_destinations: setup.allowed_destinations,
                ..self.config()
            },
        )
        .unwrap()
        .with_format(setup.format);
        let publisher = Arc::new(match setup.destination_cache {
            Some(n) => publisher.with_queue_url_cache(n),
            None => publisher,
        });
        let view = publisher.clone();
        Built {
            publisher,
            cached_destinations: Some(Box::new(move || view.cached_queue_urls())),
        }
    }

    fn destination(&self) -> String {
        self.queue_name.clone()
    }

    fn missing_destination(&self) -> String {
        format!(
            "outbox-test-no-such-queue-{}",
            uuid::Uuid::new_v4().simple()
        )
    }

    /// On a standard queue, delays over SQS's 900 s (refused per entry of a batch, next to the
    /// entries it takes); a FIFO queue has no per-message delay, and the publisher makes any other
    /// content fit.
    fn cloudevents_binding(&self) -> CloudEventsBinding {
        CloudEventsBinding::Sqs
    }

    fn poison(&self) -> Vec<(Event, ErrorKind, &'static str)> {
        if self.queue_name.ends_with(".fifo") {
            return Vec::new();
        }
        [("delay-1000", "1000"), ("delay-5000", "5000")]
            .into_iter()
            .map(|(aggregate, seconds)| {
                let mut e = publisher_suite::event(aggregate, 0);
                e.headers.insert(DELAY_HEADER.into(), seconds.into());
                (e, ErrorKind::InvalidInput, "DelaySeconds")
            })
            .collect()
    }

    async fn sibling(&self) -> Box<dyn BrokerFixture> {
        Box::new(Fixture::create_at(&self.endpoint, &sibling_name(&self.queue_name)).await)
    }

    /// An endpoint of the test's own on a spare loopback port, stopped and started again on it
    /// (it keeps nothing: its queue is created again, as an operator would).
    async fn outage(&self) -> Box<dyn Outage> {
        let endpoint = OwnEndpoint(OwnServer::new("moto"));
        endpoint.start().await;
        Box::new(endpoint)
    }
}

/// A new queue name of the same kind (FIFO or standard) as `name`.
fn sibling_name(name: &str) -> String {
    let mut sibling = format!("outbox-test-{}", uuid::Uuid::new_v4().simple());
    if name.ends_with(".fifo") {
        sibling.push_str(".fifo");
    }
    sibling
}

/// An SQS endpoint of the test's own, with the queue `outbox-faults`.
struct OwnEndpoint(OwnServer);

impl OwnEndpoint {
    const QUEUE: &'static str = "outbox-faults";

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.0.port())
    }

    /// A client that gives up quickly on an endpoint that is down.
    fn client(&self) -> Client {
        let conf = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .endpoint_url(self.url())
            .credentials_provider(Credentials::new("test", "test", None, None, "outbox-tests"))
            .http_client(crate::https_client())
            .timeout_config(
                aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
                    .operation_timeout(Duration::from_secs(5))
                    .connect_timeout(Duration::from_secs(1))
                    .build(),
            )
            .build();
        Client::from_conf(conf)
    }
}

#[async_trait]
impl Outage for OwnEndpoint {
    async fn publisher(&self) -> Arc<dyn Publisher> {
        Arc::new(
            SqsPublisher::from_client(
                self.client(),
                SqsConfig {
                    queue: Self::QUEUE.into(),
                    endpoint_url: Some(self.url()),
                    ..SqsConfig::default()
                },
            )
            .unwrap(),
        )
    }

    async fn stop(&self) {
        self.0.stop();
    }

    async fn start(&self) {
        self.0
            .start(|port| spawn_endpoint(port, std::process::Stdio::null()))
            .await;
        wait_until_serving(&self.url()).await;
        self.client()
            .create_queue()
            .queue_name(Self::QUEUE)
            .send()
            .await
            .unwrap_or_else(|e| panic!("creating {} again: {e:?}", Self::QUEUE));
    }
}
