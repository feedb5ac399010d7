//! The composed relay's checks at construction: a pool too small for the batches in flight (and,
//! with the NOTIFY listener on the same pool, its connection) is refused with the fix.
#![cfg(feature = "ops")]
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;

use txoutbox_core::publishers::JsonLinesPublisher;
use txoutbox_core::{Relay, RelayConfig};
use txoutbox_postgres::ops::{CleanupSchedule, OpsConfig, RelayService};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::PostgresStore;

fn relay_config(max_in_flight: usize) -> RelayConfig {
    RelayConfig {
        max_in_flight,
        ..RelayConfig::default()
    }
}

#[tokio::test]
async fn a_relay_refuses_a_pool_with_fewer_connections_than_batches_in_flight() {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let store = PostgresStore::new(pool(3).await, table);
    let publisher = Arc::new(JsonLinesPublisher::stdout());
    let e = Relay::new(Arc::new(store.clone()), publisher.clone(), relay_config(4))
        .map(|_| ())
        .expect_err("3 connections for 4 batches in flight");
    assert!(
        e.to_string().contains("max_in_flight = 4"),
        "names the setting: {e}"
    );
    assert!(Relay::new(Arc::new(store), publisher, relay_config(3)).is_ok());
}

#[tokio::test]
async fn the_service_counts_statistics_readiness_cleanup_and_the_listener() {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let publisher = Arc::new(JsonLinesPublisher::stdout());
    let with_cleanup = OpsConfig {
        cleanup: Some(CleanupSchedule::keeping(std::time::Duration::from_secs(60))),
        ..OpsConfig::default()
    };
    let needed = RelayService::connections_needed(&relay_config(2), &with_cleanup);
    assert_eq!(needed, 5, "2 batches, statistics, readiness, cleanup");
    let small = PostgresStore::new(pool(needed - 1).await, table.clone());
    let e = RelayService::polling(
        small,
        publisher.clone(),
        relay_config(2),
        with_cleanup.clone(),
    )
    .map(|_| ())
    .expect_err("one connection short");
    assert!(e.to_string().contains("automatic cleanup"), "{e}");
    let exact_pool = pool(needed).await;
    let exact = PostgresStore::new(exact_pool.clone(), table.clone());
    let service = RelayService::polling(
        exact,
        publisher.clone(),
        relay_config(2),
        with_cleanup.clone(),
    )
    .unwrap();
    let e = service
        .with_notify(exact_pool.clone())
        .map(|_| ())
        .expect_err("the listener on the same pool needs one more");
    assert!(e.to_string().contains("NOTIFY"), "{e}");
    let exact = PostgresStore::new(exact_pool, table.clone());
    let service =
        RelayService::polling(exact, publisher.clone(), relay_config(2), with_cleanup).unwrap();
    assert!(
        service.with_notify(pool(1).await).is_ok(),
        "a listener on a pool of its own"
    );
    let zero = OpsConfig {
        stats_interval: std::time::Duration::ZERO,
        ..OpsConfig::default()
    };
    let store = PostgresStore::new(pool(8).await, table);
    let e = RelayService::polling(store, publisher, relay_config(2), zero)
        .map(|_| ())
        .expect_err("a zero statistics interval");
    assert!(e.to_string().contains("stats_interval"), "{e}");
}
