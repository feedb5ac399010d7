//! One batch's publish calls: which call each event travels in (an aggregate's events keep their
//! order across calls), each call bounded by `relay.publish_timeout`, one outcome per event.

use std::collections::{HashMap, HashSet};

use tokio::time::Instant;

use super::Shared;
use crate::error::{Error, ErrorKind};
use crate::event::Event;
use crate::policy::OrderingPolicy;
use crate::ports::{PublishOutcome, Publisher};

/// The call each event travels in. Under [`OrderingPolicy::Unordered`] every event is in call 0.
/// Otherwise an aggregate's first event of the batch is in call 0, and each later one in the call of
/// the one before it when the publisher keeps the two in order within a call
/// ([`Publisher::keeps_order`], [`Publisher::same_call`]), else in the next call: for a publisher that
/// does not keep order, its position in its aggregate's run.
fn calls_of(publisher: &dyn Publisher, events: &[Event], ordering: OrderingPolicy) -> Vec<usize> {
    if ordering == OrderingPolicy::Unordered {
        return vec![0; events.len()];
    }
    let keeps = publisher.keeps_order();
    // Per aggregate: the call of its last event so far, and that event.
    let mut last: HashMap<(&str, &str), (usize, &Event)> = HashMap::new();
    events
        .iter()
        .map(|event| {
            let key = (event.aggregate_type.as_str(), event.aggregate_id.as_str());
            let call = match last.get(&key) {
                None => 0,
                Some(&(call, before)) if keeps && publisher.same_call(before, event) => call,
                Some(&(call, _)) => call + 1,
            };
            last.insert(key, (call, event));
            call
        })
        .collect()
}

/// One publish call, bounded by `relay.publish_timeout`; checks the publisher returned one outcome
/// per event.
async fn call_publisher(shared: &Shared, events: &[Event]) -> Vec<PublishOutcome> {
    let cfg = &shared.config;
    match tokio::time::timeout(cfg.publish_timeout, shared.publisher.publish(events)).await {
        Ok(outcomes) if outcomes.len() == events.len() => outcomes,
        Ok(outcomes) => {
            let e = Error::new(
                ErrorKind::Unexpected,
                format!(
                    "publisher `{}` returned {} outcomes for {} events; every event of the call is retried",
                    shared.publisher.name(),
                    outcomes.len(),
                    events.len()
                ),
            )
            .temporary();
            vec![Err(e); events.len()]
        }
        Err(_) => {
            let e = Error::new(
                ErrorKind::Timeout,
                format!(
                    "a publish call took longer than relay.publish_timeout = {}",
                    crate::duration::format(cfg.publish_timeout)
                ),
            )
            .with_context("publisher", shared.publisher.name());
            vec![Err(e); events.len()]
        }
    }
}

/// Publishes a batch and returns its events (in their order) with one outcome each.
///
/// Usually one call. When the batch holds two events of one aggregate that the publisher cannot keep
/// in order within a call ([`Publisher::keeps_order`]), the later one goes in a later call, and only
/// if every earlier event of its aggregate was acknowledged; otherwise it is not sent (and released
/// by [`decide`](super::decide::decide)). No call starts once `publish_timeout` has passed since
/// the first: the events left are given back as back-pressure (no attempt counted).
pub(super) async fn publish_in_calls(
    shared: &Shared,
    events: Vec<Event>,
) -> (Vec<Event>, Vec<PublishOutcome>) {
    let cfg = &shared.config;
    let call = calls_of(shared.publisher.as_ref(), &events, cfg.ordering);
    let calls = call.iter().max().map_or(0, |m| m + 1);
    if calls <= 1 {
        let outcomes = call_publisher(shared, &events).await;
        return (events, outcomes);
    }
    let started = Instant::now();
    let mut outcomes: Vec<Option<PublishOutcome>> = vec![None; events.len()];
    let mut failed: HashSet<(String, String)> = HashSet::new();
    let mut slots: Vec<Option<Event>> = events.into_iter().map(Some).collect();
    for c in 0..calls {
        let mut sending: Vec<usize> = Vec::new();
        for i in (0..slots.len()).filter(|&i| call[i] == c) {
            let Some(event) = slots[i].as_ref() else {
                continue;
            };
            let key = (event.aggregate_type.clone(), event.aggregate_id.clone());
            if failed.contains(&key) {
                outcomes[i] = Some(Err(crate::publishers::Fence::not_sent("relay")));
            } else if c > 0 && started.elapsed() >= cfg.publish_timeout {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Backpressure,
                    "not sent: the batch used up relay.publish_timeout before this event's turn",
                )));
                failed.insert(key);
            } else {
                sending.push(i);
            }
        }
        if sending.is_empty() {
            continue;
        }
        let batch: Vec<Event> = sending.iter().filter_map(|&i| slots[i].take()).collect();
        let results = call_publisher(shared, &batch).await;
        for ((i, event), result) in sending.iter().zip(batch).zip(results) {
            if result.is_err() {
                failed.insert((event.aggregate_type.clone(), event.aggregate_id.clone()));
            }
            outcomes[*i] = Some(result);
            slots[*i] = Some(event);
        }
    }
    let events = slots.into_iter().flatten().collect();
    (events, crate::publishers::finish(outcomes))
}
