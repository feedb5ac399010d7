//! The Kafka publisher: a batch is enqueued to the producer at once; each outcome comes from the
//! event's own delivery report.

use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::sync::atomic::{AtomicU32, Ordering};
use tokio::time::Instant;
use tracing::{error, warn};

use outbox_core::format::Formatter;
use outbox_core::publishers::{finish, Fence};
use outbox_core::routing::{AllowList, Template};
use outbox_core::{header, Error, ErrorKind, Event, PublishOutcome, Publisher};

use crate::config::KafkaConfig;
use crate::error::{ends_session, map_kafka};

/// Time a delivery report gets past `message.timeout.ms` to reach the publisher.
const REPORT_MARGIN: Duration = Duration::from_secs(5);

/// Messages a producer may still hold after a call in which some timed out (copies the broker has
/// not taken, sent again meanwhile by later calls) before it is replaced (or twice the call's
/// events, when more): with no message timeout in its queue (see `KafkaConfig::idempotence`), a
/// partition that stays unwritable would otherwise collect copies up to librdkafka's queue limits.
const STALE_MESSAGES: i32 = 20_000;

/// How a call ended, for [`KafkaPublisher::recover`].
struct CallEnd {
    /// Every event timed out.
    all_timed_out: bool,
    /// Some event timed out.
    some_timed_out: bool,
    /// The producer's queue took none of the call's records, full for `enqueue_timeout`.
    all_queue_full: bool,
    /// The broker refused the producer's idempotence session.
    session_lost: bool,
    /// Events in the call.
    events: usize,
}

/// Longest legal Kafka topic name.
const MAX_TOPIC_LEN: usize = 249;

/// Publishes events to Kafka.
///
/// Events of one aggregate go to one partition of their topic, and with the idempotent producer (the
/// default) an aggregate's run goes in one call ([`Publisher::keeps_order`]): librdkafka writes
/// the records of a partition in the order sent, and never past one the broker refused
/// (`enable.gapless.guarantee`: it fails the producer instead, and the publisher starts a new one).
/// No message times out in the producer's queue (`message.timeout.ms` is infinite: a timed-out
/// message would let a later one be written without it); the call stops waiting after
/// `delivery_timeout` and reports what is unacknowledged as failed. Events of an aggregate routed
/// to different topics go in separate calls ([`Publisher::same_call`]). Without idempotence, the
/// relay sends an aggregate's next event only once the one before is acknowledged.
///
/// - Key = aggregate id, so one aggregate stays on one partition, in order; value = payload (the
///   JSON event in CloudEvents structured mode, [`KafkaPublisher::with_format`]).
/// - Headers: `outbox-event-id`, `outbox-event-type`, `outbox-aggregate-type`, `content-type`, the
///   format's (`ce_*` CloudEvents attributes in binary mode; `id` and `eventType` for Debezium's
///   conventions) and every event header (`traceparent` included). Record timestamp = event
///   creation time.
/// - Topic: the [`KafkaConfig::topic`] template, or the event's own destination.
/// - The idempotent producer (on by default, at most 5 requests in flight) keeps per-partition order
///   through retries. A full local queue is waited out up to `enqueue_timeout`, then reported as
///   back-pressure (no attempt counted).
pub struct KafkaPublisher {
    producer: std::sync::Mutex<FutureProducer>,
    topic: Template,
    /// Where events may go (`kafka.allowed_destinations`).
    allowed: AllowList,
    config: KafkaConfig,
    /// Publish calls in a row whose every delivery timed out.
    stalled_batches: AtomicU32,
    /// The message format.
    format: Formatter,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Checks a topic name as Kafka does: 1 to 249 characters of `a-z A-Z 0-9 . _ -`, not `.` or `..`.
pub fn check_topic(topic: &str) -> Result<(), Error> {
    let legal = !topic.is_empty()
        && topic.len() <= MAX_TOPIC_LEN
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-');
    if legal {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::DestinationNotFound,
            format!(
                "{topic:?} is not a legal Kafka topic name: expected 1 to {MAX_TOPIC_LEN} characters of a-z, A-Z, 0-9, '.', '_' and '-'"
            ),
        )
        .with_context("adapter", "kafka"))
    }
}

/// Whether `error`, from a delivery report, is a broker's refusal of the record's content (invalid
/// record, policy, size), which a broker gives for a partition's whole record batch when one record
/// in it is bad.
fn refused_by_the_broker(error: &Error) -> bool {
    !error.is_retryable()
        && matches!(
            error.kind(),
            ErrorKind::InvalidInput | ErrorKind::PayloadTooLarge
        )
}

