//! Outcomes from publisher confirms: ack, nack, a returned (unroutable) message, or a channel that
//! closed first; and where RabbitMQ closed the channel over a message larger than its own
//! `max_message_size`, which events that close failed for good and which only beside them.

use std::borrow::Cow;

use lapin::Confirmation;

use txoutbox_core::{Error, Event, PublishOutcome};

use super::AmqpPublisher;
use crate::error::{self, map_lapin, parse_size_limit};

impl AmqpPublisher {
    /// The outcome of `event` from its confirm (`result`). A channel or connection that closed
    /// before the confirm is noted in `broken` (the channel is then reset).
    pub(super) fn confirmed(
        &self,
        result: Result<Confirmation, lapin::Error>,
        event: &Event,
        broken: &mut Option<Error>,
    ) -> PublishOutcome {
        match result {
            Ok(Confirmation::Ack(None)) => Ok(()),
            Ok(Confirmation::Ack(Some(returned))) | Ok(Confirmation::Nack(Some(returned))) => Err(
                error::unroutable(&returned, event.id, self.config.unroutable_is_retryable),
            ),
            Ok(Confirmation::Nack(None)) => Err(error::nacked(event.id)),
            Ok(Confirmation::NotRequested) => Err(error::not_confirm_mode()),
            Err(e) => {
                // The channel or connection closed before the confirm: nobody can tell
                // which message caused it, so every such event is retried.
                let err = map_lapin("confirm", e).temporary();
                broken.get_or_insert_with(|| err.clone());
                Err(err.with_context("event_id", event.id))
            }
        }
    }
}

/// Where the broker closed the channel over a message of this call larger than its
/// `max_message_size`, the events whose failure is that close: those whose body is over the limit
/// fail for good, naming it (the broker would refuse them again, whichever call they went in); the
/// others fail retryably, saying which event closed the channel (they are not at fault). Failures of
/// their own (a missing exchange, a header too long, a return, a nack) are left as they are, and so
/// is a close caused by another call on the shared channel (no event of this call over the limit).
/// Without this, the refused event and every event sent beside it would fail retryably, again and
/// again, until their attempts ran out.
pub(super) fn refused_as_too_large(
    outcomes: &mut [Option<PublishOutcome>],
    events: &[Event],
    bodies: &[Cow<'_, [u8]>],
    configured: usize,
) {
    let limit = outcomes.iter().find_map(|o| match o {
        Some(Err(e)) => parse_size_limit(&e.to_string()),
        _ => None,
    });
    let Some(limit) = limit else { return };
    let refused: Vec<String> = (0..events.len())
        .filter(|&i| bodies[i].len() > limit)
        .map(|i| events[i].id.to_string())
        .collect();
    if refused.is_empty() {
        return;
    }
    for (i, outcome) in outcomes.iter_mut().enumerate() {
        let closed = matches!(outcome, Some(Err(e)) if parse_size_limit(&e.to_string()).is_some());
        if !closed {
            continue;
        }
        if bodies[i].len() <= limit {
            *outcome = Some(Err(error::closed_by_another(&refused, limit, events[i].id)));
        } else {
            *outcome = Some(Err(error::over_broker_limit(
                bodies[i].len(),
                limit,
                configured,
                events[i].id,
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use txoutbox_core::{Error, ErrorKind, Event, PublishOutcome};

    use super::refused_as_too_large;

    fn ev(n: usize) -> Event {
        Event {
            id: txoutbox_core::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: n.to_string(),
            event_type: "order.created".into(),
            payload: vec![b'x'; n],
            content_type: "application/json".into(),
            headers: Default::default(),
            destination: None,
            created_at: Default::default(),
            attempts: 0,
        }
    }

    fn closed() -> Error {
        Error::new(
            ErrorKind::InvalidInput,
            "broker replied 406 PRECONDITION_FAILED - message size 2000 is larger than configured max size 1000",
        )
        .temporary()
    }

    /// Only the failures the close caused change: the event over the limit fails for good, the
    /// others of the call it closed fail retryably as a connection problem; a failure of an event's
    /// own stays, and a close caused by another call (no event of this one over the limit) changes
    /// nothing.
    #[test]
    fn only_the_failures_a_size_refusal_caused_are_rewritten() {
        let events = vec![ev(10), ev(2000), ev(10), ev(10)];
        let bodies: Vec<Cow<'_, [u8]>> = events.iter().map(|e| Cow::from(&e.payload[..])).collect();
        let own = Error::new(ErrorKind::DestinationNotFound, "no exchange").permanent();
        let mut outcomes: Vec<Option<PublishOutcome>> = vec![
            Some(Ok(())),
            Some(Err(closed())),
            Some(Err(closed())),
            Some(Err(own.clone())),
        ];
        refused_as_too_large(&mut outcomes, &events, &bodies, 1 << 20);
        assert!(matches!(outcomes[0], Some(Ok(()))));
        let big = outcomes[1].clone().unwrap().unwrap_err();
        assert_eq!(big.kind(), ErrorKind::PayloadTooLarge);
        assert!(!big.is_retryable());
        let other = outcomes[2].clone().unwrap().unwrap_err();
        assert_eq!(other.kind(), ErrorKind::Connection);
        assert!(other.is_retryable());
        assert!(
            other.to_string().contains(&events[1].id.to_string()),
            "{other}"
        );
        assert_eq!(
            outcomes[3].clone().unwrap().unwrap_err().kind(),
            ErrorKind::DestinationNotFound
        );

        // Another call's message closed the shared channel: nothing here is over the limit.
        let small = vec![ev(10), ev(10)];
        let bodies: Vec<Cow<'_, [u8]>> = small.iter().map(|e| Cow::from(&e.payload[..])).collect();
        let mut outcomes: Vec<Option<PublishOutcome>> =
            vec![Some(Err(closed())), Some(Err(closed()))];
        refused_as_too_large(&mut outcomes, &small, &bodies, 1 << 20);
        for o in &outcomes {
            assert_eq!(
                o.clone().unwrap().unwrap_err().kind(),
                ErrorKind::InvalidInput
            );
        }
    }
}
