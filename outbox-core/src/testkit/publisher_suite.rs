//! The Publisher conformance suite: the rules of [`Publisher::publish`](crate::Publisher::publish),
//! checked against a real broker.
//!
//! [`run_all`] runs the checks any [`PublisherFixture`] supports; [`run_contract`] runs the whole
//! contract on a [`BrokerFixture`] (bad events fail alone, a failed event holds back its aggregate,
//! the allow-list, bounded destination caches, a broker that is down); [`crate::publisher_contract!`]
//! makes one test of each. Each check is public too.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::Utc;
use uuid::Uuid;

use super::{
    decode_cloudevents, BrokerFixture, CloudEventsBinding, Outage, PublisherFixture, Received,
    Setup,
};
use crate::error::ErrorKind;
use crate::event::{header, Event, JSON_CONTENT_TYPE};
use crate::format::{Formatter, MessageFormat};
use crate::ports::PublishOutcome;

/// How long the suite waits for messages to arrive at the consumer.
pub const RECEIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The message size limit the suite sets where it needs an event to be too large.
pub const SIZE_LIMIT: usize = 2048;

/// How long a broker that was brought back has to take events again.
pub const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// A ready-to-publish event, as the store would return it.
pub fn event(aggregate_id: &str, n: usize) -> Event {
    Event {
        id: Uuid::now_v7(),
        aggregate_type: "order".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "order.updated".into(),
        payload: serde_json::json!({"aggregate": aggregate_id, "n": n})
            .to_string()
            .into_bytes(),
        content_type: JSON_CONTENT_TYPE.into(),
        headers: [
            (
                header::TRACEPARENT.to_string(),
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
            ),
            ("x-tenant".to_string(), "acme".to_string()),
        ]
        .into_iter()
        .collect(),
        destination: None,
        created_at: Utc::now(),
        attempts: 0,
    }
}

/// Runs every check of the suite against one fixture, in order (each check expects what the
/// previous ones published to be received).
pub async fn run_all(fx: &dyn PublisherFixture) {
    let mut seen = 0;
    empty_batch_has_no_outcomes(fx).await;
    check_succeeds(fx).await;
    seen += batch_is_acknowledged_and_received_in_order(fx, seen).await;
    let _ = seen;
}

/// An empty batch yields no outcome and publishes nothing.
pub async fn empty_batch_has_no_outcomes(fx: &dyn PublisherFixture) {
    let p = fx.publisher().await;
    assert!(
        p.publish(&[]).await.is_empty(),
        "an empty batch must yield no outcome"
    );
}

/// `check()` succeeds against a reachable broker.
pub async fn check_succeeds(fx: &dyn PublisherFixture) {
    let p = fx.publisher().await;
    p.check()
        .await
        .expect("check() must succeed against a reachable broker");
}

