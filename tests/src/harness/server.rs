//! Broker servers a scenario owns (a Tansu or moto process of its own) or stops (RabbitMQ
//! with `rabbitmqctl`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use uuid::Uuid;

use super::sink::{Broker, Sink};
use txoutbox_core::testkit::{free_port, OwnedProcess};

/// A broker the scenario may stop and start again: for Kafka and SQS, a Tansu or moto process of the
/// scenario's own on a spare loopback port (both keep everything in memory: a restart loses every
/// topic and queue); for RabbitMQ, the local node, stopped with `rabbitmqctl stop_app` (started again
/// on drop, should the scenario fail in between).
pub struct BrokerServer {
    broker: Broker,
    port: u16,
    child: Option<Child>,
    rabbit_stopped: bool,
}

impl BrokerServer {
    /// Starts the broker (Kafka, SQS) or checks the local one answers (RabbitMQ).
    pub async fn start(broker: Broker) -> BrokerServer {
        if broker == Broker::Amqp {
            let url = txoutbox_amqp::testing::amqp_url();
            assert!(
                url.contains("@127.0.0.1:5672") || url.contains("@localhost:5672"),
                "this scenario stops and starts the local RabbitMQ node with rabbitmqctl, but AMQP_URL \
                 points elsewhere: unset AMQP_URL to run it against the local node"
            );
        }
        let mut server = BrokerServer {
            broker,
            port: match broker {
                Broker::Amqp => 5672,
                _ => free_port(),
            },
            child: None,
            rabbit_stopped: false,
        };
        server.up().await;
        server
    }

    /// A new destination with its consumer on this broker.
    pub async fn sink(&self) -> Sink {
        match self.broker {
            Broker::Amqp => Sink::new(Broker::Amqp).await,
            Broker::Kafka => Sink::Kafka(
                txoutbox_kafka::testing::Fixture::create_at(
                    &self.address(),
                    &format!("outbox.test.{}", Uuid::new_v4().simple()),
                    4,
                )
                .await,
            ),
            Broker::Sqs => {
                let mut fx = txoutbox_sqs::testing::Fixture::create_at(
                    &self.address(),
                    &format!("outbox-test-{}.fifo", Uuid::new_v4().simple()),
                )
                .await;
                fx.send_log = Some(self.send_log());
                Sink::Sqs(fx)
            }
        }
    }

    fn address(&self) -> String {
        match self.broker {
            Broker::Amqp => txoutbox_amqp::testing::amqp_url(),
            Broker::Kafka => format!("127.0.0.1:{}", self.port),
            Broker::Sqs => format!("http://127.0.0.1:{}", self.port),
        }
    }

    /// Where the broker process logs (appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        std::env::temp_dir().join(format!(
            "outbox-test-{}-{}.log",
            self.broker.name(),
            self.port
        ))
    }

    /// Where the SQS endpoint records what it accepts (kept across restarts).
    fn send_log(&self) -> PathBuf {
        std::env::temp_dir().join(format!("outbox-test-sqs-sends-{}.log", self.port))
    }

    fn log(&self) -> Stdio {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_or_else(|_| Stdio::null(), Stdio::from)
    }

    fn answers(&self) -> bool {
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_millis(200),
        )
        .is_ok()
    }

    /// Stops the broker: kills the process (Kafka, SQS), or `rabbitmqctl stop_app`.
    pub async fn stop(&mut self) {
        match self.broker {
            Broker::Amqp => {
                rabbitmqctl("stop_app");
                self.rabbit_stopped = true;
            }
            _ => {
                if let Some(mut child) = self.child.take() {
                    let _ = Command::new("kill")
                        .args(["-TERM", &child.id().to_string()])
                        .status();
                    let deadline = std::time::Instant::now() + Duration::from_secs(10);
                    while child.try_wait().unwrap().is_none() {
                        if std::time::Instant::now() > deadline {
                            let _ = child.kill();
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        }
        for _ in 0..100 {
            if !self.answers() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "the {} broker still answers after being stopped",
            self.broker.name()
        );
    }

    /// Starts the broker again (or for the first time) and waits until it answers.
    pub async fn up(&mut self) {
        match self.broker {
            Broker::Amqp => {
                if self.rabbit_stopped {
                    rabbitmqctl("start_app");
                    self.rabbit_stopped = false;
                }
            }
            Broker::Kafka => {
                self.child = Some(txoutbox_kafka::testing::spawn_tansu(self.port, self.log()));
            }
            Broker::Sqs => {
                self.child = Some(txoutbox_sqs::testing::spawn_recording_endpoint(
                    self.port,
                    self.log(),
                    &self.send_log(),
                ));
            }
        }
        for _ in 0..300 {
            if self.answers() {
                // Tansu and moto accept connections a moment before they serve requests.
                self.serving().await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "the {} broker did not come up on port {}",
            self.broker.name(),
            self.port
        );
    }

    /// Waits (up to 60 s) until the broker answers a request of its protocol: a metadata request
    /// (Kafka), a queue listing (SQS); RabbitMQ's own start-up wait has done so already.
    async fn serving(&self) {
        match self.broker {
            Broker::Amqp => {}
            Broker::Sqs => txoutbox_sqs::testing::wait_until_serving(&self.address()).await,
            Broker::Kafka => {
                let config = txoutbox_kafka::KafkaConfig {
                    brokers: self.address(),
                    ..Default::default()
                };
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while let Err(e) =
                    txoutbox_kafka::admin::partition_count(&config, "outbox.serving").await
                {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the Kafka broker on port {} did not serve within 60 s: {e}",
                        self.port
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

fn rabbitmqctl(command: &str) {
    let status = Command::new("rabbitmqctl")
        .args(["-q", command])
        .stdout(Stdio::null())
        .status()
        .expect("this scenario stops and starts RabbitMQ with rabbitmqctl, which is not installed");
    assert!(status.success(), "rabbitmqctl {command} failed");
    if command == "start_app" {
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "await_startup"])
            .stdout(Stdio::null())
            .status();
    }
}

impl Drop for BrokerServer {
    fn drop(&mut self) {
        if self.broker == Broker::Sqs {
            let _ = std::fs::remove_file(self.send_log());
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.rabbit_stopped {
            rabbitmqctl("start_app");
        }
    }
}

/// A Tansu broker of the test's own on a free loopback port (validating records against the JSON
/// schemas in `schemas`, when given), once it accepts connections; returns it with its address.
pub fn own_tansu(schemas: Option<&std::path::Path>) -> (OwnedProcess, String) {
    let port = free_port();
    let child = match schemas {
        Some(dir) => txoutbox_kafka::testing::spawn_tansu_with_schemas(port, dir, Stdio::null()),
        None => txoutbox_kafka::testing::spawn_tansu(port, Stdio::null()),
    };
    let tansu = OwnedProcess(child);
    txoutbox_core::testkit::wait_for_port(port, Duration::from_secs(30), "Tansu");
    (tansu, format!("127.0.0.1:{port}"))
}
