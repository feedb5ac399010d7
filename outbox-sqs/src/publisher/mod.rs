//! The SQS publisher: `SendMessageBatch` in requests of at most 10 entries and 1 MiB, many in flight,
//! one outcome per event from the per-entry results. Its parts: `attributes` (an event's message
//! attributes), `entry` (the entry an event becomes), `queues` (names resolved to URLs) and `send`
//! (a lane's requests); this module holds the publisher and its calls.

pub(crate) mod attributes;
mod entry;
mod queues;
mod send;

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::config::retry::RetryConfig;
use aws_sdk_sqs::config::timeout::TimeoutConfig;
use aws_sdk_sqs::Client;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider, TlsContext, TrustStore};
use futures::future::join_all;

use txoutbox_core::cache::{BoundedCache, DEFAULT_DESTINATION_CACHE};
use txoutbox_core::format::Formatter;
use txoutbox_core::publishers::{finish, Fence};
use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{Error, Event, PublishOutcome, Publisher};

use crate::config::SqsConfig;
use crate::error::{self, map_sdk};
pub use attributes::{ENCODING, FOLDED_HEADERS, MAX_ATTRIBUTES};
use entry::{is_fifo, Prepared};
pub use entry::{message_group_id, DELAY_HEADER};
pub use send::MAX_BATCH_ENTRIES;

/// Publishes events to SQS queues.
///
/// - Queue: the [`SqsConfig::queue`] template or the event's destination; names are resolved to URLs
///   once and cached. A queue whose name ends in `.fifo` gets `MessageGroupId` = aggregate id (a
///   stable hash when the id has characters SQS refuses) and `MessageDeduplicationId` = event id.
/// - Body: the payload as text; a payload that is not valid SQS text (binary, control characters) is
///   sent base64-encoded with the attribute `outbox-encoding = base64`.
/// - Attributes (SQS allows 10): `outbox-event-id`, `outbox-event-type`, `outbox-aggregate-type`,
///   `outbox-aggregate-id`, `content-type`, then event headers (`traceparent`, `tracestate` first).
///   Headers that do not fit, or whose name or value SQS refuses, are folded into one attribute,
///   `outbox-headers`, a JSON object.
/// - Requests of at most 10 entries and 1 MiB, up to `max_concurrent_requests` in flight. Events of
///   one aggregate always travel in the same lane, in order, so a split batch keeps per-aggregate
///   order; after a failure the lane sends no later event of that aggregate.
pub struct SqsPublisher {
    client: Client,
    config: SqsConfig,
    queue: Template,
    /// Which queues events may name (`sqs.allowed_destinations`).
    allowed: AllowList,
    /// Queue names resolved to URLs, the most recently used ones (any writer can name any queue).
    urls: Mutex<BoundedCache<String, String>>,
    /// The message format.
    format: Formatter,
}

impl std::fmt::Debug for SqsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// An HTTPS client on rustls with the ring provider (the workspace's one TLS stack), trusting
/// the system's roots.
pub fn https_client() -> aws_sdk_sqs::config::SharedHttpClient {
    https_client_trusting(None)
}

/// As [`https_client`], also trusting the CA certificates of `ca_pem` (PEM text).
pub fn https_client_trusting(ca_pem: Option<&str>) -> aws_sdk_sqs::config::SharedHttpClient {
    let mut trust = TrustStore::default();
    if let Some(pem) = ca_pem {
        trust = trust.with_pem_certificate(pem.as_bytes().to_vec());
    }
    aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .tls_context(
            TlsContext::builder()
                .with_trust_store(trust)
                .build()
                .unwrap_or_default(),
        )
        .build_https()
}

impl SqsPublisher {
    /// A publisher with `config`, credentials from the standard AWS chain.
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate.
    pub async fn new(config: SqsConfig) -> Result<Self, Error> {
        config.validate()?;
        let ca = match &config.ca_file {
            Some(path) => Some(txoutbox_core::tls::read_ca_file(path, "sqs.ca_file")?),
            None => None,
        };
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(https_client_trusting(ca.as_deref()));
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some(url) = &config.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        let sdk = loader.load().await;
        let mut builder = aws_sdk_sqs::config::Builder::from(&sdk)
            .retry_config(RetryConfig::standard().with_max_attempts(config.sdk_max_attempts))
            .timeout_config(
                TimeoutConfig::builder()
                    .operation_timeout(config.operation_timeout)
                    .operation_attempt_timeout(config.attempt_timeout)
                    .connect_timeout(config.connect_timeout)
                    .build(),
            );
        if sdk.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        Self::from_client(Client::from_conf(builder.build()), config)
    }

