//! Scenario 3: PostgreSQL restarted during load. The relay reconnects and nothing is lost. Alone in its
//! file: the restart cuts every connection of this process.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_postgres::testing::{fresh_table, pool};
use outbox_tests::harness::{report, restart_postgres, soak_factor, Broker, RelayProcess, Sink};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_during_load_loses_nothing() {
    for broker in Broker::ALL {
        let pg = pool(2).await;
        let table = fresh_table(&pg).await;
        let sink = Sink::new(broker).await;
        let load = broker.load(&table);
        let relay = RelayProcess::start(&table, &sink, &[]);
        // The soak variant restarts the server once per factor, under load all along.
        for _ in 0..soak_factor() {
            tokio::time::sleep(Duration::from_secs(2)).await;
            tokio::task::spawn_blocking(restart_postgres).await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let written = load.stop().await;
        let verdict = sink
            .verdict(&written.committed, Duration::from_secs(120))
            .await;
        assert_eq!(
            relay.terminate(Duration::from_secs(60)),
            Some(0),
            "the relay survived the restart"
        );
        report("postgres-restart", broker, &verdict);
        println!(
            "  ({} events of transactions whose commit outcome was unknown are not counted)",
            written.uncertain.len()
        );
        assert_eq!(
            (verdict.lost, verdict.order_violations),
            (0, 0),
            "{verdict}"
        );
    }
}
