//! PostgreSQL -> relay -> SQS (FIFO), end to end, with an independent consumer as the checker.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_core::{RelayConfig, Store};
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::PostgresStore;
use outbox_sqs::testing::Fixture;
use outbox_tests::{check, spawn_relays, write_rounds};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_deliver_everything_in_aggregate_order() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let fx = Fixture::new(true).await;
    let committed = write_rounds(&table, 50, 10).await;
    let config = RelayConfig {
        batch_size: 100,
        poll_interval: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let (relays, shutdown) = spawn_relays(&table, 2, fx.publisher(), config).await;
    let got = fx.wait_for(committed.len(), Duration::from_secs(60)).await;
    shutdown.cancel();
    for r in relays {
        r.await.unwrap();
    }
    let received: Vec<Uuid> = got.iter().filter_map(|d| d.received.event_id).collect();
    let verdict = check(&committed, &received);
    println!("postgres -> 2 relays -> sqs: {verdict}");
    assert_eq!(
        (verdict.lost, verdict.order_violations),
        (0, 0),
        "{verdict}"
    );
    assert_eq!(
        PostgresStore::new(pg, table).stats().await.unwrap().pending,
        0
    );
}
