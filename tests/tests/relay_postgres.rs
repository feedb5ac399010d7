//! The relay engine over the real PostgreSQL store: concurrency, ordering, retries, crashes.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::testkit::{sample_event, Behavior, EventStatus, ScriptedPublisher, TestStore};
use txoutbox_core::{CancellationToken, Relay, RelayConfig, RetryPolicy, Store};
use txoutbox_postgres::testing::{fresh_table, pool, PgTestStore};
use txoutbox_postgres::{OutboxTable, PostgresStore, Writer};
use txoutbox_tests::{check, write_rounds};
use uuid::Uuid;

fn fast_retry(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        multiplier: 2.0,
        jitter: 0.2,
    }
}

fn relay_config(batch_size: usize) -> RelayConfig {
    RelayConfig {
        batch_size,
        max_in_flight: 2,
        poll_interval: Duration::from_millis(50),
        min_poll_interval: Duration::from_millis(5),
        retry: fast_retry(50),
        ..RelayConfig::default()
    }
}

async fn run_relays(
    table: &OutboxTable,
    relays: usize,
    publisher: Arc<ScriptedPublisher>,
    total: usize,
) {
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..relays {
        // One pool per relay, as separate processes would have.
        let store = PostgresStore::new(pool(4).await, table.clone());
        let relay = Relay::new(Arc::new(store), publisher.clone(), relay_config(37)).unwrap();
        let s = shutdown.clone();
        tasks.push(tokio::spawn(async move { relay.run(s).await }));
    }
    let observer = PostgresStore::new(pool(2).await, table.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let pending = observer.stats().await.unwrap().pending;
        if pending == 0 && publisher.delivered().len() >= total {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "relays did not drain: {pending} pending"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    for t in tasks {
        t.await.unwrap();
    }
}

async fn concurrent_relays_keep_order(relays: usize) {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let committed = write_rounds(&table, 200, 20).await;
    let publisher = ScriptedPublisher::new();
    // Random retryable failures on ~8% of the events (each fails once or twice, then succeeds).
    let mut rng = txoutbox_tests::harness::rng("relays keep order");
    for (i, (_, id)) in committed.iter().enumerate() {
        if rng.u32(0..100) < 8 {
            publisher.on_event(*id, Behavior::FailRetryableTimes(1 + (i % 2) as u32));
        }
    }
    run_relays(&table, relays, publisher.clone(), committed.len()).await;
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("{relays} relays over 200 aggregates x 20 events: {verdict}");
    // A scripted failure sends nothing: nothing arrives twice.
    txoutbox_tests::harness::assert_clean_verdict(&verdict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_keep_per_aggregate_order() {
    concurrent_relays_keep_order(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_keep_per_aggregate_order() {
    concurrent_relays_keep_order(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_failure_delays_only_the_rest_of_its_aggregate() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let committed = write_rounds(&table, 5, 4).await;
    // Event k = 1 of agg-2 fails retryably until the rule is cleared.
    let failing = committed
        .iter()
        .filter(|(a, _)| a == "agg-2")
        .nth(1)
        .unwrap()
        .1;
    let publisher = ScriptedPublisher::new();
    publisher.on_event(failing, Behavior::FailRetryable);
    let store = Arc::new(PgTestStore::new(PostgresStore::new(
        pool.clone(),
        table.clone(),
    )));
    let relay = Relay::new(store.clone(), publisher.clone(), relay_config(100)).unwrap();
    relay.drain().await;
    let delivered = publisher.delivered();
    assert_eq!(
        delivered
            .iter()
            .filter(|e| e.aggregate_id != "agg-2")
            .count(),
        16,
        "other aggregates flow"
    );
    assert_eq!(
        delivered
            .iter()
            .filter(|e| e.aggregate_id == "agg-2")
            .count(),
        1,
        "agg-2 stops before event 1"
    );
    let st = store.state(failing).await.unwrap().unwrap();
    assert_eq!(st.status, EventStatus::Pending);
    assert!(st.attempts >= 1);
    publisher.clear_rules();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while store.stats().await.unwrap().pending > 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
        relay.drain().await;
    }
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    txoutbox_tests::harness::assert_clean_verdict(&verdict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausting_attempts_dead_letters_with_the_last_error() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let committed = write_rounds(&table, 3, 2).await;
    let poisoned = committed[0].1;
    let publisher = ScriptedPublisher::new();
    publisher.on_event(poisoned, Behavior::FailRetryable);
    let store = Arc::new(PgTestStore::new(PostgresStore::new(
        pool.clone(),
        table.clone(),
    )));
    let cfg = RelayConfig {
        retry: fast_retry(3),
        ..relay_config(100)
    };
    let relay = Relay::new(store.clone(), publisher.clone(), cfg).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        relay.drain().await;
        if store.stats().await.unwrap().dead_letters == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let st = store.state(poisoned).await.unwrap().unwrap();
    assert_eq!((st.status, st.attempts), (EventStatus::DeadLettered, 3));
    let err = st.last_error.unwrap();
    assert!(err.starts_with("gave up after 3 attempts"), "{err}");
    assert!(err.contains("scripted retryable failure"), "{err}");
    assert_eq!(publisher.tries(poisoned), 3);
    // The poisoned aggregate's second event waits behind the dead letter; the others are done.
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead_letters), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_aborted_mid_batch_loses_nothing() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let committed = write_rounds(&table, 10, 3).await;
    let slow = ScriptedPublisher::new();
    slow.set_latency(Duration::from_secs(3600));
    let store = PostgresStore::new(pool.clone(), table.clone());
    let relay = Relay::new(Arc::new(store.clone()), slow.clone(), relay_config(100)).unwrap();
    let task = tokio::spawn(async move { relay.run(CancellationToken::new()).await });
    // Wait until the batch is claimed and being published.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while slow.calls() == 0 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task.abort();
    let _ = task.await;
    // Another relay takes over at once: everything arrives, in order.
    let publisher = ScriptedPublisher::new();
    let relay = Relay::new(
        Arc::new(PostgresStore::new(pool.clone(), table.clone())),
        publisher.clone(),
        relay_config(100),
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while publisher.delivered().len() < committed.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "claimed events were not released promptly"
        );
        relay.drain().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    let verdict = check(&committed, &received);
    println!("relay aborted mid-batch: {verdict}");
    assert_eq!(
        (verdict.lost, verdict.order_violations, verdict.unexpected),
        (0, 0, 0),
        "{verdict}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_wake_reaches_an_idle_relay() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let publisher = ScriptedPublisher::new();
    let cfg = RelayConfig {
        poll_interval: Duration::from_secs(3600),
        min_poll_interval: Duration::from_secs(3600),
        ..relay_config(100)
    };
    let store = EmptyClaims::new(PostgresStore::new(pool.clone(), table.clone()));
    let relay = Relay::new(Arc::new(store.clone()), publisher.clone(), cfg).unwrap();
    let writer = Writer::new(table.clone()).with_wake(relay.wake_handle());
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });
    // The relay has found the outbox empty: it is idle (or about to be), in a one-hour pause, and
    // only the wake-up can make it see the next event in time.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while store.empty_claims() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay never claimed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut tx = pool.begin().await.unwrap();
    writer.enqueue(&mut tx, sample_event("w", 0)).await.unwrap();
    writer.commit(tx).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while publisher.delivered().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wake-up did not reach the relay"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shutdown.cancel();
    assert_eq!(task.await.unwrap().published, 1);
    assert_eq!(store.empty_claims(), 1, "woken, not polled");
}

/// A store that counts the claims that came back empty.
#[derive(Clone)]
struct EmptyClaims {
    inner: PostgresStore,
    empty: Arc<std::sync::atomic::AtomicUsize>,
}

impl EmptyClaims {
    fn new(inner: PostgresStore) -> Self {
        EmptyClaims {
            inner,
            empty: Arc::default(),
        }
    }

    fn empty_claims(&self) -> usize {
        self.empty.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[async_trait::async_trait]
impl Store for EmptyClaims {
    async fn claim(
        &self,
        request: txoutbox_core::ClaimRequest,
    ) -> Result<txoutbox_core::Batch, txoutbox_core::Error> {
        let batch = self.inner.claim(request).await?;
        if batch.events.is_empty() {
            self.empty.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(batch)
    }

    async fn stats(&self) -> Result<txoutbox_core::StoreStats, txoutbox_core::Error> {
        self.inner.stats().await
    }

    async fn check(&self) -> Result<(), txoutbox_core::Error> {
        self.inner.check().await
    }
}
