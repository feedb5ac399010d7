//! Helpers for tests against a real SQS endpoint (feature `test-utils`): a queue of its own, a
//! consumer that reads and deletes its messages, and the Publisher conformance fixture.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::{BTreeMap, HashMap};
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

use outbox_core::testkit::{PublisherFixture, Received};
use outbox_core::Publisher;

use crate::{SqsConfig, SqsPublisher, ENCODING, FOLDED_HEADERS};

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
    outbox_core::testkit::spawn_tool(
        "SQS_ENDPOINT_BIN",
        "sqs-endpoint",
        "an SQS endpoint",
        &["-H", "127.0.0.1", "-p", &port.to_string()],
        stderr,
    )
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
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
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
        let stop = Arc::new(AtomicBool::new(false));
        let paused = Arc::new(AtomicBool::new(false));
        let (sink, halt, hold, url) =
            (got.clone(), stop.clone(), paused.clone(), queue_url.clone());
        tokio::spawn(async move {
            while !halt.load(Ordering::SeqCst) {
                if hold.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let Ok(out) = client
                    .receive_message()
                    .queue_url(&url)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .message_attribute_names("All")
                    .message_system_attribute_names(MessageSystemAttributeName::All)
                    .send()
                    .await
                else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
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
                        event_id: headers
                            .get(outbox_core::header::EVENT_ID)
                            .and_then(|v| v.parse().ok()),
                        aggregate_id: headers.get(outbox_core::header::AGGREGATE_ID).cloned(),
                        event_type: headers.get(outbox_core::header::EVENT_TYPE).cloned(),
                        payload,
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
                    let _ = client
                        .delete_message_batch()
                        .queue_url(&url)
                        .set_entries(Some(deletes))
                        .send()
                        .await;
                }
            }
        });
        Fixture {
            endpoint: endpoint.to_string(),
            queue_url,
            queue_name: name,
            got,
            stop,
            paused,
        }
    }

    /// Stops reading (and deleting) messages until [`Fixture::resume`]: SQS emulators may only
    /// deduplicate against messages still in the queue.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    /// Reads messages again.
    pub fn resume(&self) {
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

    pub async fn wait_for(&self, count: usize, timeout: Duration) -> Vec<Delivered> {
        outbox_core::testkit::wait_for_items(&self.got, count, timeout).await
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
