//! The SQS publisher while its endpoint is stopped and restarted. Uses an endpoint of its own (moto on
//! a spare loopback port, started and stopped by this test, and started again on the same port) so
//! other tests keep theirs.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Stdio;
use std::time::Duration;

use aws_config::{BehaviorVersion, Region};
use aws_sdk_sqs::config::Credentials;
use outbox_core::testkit::publisher_suite::event;
use outbox_core::testkit::{free_port, wait_for_port, OwnedProcess};
use outbox_core::Publisher;
use outbox_sqs::{SqsConfig, SqsPublisher};

/// An endpoint of the test's own on `port` (killed when dropped), once it serves requests.
async fn start_endpoint(port: u16) -> OwnedProcess {
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} was taken by another program meanwhile: run the test again"
    );
    let endpoint = OwnedProcess(outbox_sqs::testing::spawn_endpoint(port, Stdio::null()));
    wait_for_port(port, Duration::from_secs(30), "moto");
    outbox_sqs::testing::wait_until_serving(&format!("http://127.0.0.1:{port}")).await;
    endpoint
}

fn client(port: u16) -> aws_sdk_sqs::Client {
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(format!("http://127.0.0.1:{port}"))
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
    let port = free_port();
    let endpoint = start_endpoint(port).await;
    let c = client(port);
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

    let _endpoint = start_endpoint(port).await;
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