    /// A publisher over an SDK client configured by the caller (credentials, endpoint, retries...);
    /// `config`'s timeouts and SDK retry settings are then the client's business.
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate.
    pub fn from_client(client: Client, config: SqsConfig) -> Result<Self, Error> {
        let queue = config.validate()?;
        let allowed = config.allow_list()?;
        if queue.is_fixed() && !is_fifo(queue.as_str()) {
            tracing::warn!(
                queue = queue.as_str(),
                "sqs.queue is a standard queue: SQS delivers its messages in best-effort order, so a consumer may \
                 see an aggregate's events out of order (the relay sends them in order); per-aggregate order at \
                 the consumer needs a FIFO queue (a name ending in .fifo)"
            );
        }
        Ok(SqsPublisher {
            client,
            config,
            queue,
            allowed,
            urls: Mutex::new(BoundedCache::new(DEFAULT_DESTINATION_CACHE)),
            format: Formatter::default(),
        })
    }

    /// Sends events in `format` (CloudEvents, Debezium's conventions; default the outbox's own).
    /// In CloudEvents binary mode the attributes are `ce-specversion`, `ce-id`, `ce-source`,
    /// `ce-type`, `ce-time`, `ce-subject` and `content-type`, in place of the `outbox-*` ones.
    pub fn with_format(self, format: Formatter) -> Self {
        SqsPublisher { format, ..self }
    }

    /// The SDK client (for tests and tools).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The settings in force.
    pub fn config(&self) -> &SqsConfig {
        &self.config
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    fn call_limit(&self) -> Option<txoutbox_core::CallLimit> {
        Some(self.config.call_limit())
    }

    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        let started = tokio::time::Instant::now();
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
        // Resolve every queue once.
        // Only queues events may go to are looked up: the others are refused below, unresolved.
        let queues: HashSet<String> = events
            .iter()
            .map(|e| self.queue.destination(e))
            .filter(|q| self.allowed.allows(q))
            .collect();
        let resolved = join_all(queues.into_iter().map(|q| async move {
            let url = self.queue_url(&q).await;
            (q, url)
        }))
        .await;
        let urls: HashMap<String, Result<String, Error>> = resolved.into_iter().collect();

        let lanes = self.config.max_concurrent_requests;
        let mut lane_items: Vec<Vec<Prepared>> = (0..lanes).map(|_| Vec::new()).collect();
        let mut fence = Fence::new();
        for (i, event) in events.iter().enumerate() {
            if fence.holds(event) {
                outcomes[i] = Some(Err(Fence::not_sent("sqs")));
                continue;
            }
            let queue = self.queue.destination(event);
            let prepared = match (self.allowed.check(&queue), urls.get(&queue)) {
                (Err(refused), _) => Err(refused),
                (Ok(()), Some(Ok(url))) => self.prepare(i, event, url.clone()),
                (Ok(()), Some(Err(e))) => Err(e.clone()),
                (Ok(()), None) => Err(error::queue_not_resolved()),
            };
            match prepared {
                Ok(p) => {
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    (&p.queue_url, &p.aggregate).hash(&mut h);
                    lane_items[(h.finish() % lanes as u64) as usize].push(p);
                }
                Err(e) => {
                    fence.close(event);
                    outcomes[i] = Some(Err(e
                        .with_context("adapter", "sqs")
                        .with_context("event_id", event.id)));
                }
            }
        }
        let sends = lane_items
            .into_iter()
            .filter(|l| !l.is_empty())
            .map(|lane| self.send_lane(lane, events, started));
        for (i, outcome) in join_all(sends).await.into_iter().flatten() {
            outcomes[i] = Some(outcome);
        }
        finish(outcomes)
    }

    async fn check(&self) -> Result<(), Error> {
        if self.queue.is_fixed() {
            // Ask the endpoint every time: the cache must not make a dead endpoint look ready.
            let url = self.queue_url(self.queue.as_str()).await?;
            self.client
                .get_queue_attributes()
                .queue_url(&url)
                .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| map_sdk("GetQueueAttributes", e).with_context("queue", &url))
        } else {
            self.client
                .list_queues()
                .max_results(1)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| map_sdk("ListQueues", e))
        }
    }

    fn name(&self) -> &str {
        "sqs"
    }
}
