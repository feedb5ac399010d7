//! Scenario 5: bad input. Oversized payloads, destinations that cannot exist, non-text payloads,
//! oversized header values, event types the broker refuses: each is classified, dead-lettered (or
//! delivered, when the broker can carry it) with a clear error on the row, and the relay keeps going.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::testkit::sample_event;
use outbox_core::{NewEvent, Publisher, Relay, RelayConfig, Store, Uuid};
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::{DeadLetterFilter, PostgresStore, Writer};
use outbox_tests::harness::{report, soak_factor, Broker, Sink};

/// What should become of a bad event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Delivered,
    DeadLettered(&'static str),
}

fn cases(broker: Broker, sink: &Sink) -> Vec<(&'static str, NewEvent, Expect)> {
    let big = serde_json::json!({ "blob": "x".repeat(2 * 1024 * 1024) });
    let nowhere = match sink {
        Sink::Amqp(fx) => format!("{}.nowhere", fx.exchange),
        Sink::Kafka(_) => "not a topic!".to_string(),
        Sink::Sqs(_) => "outbox-test-no-such-queue".to_string(),
    };
    let long_type = "t".repeat(300);
    vec![
        (
            "payload over the limit",
            NewEvent::new("order", "big", "order.created", big),
            Expect::DeadLettered("payload_too_large"),
        ),
        (
            "unroutable destination",
            sample_event("lost", 0).with_destination(nowhere),
            Expect::DeadLettered("destination_not_found"),
        ),
        (
            "binary, not UTF-8",
            NewEvent::binary(
                "blob",
                "bin",
                "blob.stored",
                "application/octet-stream",
                vec![0xff, 0x00, 0xfe],
            ),
            Expect::Delivered,
        ),
        (
            "oversized header value",
            sample_event("hdr", 0).with_header("x-big", "v".repeat(300 * 1024)),
            match broker {
                Broker::Amqp => Expect::DeadLettered("invalid_input"),
                _ => Expect::Delivered,
            },
        ),
        (
            "event type the broker refuses",
            NewEvent::new("order", "typ", long_type, serde_json::json!({})),
            match broker {
                Broker::Amqp => Expect::DeadLettered("invalid_input"),
                _ => Expect::Delivered,
            },
        ),
        (
            "text SQS cannot carry",
            sample_event("odd", 0).with_header("x-odd", "\u{FFFF}\u{1}"),
            Expect::Delivered,
        ),
    ]
}

async fn bad_input(broker: Broker) {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let publisher: Arc<dyn Publisher> = match &sink {
        Sink::Amqp(fx) => Arc::new(
            outbox_amqp::AmqpPublisher::new(outbox_amqp::AmqpConfig {
                max_message_bytes: 1024 * 1024,
                ..fx.config()
            })
            .unwrap(),
        ),
        _ => sink.publisher(),
    };
    let writer = Writer::new(table.clone());
    let cases = cases(broker, &sink);
    let mut tx = pg.begin().await.unwrap();
    let mut expected: HashMap<Uuid, (&str, Expect)> = HashMap::new();
    // What must arrive, in commit order: the healthy events and the bad ones that are delivered.
    let mut committed: Vec<(String, Uuid)> = Vec::new();
    for (name, event, expect) in cases {
        if expect == Expect::Delivered {
            committed.push((event.aggregate_id.clone(), event.id));
        }
        expected.insert(event.id, (name, expect));
        writer.enqueue(&mut tx, event).await.unwrap();
    }
    // Healthy events around the bad ones: the relay keeps going (more of them in the soak variant).
    let healthy: Vec<_> = (0..20 * soak_factor())
        .map(|i| sample_event(&format!("ok-{}", i % 20), i / 20))
        .collect();
    let healthy_ids: Vec<Uuid> = healthy.iter().map(|e| e.id).collect();
    committed.extend(healthy.iter().map(|e| (e.aggregate_id.clone(), e.id)));
    writer.enqueue_many(&mut tx, healthy).await.unwrap();
    writer.commit(tx).await.unwrap();

    let store = PostgresStore::new(pg.clone(), table.clone());
    let relay = Relay::new(Arc::new(store.clone()), publisher, RelayConfig::default()).unwrap();
    relay.drain().await;

    let want = healthy_ids.len()
        + expected
            .values()
            .filter(|(_, e)| *e == Expect::Delivered)
            .count();
    let received = sink.received(want, Duration::from_secs(60)).await;
    for id in &healthy_ids {
        assert!(
            received.contains(id),
            "healthy event {id} must be delivered"
        );
    }
    let dead: HashMap<Uuid, String> = store
        .dead_letters(&DeadLetterFilter::All, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.last_error.unwrap_or_default()))
        .collect();
    for (id, (name, expect)) in &expected {
        match expect {
            Expect::Delivered => assert!(
                received.contains(id),
                "{}: {name} must be delivered (dead letter: {:?})",
                broker.name(),
                dead.get(id)
            ),
            Expect::DeadLettered(kind) => {
                let error = dead
                    .get(id)
                    .unwrap_or_else(|| panic!("{}: {name} must be dead-lettered", broker.name()));
                assert!(
                    error.starts_with(kind),
                    "{}: {name}: expected a {kind} error, got {error}",
                    broker.name()
                );
            }
        }
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.pending, 0, "nothing left behind");
    let verdict = outbox_tests::check(&committed, &received);
    report("bad-input", broker, &verdict);
    assert_eq!(
        (verdict.lost, verdict.order_violations),
        (0, 0),
        "{verdict}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq() {
    bad_input(Broker::Amqp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka() {
    bad_input(Broker::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs() {
    bad_input(Broker::Sqs).await;
}
