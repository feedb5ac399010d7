//! The broker's connections reset in the middle of the relay's calls (an iptables rule answering
//! every packet to the broker's port with a TCP reset for 300 ms, as when a broker's process dies or
//! a proxy drops its connections), again and again under continuous writes: Kafka (librdkafka's
//! producer) and SQS (the AWS SDK's HTTP connections). Real `outbox` binary and servers; judged
//! against the database's record of what committed. Alone in its file: the resets hit every
//! connection to the broker's port, the consumer's too. Needs root and iptables
//! (`scripts/test-env.sh`). RabbitMQ's connections closed mid-call: `fault_connections.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_tests::harness::{assert_crash_verdict, faults_under_load, one_at_a_time, Broker};
use txoutbox_tests::net::NetFault;

/// The harness's relay settings: batches of 100, two in flight (the default).
const BATCH: usize = 100;
const IN_FLIGHT: usize = 2;

/// Six resets of 300 ms, each landing on calls in flight (`faults_under_load`). Nothing is lost,
/// every aggregate's events arrive in order, and the duplicates (acknowledgements the reset
/// connection never delivered: README, guarantee 3) stay within the batches in flight at each reset.
async fn resets_under_load(broker: Broker) {
    let (verdict, hits) = faults_under_load(broker, "connections-reset", 6, |port| async move {
        let fault = NetFault::reset(port);
        tokio::time::sleep(Duration::from_millis(300)).await;
        fault.hits()
    })
    .await;
    println!("  packets to the broker's port answered with a reset, per reset: {hits:?}");
    assert!(
        hits.iter().sum::<u64>() >= hits.len() as u64,
        "the resets hit {hits:?} packets: is the broker on a loopback port?"
    );
    assert_crash_verdict(&verdict, hits.len(), BATCH, IN_FLIGHT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connections_reset_mid_call_lose_nothing_and_keep_order() {
    let _serial = one_at_a_time().await;
    resets_under_load(Broker::Kafka).await;
    resets_under_load(Broker::Sqs).await;
}
