//! The producer's life: created from the settings, shared by the calls in flight, and replaced
//! (by one call only) when it cannot make progress, its copies dropped off the async workers.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer as _};
use tracing::{debug, error, info, warn};

use txoutbox_core::{Error, Publisher};

use super::KafkaPublisher;
use crate::config::KafkaConfig;
use crate::error::producer_not_created;

/// Messages a producer may still hold after a call in which some timed out (copies the broker has
/// not taken, sent again meanwhile by later calls) before it is replaced (or twice the call's
/// events, when more): with no message timeout in its queue (see `KafkaConfig::idempotence`), a
/// partition that stays unwritable would otherwise collect copies up to librdkafka's queue limits.
pub(super) const STALE_MESSAGES: i32 = 20_000;

/// How a call ended, for [`KafkaPublisher::recover`].
pub(super) struct CallEnd {
    /// Every event timed out.
    pub(super) all_timed_out: bool,
    /// Some event timed out.
    pub(super) some_timed_out: bool,
    /// The producer's queue took none of the call's records, full for `enqueue_timeout`.
    pub(super) all_queue_full: bool,
    /// The broker refused the producer's idempotence session.
    pub(super) session_lost: bool,
    /// Events in the call.
    pub(super) events: usize,
}

/// The producer's client context: librdkafka's errors logged as by default, and the last one
/// that reported a refused broker certificate kept, with when. Such a refusal shows only there
/// (the metadata request of [`Publisher::check`] just times out, and librdkafka follows it with
/// "all brokers are down" and suppresses its repeats), so `check` reads it to name the setting.
#[derive(Clone, Default)]
pub(super) struct Context {
    refused: std::sync::Arc<
        std::sync::Mutex<Option<(txoutbox_core::tls::CertificateProblem, std::time::Instant)>>,
    >,
}

/// How long a reported refusal explains a failed check (librdkafka repeats it within 30 s).
const REFUSAL_FRESH: Duration = Duration::from_secs(60);

impl Context {
    fn refused(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        Option<(txoutbox_core::tls::CertificateProblem, std::time::Instant)>,
    > {
        self.refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The certificate problem librdkafka reported lately, if any.
    pub(super) fn recent_refusal(&self) -> Option<txoutbox_core::tls::CertificateProblem> {
        self.refused()
            .filter(|(_, at)| at.elapsed() < REFUSAL_FRESH)
            .map(|(problem, _)| problem)
    }

    /// Forgets a refusal: the brokers answered since.
    pub(super) fn answered(&self) {
        *self.refused() = None;
    }
}

impl ClientContext for Context {
    /// librdkafka's log lines, as rdkafka forwards them by default (target `librdkafka`), save one:
    /// the relay sets `enable.gapless.guarantee` on purpose (an idempotent producer that lost a
    /// message must stop rather than write the next one), and librdkafka calls the property
    /// experimental at every start. That line is logged at debug level.
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "CONFWARN" && log_message.contains("enable.gapless.guarantee") {
            debug!(target: "librdkafka", "librdkafka: {fac} {log_message}");
            return;
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                error!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Warning => {
                warn!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                info!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
            RDKafkaLogLevel::Debug => {
                debug!(target: "librdkafka", "librdkafka: {fac} {log_message}")
            }
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        error!("librdkafka: {error}: {reason}");
        if let Some(problem) = txoutbox_core::tls::openssl_problem_in(reason) {
            *self.refused() = Some((problem, std::time::Instant::now()));
        }
    }
}

/// The publisher's producer.
pub(super) type Producer = FutureProducer<Context>;

/// A producer with `config`'s properties, reporting its errors to `context`.
pub(super) fn create_producer(config: &KafkaConfig, context: &Context) -> Result<Producer, Error> {
    let mut client = ClientConfig::new();
    for (k, v) in config.producer_properties() {
        client.set(k, v);
    }
    client
        .create_with_context(context.clone())
        .map_err(producer_not_created)
}

impl KafkaPublisher {
    /// A copy of the producer new calls use.
    pub(super) fn producer(&self) -> Producer {
        self.current().clone()
    }

    /// The producer new calls use, locked (a poisoned lock still holds a usable producer).
    fn current(&self) -> std::sync::MutexGuard<'_, Producer> {
        self.producer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops `producer`, a call's copy, off the async workers when it has been replaced: the last
    /// copy of a replaced producer destroys it, which waits for its threads.
    pub(super) fn let_go(&self, producer: Producer) {
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
    pub(super) async fn recover(&self, producer: &Producer, call: CallEnd) {
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
    pub(super) fn is_current(&self, producer: &Producer) -> bool {
        self.current().client().native_ptr() == producer.client().native_ptr()
    }

    /// Replaces `used` (the producer a call found failing) with a new one, unless another call
    /// replaced it already: several batches in flight on a failed producer make one new producer,
    /// not one each (which would discard the producer newer batches already use).
    pub(super) fn replace_producer(&self, used: &Producer) {
        let mut current = self.current();
        if current.client().native_ptr() != used.client().native_ptr() {
            return;
        }
        match create_producer(&self.config, &self.context) {
            Ok(fresh) => *current = fresh,
            Err(e) => error!(error = %e, "cannot create a new Kafka producer"),
        }
    }

    /// How long a metadata request of [`Publisher::check`] may take (also run by a call that finds
    /// the producer stalled).
    pub(super) fn check_timeout(&self) -> Duration {
        self.config.check_timeout()
    }
}