/// 60 events over 6 aggregates: one `Ok` per event in input order, every event received once with its
/// id, type, aggregate id, payload and headers, and each aggregate's events in order. `already` is
/// the number of messages the fixture received before this check. Returns the number published.
pub async fn batch_is_acknowledged_and_received_in_order(
    fx: &dyn PublisherFixture,
    already: usize,
) -> usize {
    let p = fx.publisher().await;
    let mut events = Vec::new();
    for n in 0..10 {
        for a in 0..6 {
            events.push(event(&format!("agg-{a}"), n));
        }
    }
    let outcomes = p.publish(&events).await;
    assert_eq!(outcomes.len(), events.len(), "one outcome per event");
    for (e, o) in events.iter().zip(&outcomes) {
        assert!(o.is_ok(), "event {} must be acknowledged: {:?}", e.id, o);
    }
    let received = fx.receive(already + events.len(), RECEIVE_TIMEOUT).await;
    let ours: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let mine: Vec<&Received> = received
        .iter()
        .filter(|r| r.event_id.is_some_and(|id| ours.contains(&id)))
        .collect();
    let by_id: HashMap<Uuid, &Received> = mine
        .iter()
        .map(|r| (r.event_id.unwrap_or_default(), *r))
        .collect();
    assert_eq!(
        by_id.len(),
        events.len(),
        "every acknowledged event must be received (got {} of {})",
        by_id.len(),
        events.len()
    );
    for e in &events {
        let r = by_id[&e.id];
        assert_eq!(r.payload, e.payload, "payload of {}", e.id);
        assert_eq!(
            r.event_type.as_deref(),
            Some(e.event_type.as_str()),
            "event type of {}",
            e.id
        );
        assert_eq!(
            r.aggregate_id.as_deref(),
            Some(e.aggregate_id.as_str()),
            "aggregate id of {}",
            e.id
        );
        assert_eq!(
            r.headers.get(header::TRACEPARENT),
            e.headers.get(header::TRACEPARENT),
            "traceparent of {}",
            e.id
        );
        assert_eq!(
            r.headers.get("x-tenant").map(String::as_str),
            Some("acme"),
            "custom header of {}",
            e.id
        );
    }
    let mut last: HashMap<String, usize> = HashMap::new();
    let index: HashMap<Uuid, usize> = events.iter().enumerate().map(|(i, e)| (e.id, i)).collect();
    for r in &mine {
        let i = index[&r.event_id.unwrap_or_default()];
        let agg = events[i].aggregate_id.clone();
        if let Some(prev) = last.insert(agg.clone(), i) {
            assert!(
                prev < i,
                "aggregate {agg}: event #{i} received after #{prev}"
            );
        }
    }
    events.len()
}

/// Runs the whole publisher contract against a broker fixture: [`run_all`], then every check of a
/// [`BrokerFixture`], in order.
pub async fn run_contract(fx: &dyn BrokerFixture) {
    run_all(fx).await;
    bad_events_fail_alone(fx).await;
    a_failed_event_holds_back_its_aggregate(fx).await;
    destinations_outside_the_allow_list_are_refused(fx).await;
    the_destination_cache_stays_bounded(fx).await;
    messages_in_each_format_are_read_by_a_cloudevents_library(fx).await;
    broker_down(fx).await;
}

/// [`a_broker_that_is_down_fails_retryably_then_recovers`] on the fixture's [`BrokerFixture::outage`].
pub async fn broker_down(fx: &dyn BrokerFixture) {
    let outage = fx.outage().await;
    a_broker_that_is_down_fails_retryably_then_recovers(outage.as_ref()).await;
}

