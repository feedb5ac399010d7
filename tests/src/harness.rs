//! The fault-injection harness: the real `outbox` binary as a child process, a continuous writer, and
//! an independent consumer per broker, so each scenario can compare what was committed with what the
//! broker received.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::testkit::sample_event;
use outbox_core::Publisher;
use outbox_postgres::testing::{database_url, pool};
use outbox_postgres::{OutboxTable, Writer};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::{check, Verdict};

/// The brokers a scenario can run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    Amqp,
    Kafka,
    Sqs,
}

impl Broker {
    pub const ALL: [Broker; 3] = [Broker::Amqp, Broker::Kafka, Broker::Sqs];

    /// A write load the broker's test server keeps up with: moto (the SQS emulator) slows down past
    /// a few hundred messages per second, so SQS scenarios write less.
    pub fn load(self, table: &OutboxTable) -> Load {
        match self {
            Broker::Sqs => Load::start(table, 1, 40, 5, Duration::from_millis(60)),
            _ => Load::start(table, 2, 40, 5, Duration::from_millis(15)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Broker::Amqp => "rabbitmq",
            Broker::Kafka => "kafka",
            Broker::Sqs => "sqs",
        }
    }
}

/// A destination of its own on one broker, with a consumer reading it.
pub enum Sink {
    Amqp(outbox_amqp::testing::Fixture),
    Kafka(outbox_kafka::testing::Fixture),
    Sqs(outbox_sqs::testing::Fixture),
}

impl Sink {
    pub async fn new(broker: Broker) -> Sink {
        match broker {
            Broker::Amqp => Sink::Amqp(outbox_amqp::testing::Fixture::new().await),
            Broker::Kafka => Sink::Kafka(outbox_kafka::testing::Fixture::new(4).await),
            Broker::Sqs => Sink::Sqs(outbox_sqs::testing::Fixture::new(true).await),
        }
    }

    /// Points an `outbox` command at this sink.
    pub fn configure(&self, c: &mut Command) {
        match self {
            Sink::Amqp(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "amqp")
                    .env("OUTBOX_AMQP__URL", outbox_amqp::testing::amqp_url())
                    .env("OUTBOX_AMQP__EXCHANGE", &fx.exchange)
                    .env("OUTBOX_AMQP__RECONNECT_INITIAL_BACKOFF", "100ms")
                    .env("OUTBOX_AMQP__RECONNECT_MAX_BACKOFF", "1s");
            }
            Sink::Kafka(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "kafka")
                    .env("OUTBOX_KAFKA__BROKERS", outbox_kafka::testing::brokers())
                    .env("OUTBOX_KAFKA__TOPIC", &fx.topic)
                    .env("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "5s");
            }
            Sink::Sqs(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "sqs")
                    .env("OUTBOX_SQS__QUEUE", &fx.queue_name)
                    .env("OUTBOX_SQS__REGION", "us-east-1")
                    .env("OUTBOX_SQS__ENDPOINT_URL", outbox_sqs::testing::endpoint())
                    .env("OUTBOX_SQS__OPERATION_TIMEOUT", "5s")
                    .env("AWS_ACCESS_KEY_ID", "test")
                    .env("AWS_SECRET_ACCESS_KEY", "test");
            }
        }
    }

    /// A publisher to this sink, for in-process relays.
    pub fn publisher(&self) -> Arc<dyn Publisher> {
        match self {
            Sink::Amqp(fx) => fx.publisher(),
            Sink::Kafka(fx) => fx.publisher(),
            Sink::Sqs(fx) => fx.publisher(),
        }
    }

    /// Event ids received so far, in reception order, waiting up to `timeout` for `count`.
    pub async fn received(&self, count: usize, timeout: Duration) -> Vec<Uuid> {
        match self {
            Sink::Amqp(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
            Sink::Kafka(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
            Sink::Sqs(fx) => fx
                .wait_for(count, timeout)
                .await
                .into_iter()
                .filter_map(|d| d.received.event_id)
                .collect(),
        }
    }

    /// Waits until every id of `committed` was received (or `timeout`), then returns the verdict.
    pub async fn verdict(&self, committed: &[(String, Uuid)], timeout: Duration) -> Verdict {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let received = self
                .received(committed.len(), Duration::from_millis(200))
                .await;
            let v = check(committed, &received);
            if v.lost == 0 || tokio::time::Instant::now() >= deadline {
                return v;
            }
        }
    }
}

/// The `outbox` binary built next to the tests.
pub fn outbox_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("outbox");
    assert!(
        path.exists(),
        "the outbox binary is not built at {}: run `cargo test --workspace`",
        path.display()
    );
    path
}

/// A relay process.
pub struct RelayProcess {
    pub child: Child,
}

impl RelayProcess {
    /// Starts `outbox relay` over `table`, publishing to `sink`, with `extra` settings.
    pub fn start(table: &OutboxTable, sink: &Sink, extra: &[(&str, &str)]) -> RelayProcess {
        let mut c = Command::new(outbox_bin());
        c.arg("relay").current_dir(std::env::temp_dir());
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") {
                c.env_remove(k);
            }
        }
        c.env("DATABASE_URL", database_url())
            .env("OUTBOX_DATABASE__SCHEMA", table.schema())
            .env("OUTBOX_HTTP__ENABLED", "false")
            .env("OUTBOX_RELAY__BATCH_SIZE", "100")
            .env("OUTBOX_RELAY__RETRY__INITIAL_BACKOFF", "200ms")
            .env("OUTBOX_RELAY__RETRY__MAX_BACKOFF", "2s")
            .env("OUTBOX_RELAY__RETRY__MAX_ATTEMPTS", "1000")
            .env("OUTBOX_LOG__LEVEL", "warn")
            .env_remove("RUST_LOG");
        sink.configure(&mut c);
        for (k, v) in extra {
            c.env(k, v);
        }
        let child = c
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        RelayProcess { child }
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then waits for the exit (at most `timeout`); returns the exit code.
    pub fn terminate(mut self, timeout: Duration) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Concurrent writers committing events until stopped.
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Written>>,
}

