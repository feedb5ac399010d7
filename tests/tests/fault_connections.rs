//! RabbitMQ closes the relay's connection in the middle of its calls (`rabbitmqctl close_connection`,
//! as an operator, a node restart or a load balancer would), again and again under continuous
//! writes over many aggregates. Real `outbox` binary, PostgreSQL and RabbitMQ; judged against the
//! database's record of what committed. Alone in its file: it closes every connection named
//! "outbox relay" on the node, and no other test of this binary may run meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_tests::harness::{
    assert_crash_verdict, faults_under_load, one_at_a_time, soak_factor, Broker,
};

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// Eight closes, each landing on calls in flight (`faults_under_load`). Nothing is lost, every
/// aggregate's events arrive in order, and the duplicates (confirms the closed connection never
/// delivered: README, guarantee 3) stay within the batches in flight at each close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_closed_mid_call_lose_nothing_and_keep_order() {
    let _serial = one_at_a_time().await;
    let (verdict, closed) = faults_under_load(Broker::Amqp, "connections-closed", 8, |_| async {
        tokio::task::spawn_blocking(txoutbox_amqp::testing::close_publisher_connections)
            .await
            .unwrap() as u64
    })
    .await;
    let closes = closed.iter().filter(|n| **n > 0).count();
    assert!(
        closes >= 4 * soak_factor(),
        "only {closes} of the closes found the relay connected ({closed:?} connections)"
    );
    assert_crash_verdict(
        &verdict,
        closed.iter().sum::<u64>() as usize,
        BATCH,
        IN_FLIGHT,
    );
}

/// The local port of the publisher's connection to RabbitMQ (its only one).
fn publisher_connection_port() -> u16 {
    let ports = txoutbox_amqp::testing::publisher_connections("peer_port");
    assert_eq!(ports.len(), 1, "one publisher connection: {ports:?}");
    ports[0].parse().unwrap()
}

/// RabbitMQ no longer answers on the publisher's connection (every packet dropped, no reset, as in
/// a network cut): the readiness check fails within `amqp.connect_timeout` instead of passing on
/// lapin's own idea of the connection (the relay would then claim batches that fail and count
/// attempts), and passes again on a new connection once packets flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_check_fails_on_a_connection_rabbitmq_no_longer_answers() {
    use txoutbox_core::Publisher;
    let _serial = one_at_a_time().await;
    let fx = txoutbox_amqp::testing::Fixture::new().await;
    let mut config = fx.config();
    config.connect_timeout = Duration::from_secs(2);
    let p = txoutbox_amqp::AmqpPublisher::new(config).unwrap();
    let event = txoutbox_core::testkit::publisher_suite::event("a", 0);
    assert!(p.publish(std::slice::from_ref(&event)).await[0].is_ok());
    p.check().await.unwrap();
    let cut = txoutbox_tests::net::NetFault::blackhole(publisher_connection_port());
    let started = std::time::Instant::now();
    let checked = p.check().await;
    let took = started.elapsed();
    assert!(
        checked.is_err(),
        "the check passed on a connection RabbitMQ no longer answers on"
    );
    assert!(
        took < Duration::from_secs(10),
        "the check took {took:?} (amqp.connect_timeout is 2 s)"
    );
    assert!(cut.hits() > 0, "the cut dropped nothing");
    drop(cut);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while p.check().await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the check still fails 60 s after packets flow again"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(p.publish(std::slice::from_ref(&event)).await[0].is_ok());
}
