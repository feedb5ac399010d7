//! Scenario 2: the broker stopped for 12 seconds during load (RabbitMQ with `rabbitmqctl stop_app` /
//! `start_app`; Kafka and SQS by stopping and restarting a Tansu or moto process of the scenario's
//! own). While it is down the outbox grows, the relay stays up, stops claiming until the broker
//! answers again (one probe per readiness check on the documented back-off, under 2 log lines a
//! second), and `/readyz` says not ready; once it is back the backlog drains completely. Alone in
//! its file: stopping RabbitMQ would disturb other tests using it.
//!
//! The test servers keep nothing across a restart (Tansu and moto are memory-only; the consumer's
//! RabbitMQ queue is exclusive), so around each restart the relay is paused (SIGSTOP) for the moment
//! it takes to read what the broker already holds, or to declare the destination again with a new
//! consumer: a production broker keeps its topics and queues, and the relay never sees the pause.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_tests::harness::{
    assert_crash_verdict, committed_in_db, free_port, http_get, http_status, one_at_a_time,
    report_with, sample, soak_factor, unpublished, Broker, BrokerServer, RelayProcess,
};
use txoutbox_tests::wal::{pairs, WalSource};

async fn wait_ready(addr: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let addr = addr.to_string();
        let status = tokio::task::spawn_blocking(move || http_status(&addr, "/readyz"))
            .await
            .unwrap();
        if status == Some(200) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

async fn broker_down(broker: Broker, wal: bool) {
    let _serial = one_at_a_time().await;
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup_if(wal, &table).await;
    let mut server = BrokerServer::start(broker).await;
    let sink = server.sink().await;
    let http = format!("127.0.0.1:{}", free_port());
    // A file per scenario: the WAL variant runs in the same process.
    let log_path = std::env::temp_dir().join(format!(
        "outbox-fault-broker-{}{}-{}.log",
        broker.name(),
        if wal { "-wal" } else { "" },
        std::process::id()
    ));
    let log = std::fs::File::create(&log_path).unwrap();
    let load = broker.load(&table).await;
    // Few attempts, so that an outage counting them would dead-letter events within its 12 s
    // (backoff from 200 ms, doubling to 2 s).
    let settings = [
        ("OUTBOX_HTTP__ENABLED", "true"),
        ("OUTBOX_HTTP__LISTEN", http.as_str()),
        ("OUTBOX_LOG__LEVEL", "info"),
        ("OUTBOX_RELAY__RETRY__MAX_ATTEMPTS", "3"),
        ("OUTBOX_RELAY__RETRY__INITIAL_BACKOFF", "200ms"),
        ("OUTBOX_RELAY__RETRY__MAX_BACKOFF", "2s"),
    ];
    let env = match &source {
        Some(w) => w.relay_env(&settings),
        None => settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    let mut relay = RelayProcess::start_logging_to(&table, &sink, &pairs(&env), log);
    assert!(
        wait_ready(&http, Duration::from_secs(30)).await,
        "the relay never became ready; its log: {}",
        log_path.display()
    );
    sink.wait_past(
        0,
        Duration::from_secs(60),
        "the relay published nothing before the outage",
    )
    .await;

    // Everything published so far is read before the broker (and what it holds) goes away: the
    // relay stands still, the consumer reads all the broker holds, stops, and only then is its
    // record taken.
    relay.pause();
    sink.received_settled().await;
    sink.stop_and_join().await;
    let received = sink.received(usize::MAX, Duration::ZERO).await;
    server.stop().await;
    relay.resume();

    let down = Duration::from_secs(12 * soak_factor() as u64);
    let started = Instant::now();
    let (cpu_before, log_before) = (relay.cpu_time(), log_lines(&log_path));
    let claims_before = claims(&http).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pending_early = backlog(&pg, &table, source.as_ref()).await;
    let mut readiness = Vec::new();
    while started.elapsed() < down {
        let addr = http.clone();
        readiness.push(
            tokio::task::spawn_blocking(move || http_status(&addr, "/readyz"))
                .await
                .unwrap(),
        );
        assert!(relay.alive(), "the relay exited while the broker was down");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let elapsed = started.elapsed();
    let pending_late = backlog(&pg, &table, source.as_ref()).await;
    let (attempts, dead) = attempts_and_dead(&pg, &table, source.as_ref()).await;
    let cpu = relay.cpu_time() - cpu_before;
    let claims_after = claims(&http).await;
    let (claims_during, batches_during) = (
        claims_after.0 - claims_before.0,
        claims_after.1 - claims_before.1,
    );
    let lines = log_lines(&log_path) - log_before;
    // What the relay said while the broker was down, most frequent first.
    let mut said: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    for line in std::fs::read_to_string(&log_path)
        .unwrap_or_default()
        .lines()
        .skip(log_before)
    {
        let message = line.split_once("  ").map_or(line, |(_, m)| m);
        let message: String = message.chars().take(100).collect();
        *said.entry(message).or_default() += 1;
    }
    let mut said: Vec<_> = said.into_iter().collect();
    said.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    for (message, n) in said.iter().take(4) {
        println!("    {n} x {message}");
    }
    println!(
        "  broker {} down {:.1}s: unpublished {pending_early} -> {pending_late}, relay CPU {:.2}s, \
         {claims_during} claims ({batches_during} with events), {lines} log lines, /readyz {:?}",
        broker.name(),
        elapsed.as_secs_f64(),
        cpu.as_secs_f64(),
        readiness
    );
    assert!(
        pending_late > pending_early,
        "the outbox grows while the broker is down"
    );
    // The outage uses up no attempts: only the batches that found the broker gone count one
    // (README, guarantee 2); the probes after them count none.
    println!("  during the outage: at most {attempts} attempts on an unpublished event, {dead} dead letters");
    assert!(
        attempts <= 1 && dead == 0,
        "an outage used up attempts: {attempts} on one event, {dead} dead-lettered (max_attempts 3); \
         the relay's log: {}",
        log_path.display()
    );
    assert!(
        readiness.iter().all(|s| *s != Some(200)),
        "/readyz reported ready while the broker was down: {readiness:?}"
    );
    assert!(
        readiness.contains(&Some(503)),
        "/readyz answers 503 while the broker is down: {readiness:?}"
    );
    // Backing off, not spinning, judged by what spinning does (claims and log lines), not by CPU
    // time, which depends on the machine and, under the WAL source, includes decoding what the
    // writers go on committing. While the broker is unreachable the relay claims one probe per
    // readiness check, the checks spaced by the documented schedule; before the outage is noticed,
    // at most the batches its permits allow. Claims with events are bounded by twice that plus
    // those batches: a relay that kept claiming and failing batches claims and logs one per
    // failure, over a hundred here. Empty claims (an idle poll, where the source has nothing
    // claimable) come at most one per poll interval once backed off, after a short ramp.
    let config = txoutbox_core::RelayConfig::default();
    let batches_bound =
        2 * outage_rounds(elapsed, Duration::from_millis(200), Duration::from_secs(2))
            + 2 * config.max_in_flight
            + 2;
    let ramp = (config.poll_interval.as_secs_f64() / config.min_poll_interval.as_secs_f64())
        .log2()
        .ceil() as usize;
    let claims_bound = batches_bound
        + (elapsed.as_secs_f64() / config.poll_interval.as_secs_f64()).ceil() as usize
        + ramp
        + 2;
    // A task spinning without claiming (a loop in the reader, the statistics, the endpoints)
    // keeps a core busy: half a core is far above what waiting costs on any machine, and far below
    // what a spin costs on every one.
    assert!(
        cpu < elapsed / 2,
        "the relay used {cpu:?} of CPU in {elapsed:?} with the broker down: a task spins"
    );
    assert!(
        batches_during <= batches_bound as f64 && claims_during <= claims_bound as f64,
        "the relay claimed {claims_during} times, {batches_during} with events, in {elapsed:?} \
         with the broker down (at most {claims_bound} and {batches_bound}: one probe per \
         readiness check, backing off from 200 ms to 2 s, and idle polls): it spins; its log: {}",
        log_path.display()
    );
    assert!(
        lines < 2 * elapsed.as_secs() as usize,
        "{lines} log lines in {elapsed:?} with the broker down: see {}",
        log_path.display()
    );

    // Back up: the destination is declared again before the relay goes on.
    relay.pause();
    server.up().await;
    let old = sink;
    let sink = old.recreate().await;
    drop(old);
    relay.resume();
    assert!(
        wait_ready(&http, Duration::from_secs(60)).await,
        "the relay is not ready again after the broker came back; its log: {}",
        log_path.display()
    );
    sink.wait_past(
        0,
        Duration::from_secs(60),
        "the relay published nothing after the outage",
    )
    .await;
    let written = load.stop().await;

    // Everything committed arrives: before the outage, or after it.
    let committed = committed_in_db(&pg, &table, &written).await;
    let before: std::collections::HashSet<_> = received.iter().copied().collect();
    let missing: Vec<_> = committed
        .iter()
        .filter(|(_, id)| !before.contains(id))
        .cloned()
        .collect();
    sink.wait_all(&missing, Duration::from_secs(180)).await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let mut all = received.clone();
    all.extend(sink.received_settled().await);
    let verdict = sink.judge_received(&committed, &all);
    report_with(
        "broker-down-12s",
        broker,
        &verdict,
        if wal { " source=wal" } else { "" },
    );
    // Nothing crashed, but a connection lost after the broker took an event and before its
    // acknowledgement arrived makes the relay send it again (README, guarantee 3): at most the
    // batches in flight at the outage.
    assert_crash_verdict(&verdict, 1, 100, 2);
    assert_eq!(unpublished(&pg, &table).await, 0, "the backlog drained");
    if let Some(w) = &source {
        assert_eq!(w.held_unpublished().await, 0, "the held table drained");
    }
    let _ = std::fs::remove_file(&log_path);
}

/// Events committed and not published: the outbox table's, and under the WAL source the held
/// table's too (events that failed before the relay stopped claiming wait there).
async fn backlog(
    pg: &sqlx::PgPool,
    table: &txoutbox_postgres::OutboxTable,
    wal: Option<&WalSource>,
) -> i64 {
    let held = match wal {
        Some(w) => w.held_unpublished().await,
        None => 0,
    };
    unpublished(pg, table).await + held
}

/// The most attempts any unpublished event has had, and how many are dead-lettered (under the WAL
/// source, in the held table, where its failed events wait).
async fn attempts_and_dead(
    pg: &sqlx::PgPool,
    table: &txoutbox_postgres::OutboxTable,
    wal: Option<&WalSource>,
) -> (i32, i64) {
    let table = match wal {
        Some(w) => w.held.qualified(),
        None => table.qualified(),
    };
    sqlx::query_as(&format!(
        "SELECT COALESCE(max(attempts), 0), count(*) FILTER (WHERE dead_lettered_at IS NOT NULL)
         FROM {table} WHERE processed_at IS NULL"
    ))
    .fetch_one(pg)
    .await
    .unwrap()
}

/// The relay's claims so far, and those of them that returned events, from its `/metrics`.
async fn claims(addr: &str) -> (f64, f64) {
    let addr = addr.to_string();
    let metrics = tokio::task::spawn_blocking(move || http_get(&addr, "/metrics"))
        .await
        .unwrap()
        .expect("the relay's /metrics answers")
        .1;
    let get =
        |name: &str| sample(&metrics, name).unwrap_or_else(|| panic!("no {name} in:\n{metrics}"));
    (
        get("outbox_claim_duration_seconds_count"),
        get("outbox_batch_size_count"),
    )
}

/// The most readiness checks of an unreachable broker the relay makes in `elapsed`: the first after
/// `initial`, each later pause twice the one before, up to `max` (the relay's documented schedule,
/// with pauses never under 100 ms).
fn outage_rounds(elapsed: Duration, initial: Duration, max: Duration) -> usize {
    let (mut pause, mut at, mut rounds) =
        (initial.max(Duration::from_millis(100)), Duration::ZERO, 0);
    while at + pause <= elapsed {
        at += pause;
        rounds += 1;
        pause = (pause * 2).min(max).max(Duration::from_millis(100));
    }
    rounds
}

fn log_lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_rabbitmq() {
    broker_down(Broker::Amqp, false).await;
}

/// The WAL source: the reader stops reading the slot while its relay does not claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_rabbitmq_wal_source() {
    broker_down(Broker::Amqp, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_kafka_wal_source() {
    broker_down(Broker::Kafka, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_kafka() {
    broker_down(Broker::Kafka, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_down_sqs() {
    broker_down(Broker::Sqs, false).await;
}
