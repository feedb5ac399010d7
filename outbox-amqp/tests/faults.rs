//! The AMQP publisher while RabbitMQ closes its connection (`rabbitmqctl close_connection`).
//! Alone in its file: it closes the publisher's connections by name, and no other test of this
//! binary may run meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashSet;
use std::time::Duration;

use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use txoutbox_amqp::testing::Fixture;
use txoutbox_amqp::AmqpPublisher;
use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::Publisher;

/// Every message id in `queue`, read with basic.get on a new connection; the queue is deleted after.
async fn drain_queue(queue: &str) -> HashSet<String> {
    let conn = txoutbox_amqp::testing::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut ids = HashSet::new();
    while let Some(m) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        if let Some(id) = m.delivery.properties.message_id() {
            ids.insert(id.to_string());
        }
    }
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_connections_give_retryable_failures_then_recover() {
    let fx = Fixture::new().await;
    let p = std::sync::Arc::new(
        AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
            reconnect_initial_backoff: Duration::from_millis(100),
            reconnect_max_backoff: Duration::from_millis(500),
            ..fx.config()
        })
        .unwrap(),
    );
    let queue = format!("{}.durable", fx.exchange);
    let ch = fx.connection.create_channel().await.unwrap();
    ch.queue_declare(
        queue.clone().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.clone().into(),
        fx.exchange.clone().into(),
        "#".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    assert!(p.publish(&[event("warm-up", 0)]).await[0].is_ok());

    // Publish batches back to back while the broker closes the publisher's connection.
    let failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let publisher = p.clone();
    let seen = failures.clone();
    let worker = tokio::spawn(async move {
        let mut acked = Vec::new();
        let mut retryable = 0usize;
        let mut permanent = Vec::new();
        let mut batches_ok_after_failure = 0usize;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        for round in 0.. {
            let batch: Vec<_> = (0..500)
                .map(|i| event(&format!("agg-{i}"), round))
                .collect();
            let out = publisher.publish(&batch).await;
            let mut all_ok = true;
            for (e, o) in batch.iter().zip(out) {
                match o {
                    Ok(()) => acked.push(e.id),
                    Err(err) if err.is_retryable() => {
                        retryable += 1;
                        all_ok = false;
                    }
                    Err(err) => permanent.push(err.to_string()),
                }
            }
            seen.store(retryable, std::sync::atomic::Ordering::SeqCst);
            if !all_ok {
                // Let the reconnection backoff pass instead of spinning on fast failures.
                tokio::time::sleep(Duration::from_millis(50)).await;
            } else if retryable > 0 {
                batches_ok_after_failure += 1;
            }
            if batches_ok_after_failure >= 5 || tokio::time::Instant::now() > deadline {
                break;
            }
        }
        (acked, retryable, permanent, batches_ok_after_failure)
    });
    let mut closed = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        closed += tokio::task::spawn_blocking(txoutbox_amqp::testing::close_publisher_connections)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if failures.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
    }
    assert!(closed >= 1, "the publisher's connection must be found");
    let (acked, retryable, permanent, recovered) = worker.await.unwrap();

    assert!(
        permanent.is_empty(),
        "a lost connection is never a permanent failure: {permanent:?}"
    );
    assert!(
        retryable > 0,
        "events in flight when the connection closed must fail retryably"
    );
    assert!(
        recovered >= 5,
        "the publisher must reconnect and publish again"
    );
    // No false success: every acknowledged event reached the durable queue (read on a fresh
    // connection, so the check does not depend on a consumer that lived through the fault).
    let received = drain_queue(&queue).await;
    let missing = acked
        .iter()
        .filter(|id| !received.contains(&id.to_string()))
        .count();
    assert_eq!(
        missing, 0,
        "{missing} events were reported published but never arrived"
    );
    println!(
        "connection closed: {} acked, {retryable} retryable failures, recovered",
        acked.len()
    );
    fx.cleanup().await;
}
