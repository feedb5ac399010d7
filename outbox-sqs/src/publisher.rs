//! The SQS publisher: `SendMessageBatch` in requests of at most 10 entries and 1 MiB, many in flight,
//! one outcome per event from the per-entry results.

use std::collections::{BTreeMap, HashMap, HashSet};

use outbox_core::cache::{BoundedCache, DEFAULT_DESTINATION_CACHE};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use async_trait::async_trait;
use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::config::retry::RetryConfig;
use aws_sdk_sqs::config::timeout::TimeoutConfig;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use aws_sdk_sqs::Client;
use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
use base64::Engine;
use futures::future::join_all;
use tracing::debug;

use outbox_core::format::{Formatter, MessageFormat};
use outbox_core::publishers::{finish, Fence};
use outbox_core::routing::{AllowList, Template};
use outbox_core::{header, Error, ErrorKind, Event, PublishOutcome, Publisher};

use crate::config::{SqsConfig, SQS_MAX_BYTES};
use crate::error::{map_entry_failure, map_sdk};

/// Most entries in one `SendMessageBatch` request.
pub const MAX_BATCH_ENTRIES: usize = 10;
/// Most message attributes SQS accepts on one message.
pub const MAX_ATTRIBUTES: usize = 10;
/// The attribute that carries the event headers that do not fit in attributes of their own.
pub const FOLDED_HEADERS: &str = "outbox-headers";
/// The attribute set to `base64` when the body is the base64 of a payload SQS cannot carry as text.
pub const ENCODING: &str = "outbox-encoding";
/// Event header read as the message's `DelaySeconds` (standard queues), passed to SQS as is.
pub const DELAY_HEADER: &str = "outbox-delay-seconds";

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

/// One event, ready to send.
struct Prepared {
    index: usize,
    queue_url: String,
    aggregate: (String, String),
    entry: SendMessageBatchRequestEntry,
    size: usize,
}

/// An HTTPS client on rustls with the ring provider (the workspace's one TLS stack).
pub fn https_client() -> aws_sdk_sqs::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https()
}

fn valid_sqs_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

/// JSON text with every character SQS refuses written as a `\uXXXX` escape (still the same JSON).
fn sqs_safe_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if valid_sqs_char(c) {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

fn valid_attribute_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

fn valid_group_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 128 && id.chars().all(|c| c.is_ascii_graphic())
}

/// The FIFO group of an aggregate: its id, or a stable hash when SQS would refuse the id.
pub fn message_group_id(aggregate_type: &str, aggregate_id: &str) -> String {
    if valid_group_id(aggregate_id) {
        return aggregate_id.to_string();
    }
    // FNV-1a: stable across processes and releases, so one aggregate keeps one group.
    let mut fnv: u64 = 0xcbf2_9ce4_8422_2325;
    for b in aggregate_type
        .bytes()
        .chain([0u8])
        .chain(aggregate_id.bytes())
    {
        fnv ^= u64::from(b);
        fnv = fnv.wrapping_mul(0x0100_0000_01b3);
    }
    format!("aggregate-{fnv:016x}")
}

fn is_fifo(queue: &str) -> bool {
    queue.trim_end_matches('/').ends_with(".fifo")
}

pub(crate) fn attribute(value: &str) -> Result<MessageAttributeValue, Error> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("invalid message attribute: {e}"),
            )
        })
}

/// The prefix of CloudEvents attributes in binary mode: SQS has no CloudEvents binding, so they are
/// named as the HTTP binding names its headers (`ce-id`, ...; `content-type` is `datacontenttype`).
pub const CLOUDEVENTS_PREFIX: &str = "ce-";

/// How many CloudEvents attributes travel as message attributes in binary mode: `specversion`,
/// `id`, `source`, `type`, `time` and `subject` (with `content-type`, seven of SQS's ten; the
/// `partitionkey` and `aggregatetype` extensions are left out, the aggregate being the subject).
pub const CLOUDEVENTS_ATTRIBUTES: usize = 6;

