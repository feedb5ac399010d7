//! One timeout budget: with the default settings, a Kafka broker that stalls longer than every
//! timeout involved (SIGSTOP for 40 s, beyond `kafka.delivery_timeout` = 30 s) makes the publisher's
//! own limit fire and its recovery run, never the relay's cut-off; nothing is dead-lettered and
//! everything arrives, in order, once the broker is back.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::collections::HashSet;
use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::Publisher;
use txoutbox_core::{
    BatchReport, CancellationToken, Error, Event, FailureDecision, Relay, RelayConfig,
    RelayObserver,
};
use txoutbox_kafka::{KafkaConfig, KafkaPublisher};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{DeadLetterFilter, PostgresStore};
use txoutbox_tests::harness::own_tansu;
use txoutbox_tests::{check, write_rounds};

/// The failed attempts, each with the time since the relay started.
struct Failures {
    started: Instant,
    seen: Mutex<Vec<(String, FailureDecision)>>,
}

impl RelayObserver for Failures {
    fn event_failed(&self, event: &Event, error: &Error, decision: FailureDecision) {
        tracing::info!(
            at_ms = self.started.elapsed().as_millis() as u64,
            event = %event.id,
            aggregate = %event.aggregate_id,
            ?decision,
            "test observer: {error}"
        );
        self.seen
            .lock()
            .unwrap()
            .push((error.to_string(), decision));
    }

    fn batch_settled(&self, report: &BatchReport) {
        tracing::info!(
            at_ms = self.started.elapsed().as_millis() as u64,
            ?report,
            "test observer: batch settled"
        );
    }

    fn broker_checked(&self, reachable: bool) {
        tracing::info!(
            at_ms = self.started.elapsed().as_millis() as u64,
            reachable,
            "test observer: broker checked"
        );
    }
}

fn signal(pid: u32, signal: &str) {
    let ok = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {signal} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_stall_beyond_the_delivery_timeout_ends_in_recovery_not_dead_letters() {
    // The relay's log (and librdkafka's, through it) goes to the test's output, shown when it fails.
    tracing_subscriber::fmt()
        .with_env_filter("info,txoutbox_core=debug,txoutbox_kafka=debug,txoutbox_postgres=debug")
        .with_test_writer()
        .try_init()
        .ok();
    let (tansu, brokers) = own_tansu(None);
    let fx = txoutbox_kafka::testing::Fixture::create_at(&brokers, "stall", 1).await;
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;

    // Default settings everywhere but the addresses.
    let publisher = Arc::new(KafkaPublisher::new(fx.config()).unwrap());
    let store = PostgresStore::new(pool(4).await, table.clone());
    let failures = Arc::new(Failures {
        started: Instant::now(),
        seen: Mutex::default(),
    });
    let relay = Relay::new(Arc::new(store.clone()), publisher, RelayConfig::default())
        .unwrap()
        .with_observer(failures.clone());
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });

    let mut committed = write_rounds(&table, 5, 2).await;
    fx.wait_for(committed.len(), Duration::from_secs(60)).await;

    // The broker stalls (its connections stay open, nothing is answered) for longer than the
    // delivery timeout, while the service keeps writing.
    tracing::info!("test: the broker stops");
    signal(tansu.id(), "-STOP");
    committed.extend(write_rounds(&table, 5, 2).await);
    tokio::time::sleep(Duration::from_secs(40)).await;
    tracing::info!("test: the broker resumes");
    signal(tansu.id(), "-CONT");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let verdict = loop {
        let received: Vec<_> = fx
            .wait_for(committed.len(), Duration::from_millis(500))
            .await
            .iter()
            .filter_map(|d| d.received.event_id)
            .collect();
        let v = check(&committed, &received);
        if v.lost == 0 || tokio::time::Instant::now() >= deadline {
            break v;
        }
    };
    shutdown.cancel();
    task.await.unwrap();
    drop(tansu);

    let failures = failures.seen.lock().unwrap().clone();
    println!("{verdict}; {} failed attempts", failures.len());
    assert!(
        !failures.is_empty(),
        "nothing failed during the stall: the test proved nothing"
    );
    let cut_short: Vec<_> = failures
        .iter()
        .filter(|(e, _)| e.contains("relay.publish_timeout"))
        .collect();
    assert!(
        cut_short.is_empty(),
        "the relay's timeout pre-empted the publisher's own: {cut_short:?}"
    );
    assert!(
        failures
            .iter()
            .all(|(_, d)| *d != FailureDecision::DeadLetter),
        "{failures:?}"
    );
    let dead = store
        .dead_letters(&DeadLetterFilter::All, None, 10)
        .await
        .unwrap();
    assert!(dead.is_empty(), "dead letters after a stall: {dead:?}");
    // Duplicates are allowed here: a record the stalled broker took after the delivery timeout
    // reported it failed is sent again (README, guarantee 3).
    assert_eq!(
        (verdict.lost, verdict.order_violations, verdict.unexpected),
        (0, 0, 0),
        "{verdict}"
    );
}

