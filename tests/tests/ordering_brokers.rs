//! Per-aggregate order when the broker rejects an event after accepting a later one: a RabbitMQ queue
//! in `reject-publish` overflow (nacks while full, acks once the consumer made room), an SQS batch that
//! fails one entry and accepts the next (the emulator's own per-entry validation), and a Kafka broker
//! that refuses a record failing its topic's schema while another topic takes the aggregate's next
//! event.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::testkit::sample_event;
use txoutbox_core::NewEvent;
use txoutbox_core::{CancellationToken, Relay, RelayConfig, RetryPolicy};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{PostgresStore, Writer};
use txoutbox_tests::harness::{own_tansu, Sink};
use txoutbox_tests::{check, write_rounds};
use uuid::Uuid;

fn config() -> RelayConfig {
    RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        retry: RetryPolicy {
            max_attempts: 1_000,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            ..RetryPolicy::default()
        },
        ..RelayConfig::default()
    }
}

/// Ten aggregates of ten events each go to a queue that holds one ready message and refuses more, read
/// by a consumer taking one message at a time: many publishes are nacked while later ones of the
/// same aggregate would be acked. The consumer must see every aggregate in order, with nothing lost,
/// and the broker must really have refused some (or the test proved nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_reject_publish_overflow_keeps_each_aggregate_in_order() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let fx = txoutbox_amqp::testing::Fixture::bounded(1, Duration::ZERO).await;
    let committed = write_rounds(&table, 10, 10).await;
    let store = PostgresStore::new(pool(4).await, table.clone());
    let relay = Relay::new(Arc::new(store), fx.publisher(), config()).unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let verdict = loop {
        let got = fx
            .wait_for(committed.len(), Duration::from_millis(200))
            .await;
        let received: Vec<Uuid> = got.iter().filter_map(|d| d.received.event_id).collect();
        let v = check(&committed, &received);
        if v.lost == 0 || tokio::time::Instant::now() >= deadline {
            break v;
        }
    };
    shutdown.cancel();
    let summary = task.await.unwrap();
    println!("{verdict} retried={}", summary.retried);
    assert!(summary.retried > 0, "the queue never refused a message");
    // Nothing crashed: a refused message is never counted as delivered, so nothing arrives twice.
    assert_eq!(
        (
            verdict.lost,
            verdict.order_violations,
            verdict.duplicates,
            verdict.unexpected
        ),
        (0, 0, 0, 0),
        "{verdict}"
    );
    fx.cleanup().await;
}

/// Writes `bad` (aggregate `x`, refused by the broker for good), then `x`'s next event and one of
/// aggregate `y`, and relays them to `sink`. `y` flows; `bad` is dead-lettered with an error containing
/// `error_names`; `x`'s next event must not reach the broker while `bad` is refused, and flows once the
/// dead letter is discarded.
async fn held_back_behind_a_refused_event(sink: &Sink, bad: NewEvent, error_names: &str) {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let writer = Writer::new(table.clone());
    let allowed = bad.destination.iter().cloned().collect();
    let mut tx = pg.begin().await.unwrap();
    let ids = writer
        .enqueue_many(
            &mut tx,
            vec![bad, sample_event("x", 1), sample_event("y", 0)],
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (x1, x2, y1) = (ids[0], ids[1], ids[2]);

    let store = PostgresStore::new(pool(4).await, table.clone());
    let relay = Relay::new(
        Arc::new(store.clone()),
        sink.publisher_allowing(allowed),
        config(),
    )
    .unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });

    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let dead = store
            .dead_letters(&txoutbox_postgres::DeadLetterFilter::All, None, 10)
            .await
            .unwrap();
        let got = sink.received(1, Duration::from_millis(100)).await;
        if let (Some(x1_dead), true) = (dead.iter().find(|d| d.id == x1), got.contains(&y1)) {
            assert_eq!(dead.len(), 1, "only x1 is dead-lettered: {dead:?}");
            let error = x1_dead.last_error.clone().unwrap_or_default();
            assert!(error.contains(error_names), "{error}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "x1 not dead-lettered or y not delivered"
        );
    }
    // Give a wrongly sent x2 time to show up at the consumer.
    let got = sink.received(2, Duration::from_secs(2)).await;
    assert!(
        !got.contains(&x2),
        "x2 reached the broker while x1 was refused"
    );
    assert!(!got.contains(&x1));

    // Discarding the dead letter releases the aggregate.
    store
        .discard_dead_letters(&txoutbox_postgres::DeadLetterFilter::Ids(vec![x1]))
        .await
        .unwrap();
    let got = sink.received(2, Duration::from_secs(30)).await;
    shutdown.cancel();
    task.await.unwrap();
    let left: Vec<(i32, Option<String>)> = sqlx::query_as(&format!(
        "SELECT attempts, last_error FROM {} WHERE processed_at IS NULL",
        table.qualified()
    ))
    .fetch_all(&pg)
    .await
    .unwrap();
    assert_eq!(
        got.len(),
        2,
        "received {got:?}; left in the outbox: {left:?}"
    );
    assert!(got.contains(&x2) && got.contains(&y1), "{got:?}");
}

