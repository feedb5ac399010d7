//! What becomes of each event of a published batch, by the retry and ordering policies: published,
//! retried after a backoff, dead-lettered, or released behind an earlier failure of its aggregate.

use std::collections::HashSet;

use tracing::{debug, error, warn};

use super::observer::{BatchReport, FailureDecision, RelayObserver};
use crate::error::{Error, ErrorKind};
use crate::event::Event;
use crate::policy::{OrderingPolicy, RetryPolicy};
use crate::ports::{Action, PublishOutcome, Settlement};

/// Turns the publisher's outcomes into settlements, applying the retry and ordering policies.
pub(super) fn decide(
    events: &[Event],
    outcomes: Vec<PublishOutcome>,
    retry: &RetryPolicy,
    ordering: OrderingPolicy,
    observer: &dyn RelayObserver,
    report: &mut BatchReport,
) -> Vec<Settlement> {
    let mut held: HashSet<(&str, &str)> = HashSet::new();
    let mut settlements = Vec::with_capacity(events.len());
    let mut first_retry: Option<(&Event, String)> = None;
    for (event, outcome) in events.iter().zip(outcomes) {
        let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
        if ordering == OrderingPolicy::PerAggregate && held.contains(&key) {
            report.released += 1;
            settlements.push(Settlement {
                id: event.id,
                action: Action::Release,
            });
            continue;
        }
        let action = match outcome {
            Ok(()) => {
                report.published += 1;
                Action::Published
            }
            Err(err) => {
                held.insert(key);
                let (action, decision) = failure_action(event, &err, retry);
                match decision {
                    FailureDecision::DeadLetter => {
                        report.dead_lettered += 1;
                        error!(
                            event_id = %event.id,
                            event_type = %event.event_type,
                            aggregate_id = %event.aggregate_id,
                            attempt = event.attempt(),
                            error = %err,
                            "event dead-lettered"
                        );
                    }
                    FailureDecision::Backpressure => {
                        report.backpressured += 1;
                        if report.backpressure.is_none() {
                            report.backpressure = Some(err.to_string());
                        }
                        debug!(
                            event_id = %event.id,
                            aggregate_id = %event.aggregate_id,
                            error = %err,
                            "the publisher pushed back; the event goes back unchanged"
                        );
                    }
                    FailureDecision::Retry => {
                        report.retried += 1;
                        // One warning per batch (below), however many events failed: a broker
                        // outage must not flood the log. Each event is at debug level.
                        debug!(
                            event_id = %event.id,
                            event_type = %event.event_type,
                            aggregate_id = %event.aggregate_id,
                            attempt = event.attempt(),
                            error = %err,
                            "publish failed; will retry"
                        );
                        if first_retry.is_none() {
                            first_retry = Some((event, err.to_string()));
                        }
                    }
                }
                observer.event_failed(event, &err, decision);
                action
            }
        };
        settlements.push(Settlement {
            id: event.id,
            action,
        });
    }
    if let Some((event, error)) = first_retry {
        warn!(
            failed = report.retried,
            batch = events.len(),
            first_event_id = %event.id,
            first_aggregate_id = %event.aggregate_id,
            attempt = event.attempt(),
            error = %error,
            "publish failed for events of the batch; they will be retried"
        );
    }
    settlements
}

fn failure_action(event: &Event, err: &Error, retry: &RetryPolicy) -> (Action, FailureDecision) {
    if err.kind() == ErrorKind::Backpressure && err.is_retryable() {
        // A reason to wait, not a failure: the event goes back as it was (the claim loop pauses).
        return (Action::Release, FailureDecision::Backpressure);
    }
    let attempts = event.attempt();
    if err.is_retryable() && retry.may_retry(attempts) {
        (
            Action::Retry {
                attempts,
                delay: retry.backoff(attempts),
                error: err.to_string(),
            },
            FailureDecision::Retry,
        )
    } else {
        let error = if err.is_retryable() {
            format!(
                "gave up after {attempts} attempts: {}",
                err.clone().persistent()
            )
        } else {
            err.to_string()
        };
        (
            Action::DeadLetter { attempts, error },
            FailureDecision::DeadLetter,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::observer::NoopObserver;
    use chrono::Utc;
    use std::collections::BTreeMap;
    use uuid::Uuid;

    fn event(agg: &str, attempts: u32) -> Event {
        Event {
            id: Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: agg.into(),
            event_type: "order.created".into(),
            payload: b"{}".to_vec(),
            content_type: "application/json".into(),
            headers: BTreeMap::new(),
            destination: None,
            created_at: Utc::now(),
            attempts,
        }
    }

    fn retryable() -> Error {
        Error::new(ErrorKind::Connection, "down")
    }

    #[test]
    fn failure_holds_back_the_rest_of_the_aggregate_only() {
        let evs = vec![event("a", 0), event("a", 0), event("b", 0), event("a", 0)];
        let outcomes = vec![Err(retryable()), Ok(()), Ok(()), Ok(())];
        let mut report = BatchReport::default();
        let s = decide(
            &evs,
            outcomes,
            &RetryPolicy::default(),
            OrderingPolicy::PerAggregate,
            &NoopObserver,
            &mut report,
        );
        assert!(matches!(s[0].action, Action::Retry { attempts: 1, .. }));
        assert_eq!(s[1].action, Action::Release);
        assert_eq!(s[2].action, Action::Published);
        assert_eq!(s[3].action, Action::Release);
        assert_eq!(
            (report.published, report.retried, report.released),
            (1, 1, 2)
        );
    }

    #[test]
    fn unordered_settles_each_outcome_on_its_own() {
        let evs = vec![event("a", 0), event("a", 0)];
        let outcomes = vec![Err(retryable()), Ok(())];
        let mut report = BatchReport::default();
        let s = decide(
            &evs,
            outcomes,
            &RetryPolicy::default(),
            OrderingPolicy::Unordered,
            &NoopObserver,
            &mut report,
        );
        assert!(matches!(s[0].action, Action::Retry { .. }));
        assert_eq!(s[1].action, Action::Published);
    }

    #[test]
    fn permanent_and_exhausted_errors_dead_letter() {
        let policy = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        let permanent = Error::new(ErrorKind::PayloadTooLarge, "too big");
        let (a, d) = failure_action(&event("a", 0), &permanent, &policy);
        assert_eq!(d, FailureDecision::DeadLetter);
        assert_eq!(
            a,
            Action::DeadLetter {
                attempts: 1,
                error: permanent.to_string()
            }
        );
        let (a, d) = failure_action(&event("a", 2), &retryable(), &policy);
        assert_eq!(d, FailureDecision::DeadLetter);
        match a {
            Action::DeadLetter { attempts, error } => {
                assert_eq!(attempts, 3);
                assert!(
                    error.starts_with("gave up after 3 attempts: connection (persistent)"),
                    "{error}"
                );
            }
            other => panic!("expected a dead letter, got {other:?}"),
        }
        let (a, _) = failure_action(&event("a", 1), &retryable(), &policy);
        assert!(matches!(a, Action::Retry { attempts: 2, .. }));
    }

    #[test]
    fn backpressure_does_not_count_an_attempt() {
        let e = Error::new(ErrorKind::Backpressure, "queue full");
        let (a, d) = failure_action(&event("a", 4), &e, &RetryPolicy::default());
        assert_eq!(d, FailureDecision::Backpressure);
        assert_eq!(a, Action::Release, "the event goes back unchanged");
    }
}
