//! Scenario 7: writers racing on a few shared aggregates (plain SQL and the writer API, transactions
//! held open at random, some rolled back) while two relay processes publish, one of them SIGKILLed
//! and restarted again and again. Judged against the database: every committed event arrives, each
//! aggregate in `seq` order (which is commit order), nothing rolled back is published, and
//! duplicates stay within what the kills can explain.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_postgres::testing::{fresh_table, pool};
use outbox_tests::harness::{
    committed_by_seq, report, soak_factor, unpublished, Broker, RacingLoad, RelayProcess, Sink,
};

const KEEP: (&str, &str) = ("OUTBOX_DATABASE__KEEP_PROCESSED_FOR", "1h");
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

async fn racing_writers_two_relays_killed(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let load = RacingLoad::start(&table, 8, 6, Duration::from_millis(5));
    let mut relays = vec![
        RelayProcess::start(&table, &sink, &[KEEP]),
        RelayProcess::start(&table, &sink, &[KEEP]),
    ];
    let mut kills = 0;
    for _ in 0..8 * soak_factor() {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(400..900))).await;
        let i = fastrand::usize(0..relays.len());
        relays.remove(i).kill9();
        kills += 1;
        relays.insert(i, RelayProcess::start(&table, &sink, &[KEEP]));
    }
    let rolled_back = load.stop().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while unpublished(&pg, &table).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relays did not drain the outbox"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let committed = committed_by_seq(&pg, &table).await;
    let first = sink.verdict(&committed, Duration::from_secs(120)).await;
    assert_eq!(first.lost, 0, "{first}");
    // Late re-deliveries count too: read until nothing more arrives, then judge all of it.
    let received = sink.received_settled().await;
    for r in relays {
        assert_eq!(r.terminate(Duration::from_secs(60)), Some(0));
    }
    let verdict = outbox_tests::check(&committed, &received);
    let unexpected = received
        .iter()
        .filter(|id| rolled_back.contains(id))
        .count();
    report("racing-writers-2-relays-kill9", broker, &verdict);
    println!("unexpected={unexpected} kills={kills}");
    assert!(!committed.is_empty());
    assert_eq!(
        (verdict.lost, verdict.order_violations),
        (0, 0),
        "{verdict}"
    );
    assert_eq!(unexpected, 0, "rolled-back events were published");
    let bound = kills * BATCH * IN_FLIGHT;
    assert!(
        verdict.duplicates <= bound,
        "{} duplicates, more than {kills} kills x {BATCH} x {IN_FLIGHT} can explain",
        verdict.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_rabbitmq() {
    racing_writers_two_relays_killed(Broker::Amqp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_two_relays_kill9_kafka() {
    racing_writers_two_relays_killed(Broker::Kafka).await;
}
