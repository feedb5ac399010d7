//! Scenario 5: bad input. Oversized payloads, destinations that cannot exist or are not allowed,
//! non-text payloads, oversized header values, event types the broker refuses: each is classified,
//! dead-lettered (or delivered, when the broker can carry it) with a clear error on the row, and the
//! relay keeps going.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use txoutbox_core::testkit::sample_event;
use txoutbox_core::{
    CancellationToken, NewEvent, Publisher, Relay, RelayConfig, RetryPolicy, Store, Uuid,
};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{DeadLetterFilter, PostgresStore, Writer};
use txoutbox_tests::harness::{
    assert_clean_verdict, committed_by_seq, report, soak_factor, Broker, Sink,
};

/// What should become of a bad event: delivered, or dead-lettered with an error of a kind whose
/// message names the limit or field at fault (the words, per broker).
#[derive(Debug, Clone, Copy)]
enum Expect {
    Delivered,
    DeadLettered(&'static str, fn(Broker) -> &'static [&'static str]),
}

/// A destination that does not exist (or cannot) on the sink's broker; the scenario's publisher
/// allows it (`allowed_destinations`), so that the broker's own refusal is what gets classified.
fn nowhere(sink: &Sink) -> String {
    match sink {
        Sink::Amqp(fx) => format!("{}.nowhere", fx.exchange),
        Sink::Kafka(_) => "not a topic!".to_string(),
        Sink::Sqs(_) => "outbox-test-no-such-queue".to_string(),
    }
}

fn cases(broker: Broker, sink: &Sink) -> Vec<(&'static str, NewEvent, Expect)> {
    let big = serde_json::json!({ "blob": "x".repeat(2 * 1024 * 1024) });
    let nowhere = nowhere(sink);
    let long_type = "t".repeat(300);
    vec![
        (
            "payload over the limit",
            NewEvent::new("order", "big", "order.created", big),
            Expect::DeadLettered("payload_too_large", |b| match b {
                Broker::Amqp => &["amqp.max_message_bytes is 1048576"],
                Broker::Kafka => &["kafka.max_message_bytes is 1000000"],
                Broker::Sqs => &["sqs.max_message_bytes is 1048576"],
            }),
        ),
        (
            "unroutable destination",
            sample_event("lost", 0).with_destination(nowhere),
            Expect::DeadLettered("destination_not_found", |b| match b {
                Broker::Amqp => &["exchange", ".nowhere"],
                Broker::Kafka => &["\"not a topic!\"", "topic name"],
                Broker::Sqs => &["queue=outbox-test-no-such-queue"],
            }),
        ),
        (
            "destination outside the allow-list",
            sample_event("elsewhere", 0).with_destination("outbox-test-not-allowed"),
            Expect::DeadLettered("permission_denied", |b| match b {
                Broker::Amqp => &[
                    "\"outbox-test-not-allowed\" is not allowed",
                    "amqp.allowed_destinations",
                ],
                Broker::Kafka => &[
                    "\"outbox-test-not-allowed\" is not allowed",
                    "kafka.allowed_destinations",
                ],
                Broker::Sqs => &[
                    "\"outbox-test-not-allowed\" is not allowed",
                    "sqs.allowed_destinations",
                ],
            }),
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
                Broker::Amqp => {
                    Expect::DeadLettered("invalid_input", |_| &["headers", "at most 131072"])
                }
                _ => Expect::Delivered,
            },
        ),
        (
            "event type the broker refuses",
            NewEvent::new("order", "typ", long_type, serde_json::json!({})),
            match broker {
                Broker::Amqp => Expect::DeadLettered("invalid_input", |_| {
                    &["routing key is 300 bytes", "at most 255"]
                }),
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

/// The events a run writes: the bad ones, a follower behind each one that must dead-letter (same
/// aggregate, written after it), and healthy events on aggregates of their own.
struct Written {
    /// Each bad event: its case name and what must become of it.
    bad: HashMap<Uuid, (&'static str, Expect)>,
    /// Followers of the events that must dead-letter: held back, never tried.
    followers: Vec<(&'static str, Uuid)>,
    /// What must arrive, in `seq` order: healthy events and the bad ones a broker carries.
    deliverable: Vec<(String, Uuid)>,
    healthy: Vec<Uuid>,
}

async fn write(
    pg: &sqlx::PgPool,
    table: &txoutbox_postgres::OutboxTable,
    broker: Broker,
    sink: &Sink,
    with_bad: bool,
) -> Written {
    let writer = Writer::new(table.clone()).with_max_payload_bytes(4 * 1024 * 1024);
    let mut tx = pg.begin().await.unwrap();
    let mut bad = HashMap::new();
    let mut followers = Vec::new();
    if with_bad {
        for (name, event, expect) in cases(broker, sink) {
            let follower = sample_event(&event.aggregate_id, 1);
            bad.insert(event.id, (name, expect));
            writer.enqueue(&mut tx, event).await.unwrap();
            if !matches!(expect, Expect::Delivered) {
                followers.push((name, follower.id));
                writer.enqueue(&mut tx, follower).await.unwrap();
            }
        }
    }
    // Healthy events around the bad ones: the relay keeps going (more of them in the soak variant).
    let healthy: Vec<_> = (0..20 * soak_factor())
        .map(|i| sample_event(&format!("ok-{}", i % 20), i / 20))
        .collect();
    let healthy_ids: Vec<Uuid> = healthy.iter().map(|e| e.id).collect();
    writer.enqueue_many(&mut tx, healthy).await.unwrap();
    writer.commit(tx).await.unwrap();
    let held: std::collections::HashSet<Uuid> = followers.iter().map(|(_, id)| *id).collect();
    let deliverable = committed_by_seq(pg, table)
        .await
        .into_iter()
        .filter(|(_, id)| {
            !held.contains(id)
                && bad
                    .get(id)
                    .is_none_or(|(_, expect)| matches!(expect, Expect::Delivered))
        })
        .collect();
    Written {
        bad,
        followers,
        deliverable,
        healthy: healthy_ids,
    }
}

/// One run over a fresh table: writes (with or without the bad events), relays until the healthy
/// events arrive; returns what was written, the store, and how long the healthy events took.
async fn run(broker: Broker, with_bad: bool) -> (Written, PostgresStore, Sink, Duration) {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let allowed = vec![nowhere(&sink)];
    let publisher: Arc<dyn Publisher> = match &sink {
        Sink::Amqp(fx) => Arc::new(
            txoutbox_amqp::AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
                max_message_bytes: 1024 * 1024,
                allowed_destinations: allowed,
                ..fx.config()
            })
            .unwrap(),
        ),
        _ => sink.publisher_allowing(allowed),
    };
    let written = write(&pg, &table, broker, &sink, with_bad).await;
    let store = PostgresStore::new(pg.clone(), table.clone());
    // A slow retry: had a failing event held up any other aggregate, its latency would jump by 10 s.
    let config = RelayConfig {
        retry: RetryPolicy {
            initial_backoff: Duration::from_secs(10),
            ..RetryPolicy::default()
        },
        ..RelayConfig::default()
    };
    let relay = Relay::new(Arc::new(store.clone()), publisher, config).unwrap();
    let started = Instant::now();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });
    let healthy: Vec<(String, Uuid)> = written
        .deliverable
        .iter()
        .filter(|(_, id)| written.healthy.contains(id))
        .cloned()
        .collect();
    sink.wait_all(&healthy, Duration::from_secs(60)).await;
    let latency = started.elapsed();
    sink.wait_all(&written.deliverable, Duration::from_secs(60))
        .await;
    // Until nothing is left to try: each bad event delivered or dead-lettered.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.pending == written.followers.len() as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: {} events still pending, {} expected (the followers)",
            broker.name(),
            stats.pending,
            written.followers.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    (written, store, sink, latency)
}

async fn bad_input(broker: Broker) {
    let (_, _, _, without) = run(broker, false).await;
    let (written, store, sink, with) = run(broker, true).await;
    println!(
        "{}: healthy events delivered in {:.2}s without bad events, {:.2}s with them",
        broker.name(),
        without.as_secs_f64(),
        with.as_secs_f64()
    );
    assert!(
        with < without + Duration::from_secs(5),
        "{}: the bad events delayed the healthy ones ({with:?} against {without:?})",
        broker.name()
    );
    let verdict = sink.judge(&written.deliverable).await;
    let received = sink.received(usize::MAX, Duration::ZERO).await;
    let dead: HashMap<Uuid, String> = store
        .dead_letters(&DeadLetterFilter::All, None, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|d| (d.id, d.last_error.unwrap_or_default()))
        .collect();
    for (id, (name, expect)) in &written.bad {
        match expect {
            Expect::Delivered => assert!(
                received.contains(id),
                "{}: {name} must be delivered (dead letter: {:?})",
                broker.name(),
                dead.get(id)
            ),
            Expect::DeadLettered(kind, names) => {
                let error = dead
                    .get(id)
                    .unwrap_or_else(|| panic!("{}: {name} must be dead-lettered", broker.name()));
                println!("  {}: {name}: {error}", broker.name());
                assert!(
                    error.starts_with(kind),
                    "{}: {name}: expected a {kind} error, got {error}",
                    broker.name()
                );
                for needle in names(broker) {
                    assert!(
                        error.contains(needle),
                        "{}: {name}: the error must name {needle:?}: {error}",
                        broker.name()
                    );
                }
            }
        }
    }
    // Each dead letter holds back the next event of its aggregate: never tried, never sent.
    for (name, id) in &written.followers {
        let (attempts, processed): (i32, bool) = sqlx::query_as(&format!(
            "SELECT attempts, processed_at IS NOT NULL FROM {} WHERE id = $1",
            store.table().qualified()
        ))
        .bind(id)
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(
            (attempts, processed, received.contains(id)),
            (0, false, false),
            "{}: the event behind {name} must wait behind its dead letter",
            broker.name()
        );
    }
    report("bad-input", broker, &verdict);
    // Nothing crashed; the followers and dead letters received would count as unexpected.
    assert_clean_verdict(&verdict);
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