/// What the writers committed: certain commits in order, and transactions whose outcome is unknown
/// (the connection dropped during the commit).
pub struct Written {
    pub committed: Vec<(String, Uuid)>,
    pub uncertain: Vec<Uuid>,
}

impl Load {
    /// `writers` tasks, each committing transactions of `per_tx` events over its own aggregates
    /// (`w<writer>-a<n>`, `aggregates` each), pausing `pause` between transactions.
    pub fn start(
        table: &OutboxTable,
        writers: usize,
        aggregates: usize,
        per_tx: usize,
        pause: Duration,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (table, stop) = (table.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let pg = pool(2).await;
                let writer = Writer::new(table);
                let mut out = Written {
                    committed: Vec::new(),
                    uncertain: Vec::new(),
                };
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let events: Vec<_> = (0..per_tx)
                        .map(|i| {
                            sample_event(&format!("w{w}-a{}", (n * per_tx + i) % aggregates), n)
                        })
                        .collect();
                    let ids: Vec<(String, Uuid)> = events
                        .iter()
                        .map(|e| (e.aggregate_id.clone(), e.id))
                        .collect();
                    let result = async {
                        let mut tx = pg.begin().await.map_err(|e| (false, e.to_string()))?;
                        writer
                            .enqueue_many(&mut tx, events)
                            .await
                            .map_err(|e| (false, e.to_string()))?;
                        tx.commit().await.map_err(|e| (true, e.to_string()))
                    }
                    .await;
                    match result {
                        Ok(()) => out.committed.extend(ids),
                        // The commit itself failed: it may or may not have happened.
                        Err((true, _)) => out.uncertain.extend(ids.into_iter().map(|(_, id)| id)),
                        Err((false, _)) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                    n += 1;
                    tokio::time::sleep(pause).await;
                }
                out
            }));
        }
        Load { stop, tasks }
    }

    pub async fn stop(self) -> Written {
        self.stop.store(true, Ordering::SeqCst);
        let mut written = Written {
            committed: Vec::new(),
            uncertain: Vec::new(),
        };
        for t in self.tasks {
            let w = t.await.unwrap();
            written.committed.extend(w.committed);
            written.uncertain.extend(w.uncertain);
        }
        written
    }
}

/// Prints the scenario's summary line.
pub fn report(scenario: &str, broker: Broker, v: &Verdict) {
    println!("scenario={scenario} broker={} {v}", broker.name());
}

/// How much longer the soak variant runs (`OUTBOX_SOAK=<factor>`, default 1).
pub fn soak_factor() -> usize {
    std::env::var("OUTBOX_SOAK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|f| *f >= 1)
        .unwrap_or(1)
}

/// Wraps a real publisher and fails events on purpose: each event fails retryably (without being
/// sent) with probability `retryable_per_mille / 1000`, and every event of `poisoned` fails
/// permanently. Later events of a failed aggregate in the same call are held back, as real publishers
/// do.
pub struct FaultInjector {
    pub inner: Arc<dyn Publisher>,
    pub retryable_per_mille: u32,
    pub poisoned: String,
}

#[async_trait::async_trait]
impl Publisher for FaultInjector {
    async fn publish(&self, events: &[outbox_core::Event]) -> Vec<outbox_core::PublishOutcome> {
        use outbox_core::publishers::{finish, Fence};
        use outbox_core::{Error, ErrorKind};
        let mut outcomes: Vec<Option<outbox_core::PublishOutcome>> = vec![None; events.len()];
        let mut fence = Fence::new();
        let mut send = Vec::new();
        for (i, e) in events.iter().enumerate() {
            if fence.holds(e) {
                outcomes[i] = Some(Err(Fence::not_sent("fault-injector")));
            } else if e.aggregate_id == self.poisoned {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::InvalidInput,
                    "injected permanent failure",
                )));
                fence.close(e);
            } else if fastrand::u32(0..1000) < self.retryable_per_mille {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Connection,
                    "injected retryable failure",
                )));
                fence.close(e);
            } else {
                send.push(i);
            }
        }
        let batch: Vec<outbox_core::Event> = send.iter().map(|i| events[*i].clone()).collect();
        let sent = self.inner.publish(&batch).await;
        for (i, o) in send.into_iter().zip(sent) {
            outcomes[i] = Some(o);
        }
        finish(outcomes)
    }

    async fn check(&self) -> Result<(), outbox_core::Error> {
        self.inner.check().await
    }

    fn name(&self) -> &str {
        "fault-injector"
    }
}

/// The PostgreSQL cluster's version directory under /etc/postgresql, for `pg_ctlcluster`.
pub fn pg_version() -> String {
    let mut versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
        .expect("restarting PostgreSQL needs a local cluster (/etc/postgresql)")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("no PostgreSQL cluster under /etc/postgresql")
}

/// Restarts the local PostgreSQL cluster (every connection is cut).
pub fn restart_postgres() {
    let status = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &pg_version(),
            "main",
            "restart",
        ])
        .status()
        .expect("pg_ctlcluster is required to restart PostgreSQL");
    assert!(status.success(), "pg_ctlcluster restart failed");
}
