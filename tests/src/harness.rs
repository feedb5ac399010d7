//! The fault-injection harness: the real `outbox` binary as a child process, a continuous writer, and
//! an independent consumer per broker, so each scenario can compare what was committed with what the
//! broker received.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use outbox_core::testkit::sample_event;
use outbox_core::Publisher;
use outbox_postgres::testing::{database_url_named, fresh_table, pool, sessions_holding_a_claim};
use outbox_postgres::{OutboxTable, Writer};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::{check, Verdict};

pub use outbox_core::testkit::{free_port, OwnedProcess};

/// The seed of this test process's random choices: `OUTBOX_TEST_SEED`, else a random one.
pub fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        std::env::var("OUTBOX_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..))
    })
}

/// A random generator for `what` (a scenario, a writer), derived from [`seed`], which it prints so
/// that a failing run can be replayed with `OUTBOX_TEST_SEED`.
pub fn rng(what: &str) -> fastrand::Rng {
    let seed = seed();
    println!("{what}: seed={seed} (OUTBOX_TEST_SEED={seed} replays its random choices)");
    let stream = what.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    fastrand::Rng::with_seed(seed ^ stream)
}

/// Runs the heavy scenarios of one test binary one at a time: on two cores, four relays, brokers and
/// writers at once leave each scenario's deadlines to luck. Hold the guard for the whole scenario.
pub async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Waits until `condition` holds, checking every 50 ms, at most `within`; panics with `what`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (waited {within:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

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
    pub async fn load(self, table: &OutboxTable) -> Load {
        match self {
            Broker::Sqs => Load::start(table, 1, 40, 5, Duration::from_millis(60)).await,
            _ => Load::start(table, 2, 40, 5, Duration::from_millis(15)).await,
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
            // An endpoint of its own that records every send: the FIFO queue hides re-sent events.
            Broker::Sqs => Sink::Sqs(outbox_sqs::testing::Fixture::recording().await),
        }
    }

    /// The same destination (exchange, topic or queue name on the same broker) declared again, with a
    /// new consumer: after a broker restart that lost it (Tansu and moto keep nothing; RabbitMQ drops
    /// the consumer's exclusive queue, not the durable exchange).
    pub async fn recreate(&self) -> Sink {
        match self {
            Sink::Amqp(fx) => {
                Sink::Amqp(outbox_amqp::testing::Fixture::on_exchange(&fx.exchange).await)
            }
            Sink::Kafka(fx) => Sink::Kafka(
                outbox_kafka::testing::Fixture::create_at(&fx.brokers, &fx.topic, fx.partitions)
                    .await,
            ),
            Sink::Sqs(fx) => Sink::Sqs(fx.recreate().await),
        }
    }

    /// Stops the consumer (Kafka, SQS; a RabbitMQ consumer ends with its connection), so that it
    /// reads nothing of a destination declared again under the same name.
    pub fn stop_consuming(&self) {
        match self {
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.stop(),
            Sink::Sqs(fx) => fx.stop(),
        }
    }

    /// Stops the consumer and waits until its last read is done: what it received is then final.
    pub async fn stop_and_join(&self) {
        match self {
            // The consumer ends with its connection; it pushes each delivery as it arrives.
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.stop_and_join().await,
            Sink::Sqs(fx) => fx.stop_and_join().await,
        }
    }

    /// Waits (at most `within`) until the consumer has read everything the broker holds for it:
    /// every partition up to its high watermark (Kafka), an empty queue (SQS); RabbitMQ pushes to its
    /// consumer without a backlog to measure, so there the quiet window of
    /// [`Sink::received_settled`] stands alone.
    pub async fn drained(&self, within: Duration) {
        match self {
            Sink::Amqp(_) => {}
            Sink::Kafka(fx) => fx.wait_until_read_all(within).await,
            Sink::Sqs(fx) => fx.wait_until_empty(within).await,
        }
    }

    /// Every id received, once the consumer has read what the broker holds and nothing more arrived
    /// for a second (late re-deliveries included).
    pub async fn received_settled(&self) -> Vec<Uuid> {
        self.drained(Duration::from_secs(120)).await;
        outbox_core::testkit::read_until_quiet(|| self.received(usize::MAX, Duration::ZERO)).await
    }

    /// What the consumer's own reads failed with: surfaced next to a verdict, so that a consumer
    /// error is not mistaken for a lost event.
    pub fn consumer_errors(&self) -> Vec<String> {
        match self {
            Sink::Amqp(fx) => fx.errors.lock().unwrap().clone(),
            Sink::Kafka(fx) => fx.errors.lock().unwrap().clone(),
            Sink::Sqs(fx) => fx.errors.lock().unwrap().clone(),
        }
    }

    /// Every event id sent to the destination, re-sends included, where the broker cannot show a
    /// re-sent event to its consumer (an SQS FIFO queue deduplicates it); `None` elsewhere, where
    /// every send reaches the consumer.
    pub fn sends(&self) -> Option<Vec<Uuid>> {
        match self {
            Sink::Sqs(fx) => fx.sends(),
            _ => None,
        }
    }

    /// The loopback port the relay reaches this sink's broker on (its first broker, for Kafka).
    pub fn broker_port(&self) -> u16 {
        let addr = match self {
            Sink::Amqp(_) => outbox_amqp::testing::amqp_url(),
            Sink::Kafka(fx) => fx.brokers.clone(),
            Sink::Sqs(fx) => fx.endpoint.clone(),
        };
        let first = addr.split(',').next().unwrap_or(&addr);
        let host_port = first
            .split("://")
            .last()
            .unwrap_or(first)
            .split(['/', '?'])
            .next()
            .unwrap_or(first);
        let host_port = host_port.rsplit('@').next().unwrap_or(host_port);
        host_port
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in the broker address {addr:?}"))
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
                    .env("OUTBOX_KAFKA__BROKERS", &fx.brokers)
                    .env("OUTBOX_KAFKA__TOPIC", &fx.topic)
                    .env("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "5s");
            }
            Sink::Sqs(fx) => {
                c.env("OUTBOX_PUBLISHER__TYPE", "sqs")
                    .env("OUTBOX_SQS__QUEUE", &fx.queue_name)
                    .env("OUTBOX_SQS__REGION", "us-east-1")
                    .env("OUTBOX_SQS__ENDPOINT_URL", &fx.endpoint)
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

    /// A publisher to this sink that also lets events name the `allowed` destinations
    /// (`allowed_destinations`), for scenarios where the broker itself must refuse a destination.
    pub fn publisher_allowing(&self, allowed: Vec<String>) -> Arc<dyn Publisher> {
        match self {
            Sink::Amqp(fx) => Arc::new(
                outbox_amqp::AmqpPublisher::new(outbox_amqp::AmqpConfig {
                    allowed_destinations: allowed,
                    ..fx.config()
                })
                .unwrap(),
            ),
            Sink::Kafka(fx) => Arc::new(
                outbox_kafka::KafkaPublisher::new(outbox_kafka::KafkaConfig {
                    allowed_destinations: allowed,
                    ..fx.config()
                })
                .unwrap(),
            ),
            Sink::Sqs(fx) => Arc::new(
                outbox_sqs::SqsPublisher::from_client(
                    outbox_sqs::testing::client_at(&fx.endpoint),
                    outbox_sqs::SqsConfig {
                        allowed_destinations: allowed,
                        ..fx.config()
                    },
                )
                .unwrap(),
            ),
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

    /// Waits until every id of `committed` was received, at most `timeout`.
    pub async fn wait_all(&self, committed: &[(String, Uuid)], timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let received = self
                .received(committed.len(), Duration::from_millis(200))
                .await;
            if check(committed, &received).lost == 0 || tokio::time::Instant::now() >= deadline {
                return;
            }
        }
    }

    /// The verdict over everything received once the consumer settled ([`Sink::received_settled`]):
    /// stop the relays first, so that a late re-delivery is counted too. Where the broker hides
    /// re-sent events ([`Sink::sends`]), duplicates are counted from the sends.
    pub async fn judge(&self, committed: &[(String, Uuid)]) -> Verdict {
        let received = self.received_settled().await;
        self.judge_received(committed, &received)
    }

    /// The verdict over `received`, with duplicates counted from the sends where the broker hides
    /// them, and the consumer's errors attached.
    pub fn judge_received(&self, committed: &[(String, Uuid)], received: &[Uuid]) -> Verdict {
        let mut v = check(committed, received);
        if let Some(sends) = self.sends() {
            let distinct: std::collections::HashSet<Uuid> = sends.iter().copied().collect();
            if let Some(id) = received.iter().find(|id| !distinct.contains(id)) {
                panic!("event {id} was received but the endpoint recorded no send of it");
            }
            v.duplicates = v.duplicates.max(sends.len() - distinct.len());
        }
        v.consumer_errors = self.consumer_errors();
        v
    }

    /// [`Sink::wait_all`], then [`Sink::judge`]: for relays that have already stopped.
    pub async fn verdict(&self, committed: &[(String, Uuid)], timeout: Duration) -> Verdict {
        self.wait_all(committed, timeout).await;
        self.judge(committed).await
    }

    /// How many messages the consumer has received so far.
    pub async fn received_count(&self) -> usize {
        self.received(usize::MAX, Duration::ZERO).await.len()
    }

    /// Waits (at most `within`) until the consumer has received more than `count` messages: progress.
    /// Panics with `what` otherwise.
    pub async fn wait_past(&self, count: usize, within: Duration, what: &str) {
        wait_until(within, what, || async {
            self.received_count().await > count
        })
        .await;
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
    /// The `application_name` of its database sessions (`pg_stat_activity` tells them apart).
    pub tag: String,
}

impl RelayProcess {
    /// Starts `outbox relay` over `table`, publishing to `sink`, with `extra` settings; its log
    /// (stderr) goes to a file of its own under [`relay_log_dir`].
    pub fn start(table: &OutboxTable, sink: &Sink, extra: &[(&str, &str)]) -> RelayProcess {
        let dir = relay_log_dir(table);
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(dir.join(format!(
            "relay-{}.log",
            &Uuid::new_v4().simple().to_string()[..12]
        )))
        .unwrap();
        Self::start_logging_to(table, sink, extra, log)
    }

    /// As [`RelayProcess::start`], the relay's log (stderr) going to `log`.
    pub fn start_logging_to(
        table: &OutboxTable,
        sink: &Sink,
        extra: &[(&str, &str)],
        log: impl Into<Stdio>,
    ) -> RelayProcess {
        let mut c = Command::new(outbox_bin());
        c.arg("relay").current_dir(std::env::temp_dir());
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") {
                c.env_remove(k);
            }
        }
        let (tag, url) = database_url_named("outbox-test-relay");
        c.env("DATABASE_URL", url)
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
        let child = c.stdout(Stdio::null()).stderr(log.into()).spawn().unwrap();
        RelayProcess { child, tag }
    }

    /// Whether the process has installed its SIGTERM handler (`SigCgt` in /proc): before that, a
    /// SIGTERM kills it like SIGKILL.
    pub fn handles_sigterm(&self) -> bool {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
        else {
            return false;
        };
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & (1 << (15 - 1)) != 0)
    }

    /// Whether one of its database sessions holds a claim while its batch is published
    /// ([`sessions_holding_a_claim`]).
    pub async fn in_transaction(&self, pg: &sqlx::PgPool) -> bool {
        sessions_holding_a_claim(pg, &self.tag).await > 0
    }

    /// Waits (at most `within`) until the relay holds a claim while publishing
    /// ([`RelayProcess::in_transaction`]); whether it did.
    pub async fn wait_in_transaction(&self, pg: &sqlx::PgPool, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.in_transaction(pg).await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {} failed", self.child.id());
    }

    /// SIGSTOP: the process stands still (its connections stay open) until [`RelayProcess::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The process's peak resident memory so far (`VmHWM` in /proc), in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmHWM in /proc/<pid>/status")
            * 1024
    }

    /// CPU time the process has used so far (user + system), from /proc.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the command name (which may hold spaces): state is the first, utime the 12th.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // The kernel's USER_HZ is 100 on Linux.
        Duration::from_millis(ticks * 10)
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, once the process handles it, then waits for the exit (at most `timeout`); returns
    /// the exit code.
    pub fn terminate(mut self, timeout: Duration) -> Option<i32> {
        // A process spawned a moment ago may not have installed its handler yet (SIGTERM would kill).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !self.handles_sigterm() && self.child.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the relay did not install its SIGTERM handler within 60 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
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

/// Concurrent writers committing events until stopped. Each transaction also records its events
/// in a table of its own ([`committed_in_db`]): the database's word on what committed, whatever the
/// writer saw of its `COMMIT`, in `seq` order, even after the relay deleted the outbox rows.
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Written>>,
}

/// What the writers saw: commits that succeeded, in order, and transactions whose outcome is unknown
/// (the connection dropped during the commit). [`committed_in_db`] has the last word.
pub struct Written {
    pub committed: Vec<(String, Uuid)>,
    pub uncertain: Vec<Uuid>,
}

/// The table where [`Load`] records what each transaction wrote, next to `table`.
fn commits_table(table: &OutboxTable) -> String {
    format!("\"{}\".outbox_test_commits", table.schema())
}

/// Every event [`Load`] committed, as `(aggregate, id)` in `seq` order, read from the database.
/// Panics if a commit the writers saw succeed is missing (the record is then not to be trusted).
pub async fn committed_in_db(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    written: &Written,
) -> Vec<(String, Uuid)> {
    let committed: Vec<(String, Uuid)> = sqlx::query_as(&format!(
        "SELECT aggregate_id, id FROM {} ORDER BY seq",
        commits_table(table)
    ))
    .fetch_all(pg)
    .await
    .unwrap();
    let known: std::collections::HashSet<Uuid> = committed.iter().map(|(_, id)| *id).collect();
    if let Some((_, id)) = written.committed.iter().find(|(_, id)| !known.contains(id)) {
        panic!("the writer saw the commit of {id} succeed, but the database has no record of it");
    }
    committed
}

impl Load {
    /// `writers` tasks, each committing transactions of `per_tx` events over its own aggregates
    /// (`w<writer>-a<n>`, `aggregates` each), pausing `pause` between transactions.
    pub async fn start(
        table: &OutboxTable,
        writers: usize,
        aggregates: usize,
        per_tx: usize,
        pause: Duration,
    ) -> Load {
        let pg = pool(1).await;
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {} (id uuid PRIMARY KEY, aggregate_id text NOT NULL, seq bigint NOT NULL)",
            commits_table(table)
        ))
        .execute(&pg)
        .await
        .unwrap();
        let record = format!(
            "INSERT INTO {} (id, aggregate_id, seq) SELECT id, aggregate_id, seq FROM {} WHERE id = ANY($1)",
            commits_table(table),
            table.qualified()
        );
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (table, stop, record) = (table.clone(), stop.clone(), record.clone());
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
                    let just_ids: Vec<Uuid> = ids.iter().map(|(_, id)| *id).collect();
                    let result = async {
                        let mut tx = pg.begin().await.map_err(|e| (false, e.to_string()))?;
                        writer
                            .enqueue_many(&mut tx, events)
                            .await
                            .map_err(|e| (false, e.to_string()))?;
                        sqlx::query(&record)
                            .bind(&just_ids)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| (false, e.to_string()))?;
                        tx.commit().await.map_err(|e| (true, e.to_string()))
                    }
                    .await;
                    match result {
                        Ok(()) => out.committed.extend(ids),
                        // The commit itself failed: it may or may not have happened.
                        Err((true, _)) => out.uncertain.extend(just_ids),
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

/// Where the relays of the scenario over `table` write their logs (one file each).
pub fn relay_log_dir(table: &OutboxTable) -> PathBuf {
    std::env::temp_dir().join(format!("outbox-test-relays-{}", table.schema()))
}

/// The documented causes of a duplicate without a crash that the relays over `table` reported in
/// their logs (README, guarantee 3): a publish that timed out (the broker may have taken the events
/// anyway) and batches a shutdown deadline cut off.
pub fn duplicate_causes_logged(table: &OutboxTable) -> usize {
    let Ok(files) = std::fs::read_dir(relay_log_dir(table)) else {
        return 0;
    };
    files
        .filter_map(|f| std::fs::read_to_string(f.ok()?.path()).ok())
        .map(|log| {
            log.lines()
                .filter(|l| {
                    l.contains("timeout")
                        || l.contains("timed out")
                        || l.contains("shutdown deadline")
                })
                .count()
        })
        .sum()
}

/// Asserts the verdict of relay processes over `table` that did not crash: [`assert_clean_verdict`],
/// unless their logs report a documented cause of duplicates ([`duplicate_causes_logged`]); then
/// duplicates stay within a batch per batch in flight for each.
pub fn assert_clean_run(v: &Verdict, table: &OutboxTable, batch_size: usize, batches: usize) {
    let causes = duplicate_causes_logged(table);
    if causes == 0 {
        assert_clean_verdict(v);
    } else {
        println!(
            "  the relays logged {causes} publish timeouts or shutdown cut-offs (logs in {})",
            relay_log_dir(table).display()
        );
        assert_crash_verdict(v, causes, batch_size, batches);
    }
}

/// Relays killed with SIGKILL the way a crash would hit them: each kill waits for progress (the
/// consumer received something since the previous kill), then a random moment, then up to 2 s for the
/// victim to hold a claim while it publishes the batch (its session `idle in transaction`), so that
/// kills land on work in flight rather than on a relay still starting.
pub struct Kills {
    /// SIGKILLs sent.
    pub count: usize,
    /// Kills that found the victim publishing a claimed batch a moment before.
    pub in_flight: usize,
    rng: fastrand::Rng,
}

impl Kills {
    pub fn new(what: &str) -> Kills {
        Kills {
            count: 0,
            in_flight: 0,
            rng: rng(what),
        }
    }

    /// Waits for progress past `received_before` (at most 120 s), then kills `relay` as described.
    pub async fn kill(
        &mut self,
        relay: RelayProcess,
        pg: &sqlx::PgPool,
        sink: &Sink,
        received_before: usize,
    ) {
        self.before_kill(sink, received_before).await;
        if relay.wait_in_transaction(pg, Duration::from_secs(2)).await {
            self.in_flight += 1;
        }
        relay.kill9();
        self.count += 1;
    }

    /// As [`Kills::kill`], without waiting for a claim held open: for relays of the WAL source,
    /// which publish without one (and of which a standby holds nothing).
    pub async fn kill_any(&mut self, relay: RelayProcess, sink: &Sink, received_before: usize) {
        self.before_kill(sink, received_before).await;
        relay.kill9();
        self.count += 1;
    }

    /// Waits for progress past `received_before` (at most 120 s), then a random moment.
    async fn before_kill(&mut self, sink: &Sink, received_before: usize) {
        sink.wait_past(
            received_before,
            Duration::from_secs(120),
            "no progress between two kills: nothing more was delivered",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(self.rng.u64(0..300))).await;
    }

    /// Asserts that some kills hit work in flight (at least a quarter of them), and prints the counts.
    pub fn assert_some_hit_work(&self) {
        println!("kills={} in_flight={}", self.count, self.in_flight);
        assert!(
            self.in_flight * 4 >= self.count && self.in_flight > 0,
            "only {} of {} kills found the relay publishing a claimed batch: the scenario did not \
             crash relays mid-batch",
            self.in_flight,
            self.count
        );
    }
}

/// Asserts no loss, no order violation and nothing unexpected, and duplicates within what
/// `kills` crashes can explain (each leaves at most `batches_in_flight` batches of `batch_size`
/// events published and not yet marked).
pub fn assert_crash_verdict(
    v: &Verdict,
    kills: usize,
    batch_size: usize,
    batches_in_flight: usize,
) {
    assert_eq!((v.lost, v.order_violations, v.unexpected), (0, 0, 0), "{v}");
    let bound = kills * batch_size * batches_in_flight;
    assert!(
        v.duplicates <= bound,
        "{v}: more duplicates than {kills} kills x {batch_size} x {batches_in_flight} in flight can explain"
    );
}

/// Asserts the verdict of a run in which nothing crashed: no loss, no order violation, nothing
/// unexpected, and no duplicate at all.
pub fn assert_clean_verdict(v: &Verdict) {
    assert_eq!(
        (v.lost, v.order_violations, v.unexpected, v.duplicates),
        (0, 0, 0, 0),
        "{v}: nothing crashed, so nothing may be lost, reordered, unexpected or sent twice"
    );
}

/// A relay process publishing to `broker` under continuous writes while `fault` strikes `times`
/// times (times `OUTBOX_SOAK`), each after progress since the previous strike (the relay connected
/// again and published) and a random moment, so that strikes land on calls in flight; then every
/// committed event is waited for, the relay stopped cleanly, and the delivery judged and reported as
/// `scenario`. `fault` gets the loopback port of the sink's broker and returns what it hit
/// (connections closed, packets reset); returns the verdict and those counts, one per strike.
pub async fn faults_under_load<F, Fut>(
    broker: Broker,
    scenario: &str,
    times: usize,
    mut fault: F,
) -> (Verdict, Vec<u64>)
where
    F: FnMut(u16) -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(broker).await;
    let port = sink.broker_port();
    let load = broker.load(&table).await;
    let relay = RelayProcess::start(&table, &sink, &[]);
    let mut rng = rng(scenario);
    let mut hits = Vec::new();
    let mut before = 0;
    for _ in 0..times * soak_factor() {
        sink.wait_past(
            before,
            Duration::from_secs(120),
            "the relay published nothing since the last fault: it did not connect again",
        )
        .await;
        tokio::time::sleep(Duration::from_millis(rng.u64(50..500))).await;
        hits.push(fault(port).await);
        before = sink.received_count().await;
    }
    let written = load.stop().await;
    let committed = committed_in_db(&pg, &table, &written).await;
    sink.wait_all(&committed, Duration::from_secs(180)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = sink.judge(&committed).await;
    report(&format!("{scenario}-x{}", hits.len()), broker, &verdict);
    (verdict, hits)
}

/// Prints the scenario's summary line, and appends it to the file `$FAULT_SCENARIO_REPORT` when set
/// (`scripts/test.sh` sets it and prints the file at the end, since cargo hides a passing test's
/// output).
pub fn report(scenario: &str, broker: Broker, v: &Verdict) {
    report_with(scenario, broker, v, "");
}

/// [`report`], with `extra` figures (`name=value` pairs) at the end of the summary line.
pub fn report_with(scenario: &str, broker: Broker, v: &Verdict, extra: &str) {
    let line = format!("scenario={scenario} broker={} {v}{extra}", broker.name());
    println!("{line}");
    if let Some(first) = v.consumer_errors.first() {
        println!(
            "  the consumer's reads failed {} times (first: {first})",
            v.consumer_errors.len()
        );
    }
    if let Some(path) = std::env::var_os("FAULT_SCENARIO_REPORT") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{line}");
        }
    }
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
    rng: std::sync::Mutex<fastrand::Rng>,
}