/// The record's headers: `outbox-*`, `content-type` (the format's), the format's own (CloudEvents
/// `ce_*` attributes, Debezium's `id` and `eventType`), then the event's headers.
fn headers(event: &Event, format: &Formatter) -> OwnedHeaders {
    let id = event.id.to_string();
    let extra = format.headers(event, CLOUDEVENTS_PREFIX);
    let mut h = OwnedHeaders::new_with_capacity(event.headers.len() + extra.len() + 4)
        .insert(Header {
            key: header::EVENT_ID,
            value: Some(id.as_str()),
        })
        .insert(Header {
            key: header::EVENT_TYPE,
            value: Some(event.event_type.as_str()),
        })
        .insert(Header {
            key: header::AGGREGATE_TYPE,
            value: Some(event.aggregate_type.as_str()),
        })
        .insert(Header {
            key: header::CONTENT_TYPE,
            value: Some(format.content_type(event)),
        });
    // An event header of a name the format sets is left out: one value per name, the format's.
    let own = event
        .headers
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(name, _)| name == *k))
        .map(|(k, v)| (k.as_str(), v.as_str()));
    for (k, v) in extra
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(own)
    {
        h = h.insert(Header {
            key: k,
            value: Some(v),
        });
    }
    h
}

/// The prefix of CloudEvents attribute headers in binary mode (the Kafka protocol binding).
pub const CLOUDEVENTS_PREFIX: &str = "ce_";

fn create_producer(config: &KafkaConfig) -> Result<FutureProducer, Error> {
    let mut client = ClientConfig::new();
    for (k, v) in config.producer_properties() {
        client.set(k, v);
    }
    client.create().map_err(|e| {
        Error::config(format!(
            "kafka: the producer cannot be created with these settings: {e} (check kafka.properties)"
        ))
    })
}

impl KafkaPublisher {
    /// `error`, when it says the record is too large, with a message naming the record's size and
    /// the limits that apply (librdkafka's own text names neither).
    fn name_the_limit(&self, error: Error, event: &Event) -> Error {
        if error.kind() != ErrorKind::PayloadTooLarge {
            return error;
        }
        let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
        let size = self.format.body(event).len() + event.aggregate_id.len() + headers;
        Error::new(
            ErrorKind::PayloadTooLarge,
            format!(
                "the record is about {size} bytes (body, key and headers); kafka.max_message_bytes is {} \
                 (the broker's message.max.bytes or the topic's max.message.bytes may be lower): \
                 move large data out of the event, or raise the limits",
                self.config.max_message_bytes
            ),
        )
        .with_context("adapter", "kafka")
        .with_source(error)
        .permanent()
    }