/// Waits until every id of `expected` was received (at most [`RECEIVE_TIMEOUT`]), then for a quiet
/// second; returns what was received of `ours` (ids the check published), in arrival order.
async fn receive_ours(
    fx: &dyn PublisherFixture,
    ours: &HashSet<Uuid>,
    expected: &HashSet<Uuid>,
) -> Vec<Received> {
    let deadline = tokio::time::Instant::now() + RECEIVE_TIMEOUT;
    loop {
        let got = fx.receive(0, Duration::ZERO).await;
        let seen: HashSet<Uuid> = got.iter().filter_map(|r| r.event_id).collect();
        if expected.is_subset(&seen) || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    super::read_until_quiet(|| fx.receive(0, Duration::ZERO))
        .await
        .into_iter()
        .filter(|r| r.event_id.is_some_and(|id| ours.contains(&id)))
        .collect()
}

/// The error of outcome `i`, with its kind and whether it is retryable.
fn failure(outcomes: &[PublishOutcome], i: usize) -> (ErrorKind, bool, String) {
    match &outcomes[i] {
        Ok(()) => panic!("event #{i} must fail, and was acknowledged: {outcomes:?}"),
        Err(e) => (e.kind(), e.is_retryable(), e.to_string()),
    }
}

/// An event of `aggregate` whose payload is `bytes` long.
fn sized(aggregate: &str, bytes: usize) -> Event {
    let mut e = event(aggregate, 0);
    e.payload = vec![b'x'; bytes];
    e
}

/// One batch holding healthy events around a too-large one, one for a destination the broker does
/// not have, and the broker's own poison: every bad event fails alone with a permanent error of its
/// kind, in its position; the healthy ones are acknowledged and received, the bad ones never; the
/// publisher takes the next batch as before.
pub async fn bad_events_fail_alone(fx: &dyn BrokerFixture) {
    let missing = fx.missing_destination();
    let p = fx
        .build(Setup {
            max_message_bytes: Some(SIZE_LIMIT),
            allowed_destinations: vec![missing.clone()],
            ..Setup::default()
        })
        .await
        .publisher;
    let first = event("healthy-1", 0);
    let too_large = sized("too-large", 2 * SIZE_LIMIT);
    let mut lost = event("lost", 0);
    lost.destination = Some(missing.clone());
    let mut batch = vec![first.clone(), too_large, lost];
    let limit = SIZE_LIMIT.to_string();
    let mut expected = vec![
        (
            ErrorKind::PayloadTooLarge,
            "a too-large event".to_string(),
            limit.as_str(),
        ),
        (
            ErrorKind::DestinationNotFound,
            format!("an event for the missing destination {missing}"),
            missing.as_str(),
        ),
    ];
    // Where each bad event sits in the batch; a healthy event follows each of the broker's poison
    // events, so that an outcome mapped to the wrong entry shows.
    let mut bad_at = vec![1, 2];
    let mut healthy = vec![first.id];
    let poison = fx.poison();
    for (n, (e, kind, text)) in poison.iter().enumerate() {
        expected.push((*kind, format!("poison {kind:?} ({})", e.aggregate_id), text));
        bad_at.push(batch.len());
        batch.push(e.clone());
        let between = event(&format!("healthy-after-poison-{n}"), 0);
        healthy.push(between.id);
        batch.push(between);
    }
    let last = event("healthy-2", 0);
    healthy.push(last.id);
    batch.push(last);
    let outcomes = p.publish(&batch).await;
    assert_eq!(
        outcomes.len(),
        batch.len(),
        "one outcome per event, in order"
    );
    for (i, (e, o)) in batch.iter().zip(&outcomes).enumerate() {
        if healthy.contains(&e.id) {
            assert!(
                o.is_ok(),
                "the healthy event #{i} of the batch is acknowledged: {outcomes:?}"
            );
        }
    }
    for ((kind, what, named), i) in expected.iter().zip(&bad_at) {
        let (got, retryable, text) = failure(&outcomes, *i);
        assert_eq!(
            (got, retryable),
            (*kind, false),
            "{what} fails alone with a permanent {kind:?} error: {text}"
        );
        assert!(
            text.contains(named),
            "the error of {what} says {named:?}: {text}"
        );
    }
    // The publisher survived the bad events: the next batch goes through.
    let after = event("healthy-3", 0);
    let out = p.publish(std::slice::from_ref(&after)).await;
    assert!(out[0].is_ok(), "the batch after the bad events: {out:?}");
    let ours: HashSet<Uuid> = batch.iter().chain([&after]).map(|e| e.id).collect();
    let healthy: HashSet<Uuid> = healthy.into_iter().chain([after.id]).collect();
    let got: HashSet<Uuid> = receive_ours(fx, &ours, &healthy)
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(got, healthy, "the healthy events arrive, and nothing else");
}

/// A batch whose first event of aggregate A fails: the later event of A in the same call is not
/// sent (a retryable failure, for the relay to publish after the failed one), while aggregate B's
/// event is acknowledged and received.
pub async fn a_failed_event_holds_back_its_aggregate(fx: &dyn BrokerFixture) {
    let p = fx
        .build(Setup {
            max_message_bytes: Some(SIZE_LIMIT),
            ..Setup::default()
        })
        .await
        .publisher;
    let aggregate = format!("fenced-{}", Uuid::now_v7().simple());
    let failed = sized(&aggregate, 2 * SIZE_LIMIT);
    let held = event(&aggregate, 1);
    let other = event("unfenced", 0);
    let batch = vec![failed, held.clone(), other.clone()];
    let outcomes = p.publish(&batch).await;
    assert_eq!(outcomes.len(), 3, "one outcome per event");
    let (kind, retryable, text) = failure(&outcomes, 0);
    assert_eq!(
        (kind, retryable),
        (ErrorKind::PayloadTooLarge, false),
        "{text}"
    );
    let (_, retryable, text) = failure(&outcomes, 1);
    assert!(
        retryable,
        "the event after a failed one of its aggregate is held back, retryably: {text}"
    );
    assert!(
        outcomes[2].is_ok(),
        "another aggregate goes on: {outcomes:?}"
    );
    let ours: HashSet<Uuid> = batch.iter().map(|e| e.id).collect();
    let got: Vec<Uuid> = receive_ours(fx, &ours, &[other.id].into())
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(
        got,
        vec![other.id],
        "the held-back event never reaches the broker"
    );
}

/// By default an event may name only the publisher's own destination: another one that exists on
/// the broker is refused (permission denied, permanent, naming the setting and the destination),
/// never probed nor sent to; a pattern in `allowed_destinations` that matches it lets it through.
pub async fn destinations_outside_the_allow_list_are_refused(fx: &dyn BrokerFixture) {
    let other = fx.sibling().await;
    let strict = fx.build(Setup::default()).await;
    let mut elsewhere = event("elsewhere", 0);
    elsewhere.destination = Some(other.destination());
    let outcomes = strict
        .publisher
        .publish(std::slice::from_ref(&elsewhere))
        .await;
    let (kind, retryable, text) = failure(&outcomes, 0);
    assert_eq!(
        (kind, retryable),
        (ErrorKind::PermissionDenied, false),
        "{text}"
    );
    let setting = format!("{}.allowed_destinations", strict.publisher.name());
    assert!(
        text.contains(&setting) && text.contains(&other.destination()),
        "the error names {setting} and the destination: {text}"
    );
    if let Some(cached) = &strict.cached_destinations {
        assert_eq!(cached(), 0, "a refused destination is not even probed");
    }
    let mut home = event("home", 0);
    home.destination = Some(fx.destination());
    let outcomes = strict.publisher.publish(std::slice::from_ref(&home)).await;
    assert!(
        outcomes[0].is_ok(),
        "the publisher's own destination, named, stays allowed: {outcomes:?}"
    );
    let got = receive_ours(fx, &[home.id].into(), &[home.id].into()).await;
    assert_eq!(got.len(), 1, "the event for the own destination arrives");
    // A pattern: the destination's first half, then `*`.
    let name = other.destination();
    let half = name
        .char_indices()
        .nth(name.chars().count() / 2)
        .map_or(0, |(i, _)| i);
    let open = fx
        .build(Setup {
            allowed_destinations: vec![format!("{}*", &name[..half])],
            ..Setup::default()
        })
        .await
        .publisher;
    let mut allowed = event("allowed", 0);
    allowed.destination = Some(other.destination());
    let outcomes = open.publish(std::slice::from_ref(&allowed)).await;
    assert!(outcomes[0].is_ok(), "an allowed destination: {outcomes:?}");
    let ours: HashSet<Uuid> = [elsewhere.id, allowed.id].into();
    let got: Vec<Uuid> = receive_ours(other.as_ref(), &ours, &[allowed.id].into())
        .await
        .iter()
        .filter_map(|r| r.event_id)
        .collect();
    assert_eq!(
        got,
        vec![allowed.id],
        "the allowed event arrives, the refused one never did"
    );
    other.dispose().await;
}

/// Events naming ten destinations, twice each, all arrive; a publisher that remembers destinations
/// (exchanges known to exist, queue URLs) keeps exactly its bound of them, however many destinations
/// events name, and a forgotten one is looked up again and still published to.
pub async fn the_destination_cache_stays_bounded(fx: &dyn BrokerFixture) {
    const BOUND: usize = 4;
    let built = fx
        .build(Setup {
            allowed_destinations: vec!["*".into()],
            destination_cache: Some(BOUND),
            ..Setup::default()
        })
        .await;
    let mut others = Vec::new();
    for _ in 0..10 {
        others.push(fx.sibling().await);
    }
    let mut sent: Vec<HashSet<Uuid>> = vec![HashSet::new(); others.len()];
    for round in 0..2 {
        for (i, other) in others.iter().enumerate() {
            let mut e = event(&format!("agg-{i}"), round);
            e.destination = Some(other.destination());
            let outcomes = built.publisher.publish(std::slice::from_ref(&e)).await;
            assert!(outcomes[0].is_ok(), "{}: {outcomes:?}", other.destination());
            if let Some(cached) = &built.cached_destinations {
                assert!(
                    cached() <= BOUND,
                    "{} destinations remembered, more than the bound of {BOUND}",
                    cached()
                );
            }
            sent[i].insert(e.id);
        }
        if let Some(cached) = &built.cached_destinations {
            assert_eq!(
                cached(),
                BOUND,
                "after {} destinations the cache is full, no fuller",
                others.len()
            );
        }
    }
    for (other, ids) in others.iter().zip(&sent) {
        let got = receive_ours(other.as_ref(), ids, ids).await;
        assert_eq!(got.len(), 2, "both events reach {}", other.destination());
    }
    for other in others {
        other.dispose().await;
    }
}

/// While the broker is down every event of a batch fails retryably (nothing is reported published)
/// and `check()` fails; once it is back, publishing recovers without a new publisher.
pub async fn a_broker_that_is_down_fails_retryably_then_recovers(outage: &dyn Outage) {
    let p = outage.publisher().await;
    let batch =
        |round: usize| -> Vec<Event> { (0..20).map(|i| event(&format!("a{i}"), round)).collect() };
    let out = p.publish(&batch(0)).await;
    assert!(
        out.iter().all(Result::is_ok),
        "warm-up, before the outage: {:?}",
        out.iter().find(|o| o.is_err())
    );
    outage.stop().await;
    let events = batch(1);
    let out = p.publish(&events).await;
    assert_eq!(out.len(), events.len(), "one outcome per event");
    for (i, o) in out.iter().enumerate() {
        let (_, retryable, text) = failure(&out, i);
        assert!(
            retryable,
            "a broker that is down is a retryable failure: {text} ({o:?})"
        );
    }
    assert!(
        p.check().await.is_err(),
        "check() (readiness) reports the broker down"
    );
    outage.start().await;
    let deadline = tokio::time::Instant::now() + RECOVERY_TIMEOUT;
    for round in 2.. {
        let events = batch(round);
        let out = p.publish(&events).await;
        assert_eq!(out.len(), events.len(), "one outcome per event");
        if out.iter().all(Result::is_ok) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recovery within {RECOVERY_TIMEOUT:?} of the broker's return: {:?}",
            out.iter().find(|o| o.is_err())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(p.check().await.is_ok(), "check() after the recovery");
}

/// One test per rule of the publisher contract ([`run_contract`]), each on a fixture of its own:
/// `publisher_contract!(Fixture::new().await);` in an adapter's test file, with `tokio` among its
/// dev-dependencies. The expression is evaluated in each test.
#[macro_export]
macro_rules! publisher_contract {
    ($fixture:expr) => {
        mod publisher_contract {
            #[allow(unused_imports)]
            use super::*;
            use $crate::testkit::{publisher_suite as suite, BrokerFixture};

            $crate::publisher_contract!(@test $fixture, acknowledges_in_order_and_carries_the_event, suite::run_all);
            $crate::publisher_contract!(@test $fixture, bad_events_fail_alone, suite::bad_events_fail_alone);
            $crate::publisher_contract!(@test $fixture, a_failed_event_holds_back_its_aggregate, suite::a_failed_event_holds_back_its_aggregate);
            $crate::publisher_contract!(@test $fixture, destinations_outside_the_allow_list_are_refused, suite::destinations_outside_the_allow_list_are_refused);
            $crate::publisher_contract!(@test $fixture, the_destination_cache_stays_bounded, suite::the_destination_cache_stays_bounded);
            $crate::publisher_contract!(@test $fixture, messages_in_each_format_are_read_by_a_cloudevents_library, suite::messages_in_each_format_are_read_by_a_cloudevents_library);
            $crate::publisher_contract!(@test $fixture, a_broker_that_is_down_fails_retryably_then_recovers, suite::broker_down);
        }
    };
    (@test $fixture:expr, $name:ident, $check:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let fx = $fixture;
            $check(&fx).await;
            fx.dispose().await;
        }
    };
}

/// The CloudEvents `source` template the format checks use.
pub const CLOUDEVENTS_SOURCE: &str = "/test/{aggregate_type}";

impl CloudEventsBinding {
    /// The prefix of CloudEvents attribute headers in binary mode on this binding.
    pub fn prefix(self) -> &'static str {
        match self {
            CloudEventsBinding::Kafka => "ce_",
            CloudEventsBinding::Amqp => "cloudEvents_",
            CloudEventsBinding::RabbitMq | CloudEventsBinding::Sqs => "ce-",
        }
    }
}

