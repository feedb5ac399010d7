//! The Kafka publisher: a batch is enqueued to the producer at once; each outcome comes from the
//! event's own delivery report. Its parts: `record` (what an event becomes, and enqueuing it),
//! `delivery` (outcomes from delivery reports, refused records sent again alone) and `producer`
//! (creating, sharing and replacing the producer); this module holds the publisher and its calls.

mod delivery;
mod producer;
mod record;
#[cfg(test)]
mod tests;

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::join_all;
use rdkafka::producer::Producer as _;
use tokio::time::Instant;

use txoutbox_core::format::Formatter;
use txoutbox_core::publishers::{finish, Fence};
use txoutbox_core::routing::{AllowList, Template};
use txoutbox_core::{Error, ErrorKind, Event, PublishOutcome, Publisher};

use crate::config::KafkaConfig;
use crate::error::{self, map_kafka};
use delivery::refused_by_the_broker;
use producer::{create_producer, CallEnd, Context, Producer};
pub use record::check_topic;

/// Time a delivery report gets past `message.timeout.ms` to reach the publisher.
use crate::config::REPORT_MARGIN;

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
    producer: std::sync::Mutex<Producer>,
    /// The producers' client context (their last error).
    context: Context,
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

impl KafkaPublisher {
    /// A publisher with `config`. The producer connects in the background.
    ///
    /// # Errors
    /// A config error naming the key when `config` does not validate or librdkafka refuses a property.
    pub fn new(config: KafkaConfig) -> Result<Self, Error> {
        let topic = config.validate()?;
        let allowed = config.allow_list()?;
        let context = Context::default();
        let producer = create_producer(&config, &context)?;
        Ok(KafkaPublisher {
            producer: std::sync::Mutex::new(producer),
            context,
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
            .map_err(|e| error::task_failed("flush", e))?
            .map_err(|e| map_kafka("flush", e))
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    fn call_limit(&self) -> Option<txoutbox_core::CallLimit> {
        Some(self.config.call_limit())
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
                outcomes[i] = Some(Err(error::producer_failed(events[i].id)));
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
        .map_err(|e| error::task_failed("metadata", e))?
        .map(|()| self.context.answered())
        .map_err(|e| {
            let cause = map_kafka("metadata request", e);
            match self.context.recent_refusal() {
                Some(problem) => txoutbox_core::tls::certificate_error(
                    problem,
                    txoutbox_core::tls::TlsSettings {
                        server: "Kafka",
                        host: &self.config.brokers,
                        address: "kafka.brokers",
                        ca: "kafka.properties.\"ssl.ca.location\"",
                    },
                )
                .with_context("adapter", "kafka")
                .with_source(cause),
                None => error::brokers_do_not_answer(&self.config.brokers, cause),
            }
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
