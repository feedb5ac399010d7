//! The SQS publisher against a real SQS endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::testkit::publisher_suite::{self, event};
use outbox_core::{ErrorKind, Publisher};
use outbox_sqs::testing::Fixture;
use outbox_sqs::{SqsConfig, SqsPublisher, DELAY_HEADER, FOLDED_HEADERS};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_fifo_queue() {
    let fx = Fixture::new(true).await;
    publisher_suite::run_all(&fx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_groups_order_and_deduplication() {
    let fx = Fixture::new(true).await;
    fx.pause();
    tokio::time::sleep(Duration::from_millis(1500)).await; // any receive in flight is over
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_batch_failure_maps_to_exactly_the_failed_events() {
    let fx = Fixture::new(false).await;
    let p = fx.publisher();
    let mut events: Vec<_> = (0..8).map(|i| event(&format!("p-{i}"), 0)).collect();
    // SQS refuses a delay over 900 s for that entry only (SenderFault).
    events[3].headers.insert(DELAY_HEADER.into(), "1000".into());
    events[6].headers.insert(DELAY_HEADER.into(), "5000".into());
    let out = p.publish(&events).await;
    for (i, o) in out.iter().enumerate() {
        if i == 3 || i == 6 {
            let e = o.as_ref().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
            assert!(!e.is_retryable(), "a sender fault is permanent: {e}");
            assert!(e.to_string().contains("DelaySeconds"), "{e}");
        } else {
            assert!(o.is_ok(), "event {i}: {o:?}");
        }
    }
    assert_eq!(fx.wait_for(6, WAIT).await.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_events_and_missing_queues_are_permanent() {
    let fx = Fixture::new(false).await;
    let p = SqsPublisher::from_client(
        outbox_sqs::testing::client(),
        SqsConfig {
            max_message_bytes: 2048,
            allowed_destinations: vec!["outbox-test-no-such-queue".into()],
            ..fx.config()
        },
    )
    .unwrap();
    let mut big = event("big", 0);
    big.payload = vec![b'x'; 4096];
    let mut lost = event("lost", 0);
    lost.destination = Some("outbox-test-no-such-queue".into());
    let out = p.publish(&[event("ok", 0), big, lost]).await;
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err();
    assert_eq!(
        (e.kind(), e.is_retryable()),
        (ErrorKind::PayloadTooLarge, false),
        "{e}"
    );
    let e = out[2].as_ref().unwrap_err();
    assert_eq!(
        (e.kind(), e.is_retryable()),
        (ErrorKind::DestinationNotFound, false),
        "{e}"
    );
    assert!(p.check().await.is_ok());
    let missing = SqsPublisher::from_client(
        outbox_sqs::testing::client(),
        SqsConfig {
            queue: "outbox-test-absent".into(),
            ..fx.config()
        },
    )
    .unwrap();
    assert!(missing.check().await.is_err());
}

/// Queue URLs are remembered up to a bound, however many queues writers name; a forgotten one is
/// resolved again and still sent to.
#[tokio::test]
async fn the_queue_url_cache_stays_bounded() {
    let home = Fixture::new(false).await;
    let mut others = Vec::new();
    for _ in 0..10 {
        others.push(Fixture::new(false).await);
    }
    let publisher = SqsPublisher::from_client(
        outbox_sqs::testing::client_at(&home.endpoint),
        SqsConfig {
            allowed_destinations: vec!["*".into()],
            ..home.config()
        },
    )
    .unwrap()
    .with_queue_url_cache(4);
    for round in 0..2 {
        for (i, fx) in others.iter().enumerate() {
            let mut e = event(&format!("agg-{i}"), round);
            e.destination = Some(fx.queue_name.clone());
            let outcomes = publisher.publish(&[e]).await;
            assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
            assert!(
                publisher.cached_queue_urls() <= 4,
                "{} queue URLs remembered",
                publisher.cached_queue_urls()
            );
        }
    }
    for fx in &others {
        assert_eq!(fx.wait_for(2, WAIT).await.len(), 2, "{}", fx.queue_name);
    }
}

/// By default events may name only the configured queue: another queue, however real, is refused
/// (permission denied, naming the setting), never resolved nor sent to; a pattern in
/// `sqs.allowed_destinations` lets it through.
#[tokio::test]
async fn destinations_outside_the_allow_list_are_refused() {
    let home = Fixture::new(false).await;
    let other = Fixture::new(false).await;
    let strict = home.publisher();
    let mut e = event("elsewhere", 0);
    e.destination = Some(other.queue_name.clone());
    let out = strict.publish(std::slice::from_ref(&e)).await;
    let err = out[0].as_ref().unwrap_err();
    assert_eq!(
        (err.kind(), err.is_retryable()),
        (ErrorKind::PermissionDenied, false),
        "{err}"
    );
    assert!(
        err.to_string().contains("sqs.allowed_destinations")
            && err.to_string().contains(&other.queue_name),
        "{err}"
    );
    assert_eq!(
        strict.cached_queue_urls(),
        0,
        "a refused queue is not even resolved"
    );
    assert!(strict.publish(&[event("home", 0)]).await[0].is_ok());
    assert_eq!(home.wait_for(1, WAIT).await.len(), 1);
    assert!(
        other.wait_for(1, Duration::from_secs(1)).await.is_empty(),
        "nothing reached the other queue"
    );
    let open = SqsPublisher::from_client(
        outbox_sqs::testing::client_at(&home.endpoint),
        SqsConfig {
            allowed_destinations: vec!["outbox-test-*".into()],
            ..home.config()
        },
    )
    .unwrap();
    assert!(open.publish(&[e]).await[0].is_ok());
    assert_eq!(other.wait_for(1, WAIT).await.len(), 1);
}
