//! The SQS publisher while its endpoint is stopped and restarted. Uses an endpoint of its own (moto on
//! 127.0.0.1:14566, started and stopped by this test) so other tests keep theirs.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Child, Stdio};
use std::time::Duration;

use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::config::Credentials;
use outbox_core::testkit::publisher_suite::event;
use outbox_core::Publisher;
use outbox_sqs::{SqsConfig, SqsPublisher};

const PORT: u16 = 14566;

struct Endpoint(Child);

impl Endpoint {
    fn start() -> Endpoint {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err(),
            "port {PORT} is taken: this test needs it for an endpoint of its own"
        );
        let child = outbox_sqs::testing::spawn_endpoint(PORT, Stdio::null());
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "moto did not start on port {PORT}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Endpoint(child)
    }

    fn stop(mut self) {
        self.0.kill().unwrap();
        self.0.wait().unwrap();
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn client() -> aws_sdk_sqs::Client {
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(format!("http://127.0.0.1:{PORT}"))
        .credentials_provider(Credentials::new("test", "test", None, None, "outbox-tests"))
        .http_client(outbox_sqs::https_client())
        .timeout_config(
            aws_sdk_sqs::config::timeout::TimeoutConfig::builder()
                .operation_timeout(Duration::from_secs(5))
                .connect_timeout(Duration::from_secs(1))
                .build(),
        )
        .build();
    aws_sdk_sqs::Client::from_conf(conf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_down_gives_retryable_failures_then_recovers() {
    let endpoint = Endpoint::start();
    let c = client();
    let url = c
        .create_queue()
        .queue_name("outbox-faults")
        .send()
        .await
        .unwrap()
        .queue_url()
        .unwrap()
        .to_string();
    let p = SqsPublisher::from_client(
        c.clone(),
        SqsConfig {
            queue: url.clone(),
            ..SqsConfig::default()
        },
    )
    .unwrap();
    let batch: Vec<_> = (0..25).map(|i| event(&format!("a{i}"), 0)).collect();
    let out = p.publish(&batch).await;
    assert_eq!(out.len(), batch.len(), "one outcome per event");
    assert!(out.iter().all(|o| o.is_ok()));

    endpoint.stop();
    let out = p.publish(&batch).await;
    assert_eq!(out.len(), batch.len(), "one outcome per event");
    for o in &out {
        let e = o
            .as_ref()
            .expect_err("nothing may be reported published while the endpoint is down");
        assert!(e.is_retryable(), "{e}");
    }
    assert!(
        p.check().await.is_err(),
        "readiness reports the endpoint down"
    );

    let _endpoint = Endpoint::start();
    // The restarted emulator starts empty: the queue is created again, as an operator would.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let _ = c.create_queue().queue_name("outbox-faults").send().await;
        let out = p.publish(&batch).await;
        assert_eq!(out.len(), batch.len(), "one outcome per event");
        if out.iter().all(|o| o.is_ok()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no recovery: {:?}",
            out.iter().find(|o| o.is_err())
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