impl FaultInjector {
    /// Fails events of `inner` as described above; its random choices come from [`rng`].
    pub fn new(inner: Arc<dyn Publisher>, retryable_per_mille: u32, poisoned: &str) -> Self {
        FaultInjector {
            inner,
            retryable_per_mille,
            poisoned: poisoned.to_string(),
            rng: std::sync::Mutex::new(rng("fault injector")),
        }
    }
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
            } else if self.rng.lock().unwrap().u32(0..1000) < self.retryable_per_mille {
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

    // The broker's own ordering and limits, so that the relay drives it as it drives the broker
    // alone (whole runs in one call where the broker keeps them in order).
    fn keeps_order(&self) -> bool {
        self.inner.keeps_order()
    }

    fn same_call(&self, earlier: &outbox_core::Event, later: &outbox_core::Event) -> bool {
        self.inner.same_call(earlier, later)
    }

    fn call_limit(&self) -> Option<outbox_core::CallLimit> {
        self.inner.call_limit()
    }
}

/// `GET http://<addr><path>`: the status code, or `None` when nothing answered within 5 s.
pub fn http_status(addr: &str, path: &str) -> Option<u16> {
    http_get(addr, path).map(|(status, _)| status)
}

/// `GET http://<addr><path>`: the status code and the body, or `None` when nothing answered
/// within 5 s.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Some((status, body))
}

