//! PostgreSQL -> relay -> RabbitMQ: a destination that cannot be routed dead-letters one aggregate
//! while the rest flows.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use txoutbox_amqp::testing::Fixture;
use txoutbox_core::testkit::{read_until_quiet, sample_event};
use txoutbox_core::{Relay, RelayConfig, Store};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{DeadLetterFilter, PostgresStore, Writer};

fn config() -> RelayConfig {
    RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        min_poll_interval: Duration::from_millis(5),
        ..RelayConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_event_dead_letters_and_the_rest_flows() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new().await;
    let writer = Writer::new(table.clone());
    let mut tx = pg.begin().await.unwrap();
    let nowhere = format!("{}.nowhere", fx.exchange);
    let poisoned = sample_event("poisoned", 0).with_destination(nowhere.clone());
    let held_back = sample_event("poisoned", 1);
    let healthy: Vec<_> = (0..20)
        .map(|i| sample_event(&format!("ok-{i}"), 0))
        .collect();
    let mut all = vec![poisoned.clone(), held_back.clone()];
    all.extend(healthy.iter().cloned());
    writer.enqueue_many(&mut tx, all).await.unwrap();
    writer.commit(tx).await.unwrap();

    let store = PostgresStore::new(pg.clone(), table.clone());
    // The exchange is allowed, so that RabbitMQ's own refusal is what the relay classifies.
    let publisher = txoutbox_amqp::AmqpPublisher::new(txoutbox_amqp::AmqpConfig {
        allowed_destinations: vec![nowhere],
        ..fx.config()
    })
    .unwrap();
    let relay = Relay::new(Arc::new(store.clone()), Arc::new(publisher), config()).unwrap();
    relay.drain().await;
    fx.wait_for(20, Duration::from_secs(30)).await;
    let got = read_until_quiet(|| fx.wait_for(usize::MAX, Duration::ZERO)).await;
    let mut ids: Vec<_> = got.iter().filter_map(|d| d.received.event_id).collect();
    ids.sort();
    let mut want: Vec<_> = healthy.iter().map(|e| e.id).collect();
    want.sort();
    assert_eq!(ids, want, "every healthy event arrives, and nothing else");
    let dead = store
        .dead_letters(&DeadLetterFilter::All, None, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, poisoned.id);
    let err = dead[0].last_error.clone().unwrap();
    assert!(
        err.contains("destination_not_found") && err.contains("nowhere"),
        "{err}"
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.dead_letters),
        (1, 1),
        "the poisoned aggregate's next event waits"
    );
    // The held-back event was never tried: still in the outbox, unpublished, no attempt.
    let (attempts, processed): (i32, bool) = sqlx::query_as(&format!(
        "SELECT attempts, processed_at IS NOT NULL FROM {} WHERE id = $1",
        table.qualified()
    ))
    .bind(held_back.id)
    .fetch_one(&pg)
    .await
    .unwrap();
    assert_eq!(
        (attempts, processed),
        (0, false),
        "the event behind the dead letter was tried"
    );
    // Discarding the dead letter lets the aggregate flow again.
    store
        .discard_dead_letters(&DeadLetterFilter::Ids(vec![poisoned.id]))
        .await
        .unwrap();
    relay.drain().await;
    let got = fx.wait_for(21, Duration::from_secs(30)).await;
    assert_eq!(
        got.len(),
        21,
        "the held-back event, once, after the healthy ones"
    );
    assert_eq!(got[20].received.event_id, Some(held_back.id));
    fx.cleanup().await;
}
