//! The broker's connections reset in the middle of the relay's calls (an iptables rule answering
//! every packet to the broker's port with a TCP reset for 300 ms, as when a broker's process dies or
//! a proxy drops its connections), again and again under continuous writes: Kafka (librdkafka's
//! producer) and SQS (the AWS SDK's HTTP connections). Real `outbox` binary and servers; judged
//! against the database's record of what committed. Alone in its file: the resets hit every
//! connection to the broker's port, the consumer's too. Needs root and iptables
//! (`scripts/test-env.sh`). RabbitMQ's connections closed mid-call: `fault_connections.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use outbox_postgres::testing::{fresh_table, pool};
use outbox_tests::harness::{
    assert_crash_verdict, committed_in_db, one_at_a_time, report, soak_factor, Broker,
    RelayProcess, Sink,
};
use outbox_tests::net::NetFault;

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// Six resets, each after progress since the previous one and a random moment, so that they land on
/// calls in flight. Nothing is lost, every aggregate's events arrive in order, and the duplicates
/// (acknowledgements the reset connection never delivered: README, guarantee 3) stay within the
/// batches in flight at each reset.
async fn resets_under_load(broker: Broker) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let port = sink.broker_port();
    let load = broker.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &[]);
    let mut rng = fastrand::Rng::with_seed(0x5e7);
    let (mut resets, mut hits) = (0, 0);
    let mut before = 0;
    for _ in 0..6 * soak_factor() {
        sink.wait_past(
            before,
            Duration::from_secs(120),
            "the relay published nothing since the last reset: it did not connect again",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.u64(50..500))).await;
        let fault = NetFault::reset(port);
        tokio::time::sleep(Duration::from_millis(300)).await;
        hits += fault.hits();
        drop(fault);
        resets += 1;
        before = sink.received_count().await;
    }
    let written = load.stop().await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(180)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    report(&format!("connections-reset-x{resets}"), broker, &verdict);
    println!("  {hits} packets to the broker's port answered with a reset");
    assert!(
        hits >= resets as u64,
        "the resets hit {hits} packets: is the broker on this loopback port ({port})?"
    );
    assert_crash_verdict(&verdict, resets, BATCH, IN_FLIGHT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connections_reset_mid_call_lose_nothing_and_keep_order() {
    let _serial = one_at_a_time().await;
    resets_under_load(Broker::Kafka).await;
    resets_under_load(Broker::Sqs).await;
}
