//! Settings a DBA gives the role the writer and the relay log in as (`ALTER ROLE ... SET`): a
//! short `statement_timeout`, a short `lock_timeout`, a `search_path` without `public`,
//! `default_transaction_isolation = 'serializable'`, a short `idle_in_transaction_session_timeout`.
//! Under each, events written through the writer API and by plain SQL are all published by two
//! polling relays, once each, in per-aggregate order, with no dead letter.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::testkit::{sample_event, ScriptedPublisher};
use txoutbox_core::{CancellationToken, Relay, RelayConfig, Store};
use txoutbox_postgres::testing::{database_url, fresh_table, pool};
use txoutbox_postgres::{connect, OutboxTable, PostgresStore, Writer};
use uuid::Uuid;

/// A login role of its own with `setting` set on it, allowed what the test's tables need (a member
/// of the role that owns them). Dropped at the end of the test.
struct Role {
    name: String,
    admin: sqlx::PgPool,
}

impl Role {
    async fn create(admin: &sqlx::PgPool, setting: &str) -> Role {
        let name = format!("outbox_dba_{}", &Uuid::new_v4().simple().to_string()[..10]);
        for sql in [
            format!("CREATE ROLE {name} LOGIN"),
            format!("GRANT postgres TO {name}"),
            format!("ALTER ROLE {name} SET {setting}"),
        ] {
            sqlx::query(&sql).execute(admin).await.unwrap();
        }
        Role {
            name,
            admin: admin.clone(),
        }
    }

    /// The test database's URL as this role.
    fn url(&self) -> String {
        let url = database_url();
        let (scheme, rest) = url.split_once("://").unwrap();
        let host = rest.split_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{}@{host}", self.name)
    }

    async fn pool(&self, size: u32) -> sqlx::PgPool {
        connect(&self.url(), size).await.unwrap()
    }

    async fn drop_it(self) {
        // Sessions of the role may linger in the pool a moment after it is dropped.
        let _ = sqlx::query(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{}'",
            self.name
        ))
        .execute(&self.admin)
        .await;
        let _ = sqlx::query(&format!("DROP ROLE IF EXISTS {}", self.name))
            .execute(&self.admin)
            .await;
    }
}

/// Writes `rounds` transactions of one event for each of `aggregates` aggregates as `pool`'s role:
/// every other transaction through the writer API, the rest by plain SQL. Returns (aggregate, id)
/// in commit order per aggregate.
async fn write(
    pool: &sqlx::PgPool,
    table: &OutboxTable,
    aggregates: usize,
    rounds: usize,
) -> Vec<(String, Uuid)> {
    let writer = Writer::new(table.clone());
    let mut written = Vec::new();
    for round in 0..rounds {
        let mut tx = pool.begin().await.unwrap();
        for a in 0..aggregates {
            let aggregate = format!("agg-{a}");
            let id = if round % 2 == 0 {
                writer
                    .enqueue(&mut tx, sample_event(&aggregate, round))
                    .await
                    .unwrap()
            } else {
                sqlx::query_scalar(&format!(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, 'order.updated', jsonb_build_object('n', $2::int)) RETURNING id",
                    table.qualified()
                ))
                .bind(&aggregate)
                .bind(round as i32)
                .fetch_one(&mut *tx)
                .await
                .unwrap()
            };
            written.push((aggregate, id));
        }
        tx.commit().await.unwrap();
    }
    written
}

/// Under the role's `setting`, everything written is published once, in per-aggregate order, by
/// two relays whose publisher takes `latency` per call; nothing is dead-lettered.
async fn relays_everything_under(setting: &str, latency: Duration) {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let role = Role::create(&admin, setting).await;
    let pg = role.pool(6).await;
    let shown: String = sqlx::query_scalar(&format!(
        "SELECT current_setting('{}')",
        setting.split_whitespace().next().unwrap()
    ))
    .fetch_one(&pg)
    .await
    .unwrap();
    println!("{setting}: the role's sessions have {shown:?}");
    let written = write(&pg, &table, 20, 10).await;

    // Two relays, as two replicas run: their claims wait for each other's partitions (a lock
    // wait the role's timeouts also bound).
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(latency);
    let store = PostgresStore::new(pg.clone(), table.clone());
    let config = RelayConfig {
        batch_size: 50,
        ..RelayConfig::default()
    };
    let shutdown = CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let own = PostgresStore::new(role.pool(4).await, table.clone());
        let relay = Relay::new(Arc::new(own), publisher.clone(), config.clone()).unwrap();
        let shutdown = shutdown.clone();
        runs.push(tokio::spawn(async move { relay.run(shutdown).await }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let stats = store.stats().await.unwrap();
        if stats.pending == 0 && publisher.delivered().len() >= written.len() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{setting}: {} of {} published, {} pending, {} dead letters",
            publisher.delivered().len(),
            written.len(),
            stats.pending,
            stats.dead_letters
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    for run in runs {
        let summary = run.await.unwrap();
        assert_eq!(summary.dead_lettered, 0, "{setting}: {summary:?}");
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.dead_letters, 0, "{setting}");

    // Every event once, each aggregate's in the order written.
    let delivered = publisher.delivered();
    let mut seen: HashMap<Uuid, usize> = HashMap::new();
    for e in &delivered {
        *seen.entry(e.id).or_default() += 1;
    }
    assert!(
        written.iter().all(|(_, id)| seen.get(id) == Some(&1)),
        "{setting}: not every event published exactly once ({} delivered for {} written)",
        delivered.len(),
        written.len()
    );
    let mut expected: HashMap<&str, Vec<Uuid>> = HashMap::new();
    for (aggregate, id) in &written {
        expected.entry(aggregate).or_default().push(*id);
    }
    let mut got: HashMap<String, Vec<Uuid>> = HashMap::new();
    for e in &delivered {
        got.entry(e.aggregate_id.clone()).or_default().push(e.id);
    }
    for (aggregate, ids) in expected {
        assert_eq!(got[aggregate], ids, "{setting}: order of {aggregate}");
    }
    drop(pg);
    role.drop_it().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_statement_timeout() {
    relays_everything_under("statement_timeout = '200ms'", Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lock_timeout() {
    relays_everything_under("lock_timeout = '10ms'", Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_path_without_public() {
    relays_everything_under("search_path = 'app_nowhere'", Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_by_default() {
    relays_everything_under(
        "default_transaction_isolation = 'serializable'",
        Duration::ZERO,
    )
    .await;
}

/// The relay holds a claim's transaction open while the batch is published: a role's timeout
/// for idle transactions shorter than a publish call must not end its sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_in_transaction_timeout_shorter_than_a_publish() {
    relays_everything_under(
        "idle_in_transaction_session_timeout = '500ms'",
        Duration::from_millis(1500),
    )
    .await;
}