    /// A publisher with `config`. The producer connects in the background.
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate or librdkafka refuses a property.
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        let topic = config.validate()?;
        let allowed = config.allow_list()?;
        let producer = create_producer(&config)?;
        Ok(KafkaPublisher {
            producer: std::sync::Mutex::new(producer),
            topic,
            allowed,
            config,
            stalled_batches: AtomicU32::new(0),
            format: Formatter::default(),
        })
    }

    /// Sends events in `format` (CloudEvents, Debezium's conventions; default the outbox's own).
    pub fn with_format(mut self, format: Formatter) -> Self {
        self.format = format;
        self
    }

    /// Hands `event` to `producer` (waiting out a full local queue until `enqueue_deadline`); the
    /// error, when it cannot be sent, names the event.
    async fn enqueue(
        &self,
        producer: &FutureProducer,
        event: &Event,
        enqueue_deadline: Instant,
    ) -> Result<rdkafka::producer::DeliveryFuture, Error> {
        // The aggregate id is the record's key: librdkafka's default partitioner sends a record
        // with an empty key to any partition, where the aggregate's order would be lost.
        if event.aggregate_id.is_empty() && self.config.spreads_empty_keys() {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                "the event's aggregate_id is empty: it is the Kafka record's key, and the producer's \
                 partitioner (consistent_random, librdkafka's default) sends a record with an empty \
                 key to any partition, out of order with the rest of its aggregate; write a non-empty \
                 aggregate_id (the Writer refuses an empty one), or set kafka.properties.partitioner \
                 to one that hashes an empty key (murmur2_random: the Java client's)",
            )
            .with_context("adapter", "kafka")
            .with_context("event_id", event.id));
        }
        let topic = self.topic.destination(event);
        self.allowed.check(&topic).map_err(|e| {
            e.with_context("adapter", "kafka")
                .with_context("event_id", event.id)
        })?;
        check_topic(&topic).map_err(|e| e.with_context("event_id", event.id))?;
        let body = self.format.body(event);
        let mut record = FutureRecord::to(&topic)
            .key(event.aggregate_id.as_bytes())
            .payload(body.as_ref())
            .headers(headers(event, &self.format))
            .timestamp(event.created_at.timestamp_millis());
        loop {
            match producer.send_result(record) {
                Ok(delivery) => return Ok(delivery),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < enqueue_deadline =>
                {
                    // Back-pressure: librdkafka's background thread drains the queue.
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => {
                    return Err(self
                        .name_the_limit(map_kafka("produce", e), event)
                        .with_context("event_id", event.id))
                }
            }
        }
    }

    /// The outcome of `event` from its delivery report (or the call's deadline); notes a refused
    /// idempotence session in `session_lost`.
    fn outcome(
        &self,
        report: Result<
            Result<
                rdkafka::producer::future_producer::OwnedDeliveryResult,
                futures::channel::oneshot::Canceled,
            >,
            tokio::time::error::Elapsed,
        >,
        event: &Event,
        session_lost: &mut bool,
    ) -> PublishOutcome {
        match report {
            Ok(Ok(Ok(_delivery))) => Ok(()),
            Ok(Ok(Err((e, _message)))) => {
                *session_lost |= e.rdkafka_error_code().is_some_and(ends_session);
                Err(self
                    .name_the_limit(map_kafka("delivery", e), event)
                    .with_context("event_id", event.id))
            }
            Ok(Err(_canceled)) => Err(Error::new(
                ErrorKind::Connection,
                "the producer dropped the delivery report",
            )
            .with_context("adapter", "kafka")
            .with_context("event_id", event.id)),
            Err(_) => Err(Error::new(
                ErrorKind::Timeout,
                "no delivery report within kafka.delivery_timeout",
            )
            .with_context("adapter", "kafka")
            .with_context("event_id", event.id)),
        }
    }

    /// Sends each of the events `refused` (indexes into `events`, in order) again, alone, awaiting
    /// its report before the next, and replaces their outcomes: acknowledged alone, an event was
    /// refused only for sharing a record batch with a bad one. An event refused alone keeps its
    /// error, and the later events of its aggregate are not sent; neither is an event of an
    /// aggregate whose earlier event in the call failed otherwise (after a refusal the gapless
    /// producer fails, and a new one is made for the next). All of it within `budget`: what is left
    /// when it runs out, or once a resend finds the broker not answering, goes back as
    /// back-pressure (sent again shortly, no attempt counted).
    async fn resend_alone(
        &self,
        events: &[Event],
        refused: &[usize],
        outcomes: &mut [Option<PublishOutcome>],
        budget: Duration,
    ) {
        let until = Instant::now() + budget;
        let mut is_refused = vec![false; events.len()];
        for &i in refused {
            is_refused[i] = true;
        }
        let mut fence = Fence::new();
        let mut stopped = false;
        for (i, event) in events.iter().enumerate() {
            if !is_refused[i] {
                if matches!(outcomes[i], Some(Err(_))) {
                    fence.close(event);
                }
                continue;
            }
            if fence.holds(event) {
                outcomes[i] = Some(Err(Fence::not_sent("kafka")));
                continue;
            }
            if stopped || Instant::now() >= until {
                stopped = true;
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Backpressure,
                    "refused with its record batch; not sent again alone within the call's time",
                )
                .with_context("adapter", "kafka")
                .with_context("event_id", event.id)));
                fence.close(event);
                continue;
            }
            let producer = self.producer();
            let mut session_lost = false;
            let outcome = match self.enqueue(&producer, event, until).await {
                Ok(delivery) => {
                    let deadline = until.min(Instant::now() + self.config.delivery_timeout);
                    let report = tokio::time::timeout_at(deadline, delivery).await;
                    self.outcome(report, event, &mut session_lost)
                }
                Err(e) => Err(e),
            };
            if let Err(e) = &outcome {
                fence.close(event);
                stopped = !refused_by_the_broker(e);
                if session_lost || producer.client().fatal_error().is_some() {
                    self.replace_producer(&producer);
                }
            }
            outcomes[i] = Some(outcome);
            self.let_go(producer);
        }
    }

    fn producer(&self) -> FutureProducer {
        self.current().clone()
    }

    /// The producer new calls use, locked (a poisoned lock still holds a usable producer).
    fn current(&self) -> std::sync::MutexGuard<'_, FutureProducer> {
        self.producer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops `producer`, a call's copy, off the async workers when it has been replaced: the last
    /// copy of a replaced producer destroys it, which waits for its threads.
    fn let_go(&self, producer: FutureProducer) {
        if !self.is_current(&producer) {
            drop(tokio::task::spawn_blocking(move || drop(producer)));
        }
    }

    /// Replaces the producer when it cannot make progress: librdkafka declared it failed for good, or
    /// the broker refused its idempotence session (fenced, unknown producer id, out-of-order sequence), or
    /// two calls in a row timed out entirely (an idempotent producer whose broker lost its producer
    /// state waits forever, and a connection wedged by an outage can fail even metadata requests
    /// long after the brokers are back). Unacknowledged events
    /// were reported as failures, so nothing is lost; a new producer starts a new idempotence session.
    async fn recover(&self, producer: &FutureProducer, call: CallEnd) {
        let CallEnd {
            all_timed_out,
            some_timed_out,
            all_queue_full,
            session_lost,
            events,
        } = call;
        if let Some((code, reason)) = producer.client().fatal_error() {
            error!(code = ?code, reason = %reason, "the Kafka producer failed fatally; creating a new one");
            self.replace_producer(producer);
            return;
        }
        if session_lost {
            warn!("the Kafka broker refused the producer's idempotence session (fenced, unknown producer id or sequence); creating a new producer");
            self.replace_producer(producer);
            return;
        }
        if all_queue_full {
            warn!(
                held = producer.in_flight_count(),
                "the Kafka producer's queue took no record of a call within kafka.enqueue_timeout; creating a new producer"
            );
            self.replace_producer(producer);
            return;
        }
        let stale_limit =
            STALE_MESSAGES.max(i32::try_from(events.saturating_mul(2)).unwrap_or(i32::MAX));
        if some_timed_out && producer.in_flight_count() >= stale_limit {
            warn!(
                held = producer.in_flight_count(),
                "the Kafka producer holds many messages the brokers have not taken; creating a new one"
            );
            self.replace_producer(producer);
            return;
        }
        if !all_timed_out {
            self.stalled_batches.store(0, Ordering::Relaxed);
            return;
        }
        if self.stalled_batches.fetch_add(1, Ordering::Relaxed) + 1 < 2 {
            return;
        }
        // Replaced whether or not the brokers answer its metadata request: a producer whose
        // connection stays wedged after an outage fails that request too, and would otherwise be
        // kept (and every later call time out) until librdkafka gave the connection up. A new
        // producer costs a connection; while the brokers are really down, one per two calls.
        match self.check().await {
            Ok(()) => warn!(
                "the Kafka producer makes no progress while the brokers answer; creating a new one"
            ),
            Err(e) => warn!(
                error = %e,
                "two Kafka publish calls in a row timed out entirely; creating a new producer (fresh connections, a new idempotence session)"
            ),
        }
        self.stalled_batches.store(0, Ordering::Relaxed);
        self.replace_producer(producer);
    }

    /// Whether `producer` is the one new calls use.
    fn is_current(&self, producer: &FutureProducer) -> bool {
        self.current().client().native_ptr() == producer.client().native_ptr()
    }

    /// Replaces `used` (the producer a call found failing) with a new one, unless another call
    /// replaced it already: several batches in flight on a failed producer make one new producer,
    /// not one each (which would discard the producer newer batches already use).
    fn replace_producer(&self, used: &FutureProducer) {
        let mut current = self.current();
        if current.client().native_ptr() != used.client().native_ptr() {
            return;
        }
        match create_producer(&self.config) {
            Ok(fresh) => *current = fresh,
            Err(e) => error!(error = %e, "cannot create a new Kafka producer"),
        }
    }

    /// How long a metadata request of [`Publisher::check`] may take (also run by a call that finds
    /// the producer stalled).
    fn check_timeout(&self) -> Duration {
        self.config.delivery_timeout.min(Duration::from_secs(10))
    }

    /// The time a call has to send refused records again alone (see `resend_alone`): the part of
    /// its limit (`call_limit`) a call that had records refused does not use otherwise (the stalled
    /// producer's check, which only follows a call that timed out entirely, and with the
    /// idempotent producer, whose call waits `delivery_timeout` exactly, the report margin).
    fn resend_budget(&self) -> Duration {
        if self.config.idempotence {
            REPORT_MARGIN + self.check_timeout()
        } else {
            self.check_timeout()
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// Waits until every message handed to the producer is acknowledged or failed (at most `timeout`).
    ///
    /// # Errors
    /// A timeout error when messages are still in flight at the end.
    pub async fn flush(&self, timeout: Duration) -> Result<(), Error> {
        let producer = self.producer();
        tokio::task::spawn_blocking(move || producer.flush(timeout))
            .await
            .map_err(|e| Error::new(ErrorKind::Unexpected, format!("flush task failed: {e}")))?
            .map_err(|e| map_kafka("flush", e))
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    fn call_limit(&self) -> Option<outbox_core::CallLimit> {
        Some(outbox_core::CallLimit {
            limit: self.config.enqueue_timeout
                + self.config.delivery_timeout
                + REPORT_MARGIN
                + self.check_timeout(),
            settings: format!(
                "kafka.enqueue_timeout {} + kafka.delivery_timeout {} + {} + a stalled producer's metadata check {}",
                outbox_core::duration::format(self.config.enqueue_timeout),
                outbox_core::duration::format(self.config.delivery_timeout),
                outbox_core::duration::format(REPORT_MARGIN),
                outbox_core::duration::format(self.check_timeout())
            ),
        })
    }

    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        let producer = self.producer();
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
        let mut fence = Fence::new();
        let mut pending = Vec::with_capacity(events.len());
        // One enqueue deadline for the whole call (not per event), so that a call lasts at most
        // `call_limit`: a full local queue is waited out that long, in all.
        let enqueue_deadline = Instant::now() + self.config.enqueue_timeout;
        let mut queue_full = false;
        for (i, event) in events.iter().enumerate() {
            if fence.holds(event) {
                outcomes[i] = Some(Err(Fence::not_sent("kafka")));
                continue;
            }
            match self.enqueue(&producer, event, enqueue_deadline).await {
                Ok(delivery) => pending.push((i, delivery)),
                Err(e) => {
                    queue_full |= e.kind() == ErrorKind::Backpressure;
                    outcomes[i] = Some(Err(e));
                    fence.close(event);
                }
            }
        }
        let nothing_taken = pending.is_empty();
        // The idempotent producer has no message timeout of its own (see `KafkaConfig::idempotence`):
        // the call bounds the wait. Otherwise librdkafka bounds every message by message.timeout.ms,
        // and the margin covers the report's trip. Each report has the deadline on its own: one
        // record left unacknowledged does not undo the acknowledgements of the others.
        let limit = if self.config.idempotence {
            self.config.delivery_timeout
        } else {
            self.config.delivery_timeout + REPORT_MARGIN
        };
        let deadline = Instant::now() + limit;
        let reports = join_all(
            pending
                .into_iter()
                .map(|(i, d)| async move { (i, tokio::time::timeout_at(deadline, d).await) }),
        )
        .await;
        let mut session_lost = false;
        let (mut refused, mut dropped) = (Vec::new(), Vec::new());
        for (i, report) in reports {
            let outcome = self.outcome(report, &events[i], &mut session_lost);
            match &outcome {
                Err(e) if refused_by_the_broker(e) => refused.push(i),
                // From a delivery report, back-pressure is a record the producer dropped (purged).
                Err(e) if e.kind() == ErrorKind::Backpressure => dropped.push(i),
                _ => {}
            }
            outcomes[i] = Some(outcome);
        }
        // Records dropped by a producer that failed although no record of the call was refused: a
        // failure of the producer itself (its idempotence session refused for good, say), not of a
        // bad record. They count an attempt, and the relay treats the broker as unreachable
        // (pausing, checking, probing) rather than sending them again at once, again and again.
        if refused.is_empty() {
            for &i in &dropped {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Connection,
                    "the Kafka producer failed and dropped this record, and no record of the call was \
                     refused: a failure of the producer itself (its reason is logged as a fatal error)",
                )
                .with_context("adapter", "kafka")
                .with_context("event_id", events[i].id)));
            }
        }
        let all_timed_out = !outcomes.is_empty()
            && outcomes
                .iter()
                .all(|o| matches!(o, Some(Err(e)) if e.kind() == ErrorKind::Timeout));
        let call = CallEnd {
            all_timed_out,
            some_timed_out: outcomes
                .iter()
                .any(|o| matches!(o, Some(Err(e)) if e.kind() == ErrorKind::Timeout)),
            all_queue_full: queue_full && nothing_taken,
            session_lost,
            events: events.len(),
        };
        self.recover(&producer, call).await;
        // A broker refuses a partition's whole record batch for one bad record (and librdkafka
        // merges the records of concurrent calls into one batch): each refused record goes again
        // alone, to tell the bad ones from the others, within what is left of the call's limit.
        if !refused.is_empty() {
            self.resend_alone(events, &refused, &mut outcomes, self.resend_budget())
                .await;
        }
        self.let_go(producer);
        finish(outcomes)
    }

    async fn check(&self) -> Result<(), Error> {
        let producer = self.producer();
        let timeout = self.check_timeout();
        tokio::task::spawn_blocking(move || {
            producer.client().fetch_metadata(None, timeout).map(|_| ())
        })
        .await
        .map_err(|e| Error::new(ErrorKind::Unexpected, format!("metadata task failed: {e}")))?
        .map_err(|e| {
            let base = map_kafka("metadata request", e);
            Error::new(
                ErrorKind::Connection,
                format!("the Kafka brokers at {} do not answer", self.config.brokers),
            )
            .with_context("adapter", "kafka")
            .with_source(base)
        })
    }

    fn name(&self) -> &str {
        "kafka"
    }

    /// With the idempotent producer: its records are written in the order sent, per partition, with
    /// no gap (see [`KafkaConfig::idempotence`]), and an aggregate's records of one topic share a
    /// partition (the key). Not with a topic template that varies within an aggregate
    /// (`{event_type}`): its runs would be split into a call per topic anyway, and the relay
    /// spreads its batches over more aggregates instead.
    fn keeps_order(&self) -> bool {
        self.config.idempotence && self.topic.is_per_aggregate()
    }

    /// Two events of an aggregate routed to different topics are on different partitions, whose
    /// order Kafka does not relate: they go in separate calls.
    fn same_call(&self, earlier: &Event, later: &Event) -> bool {
        match (&earlier.destination, &later.destination) {
            // The template alone routes both: one topic for an aggregate, unless it varies by event.
            (None, None) if self.topic.is_per_aggregate() => true,
            _ => self.topic.destination(earlier) == self.topic.destination(later),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publisher with `config`, but brokers that take connections and never answer (a listener
    /// nobody accepts from: the kernel completes the handshakes and buffers the requests, as a
    /// connection wedged by an outage does) and a delivery timeout of 300 ms. Keep the listener.
    fn silent_publisher(config: KafkaConfig) -> (std::net::TcpListener, KafkaPublisher) {
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let publisher = KafkaPublisher::new(KafkaConfig {
            brokers: silent.local_addr().unwrap().to_string(),
            topic: "silent".into(),
            delivery_timeout: Duration::from_millis(300),
            ..config
        })
        .unwrap();
        (silent, publisher)
    }

    /// One event of each of `n` aggregates.
    fn one_each(n: usize) -> Vec<Event> {
        (0..n)
            .map(|n| outbox_core::testkit::publisher_suite::event(&format!("o-{n}"), n))
            .collect()
    }

    /// An event with an empty aggregate id (written by plain SQL: the Writer refuses one) would be
    /// a record with an empty key, which the default partitioner sends to any partition: it fails
    /// for good before it is produced, the rest of its aggregate is not sent past it, and other
    /// aggregates' events go on (here to brokers that never answer, so they time out). Under a
    /// partitioner that hashes an empty key, it is sent like any other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_event_without_an_aggregate_id_fails_for_good_before_it_is_produced() {
        let (_silent, publisher) = silent_publisher(KafkaConfig::default());
        let events = vec![
            outbox_core::testkit::publisher_suite::event("", 0),
            outbox_core::testkit::publisher_suite::event("", 1),
            outbox_core::testkit::publisher_suite::event("o-2", 2),
        ];
        assert_eq!(events[0].aggregate_id, "");
        let outcomes = publisher.publish(&events).await;
        let kinds: Vec<(ErrorKind, bool)> = outcomes
            .iter()
            .map(|o| {
                let e = o.as_ref().unwrap_err();
                (e.kind(), e.is_retryable())
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                (ErrorKind::InvalidInput, false),
                (ErrorKind::Rejected, true),
                (ErrorKind::Timeout, true),
            ],
            "{outcomes:?}"
        );
        let message = outcomes[0].as_ref().unwrap_err().to_string();
        assert!(message.contains("aggregate_id is empty"), "{message}");

        let mut hashing = KafkaConfig::default();
        hashing
            .properties
            .insert("partitioner".into(), "murmur2_random".into());
        let (_silent, publisher) = silent_publisher(hashing);
        let outcomes = publisher.publish(&events[..1]).await;
        assert!(
            matches!(outcomes.as_slice(), [Err(e)] if e.kind() == ErrorKind::Timeout),
            "sent (to brokers that never answer): {outcomes:?}"
        );
    }

    /// Brokers that never answer (`silent_publisher`), as a connection wedged by an outage.
    /// Two calls in a row that time out entirely replace the producer although its metadata check
    /// fails too; a producer kept there would time out every later call.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_producer_whose_calls_time_out_twice_is_replaced_even_when_the_brokers_do_not_answer()
    {
        let (silent, publisher) = silent_publisher(KafkaConfig::default());
        let first = publisher.producer();
        let event = outbox_core::testkit::publisher_suite::event("o-1", 1);
        let timed_out = |outcomes: Vec<PublishOutcome>| matches!(outcomes.as_slice(), [Err(e)] if e.kind() == ErrorKind::Timeout);
        assert!(timed_out(
            publisher.publish(std::slice::from_ref(&event)).await
        ));
        assert!(publisher.check().await.is_err(), "the brokers answered");
        assert!(publisher.is_current(&first), "replaced after one call");
        assert!(timed_out(
            publisher.publish(std::slice::from_ref(&event)).await
        ));
        assert!(
            !publisher.is_current(&first),
            "the producer was kept after two calls in a row timed out"
        );
        drop(silent);
    }

    /// Sending refused records again alone: not an event whose aggregate had an earlier event fail
    /// otherwise in the call, and once a resend finds the broker not answering, no more (the rest
    /// come back as back-pressure).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn refused_records_go_again_alone_in_order_and_within_the_budget() {
        let (silent, publisher) = silent_publisher(KafkaConfig::default());
        let event = outbox_core::testkit::publisher_suite::event;
        let events = [event("a", 0), event("a", 1), event("b", 0), event("c", 0)];
        let refusal = || {
            Some(Err(Error::new(
                ErrorKind::InvalidInput,
                "refused with its batch",
            )
            .permanent()))
        };
        let mut outcomes = vec![
            Some(Err(Error::new(ErrorKind::Connection, "failed otherwise"))),
            refusal(),
            refusal(),
            refusal(),
        ];
        publisher
            .resend_alone(&events, &[1, 2, 3], &mut outcomes, Duration::from_secs(5))
            .await;
        let kinds: Vec<ErrorKind> = outcomes
            .iter()
            .map(|o| o.as_ref().unwrap().as_ref().unwrap_err().kind())
            .collect();
        assert_eq!(
            kinds,
            vec![
                ErrorKind::Connection,   // as it was
                ErrorKind::Rejected,     // not sent: its aggregate's earlier event failed
                ErrorKind::Timeout,      // sent alone; the brokers do not answer
                ErrorKind::Backpressure, // not sent once they did not
            ]
        );
        drop(silent);
    }

    /// Records the producer drops (purged: it failed, or was replaced) while no record of the call
    /// was refused come back as connection errors (an attempt, and the relay's outage handling),
    /// not as back-pressure sent again at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_a_failing_producer_drops_with_no_record_refused_are_connection_errors() {
        let (silent, publisher) = silent_publisher(KafkaConfig {
            delivery_timeout: Duration::from_secs(10),
            ..KafkaConfig::default()
        });
        let producer = publisher.producer();
        let events: Vec<Event> = (0..3)
            .map(|n| outbox_core::testkit::publisher_suite::event("o-1", n))
            .collect();
        let purge = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
        };
        let (outcomes, ()) = tokio::join!(publisher.publish(&events), purge);
        assert!(
            outcomes.iter().all(
                |o| matches!(o, Err(e) if e.kind() == ErrorKind::Connection && e.is_retryable())
            ),
            "{outcomes:?}"
        );
        drop(silent);
    }

    /// A producer whose queue is full of records the brokers have not taken (a call left them there)
    /// and takes none of the next call's within `enqueue_timeout` is replaced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_producer_whose_full_queue_takes_no_record_of_a_call_is_replaced() {
        let (silent, publisher) = silent_publisher(KafkaConfig {
            enqueue_timeout: Duration::from_millis(100),
            properties: [("queue.buffering.max.messages".to_string(), "10".to_string())].into(),
            ..KafkaConfig::default()
        });
        let first = publisher.producer();
        let events: Vec<Event> = one_each(20);
        let outcomes = publisher.publish(&events).await;
        assert!(outcomes
            .iter()
            .any(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Timeout)));
        assert!(
            publisher.is_current(&first),
            "replaced after the first call"
        );
        let outcomes = publisher.publish(&events[..5]).await;
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Backpressure)));
        assert!(!publisher.is_current(&first), "the full producer was kept");
        drop(silent);
    }

    /// A call whose events time out while the producer holds many messages the brokers have not
    /// taken (no message expires in its queue) replaces the producer at once, dropping them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_producer_left_holding_many_unsent_messages_is_replaced() {
        let (silent, publisher) = silent_publisher(KafkaConfig::default());
        // A call of many events: they stay in the producer's queue (a call does not count the
        // messages it has just enqueued as stale, up to twice its own).
        let first = publisher.producer();
        let many: Vec<Event> = one_each(STALE_MESSAGES as usize);
        let outcomes = publisher.publish(&many).await;
        assert!(outcomes
            .iter()
            .all(|o| matches!(o, Err(e) if e.kind() == ErrorKind::Timeout)));
        assert!(publisher.is_current(&first), "replaced after one call");
        // The next call times out too, but not entirely (one event is refused at once): the copies
        // the producer still holds replace it, not two calls in a row timed out.
        let mut refused = outbox_core::testkit::publisher_suite::event("o-x", 0);
        refused.destination = Some("not-allowed".into());
        let next = [
            refused,
            outbox_core::testkit::publisher_suite::event("o-y", 0),
        ];
        let outcomes = publisher.publish(&next).await;
        assert!(matches!(&outcomes[0], Err(e) if e.kind() != ErrorKind::Timeout));
        assert!(matches!(&outcomes[1], Err(e) if e.kind() == ErrorKind::Timeout));
        assert!(
            !publisher.is_current(&first),
            "the producer kept {} unsent messages",
            first.in_flight_count()
        );
        drop(silent);
    }

    /// The idempotent producer takes an aggregate's run in one call, up to an event routed to
    /// another topic; without idempotence, one event of an aggregate per call.
    #[test]
    fn runs_go_in_one_call_per_topic_with_the_idempotent_producer() {
        let publisher = KafkaPublisher::new(KafkaConfig {
            allowed_destinations: vec!["audit".into()],
            ..KafkaConfig::default()
        })
        .unwrap();
        assert!(publisher.keeps_order());
        let first = outbox_core::testkit::publisher_suite::event("o-1", 1);
        let second = outbox_core::testkit::publisher_suite::event("o-1", 2);
        let mut elsewhere = outbox_core::testkit::publisher_suite::event("o-1", 3);
        elsewhere.destination = Some("audit".into());
        assert!(publisher.same_call(&first, &second));
        assert!(!publisher.same_call(&second, &elsewhere));
        let by_type = KafkaPublisher::new(KafkaConfig {
            topic: "events.{event_type}".into(),
            ..KafkaConfig::default()
        })
        .unwrap();
        assert!(!by_type.keeps_order());
        let mut shipped = second.clone();
        shipped.event_type = "order.shipped".into();
        assert!(!by_type.same_call(&second, &shipped));
        let plain = KafkaPublisher::new(KafkaConfig {
            idempotence: false,
            acks: "1".into(),
            ..KafkaConfig::default()
        })
        .unwrap();
        assert!(!plain.keeps_order());
    }

    #[test]
    fn topic_names_are_checked() {
        assert!(check_topic("outbox.event.order").is_ok());
        assert!(check_topic("Orders_v2-eu").is_ok());
        for bad in [
            "",
            ".",
            "..",
            "has space",
            "slash/topic",
            "ünïcode",
            &"x".repeat(250),
        ] {
            let e = check_topic(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::DestinationNotFound);
            assert!(!e.is_retryable());
        }
    }
}