/// Events of every shape a format must carry, on one new aggregate: a JSON payload (with non-ASCII
/// text, a trace header), plain text with quotes and a newline, and, where the broker carries bytes,
/// a binary payload.
fn format_events(binding: CloudEventsBinding) -> Vec<Event> {
    let aggregate = format!("fmt-{}", Uuid::now_v7().simple());
    let mut events = vec![event(&aggregate, 0)];
    events[0].payload =
        serde_json::json!({"name": "Zoë ünïcødé", "items": [1, 2.5, null], "nested": {"ok": true}})
            .to_string()
            .into_bytes();
    let mut text = event(&aggregate, 1);
    text.payload = b"plain text, \"quoted\"\nand a second line".to_vec();
    text.content_type = "text/plain; charset=utf-8".into();
    text.event_type = "order.noted".into();
    events.push(text);
    if binding.carries_binary_bodies() {
        let mut bytes = event(&aggregate, 2);
        bytes.payload = vec![0, 1, 2, 0x7f, 0x80, 0xfe, 0xff];
        bytes.content_type = "application/octet-stream".into();
        events.push(bytes);
    }
    events
}

/// Publishes `events` with a publisher in `format` and returns what the consumer received of them,
/// in the order published (every event acknowledged and received).
async fn published_as(
    fx: &dyn BrokerFixture,
    format: MessageFormat,
    events: &[Event],
) -> Vec<Received> {
    let formatter = Formatter::new(format, "cloudevents_source", CLOUDEVENTS_SOURCE)
        .unwrap_or_else(|e| panic!("{e}"));
    let p = fx
        .build(Setup {
            format: formatter,
            ..Setup::default()
        })
        .await
        .publisher;
    let outcomes = p.publish(events).await;
    assert!(
        outcomes.iter().all(Result::is_ok),
        "{format}: every event is acknowledged: {outcomes:?}"
    );
    let ids: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let got = receive_ours(fx, &ids, &ids).await;
    events
        .iter()
        .map(|e| {
            got.iter()
                .find(|r| r.event_id == Some(e.id))
                .cloned()
                .unwrap_or_else(|| panic!("{format}: event {} was not received: {got:?}", e.id))
        })
        .collect()
}

