//! RabbitMQ closes the relay's connection in the middle of its calls (`rabbitmqctl close_connection`,
//! as an operator, a node restart or a load balancer would), again and again under continuous
//! writes over many aggregates. Real `outbox` binary, PostgreSQL and RabbitMQ; judged against the
//! database's record of what committed. Alone in its file: it closes every connection named
//! "outbox relay" on the node, and no other test of this binary may run meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_postgres::testing::{fresh_table, pool};
use outbox_tests::harness::{
    assert_crash_verdict, committed_in_db, one_at_a_time, report, soak_factor, Broker,
    RelayProcess, Sink,
};

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// Each close waits for progress since the previous one (the relay has connected again and
/// published), then a random moment, so that closes land on calls in flight. Nothing is lost, every
/// aggregate's events arrive in order, and the duplicates (confirms the closed connection never
/// delivered: README, guarantee 3) stay within the batches in flight at each close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_closed_mid_call_lose_nothing_and_keep_order() {
    let _serial = one_at_a_time().await;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(Broker::Amqp).await;
    let load = Broker::Amqp.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &[]);
    let mut rng = fastrand::Rng::with_seed(0x0c105e);
    let (mut closes, mut closed) = (0, 0);
    let mut before = 0;
    for _ in 0..8 * soak_factor() {
        sink.wait_past(
            before,
            Duration::from_secs(60),
            "the relay published nothing since the last close: it did not connect again",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.u64(50..500))).await;
        let n = tokio::task::spawn_blocking(outbox_amqp::testing::close_publisher_connections)
            .await
            .unwrap();
        closes += usize::from(n > 0);
        closed += n;
        before = sink.received_count().await;
    }
    let written = load.stop().await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(120)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    report(
        &format!("connections-closed-x{closes}"),
        Broker::Amqp,
        &verdict,
    );
    assert!(
        closes >= 4 * soak_factor(),
        "only {closes} of the closes found the relay connected ({closed} connections)"
    );
    assert_crash_verdict(&verdict, closed, BATCH, IN_FLIGHT);
}
