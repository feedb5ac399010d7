//! The Kafka publisher while its broker is stopped and restarted. Uses a broker of its own (Tansu on
//! a spare loopback port, started and stopped by this test, and started again on the same port) so
//! other tests keep theirs.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Stdio;
use std::time::Duration;

use outbox_core::testkit::publisher_suite::event;
use outbox_core::testkit::{free_port, wait_for_port, OwnedProcess};
use outbox_core::Publisher;
use outbox_kafka::{KafkaConfig, KafkaPublisher};

/// A Tansu of the test's own on `port` (killed when dropped), once it accepts connections.
fn start_broker(port: u16) -> OwnedProcess {
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} was taken by another program meanwhile: run the test again"
    );
    let broker = OwnedProcess(outbox_kafka::testing::spawn_tansu(port, Stdio::null()));
    wait_for_port(port, Duration::from_secs(30), "Tansu");
    broker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_gives_retryable_failures_then_recovers() {
    let port = free_port();
    let broker = start_broker(port);
    let p = KafkaPublisher::new(KafkaConfig {
        brokers: format!("127.0.0.1:{port}"),
        topic: "outbox.faults".into(),
        delivery_timeout: Duration::from_secs(3),
        ..KafkaConfig::default()
    })
    .unwrap();
    let batch: Vec<_> = (0..20).map(|i| event(&format!("a{i}"), 0)).collect();
    let out = p.publish(&batch).await;
    assert_eq!(out.len(), batch.len(), "one outcome per event");
    assert!(
        out.iter().all(|o| o.is_ok()),
        "warm-up: {:?}",
        out.iter().find(|o| o.is_err())
    );

    broker.stop();
    let batch: Vec<_> = (0..20).map(|i| event(&format!("a{i}"), 1)).collect();
    let out = p.publish(&batch).await;
    assert_eq!(out.len(), batch.len(), "one outcome per event");
    for o in &out {
        let e = o
            .as_ref()
            .expect_err("nothing may be reported published while the broker is down");
        assert!(
            e.is_retryable(),
            "a stopped broker is a retryable failure: {e}"
        );
    }
    assert!(
        p.check().await.is_err(),
        "readiness reports the broker down"
    );

    let broker = start_broker(port);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let batch: Vec<_> = (0..20).map(|i| event(&format!("a{i}"), 2)).collect();
        let out = p.publish(&batch).await;
        assert_eq!(out.len(), batch.len(), "one outcome per event");
        if out.iter().all(|o| o.is_ok()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recovery after the restart: {:?}",
            out.iter().find(|o| o.is_err())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    broker.stop();
}