/// Messages in CloudEvents binary and structured mode are read by a third-party CloudEvents SDK
/// (the Python one, through the broker's binding, as its consumers read them) as the events that
/// were published: every attribute, the data (JSON as JSON, text as text, bytes as bytes), the
/// required attributes present in the message itself (the SDK would make up a missing id or time).
/// Messages in Debezium's shape carry its `id` and `eventType` headers, the payload as the body and,
/// on Kafka, the aggregate id as the key.
pub async fn messages_in_each_format_are_read_by_a_cloudevents_library(fx: &dyn BrokerFixture) {
    let binding = fx.cloudevents_binding();
    for format in [
        MessageFormat::CloudeventsBinary,
        MessageFormat::CloudeventsStructured,
    ] {
        let events = format_events(binding);
        let received = published_as(fx, format, &events).await;
        let decoded = decode_cloudevents(binding, &received);
        assert_eq!(decoded.len(), events.len(), "{format}: {decoded:?}");
        for ((e, r), d) in events.iter().zip(&received).zip(&decoded) {
            let what = format!(
                "{format} on {binding:?}, event {} ({})",
                e.id, e.content_type
            );
            assert!(
                d.get("error").is_none(),
                "{what}: the SDK refused it: {d}\nmessage: {r:?}"
            );
            let a = &d["attributes"];
            let text = |k: &str| a[k].as_str().map(str::to_string);
            assert_eq!(text("specversion").as_deref(), Some("1.0"), "{what}: {d}");
            assert_eq!(text("id"), Some(e.id.to_string()), "{what}: {d}");
            assert_eq!(
                text("source").as_deref(),
                Some("/test/order"),
                "{what}: {d}"
            );
            assert_eq!(text("type"), Some(e.event_type.clone()), "{what}: {d}");
            assert_eq!(text("subject"), Some(e.aggregate_id.clone()), "{what}: {d}");
            assert_eq!(
                text("datacontenttype"),
                Some(e.content_type.clone()),
                "{what}: {d}"
            );
            if let Some(key) = text("partitionkey") {
                assert_eq!(key, e.aggregate_id, "{what}: {d}");
            }
            let time = text("time")
                .and_then(|t| chrono::DateTime::parse_from_rfc3339(&t).ok())
                .unwrap_or_else(|| panic!("{what}: no RFC 3339 time: {d}"));
            assert_eq!(
                time.timestamp_micros(),
                e.created_at.timestamp_micros(),
                "{what}: the creation time, to the microsecond: {d}"
            );
            if crate::format::is_json(&e.content_type) {
                let sent: serde_json::Value =
                    serde_json::from_slice(&e.payload).unwrap_or_default();
                assert_eq!(d["data"], sent, "{what}: {d}");
            } else if crate::format::is_text(&e.content_type) {
                let sent = String::from_utf8_lossy(&e.payload);
                assert_eq!(d["data"].as_str(), Some(sent.as_ref()), "{what}: {d}");
            } else {
                assert_eq!(
                    d["data_b64"].as_str(),
                    Some(crate::format::base64_for_tests(&e.payload).as_str()),
                    "{what}: {d}"
                );
            }
            // What reached the consumer is the message as sent: nothing re-encoded or folded for the
            // broker (SQS's `outbox-encoding` and `outbox-headers`), which no CloudEvents consumer
            // would undo.
            for marker in ["outbox-encoding", "outbox-headers"] {
                assert!(
                    !r.headers.contains_key(marker),
                    "{what}: {marker} in {:?}",
                    r.headers
                );
            }
            // What the SDK would make up when missing is really in the message.
            if format == MessageFormat::CloudeventsBinary {
                for k in ["specversion", "id", "time"] {
                    let name = format!("{}{k}", binding.prefix());
                    assert!(
                        r.headers.contains_key(&name),
                        "{what}: no {name} in {:?}",
                        r.headers
                    );
                }
            } else {
                assert!(
                    r.content_type
                        .as_deref()
                        .unwrap_or("")
                        .starts_with("application/cloudevents+json"),
                    "{what}: structured mode's content type: {r:?}"
                );
                let body: serde_json::Value = serde_json::from_slice(&r.payload)
                    .unwrap_or_else(|err| panic!("{what}: the body is not JSON: {err}"));
                for k in ["specversion", "id", "time"] {
                    assert!(body.get(k).is_some(), "{what}: no {k} in {body}");
                }
            }
        }
    }
    // Debezium's outbox event router shape.
    let events = format_events(binding);
    let received = published_as(fx, MessageFormat::Debezium, &events).await;
    for (e, r) in events.iter().zip(&received) {
        assert_eq!(r.headers.get("id"), Some(&e.id.to_string()), "{r:?}");
        assert_eq!(r.headers.get("eventType"), Some(&e.event_type), "{r:?}");
        assert_eq!(r.payload, e.payload, "the payload as stored: {r:?}");
        assert_eq!(
            r.content_type.as_deref(),
            Some(e.content_type.as_str()),
            "{r:?}"
        );
        if binding == CloudEventsBinding::Kafka {
            assert_eq!(
                r.aggregate_id.as_deref(),
                Some(e.aggregate_id.as_str()),
                "the key: {r:?}"
            );
        }
    }
}
