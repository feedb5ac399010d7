//! One timeout budget: with the default settings, a Kafka broker that stalls longer than every
//! timeout involved (SIGSTOP for 40 s, beyond `kafka.delivery_timeout` = 30 s) makes the publisher's
//! own limit fire and its recovery run, never the relay's cut-off; nothing is dead-lettered and
//! everything arrives, in order, once the broker is back.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{
    BatchReport, CancellationToken, Error, Event, FailureDecision, Relay, RelayConfig,
    RelayObserver,
};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::testing::{fresh_table, pool};
use outbox_postgres::{DeadLetterFilter, PostgresStore};
use outbox_tests::harness::own_tansu;
use outbox_tests::{check, write_rounds};

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
        .with_env_filter("info,outbox_core=debug,outbox_kafka=debug,outbox_postgres=debug")
        .with_test_writer()
        .init();
    let (tansu, brokers) = own_tansu(None);
    let fx = outbox_kafka::testing::Fixture::create_at(&brokers, "stall", 1).await;
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