/// Whole runs under a stall: one call holds 40 events of each of 50 aggregates, and the broker stops
/// (SIGSTOP) at some moment of the call (five rounds, from its start to a few milliseconds in), for
/// longer than the delivery timeout. What the call
/// acknowledged is a prefix of each aggregate's run; and once the broker is back and each
/// aggregate's run is sent again from its first unacknowledged event (as the relay does), the topic
/// holds every event, each aggregate's first copies in order: no record was written past a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_stall_in_the_middle_of_whole_runs_leaves_no_gap_in_any_aggregate() {
    let (tansu, brokers) = own_tansu(None);
    let fx = txoutbox_kafka::testing::Fixture::create_at(&brokers, "runs", 3).await;
    let publisher = KafkaPublisher::new(KafkaConfig {
        delivery_timeout: Duration::from_secs(3),
        ..fx.config()
    })
    .unwrap();
    assert!(publisher.keeps_order(), "whole runs in one call");
    // The producer knows the topic and has its idempotence session before the stall.
    let warm = [event("warm", 0)];
    assert!(publisher.publish(&warm).await.iter().all(Result::is_ok));
    fx.wait_for(1, Duration::from_secs(60)).await;

    // Five rounds, the broker stopped at a different moment of each call.
    let mut all: Vec<Event> = Vec::new();
    for round in 0..5u64 {
        let runs: Vec<Event> = (0..40)
            .flat_map(|n| (0..50).map(move |a| event(&format!("agg-{round}-{a}"), n)))
            .collect();
        // The signal is sent from a thread of its own (starting `kill` takes a few milliseconds).
        let pid = tansu.id();
        let pause = Duration::from_micros(4_000 * round + fastrand::u64(0..4_000));
        let stopper = std::thread::spawn(move || {
            std::thread::sleep(pause);
            signal(pid, "-STOP");
        });
        let outcomes = publisher.publish(&runs).await;
        stopper.join().unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        signal(tansu.id(), "-CONT");

        // What the call acknowledged: a prefix of each aggregate's run.
        let mut failed: HashSet<&str> = HashSet::new();
        let mut left: Vec<Event> = Vec::new();
        for (e, o) in runs.iter().zip(&outcomes) {
            if o.is_ok() {
                assert!(
                    !failed.contains(e.aggregate_id.as_str()),
                    "{}: acknowledged after an earlier event of its run failed",
                    e.aggregate_id
                );
            } else {
                failed.insert(e.aggregate_id.as_str());
            }
            if failed.contains(e.aggregate_id.as_str()) {
                left.push(e.clone());
            }
        }
        println!(
            "round {round}: acknowledged in the stalled call: {} of {}",
            runs.len() - left.len(),
            runs.len()
        );
        // The rest, again, until acknowledged (a new producer may be needed after the stall).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while !left.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} events still unacknowledged 120 s after the broker resumed",
                left.len()
            );
            let outcomes = publisher.publish(&left).await;
            let mut failed: HashSet<String> = HashSet::new();
            let mut next = Vec::new();
            for (e, o) in left.iter().zip(outcomes) {
                if o.is_err() || failed.contains(&e.aggregate_id) {
                    failed.insert(e.aggregate_id.clone());
                    next.push(e.clone());
                }
            }
            left = next;
            if !left.is_empty() {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        all.extend(runs);
    }

    // Every event in the topic, each aggregate's first copies in the order of its run. The topic is
    // read again from its beginning by a consumer of its own: the verdict is on what the log holds,
    // and what the background consumer read across the stall is reported beside it.
    fx.wait_until_read_all(Duration::from_secs(60)).await;
    let live = fx.got.lock().unwrap().clone();
    let log = fx.read_again(Duration::from_secs(60)).await;
    drop(tansu);
    // The warm-up event counts as committed first.
    let committed: Vec<(String, uuid::Uuid)> = warm
        .iter()
        .chain(&all)
        .map(|e| (e.aggregate_id.clone(), e.id))
        .collect();
    let ids = |read: &[txoutbox_kafka::testing::Delivered]| -> Vec<uuid::Uuid> {
        read.iter().filter_map(|d| d.received.event_id).collect()
    };
    let live_verdict = check(&committed, &ids(&live));
    println!(
        "the background consumer read {} records: {live_verdict}; the log holds {}",
        live.len(),
        log.len()
    );
    let received = ids(&log);
    let verdict = check(&committed, &received);
    println!("{verdict}");
    assert_eq!(
        (verdict.lost, verdict.order_violations, verdict.unexpected),
        (0, 0, 0),
        "a gap in an aggregate, or events missing: {verdict}"
    );
}
