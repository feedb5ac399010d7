//! The Kafka publisher while its broker is stopped and restarted. Uses a broker of its own (Tansu on
//! 127.0.0.1:19092, started and stopped by this test) so other tests keep theirs.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Child, Stdio};
use std::time::Duration;

use outbox_core::testkit::publisher_suite::event;
use outbox_core::Publisher;
use outbox_kafka::{KafkaConfig, KafkaPublisher};

const PORT: u16 = 19092;

/// The broker process; killed when dropped, so a failing test leaves nothing running.
struct Broker(Child);

impl Broker {
    fn stop(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_broker() -> Broker {
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err(),
        "port {PORT} is taken: this test needs it for a broker of its own"
    );
    let child = outbox_kafka::testing::spawn_tansu(PORT, Stdio::null());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "Tansu did not start on port {PORT}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Broker(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_gives_retryable_failures_then_recovers() {
    let broker = start_broker();
    let p = KafkaPublisher::new(KafkaConfig {
        brokers: format!("127.0.0.1:{PORT}"),
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

    let broker = start_broker();
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
