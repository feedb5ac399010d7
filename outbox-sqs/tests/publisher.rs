//! The SQS publisher against a real SQS endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::time::Duration;

use txoutbox_core::testkit::publisher_suite::{self, event};
use txoutbox_core::testkit::BrokerFixture;
use txoutbox_core::Publisher;
use txoutbox_sqs::testing::Fixture;
use txoutbox_sqs::{SqsConfig, SqsPublisher, FOLDED_HEADERS};

const WAIT: Duration = Duration::from_secs(60);

// The publisher contract (txoutbox_core::testkit::publisher_suite), one test per rule, on a FIFO queue
// (the one that keeps order).
txoutbox_core::publisher_contract!(Fixture::new(true).await);

/// On a standard queue, delays SQS refuses fail alone next to entries of the same request that it
/// takes (the per-entry outcomes of SendMessageBatch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_events_fail_alone_on_a_standard_queue() {
    let fx = Fixture::new(false).await;
    assert!(!fx.poison().is_empty());
    publisher_suite::bad_events_fail_alone(&fx).await;
}

/// SQS bodies are text: in CloudEvents binary mode a payload that is not SQS text is refused for good
/// (no CloudEvents consumer could read its base64), naming structured mode; in structured mode a
/// JSON payload with characters SQS refuses travels as escaped JSON, still one JSON event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_bodies_sqs_cannot_carry_are_refused_or_escaped() {
    use txoutbox_core::format::{Formatter, MessageFormat};
    use txoutbox_core::testkit::{decode_cloudevents, CloudEventsBinding, Setup};
    let fx = Fixture::new(true).await;
    let built = |format| {
        fx.build(Setup {
            format: Formatter::new(format, "s", "/shop/{aggregate_type}").unwrap(),
            ..Setup::default()
        })
    };
    let binary = built(MessageFormat::CloudeventsBinary).await.publisher;
    let mut bytes = event("ce-bytes", 0);
    bytes.payload = vec![0, 159, 146, 150];
    bytes.content_type = "application/octet-stream".into();
    let out = binary.publish(std::slice::from_ref(&bytes)).await;
    let e = out[0].as_ref().unwrap_err();
    assert_eq!(e.kind(), txoutbox_core::ErrorKind::InvalidInput);
    assert!(!e.is_retryable());
    assert!(e.message().contains("cloudevents-structured"), "{e}");

    let structured = built(MessageFormat::CloudeventsStructured).await.publisher;
    let mut odd = event("ce-odd", 0);
    odd.payload = serde_json::json!({"text": "not a character: \u{FFFE}"})
        .to_string()
        .into_bytes();
    let out = structured.publish(std::slice::from_ref(&odd)).await;
    assert!(out[0].is_ok(), "{out:?}");
    let got = fx.wait_for(1, WAIT).await;
    let r = got
        .iter()
        .find(|d| d.received.event_id == Some(odd.id))
        .unwrap();
    assert!(
        !r.attributes.contains_key("outbox-encoding"),
        "{:?}",
        r.attributes
    );
    let decoded = decode_cloudevents(CloudEventsBinding::Sqs, std::slice::from_ref(&r.received));
    assert_eq!(
        decoded[0]["data"]["text"], "not a character: \u{FFFE}",
        "{decoded:?}"
    );
    assert_eq!(decoded[0]["attributes"]["id"], odd.id.to_string());
    fx.dispose().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_configured_queue_fails_the_check() {
    let fx = Fixture::new(false).await;
    assert!(fx.publisher().check().await.is_ok());
    let missing = SqsPublisher::from_client(
        txoutbox_sqs::testing::client(),
        SqsConfig {
            queue: format!("outbox-test-absent-{}", uuid::Uuid::new_v4().simple()),
            ..fx.config()
        },
    )
    .unwrap();
    assert!(missing.check().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_order_and_deduplication() {
    let fx = Fixture::new(true).await;
    fx.pause().await;
    let p = fx.publisher();
    // 95 events over 5 aggregates: split into many requests, sent concurrently.
    let events: Vec<_> = (0..95)
        .map(|i| event(&format!("agg-{}", i % 5), i / 5))
        .collect();
    let out = p.publish(&events).await;
    assert!(
        out.iter().all(|o| o.is_ok()),
        "{:?}",
        out.iter().find(|o| o.is_err())
    );
    // The same events again (a relay retry after a crash): deduplicated by event id.
    let again = p.publish(&events[..10]).await;
    assert!(again.iter().all(|o| o.is_ok()));
    fx.resume();
    let got = fx.wait_for(95, WAIT).await;
    // Once the queue is empty the consumer has read (and deleted) everything the queue took.
    fx.wait_until_empty(WAIT).await;
    let got_all = fx.wait_for(200, Duration::ZERO).await;
    assert_eq!(
        got_all.len(),
        95,
        "duplicates of an event id are dropped by the FIFO queue"
    );
    let mut last: HashMap<String, i64> = HashMap::new();
    for d in &got {
        let agg = d.received.aggregate_id.clone().unwrap();
        assert_eq!(
            d.group_id.as_deref(),
            Some(agg.as_str()),
            "MessageGroupId = aggregate id"
        );
        let n = serde_json::from_slice::<serde_json::Value>(&d.received.payload).unwrap()["n"]
            .as_i64()
            .unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(prev < n, "{agg}: {n} after {prev}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_queue_attributes_and_folding() {
    let fx = Fixture::new(false).await;
    let p = fx.publisher();
    let mut e = event("a-1", 0);
    for i in 0..8 {
        e.headers.insert(format!("x-h{i}"), format!("v{i}"));
    }
    let mut binary = event("a-2", 0);
    binary.payload = vec![0, 159, 146, 150, 255];
    binary.content_type = "application/octet-stream".into();
    let out = p.publish(&[e.clone(), binary.clone()]).await;
    assert!(out.iter().all(|o| o.is_ok()), "{out:?}");
    let got = fx.wait_for(2, WAIT).await;
    let by_id: HashMap<_, _> = got
        .iter()
        .map(|d| (d.received.event_id.unwrap(), d))
        .collect();
    let d = by_id[&e.id];
    assert!(d.attributes.len() <= 10, "SQS allows 10 attributes");
    assert_eq!(
        d.attributes.get("outbox-event-id"),
        Some(&e.id.to_string()),
        "the event id travels as an attribute"
    );
    assert_eq!(
        d.attributes.get("outbox-event-type").map(String::as_str),
        Some("order.updated")
    );
    assert!(
        d.attributes.contains_key("traceparent"),
        "trace context keeps its own attribute"
    );
    assert!(d.attributes.contains_key(FOLDED_HEADERS));
    for (k, v) in &e.headers {
        assert_eq!(
            d.received.headers.get(k),
            Some(v),
            "header {k} survives, folded or not"
        );
    }
    let b = by_id[&binary.id];
    assert_eq!(
        b.received.payload, binary.payload,
        "binary payloads round-trip (base64)"
    );
}

/// Messages of hundreds of kilobytes, and one of nearly 1 MiB (body and attributes), go in requests
/// that stay within SQS's 1 MiB per `SendMessageBatch` (the endpoint refuses a larger request whole,
/// `BatchRequestTooLong`, which would fail every event in it for good): every event is taken, whole,
/// in its aggregate's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_go_in_requests_within_the_batch_limit() {
    let fx = Fixture::new(true).await;
    let p = fx.publisher();
    let big = txoutbox_sqs::SQS_MAX_BYTES - 4096;
    let mut events = Vec::new();
    for n in 0..4 {
        for a in 0..4 {
            let mut e = event(&format!("agg-{a}"), n);
            let pad = if a == 0 && n == 2 { big } else { 300_000 };
            e.payload = serde_json::json!({"aggregate": format!("agg-{a}"), "n": n, "pad": "x".repeat(pad)})
                .to_string()
                .into_bytes();
            events.push(e);
        }
    }
    let total: usize = events.iter().map(|e| e.payload.len()).sum();
    assert!(
        total > 5 * txoutbox_sqs::SQS_MAX_BYTES,
        "the call needs several requests"
    );
    let out = p.publish(&events).await;
    for (e, o) in events.iter().zip(&out) {
        assert!(
            o.is_ok(),
            "{} n={} ({} bytes): {o:?}",
            e.aggregate_id,
            serde_json::from_slice::<serde_json::Value>(&e.payload).unwrap()["n"],
            e.payload.len()
        );
    }
    let got = fx.wait_for(events.len(), WAIT).await;
    assert_eq!(got.len(), events.len());
    let sent: HashMap<txoutbox_core::Uuid, usize> =
        events.iter().map(|e| (e.id, e.payload.len())).collect();
    let mut last: HashMap<String, i64> = HashMap::new();
    for d in &got {
        let agg = d.received.aggregate_id.clone().unwrap();
        let id = d.received.event_id.unwrap();
        assert_eq!(
            Some(&d.received.payload.len()),
            sent.get(&id),
            "{id} arrives whole"
        );
        let n = serde_json::from_slice::<serde_json::Value>(&d.received.payload).unwrap()["n"]
            .as_i64()
            .unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(prev < n, "{agg}: {n} after {prev}");
        }
    }
}