/// The value of the sample `name` (a whole sample name, labels included when it has some) in a
/// Prometheus text exposition, or `None` when it has no such sample.
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok()).flatten()
    })
}

/// Rows of `table` not yet published (pending, backing off or in flight).
pub async fn unpublished(pg: &sqlx::PgPool, table: &OutboxTable) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE processed_at IS NULL",
        table.qualified()
    ))
    .fetch_one(pg)
    .await
    .unwrap()
}

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
            let url = outbox_amqp::testing::amqp_url();
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
                outbox_kafka::testing::Fixture::create_at(
                    &self.address(),
                    &format!("outbox.test.{}", Uuid::new_v4().simple()),
                    4,
                )
                .await,
            ),
            Broker::Sqs => {
                let mut fx = outbox_sqs::testing::Fixture::create_at(
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
            Broker::Amqp => outbox_amqp::testing::amqp_url(),
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
                self.child = Some(outbox_kafka::testing::spawn_tansu(self.port, self.log()));
            }
            Broker::Sqs => {
                self.child = Some(outbox_sqs::testing::spawn_recording_endpoint(
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
            Broker::Sqs => outbox_sqs::testing::wait_until_serving(&self.address()).await,
            Broker::Kafka => {
                let config = outbox_kafka::KafkaConfig {
                    brokers: self.address(),
                    ..Default::default()
                };
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while let Err(e) =
                    outbox_kafka::admin::partition_count(&config, "outbox.serving").await
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
    pg_ctlcluster_restart(&[]);
}

/// Crashes the local PostgreSQL server and starts it again (`pg_ctlcluster ... restart -m
/// immediate`): no shutdown checkpoint, so the server recovers from its WAL, as after a power cut.
pub fn crash_postgres() {
    pg_ctlcluster_restart(&["-m", "immediate"]);
}

fn pg_ctlcluster_restart(options: &[&str]) {
    let status = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &pg_version(),
            "main",
            "restart",
        ])
        .args(options)
        .status()
        .expect("pg_ctlcluster is required to restart PostgreSQL");
    assert!(status.success(), "pg_ctlcluster restart {options:?} failed");
}

/// Writers racing on a few shared aggregates, as production services do: each transaction writes one
/// aggregate, from plain SQL or the writer API, and holds the transaction open a few milliseconds
/// before committing (one in ten rolls back). The committed events are read back from the database
/// (their `seq` order), not from the writers.
pub struct RacingLoad {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Vec<Uuid>>>,
    pub seed: u64,
}

impl RacingLoad {
    /// `writers` connections over `aggregates` shared aggregates (`r-a<n>`), each transaction held
    /// open up to `hold`. The seed (printed; `OUTBOX_TEST_SEED` sets it) fixes the writers' choices.
    pub fn start(
        table: &OutboxTable,
        writers: usize,
        aggregates: usize,
        hold: Duration,
    ) -> RacingLoad {
        let seed = seed();
        println!("racing writers: seed={seed} (OUTBOX_TEST_SEED reproduces the writers' choices)");
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (table, stop) = (table.clone(), stop.clone());
            let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(w as u64));
            tasks.push(tokio::spawn(async move {
                let pg = pool(1).await;
                let writer = Writer::new(table.clone());
                let plain = format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'order.updated', '{{}}') RETURNING id",
                    table.qualified()
                );
                let mut rolled_back = Vec::new();
                let mut n = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let aggregate = format!("r-a{}", rng.usize(0..aggregates));
                    let Ok(mut tx) = pg.begin().await else {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    };
                    let id = if rng.bool() {
                        sqlx::query_scalar::<_, Uuid>(&plain)
                            .bind(&aggregate)
                            .fetch_one(&mut *tx)
                            .await
                            .unwrap()
                    } else {
                        writer
                            .enqueue(&mut tx, sample_event(&aggregate, n))
                            .await
                            .unwrap()
                    };
                    tokio::time::sleep(Duration::from_micros(
                        rng.u64(0..hold.as_micros() as u64 + 1),
                    ))
                    .await;
                    if rng.u8(0..10) == 0 {
                        tx.rollback().await.unwrap();
                        rolled_back.push(id);
                    } else {
                        tx.commit().await.unwrap();
                    }
                    n += 1;
                }
                rolled_back
            }));
        }
        RacingLoad { stop, tasks, seed }
    }

    /// Stops the writers; returns the ids of the events they rolled back.
    pub async fn stop(self) -> Vec<Uuid> {
        self.stop.store(true, Ordering::SeqCst);
        let mut rolled_back = Vec::new();
        for t in self.tasks {
            rolled_back.extend(t.await.unwrap());
        }
        rolled_back
    }
}

/// Every event the outbox holds (published rows kept), as `(aggregate, id)` in `seq` order: the
/// database's own record of what was committed and in which order.
pub async fn committed_by_seq(pg: &sqlx::PgPool, table: &OutboxTable) -> Vec<(String, Uuid)> {
    sqlx::query_as(&format!(
        "SELECT aggregate_id, id FROM {} ORDER BY seq",
        table.qualified()
    ))
    .fetch_all(pg)
    .await
    .unwrap()
}

/// A Tansu broker of the test's own on a free loopback port (validating records against the JSON
/// schemas in `schemas`, when given), once it accepts connections; returns it with its address.
pub fn own_tansu(schemas: Option<&std::path::Path>) -> (OwnedProcess, String) {
    let port = free_port();
    let child = match schemas {
        Some(dir) => outbox_kafka::testing::spawn_tansu_with_schemas(port, dir, Stdio::null()),
        None => outbox_kafka::testing::spawn_tansu(port, Stdio::null()),
    };
    let tansu = OwnedProcess(child);
    outbox_core::testkit::wait_for_port(port, Duration::from_secs(30), "Tansu");
    (tansu, format!("127.0.0.1:{port}"))
}
