//! Outcomes from delivery reports: each event's own report (or the call's deadline) gives its
//! outcome, and records a broker refused with their whole record batch go again alone, to tell the
//! bad ones from those refused beside them.

use std::time::Duration;

use futures::channel::oneshot::Canceled;
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::Producer;
use tokio::time::error::Elapsed;
use tokio::time::Instant;

use txoutbox_core::publishers::Fence;
use txoutbox_core::{Error, ErrorKind, Event, PublishOutcome};

use super::{KafkaPublisher, REPORT_MARGIN};
use crate::error::{self, ends_session, map_kafka};

/// Whether `error`, from a delivery report, is a broker's refusal of the record's content (invalid
/// record, policy, size), which a broker gives for a partition's whole record batch when one record
/// in it is bad.
pub(super) fn refused_by_the_broker(error: &Error) -> bool {
    !error.is_retryable()
        && matches!(
            error.kind(),
            ErrorKind::InvalidInput | ErrorKind::PayloadTooLarge
        )
}

impl KafkaPublisher {
    /// The outcome of `event` from its delivery report (or the call's deadline); notes a refused
    /// idempotence session in `session_lost`.
    pub(super) fn outcome(
        &self,
        report: Result<Result<OwnedDeliveryResult, Canceled>, Elapsed>,
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
            Ok(Err(_canceled)) => Err(error::report_dropped(event.id)),
            Err(_) => Err(error::no_report(event.id)),
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
    pub(super) async fn resend_alone(
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
                outcomes[i] = Some(Err(error::not_resent(event.id)));
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

    /// The time a call has to send refused records again alone (see `resend_alone`): the part of
    /// its limit (`call_limit`) a call that had records refused does not use otherwise (the stalled
    /// producer's check, which only follows a call that timed out entirely, and with the
    /// idempotent producer, whose call waits `delivery_timeout` exactly, the report margin).
    pub(super) fn resend_budget(&self) -> Duration {
        if self.config.idempotence {
            REPORT_MARGIN + self.check_timeout()
        } else {
            self.check_timeout()
        }
    }
}