/// The attributes the message format gives `event`: in CloudEvents binary mode the CloudEvents
/// attributes and `content-type` (in place of the `outbox-*` attributes, which would not leave
/// room: SQS allows ten); else `outbox-event-id`, `outbox-event-type`, `outbox-aggregate-type`,
/// `outbox-aggregate-id`, `content-type` (the format's) and the format's own (Debezium's `id` and
/// `eventType`).
fn base_attributes(event: &Event, format: &Formatter) -> Vec<(String, String)> {
    if format.format() == MessageFormat::CloudeventsBinary {
        return format
            .cloudevents_attributes(event)
            .into_iter()
            .take(CLOUDEVENTS_ATTRIBUTES)
            .map(|(k, v)| (format!("{CLOUDEVENTS_PREFIX}{k}"), v))
            .chain([(header::CONTENT_TYPE.to_string(), event.content_type.clone())])
            .collect();
    }
    [
        (header::EVENT_ID, event.id.to_string()),
        (header::EVENT_TYPE, event.event_type.clone()),
        (header::AGGREGATE_TYPE, event.aggregate_type.clone()),
        (header::AGGREGATE_ID, event.aggregate_id.clone()),
        (header::CONTENT_TYPE, format.content_type(event).to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain(format.headers(event, CLOUDEVENTS_PREFIX))
    .collect()
}

/// The attributes of `event` (at most 10) and their size in bytes, with the body encoding if any.
fn attributes(
    event: &Event,
    encoding: Option<&str>,
    format: &Formatter,
) -> (Vec<(String, String)>, usize) {
    let mut attrs: Vec<(String, String)> = Vec::with_capacity(MAX_ATTRIBUTES);
    let mut folded: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in base_attributes(event, format) {
        if !v.is_empty() && v.chars().all(valid_sqs_char) {
            attrs.push((k, v));
        } else {
            folded.insert(k, v);
        }
    }
    if let Some(enc) = encoding {
        attrs.push((ENCODING.to_string(), enc.to_string()));
    }
    // traceparent and tracestate first, then the rest by name.
    let mut headers: Vec<(&String, &String)> = event.headers.iter().collect();
    headers.sort_by_key(|(k, _)| match k.as_str() {
        header::TRACEPARENT => 0,
        header::TRACESTATE => 1,
        _ => 2,
    });
    let room = MAX_ATTRIBUTES - attrs.len();
    let fits_all = headers.len() <= room && folded.is_empty();
    let individual_room = if fits_all {
        room
    } else {
        room.saturating_sub(1)
    };
    for (k, v) in headers {
        let own = attrs.len() < individual_room + (MAX_ATTRIBUTES - room)
            && valid_attribute_name(k)
            && !v.is_empty()
            && v.chars().all(valid_sqs_char)
            && !attrs.iter().any(|(n, _)| n == k);
        if own {
            attrs.push((k.clone(), v.clone()));
        } else {
            folded.insert(k.clone(), v.clone());
        }
    }
    if !folded.is_empty() {
        let json = serde_json::to_string(&folded).unwrap_or_default();
        attrs.push((FOLDED_HEADERS.to_string(), sqs_safe_json(&json)));
    }
    let size = attrs
        .iter()
        .map(|(k, v)| k.len() + v.len() + "String".len())
        .sum();
    (attrs, size)
}

impl SqsPublisher {
    /// A publisher with `config`, credentials from the standard AWS chain.
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate.
    pub async fn new(config: SqsConfig) -> Result<Self, Error> {
        config.validate()?;
        let mut loader =
            aws_config::defaults(BehaviorVersion::latest()).http_client(https_client());
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

    /// Remembers at most `capacity` resolved queue URLs (default
    /// [`outbox_core::cache::DEFAULT_DESTINATION_CACHE`]); the least recently used is resolved again
    /// when next needed.
    pub fn with_queue_url_cache(self, capacity: usize) -> Self {
        SqsPublisher {
            urls: Mutex::new(BoundedCache::new(capacity)),
            ..self
        }
    }

    /// How many queue URLs are remembered now.
    pub fn cached_queue_urls(&self) -> usize {
        self.urls.lock().map_or(0, |m| m.len())
    }

    /// The SDK client (for tests and tools).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The settings in force.
    pub fn config(&self) -> &SqsConfig {
        &self.config
    }

    /// The URL of a queue given by URL or name (names resolved once, then cached).
    ///
    /// # Errors
    /// A permanent `destination_not_found` error when the queue does not exist.
    pub async fn queue_url(&self, queue: &str) -> Result<String, Error> {
        if queue.starts_with("https://") || queue.starts_with("http://") {
            return Ok(queue.to_string());
        }
        if let Some(url) = self
            .urls
            .lock()
            .ok()
            .and_then(|mut m| m.get(&queue.to_string()))
        {
            return Ok(url);
        }
        let out = self
            .client
            .get_queue_url()
            .queue_name(queue)
            .send()
            .await
            .map_err(|e| map_sdk("GetQueueUrl", e).with_context("queue", queue))?;
        let url = out.queue_url().unwrap_or_default().to_string();
        if url.is_empty() {
            return Err(Error::new(
                ErrorKind::Unexpected,
                format!("SQS returned no URL for queue {queue:?}"),
            )
            .temporary());
        }
        if let Ok(mut m) = self.urls.lock() {
            m.insert(queue.to_string(), url.clone());
        }
        Ok(url)
    }

    fn forget(&self, queue_url: &str) {
        if let Ok(mut m) = self.urls.lock() {
            m.retain(|_, v| v != queue_url);
        }
    }

    fn prepare(&self, index: usize, event: &Event, queue_url: String) -> Result<Prepared, Error> {
        let format = self.format.format();
        let body = self.format.body(event);
        let (body, encoding) = match std::str::from_utf8(&body) {
            Ok(text) if text.chars().all(valid_sqs_char) => (text.to_string(), None),
            // The JSON event with the characters SQS refuses escaped: the same JSON.
            Ok(text) if format == MessageFormat::CloudeventsStructured => {
                (sqs_safe_json(text), None)
            }
            _ if format == MessageFormat::CloudeventsBinary => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "the payload ({} bytes of {}) is not text SQS can carry (binary, or characters SQS refuses), \
                         so in CloudEvents binary mode no CloudEvents consumer could read it as sent: \
                         use publisher.format = \"cloudevents-structured\" (bytes travel in data_base64)",
                        event.payload.len(),
                        event.content_type
                    ),
                )
                .with_context("adapter", "sqs"));
            }
            _ => (
                base64::engine::general_purpose::STANDARD.encode(&body),
                Some("base64"),
            ),
        };
        if format == MessageFormat::CloudeventsBinary {
            // Every CloudEvents attribute travels as an attribute of its own, never folded.
            if let Some((name, _)) = base_attributes(event, &self.format)
                .into_iter()
                .find(|(_, v)| v.is_empty() || !v.chars().all(valid_sqs_char))
            {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "the CloudEvents attribute {name} is empty or has characters SQS refuses in a message attribute: \
                         use publisher.format = \"cloudevents-structured\""
                    ),
                )
                .with_context("adapter", "sqs"));
            }
        }
        let (attrs, attr_size) = attributes(event, encoding, &self.format);
        let size = body.len() + attr_size;
        if size > self.config.max_message_bytes {
            return Err(Error::new(
                ErrorKind::PayloadTooLarge,
                format!(
                    "the message is {size} bytes (body and attributes); sqs.max_message_bytes is {}",
                    self.config.max_message_bytes
                ),
            ));
        }
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body);
        for (k, v) in &attrs {
            entry = entry.message_attributes(k, attribute(v)?);
        }
        if is_fifo(&queue_url) {
            entry = entry
                .message_group_id(message_group_id(&event.aggregate_type, &event.aggregate_id))
                .message_deduplication_id(event.id.simple().to_string());
        } else if let Some(delay) = event.headers.get(DELAY_HEADER) {
            let seconds: i32 = delay.trim().parse().map_err(|_| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "header {DELAY_HEADER} = {delay:?}: expected a whole number of seconds"
                    ),
                )
            })?;
            entry = entry.delay_seconds(seconds);
        }
        let entry = entry
            .build()
            .map_err(|e| Error::new(ErrorKind::InvalidInput, format!("invalid SQS entry: {e}")))?;
        Ok(Prepared {
            index,
            queue_url,
            aggregate: (event.aggregate_type.clone(), event.aggregate_id.clone()),
            entry,
            size,
        })
    }

    /// Sends one lane's events in order, in requests of at most 10 entries and 1 MiB.
    async fn send_lane(
        &self,
        lane: Vec<Prepared>,
        events: &[Event],
        started: tokio::time::Instant,
    ) -> Vec<(usize, PublishOutcome)> {
        let mut results = Vec::with_capacity(lane.len());
        let mut fenced: HashSet<(String, String)> = HashSet::new();
        let mut broken: Option<Error> = None;
        let mut rest = lane.into_iter().peekable();
        // Requests start only within half of sqs.operation_timeout from the start of the call
        // (`started`: queue resolution included), each bounded by all of it: a call lasts at most
        // 1.5 x sqs.operation_timeout (`call_limit`).
        while rest.peek().is_some() {
            if started.elapsed() >= self.config.operation_timeout / 2 {
                // Never sent: back-pressure, so no attempt is counted for it.
                let late = Error::new(
                    ErrorKind::Backpressure,
                    format!(
                        "not sent: half of sqs.operation_timeout = {} passed before this request's turn",
                        outbox_core::duration::format(self.config.operation_timeout)
                    ),
                )
                .with_context("adapter", "sqs");
                results.extend(rest.map(|p| (p.index, Err(late.clone()))));
                break;
            }
            // Next request: consecutive events for one queue.
            let mut chunk: Vec<Prepared> = Vec::new();
            let mut bytes = 0;
            while let Some(next) = rest.peek() {
                let same_queue = chunk.first().is_none_or(|c| c.queue_url == next.queue_url);
                if !same_queue
                    || chunk.len() == MAX_BATCH_ENTRIES
                    || bytes + next.size > SQS_MAX_BYTES
                {
                    break;
                }
                let Some(p) = rest.next() else { break };
                if let Some(e) = &broken {
                    results.push((p.index, Err(e.clone())));
                    continue;
                }
                if fenced.contains(&p.aggregate) {
                    results.push((p.index, Err(Fence::not_sent("sqs"))));
                    continue;
                }
                bytes += p.size;
                chunk.push(p);
            }
            if chunk.is_empty() {
                continue;
            }
            let queue_url = chunk[0].queue_url.clone();
            let entries: Vec<SendMessageBatchRequestEntry> =
                chunk.iter().map(|p| p.entry.clone()).collect();
            debug!(queue = %queue_url, entries = entries.len(), bytes, "SendMessageBatch");
            let sent = self
                .client
                .send_message_batch()
                .queue_url(&queue_url)
                .set_entries(Some(entries))
                .send()
                .await;
            match sent {
                Ok(out) => {
                    let ok: HashSet<&str> = out.successful().iter().map(|s| s.id()).collect();
                    let failed: HashMap<&str, _> =
                        out.failed().iter().map(|f| (f.id(), f)).collect();
                    for p in &chunk {
                        let id = p.index.to_string();
                        let outcome = if ok.contains(id.as_str()) {
                            Ok(())
                        } else if let Some(f) = failed.get(id.as_str()) {
                            Err(map_entry_failure(f))
                        } else {
                            Err(Error::new(
                                ErrorKind::Unexpected,
                                "SQS reported no result for this message",
                            )
                            .temporary())
                        };
                        if outcome.is_err() {
                            fenced.insert(p.aggregate.clone());
                        }
                        results.push((
                            p.index,
                            outcome.map_err(|e| e.with_context("event_id", events[p.index].id)),
                        ));
                    }
                }
                Err(err) => {
                    let e = map_sdk("SendMessageBatch", err).with_context("queue", &queue_url);
                    if e.kind() == ErrorKind::DestinationNotFound {
                        self.forget(&queue_url);
                    } else if matches!(e.kind(), ErrorKind::Connection | ErrorKind::Timeout) {
                        broken = Some(e.clone());
                    }
                    for p in &chunk {
                        fenced.insert(p.aggregate.clone());
                        results.push((
                            p.index,
                            Err(e.clone().with_context("event_id", events[p.index].id)),
                        ));
                    }
                }
            }
        }
        results
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    fn call_limit(&self) -> Option<outbox_core::CallLimit> {
        Some(outbox_core::CallLimit {
            limit: self.config.operation_timeout.mul_f64(1.5),
            settings: format!(
                "1.5 x sqs.operation_timeout {}",
                outbox_core::duration::format(self.config.operation_timeout)
            ),
        })
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
                (Ok(()), None) => {
                    Err(Error::new(ErrorKind::Unexpected, "queue not resolved").temporary())
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(headers: &[(&str, &str)]) -> Event {
        Event {
            id: outbox_core::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            event_type: "order.created".into(),
            payload: b"{}".to_vec(),
            content_type: "application/json".into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            destination: None,
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    fn names(attrs: &[(String, String)]) -> Vec<&str> {
        attrs.iter().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn few_headers_get_attributes_of_their_own() {
        let (attrs, size) = attributes(
            &ev(&[("traceparent", "00-abc-01"), ("x-tenant", "acme")]),
            None,
            &Formatter::default(),
        );
        assert_eq!(
            names(&attrs),
            [
                "outbox-event-id",
                "outbox-event-type",
                "outbox-aggregate-type",
                "outbox-aggregate-id",
                "content-type",
                "traceparent",
                "x-tenant"
            ]
        );
        assert!(size > 0);
    }

    #[test]
    fn each_format_fits_its_attributes_in_ten() {
        let e = ev(&[
            ("traceparent", "00-abc-01"),
            ("tracestate", "a=b"),
            ("x-tenant", "acme"),
        ]);
        let format = |f| Formatter::new(f, "s", "/shop/{aggregate_type}").unwrap();
        let (attrs, _) = attributes(
            &e,
            Some("base64"),
            &format(MessageFormat::CloudeventsBinary),
        );
        assert_eq!(
            names(&attrs),
            [
                "ce-specversion",
                "ce-id",
                "ce-source",
                "ce-type",
                "ce-time",
                "ce-subject",
                "content-type",
                "outbox-encoding",
                "traceparent",
                "outbox-headers"
            ]
        );
        let (attrs, _) = attributes(&e, None, &format(MessageFormat::Debezium));
        assert_eq!(names(&attrs)[5..7], ["id", "eventType"]);
        assert_eq!(attrs.len(), MAX_ATTRIBUTES);
        let (attrs, _) = attributes(&e, None, &format(MessageFormat::CloudeventsStructured));
        assert_eq!(attrs[4].1, outbox_core::format::CLOUDEVENTS_JSON);
    }

    #[test]
    fn what_does_not_fit_is_folded_into_one_json_attribute() {
        let many: Vec<(String, String)> =
            (0..8).map(|i| (format!("h{i}"), format!("v{i}"))).collect();
        let mut headers: Vec<(&str, &str)> =
            many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        headers.push(("traceparent", "00-abc-01"));
        headers.push(("bad name!", "x"));
        let (attrs, _) = attributes(&ev(&headers), Some("base64"), &Formatter::default());
        assert_eq!(attrs.len(), MAX_ATTRIBUTES, "never more than SQS allows");
        let n = names(&attrs);
        assert!(
            n.contains(&"traceparent"),
            "trace context keeps its own attribute: {n:?}"
        );
        assert!(n.contains(&ENCODING));
        let folded: BTreeMap<String, String> =
            serde_json::from_str(&attrs.last().unwrap().1).unwrap();
        assert_eq!(attrs.last().unwrap().0, FOLDED_HEADERS);
        assert!(folded.contains_key("bad name!"));
        // Every header is somewhere: in its own attribute or folded.
        for (k, _) in &headers {
            assert!(n.contains(k) || folded.contains_key(*k), "{k} lost");
        }
    }

    #[test]
    fn folded_json_escapes_what_sqs_refuses() {
        let json = serde_json::to_string(&BTreeMap::from([("k", "a\u{FFFF}b")])).unwrap();
        let safe = sqs_safe_json(&json);
        assert!(safe.chars().all(valid_sqs_char), "{safe}");
        let back: BTreeMap<String, String> = serde_json::from_str(&safe).unwrap();
        assert_eq!(back["k"], "a\u{FFFF}b");
    }

    #[test]
    fn group_ids_are_stable_and_valid() {
        assert_eq!(message_group_id("order", "42"), "42");
        let odd = message_group_id("order", "with space é");
        assert_eq!(odd, message_group_id("order", "with space é"), "stable");
        assert!(valid_group_id(&odd));
        assert_ne!(odd, message_group_id("customer", "with space é"));
        assert!(is_fifo("https://sqs.us-east-1.amazonaws.com/1/orders.fifo"));
        assert!(!is_fifo("orders"));
    }

    #[test]
    fn attribute_names_follow_sqs_rules() {
        for ok in ["traceparent", "x-tenant", "a.b_c"] {
            assert!(valid_attribute_name(ok), "{ok}");
        }
        for bad in [
            "",
            "AWS.thing",
            "amazon.x",
            ".a",
            "a.",
            "a..b",
            "sp ace",
            "ü",
        ] {
            assert!(!valid_attribute_name(bad), "{bad}");
        }
        assert!(
            valid_sqs_char('a')
                && valid_sqs_char('\n')
                && !valid_sqs_char('\u{0}')
                && !valid_sqs_char('\u{FFFF}')
        );
    }
}
