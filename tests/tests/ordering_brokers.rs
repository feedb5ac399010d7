//! Per-aggregate order when the broker rejects an event after accepting a later one: a RabbitMQ queue
//! in `reject-publish` overflow (nacks while full, acks once the consumer made room) and an SQS batch
//! that fails one entry and accepts the next (the emulator's own per-entry validation).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::testkit::sample_event;
use outbox_core::{CancellationToken, Publisher, Relay, RelayConfig, RetryPolicy};
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::{PostgresStore, Writer};
use outbox_tests::{check, write_rounds};
use uuid::Uuid;

/// The event ids the SQS consumer received, waiting up to `timeout` for `count`.
async fn sqs_ids(fx: &outbox_sqs::testing::Fixture, count: usize, timeout: Duration) -> Vec<Uuid> {
    fx.wait_for(count, timeout)
        .await
        .iter()
        .filter_map(|d| d.received.event_id)
        .collect()
}

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
    let fx = outbox_amqp::testing::Fixture::bounded(1, Duration::ZERO).await;
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
        (verdict.lost, verdict.order_violations, verdict.duplicates),
        (0, 0, 0),
        "{verdict}"
    );
    fx.cleanup().await;
}

/// One SQS `SendMessageBatch` in which the first event of an aggregate is refused by the endpoint (a
/// delay of 1,000 s: moto fails that entry with InvalidParameterValue and accepts the others) and the
/// second is fine. The second must not reach the queue while the first is refused: it waits behind
/// the dead letter, and flows once the dead letter is discarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sqs_entry_refused_in_a_batch_holds_back_the_rest_of_its_aggregate() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let fx = outbox_sqs::testing::Fixture::new(false).await;
    let writer = Writer::new(table.clone());
    let mut bad = sample_event("x", 0);
    bad.headers = BTreeMap::from([(outbox_sqs::DELAY_HEADER.to_string(), "1000".to_string())]);
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
    let publisher: Arc<dyn Publisher> = fx.publisher();
    let relay = Relay::new(Arc::new(store.clone()), publisher, config()).unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });

    // y flows; x1 is dead-lettered (the endpoint's refusal is permanent); x2 must not arrive.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let dead = store
            .dead_letters(&outbox_postgres::DeadLetterFilter::All, 10)
            .await
            .unwrap();
        let got = sqs_ids(&fx, 1, Duration::from_millis(100)).await;
        if dead.iter().any(|d| d.id == x1) && got.contains(&y1) {
            let error = dead[0].last_error.clone().unwrap_or_default();
            assert!(error.contains("DelaySeconds"), "{error}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "x1 not dead-lettered or y not delivered"
        );
    }
    // Give a wrongly sent x2 time to show up at the consumer.
    let got = sqs_ids(&fx, 2, Duration::from_secs(2)).await;
    assert!(
        !got.contains(&x2),
        "x2 reached the queue while x1 was refused"
    );
    assert!(!got.contains(&x1));

    // Discarding the dead letter releases the aggregate.
    store
        .discard_dead_letters(&outbox_postgres::DeadLetterFilter::Ids(vec![x1]))
        .await
        .unwrap();
    let got = sqs_ids(&fx, 2, Duration::from_secs(30)).await;
    shutdown.cancel();
    task.await.unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.contains(&x2) && got.contains(&y1), "{got:?}");
}
