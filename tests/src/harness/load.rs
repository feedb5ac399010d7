//! Writers under load: the continuous writer, racing writers, and what they committed, read back
//! from the database.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use txoutbox_core::testkit::sample_event;
use txoutbox_postgres::testing::{database_url, pool, pool_at};
use txoutbox_postgres::{OutboxTable, Writer};
use uuid::Uuid;

use super::scenario::seed;

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
        Self::start_at(&database_url(), table, writers, aggregates, per_tx, pause).await
    }

    /// As [`Load::start`], the writers connecting to `url` (the test database through a pooler).
    pub async fn start_at(
        url: &str,
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
            let url = url.to_string();
            tasks.push(tokio::spawn(async move {
                let pg = pool_at(&url, 2).await;
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
        Self::start_at(&database_url(), table, writers, aggregates, hold)
    }

    /// As [`RacingLoad::start`], the writers connecting to `url` (the test database through a
    /// pooler).
    pub fn start_at(
        url: &str,
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
            let url = url.to_string();
            tasks.push(tokio::spawn(async move {
                let pg = pool_at(&url, 1).await;
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

/// Commits `n` events, an aggregate each (`w-<random>`), in one transaction through `url` with the
/// writer API; `(aggregate, id)` in order.
pub async fn write_through(url: &str, table: &OutboxTable, n: usize) -> Vec<(String, Uuid)> {
    let pg = pool_at(url, 1).await;
    let writer = Writer::new(table.clone());
    let mut tx = pg.begin().await.unwrap();
    let events: Vec<_> = (0..n)
        .map(|i| sample_event(&format!("w-{}", Uuid::new_v4().simple()), i))
        .collect();
    let keys: Vec<String> = events.iter().map(|e| e.aggregate_id.clone()).collect();
    let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    keys.into_iter().zip(ids).collect()
}