/// One SQS `SendMessageBatch` in which the endpoint refuses the first event of an aggregate (a delay of
/// 1,000 s: moto fails that entry with InvalidParameterValue and accepts the others).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_entry_refused_in_a_batch_holds_back_the_rest_of_its_aggregate() {
    let sink = Sink::Sqs(txoutbox_sqs::testing::Fixture::new(false).await);
    let mut bad = sample_event("x", 0);
    bad.headers = BTreeMap::from([(txoutbox_sqs::DELAY_HEADER.to_string(), "1000".to_string())]);
    held_back_behind_a_refused_event(&sink, bad, "DelaySeconds").await;
}

/// A Tansu of the test's own that validates topic `strict` against a JSON schema (a record value
/// without `n` is refused as `InvalidRecord`), with the directory of its schemas.
fn strict_tansu() -> (
    std::path::PathBuf,
    txoutbox_tests::harness::OwnedProcess,
    String,
) {
    let dir = std::env::temp_dir().join(format!("outbox-schemas-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("strict.json"),
        r#"{"type": "object", "properties": {"value": {"type": "object", "required": ["n"]}}}"#,
    )
    .unwrap();
    let (tansu, brokers) = own_tansu(Some(&dir));
    (dir, tansu, brokers)
}

/// An event of aggregate `x` that `strict_tansu` refuses.
fn invalid_for_strict() -> NewEvent {
    NewEvent::new(
        "order",
        "x",
        "order.created",
        serde_json::json!({"nope": 1}),
    )
}

/// A Kafka broker (a Tansu of the test's own, validating topic `strict` against a JSON schema) refuses
/// the first event of an aggregate, bound for `strict`, as `InvalidRecord`, while the aggregate's next
/// event is bound for another topic the broker accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_record_the_broker_refuses_holds_back_the_rest_of_its_aggregate() {
    let (dir, _tansu, brokers) = strict_tansu();
    let _strict = txoutbox_kafka::testing::Fixture::create_at(&brokers, "strict", 1).await;
    let sink = Sink::Kafka(txoutbox_kafka::testing::Fixture::create_at(&brokers, "plain", 1).await);
    let bad = invalid_for_strict().with_destination("strict");
    held_back_behind_a_refused_event(&sink, bad, "validate").await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same on one topic: the broker refuses the first event of an aggregate, and with it the whole
/// record batch it is in, which holds the aggregate's next event (Kafka takes whole runs in one
/// call) and another aggregate's event. The refused events go again one by one: the bad one is
/// dead-lettered, the other aggregate's event is published, and the next event of the bad one's
/// aggregate is held back (the producer's gapless guarantee keeps it from being written past the
/// refused one) until the dead letter is discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_record_batch_the_broker_refuses_for_one_record_holds_back_only_its_aggregate() {
    let (dir, _tansu, brokers) = strict_tansu();
    let sink =
        Sink::Kafka(txoutbox_kafka::testing::Fixture::create_at(&brokers, "strict", 1).await);
    let bad = invalid_for_strict();
    held_back_behind_a_refused_event(&sink, bad, "validate").await;
    let _ = std::fs::remove_dir_all(&dir);
}
