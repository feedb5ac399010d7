//! Per-aggregate order with concurrent writers: transactions that race on one aggregate, from plain
//! SQL and from the writer API, holding their transactions open, with two relays claiming meanwhile.
//! The order judged is the database's own: `seq` read back from the kept rows, and a counter each
//! transaction takes as its last statement before `COMMIT`.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgPool, Row};
use txoutbox_core::testkit::{sample_event, ScriptedPublisher};
use txoutbox_core::{CancellationToken, Relay, RelayConfig};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::{OutboxTable, PostgresStore, Retention, Writer};
use txoutbox_tests::check;
use uuid::Uuid;

fn config(batch_size: usize) -> RelayConfig {
    RelayConfig {
        batch_size,
        max_in_flight: 2,
        poll_interval: Duration::from_millis(20),
        min_poll_interval: Duration::from_millis(1),
        ..RelayConfig::default()
    }
}

fn spawn_relays(
    pools: Vec<PgPool>,
    table: &OutboxTable,
    publisher: Arc<ScriptedPublisher>,
    batch_size: usize,
) -> (
    Vec<tokio::task::JoinHandle<txoutbox_core::RelaySummary>>,
    CancellationToken,
) {
    let shutdown = CancellationToken::new();
    let tasks = pools
        .into_iter()
        .map(|p| {
            let store = PostgresStore::with_retention(p, table.clone(), Retention::Keep);
            let relay = Relay::new(Arc::new(store), publisher.clone(), config(batch_size)).unwrap();
            let s = shutdown.clone();
            tokio::spawn(async move { relay.run(s).await })
        })
        .collect();
    (tasks, shutdown)
}

fn insert_sql(table: &OutboxTable) -> String {
    format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'order.updated', '{{}}') RETURNING id",
        table.qualified()
    )
}

async fn plain_insert(tx: &mut sqlx::PgConnection, table: &OutboxTable, aggregate: &str) -> Uuid {
    let row = sqlx::query(&insert_sql(table))
        .bind(aggregate)
        .fetch_one(tx)
        .await
        .unwrap();
    row.get("id")
}

/// Inserts an event of `aggregate` in the connection's open transaction, then commits, or rolls
/// back when the insert failed; returns the insert's result.
async fn insert_then_end(
    conn: &mut sqlx::PgConnection,
    table: &OutboxTable,
    aggregate: &str,
) -> Result<(), sqlx::Error> {
    let inserted = sqlx::query(&insert_sql(table))
        .bind(aggregate)
        .execute(&mut *conn)
        .await
        .map(|_| ());
    let end = if inserted.is_ok() {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    sqlx::query(end).execute(&mut *conn).await.unwrap();
    inserted
}

/// A pooled connection and its backend's pid.
async fn session(pg: &PgPool) -> (sqlx::pool::PoolConnection<sqlx::Postgres>, i32) {
    let mut conn = pg.acquire().await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    (conn, pid)
}

/// Waits until `pid`'s session waits for a lock, or `done` is true; returns which.
async fn blocked_or_done<T>(pg: &PgPool, pid: i32, done: &tokio::task::JoinHandle<T>) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if done.is_finished() {
            return false;
        }
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_one(pg)
                .await
                .unwrap();
        if waiting.as_deref() == Some("Lock") {
            return true;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the second writer neither committed nor waited for a lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_delivered(publisher: &ScriptedPublisher, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while publisher.delivered().len() < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {n} events published",
            publisher.delivered().len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Session A inserts an event of aggregate X and holds its transaction; session B inserts another event
/// of X and commits; A commits. The relay must publish A's event first: B's transaction may not commit
/// an event of X ahead of A's (it waits at its insert), and whatever order the commits take, the
/// relay publishes in `seq` order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_committed_later_never_overtakes_an_earlier_insert_of_its_aggregate() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let publisher = ScriptedPublisher::new();
    let (relays, shutdown) = spawn_relays(vec![pool(4).await], &table, publisher.clone(), 10);

    let mut a = pg.begin().await.unwrap();
    let e1 = plain_insert(&mut a, &table, "x").await;
    let (b_conn, b_pid) = session(&pg).await;
    let (b_tx, b_id) = tokio::sync::oneshot::channel();
    let t = table.clone();
    let b = tokio::spawn(async move {
        let mut conn = b_conn;
        sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
        let id = plain_insert(&mut conn, &t, "x").await;
        sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
        let _ = b_tx.send(id);
    });
    let b_waits = blocked_or_done(&pg, b_pid, &b).await;
    if !b_waits {
        // B committed while A still holds its insert: give the relay every chance to publish it.
        wait_delivered(&publisher, 1).await;
    }
    a.commit().await.unwrap();
    b.await.unwrap();
    let e2 = b_id.await.unwrap();
    wait_delivered(&publisher, 2).await;
    shutdown.cancel();
    for r in relays {
        r.await.unwrap();
    }
    let order: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    assert_eq!(order, vec![e1, e2], "published out of insertion order");
    let seqs: Vec<i64> = sqlx::query_scalar(&format!(
        "SELECT seq FROM {} WHERE id = ANY($1) ORDER BY array_position($1, id)",
        table.qualified()
    ))
    .bind(vec![e1, e2])
    .fetch_all(&pg)
    .await
    .unwrap();
    assert!(seqs[0] < seqs[1], "seq order is not commit order: {seqs:?}");
    assert!(
        b_waits,
        "the second writer of the aggregate did not wait for the first"
    );
}

/// Sixteen connections write five aggregates, from plain SQL and from the writer API, each holding its
/// transaction open 0-4 ms (one in ten rolls back), while two relays publish in batches small enough
/// to overlap. The consumer's order is judged against the database: every aggregate's events arrive in
/// `seq` order, `seq` order is commit order (the counter each transaction takes last), nothing is lost,
/// nothing rolled back is published, and nothing is published twice (no relay crashed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_on_few_aggregates_keep_commit_order_without_duplicates() {
    racing_writers(7).await;
}

/// The same with batches of three over the five aggregates: a claim takes the partitions of three
/// aggregates and leaves the others to the next claims, in this relay and the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_writers_keep_commit_order_when_the_heads_fill_the_batches() {
    racing_writers(3).await;
}

async fn racing_writers(batch_size: usize) {
    let seed = txoutbox_tests::harness::seed();
    println!("seed={seed} (OUTBOX_TEST_SEED reproduces the writers' choices)");
    let pg = pool(20).await;
    let table = fresh_table(&pg).await;
    let log = format!("\"{}\".commit_log", table.schema());
    sqlx::query(&format!(
        "CREATE TABLE {log} (n bigint GENERATED ALWAYS AS IDENTITY, id uuid NOT NULL)"
    ))
    .execute(&pg)
    .await
    .unwrap();
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(Duration::from_millis(2));
    let (relays, shutdown) = spawn_relays(
        vec![pool(4).await, pool(4).await],
        &table,
        publisher.clone(),
        batch_size,
    );

    let writers = 16;
    let per_writer = 40;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (pg, table, log) = (pg.clone(), table.clone(), log.clone());
        let mut rng = fastrand::Rng::with_seed(seed.wrapping_add(w));
        tasks.push(tokio::spawn(async move {
            let writer = Writer::new(table.clone());
            let mut rolled_back = Vec::new();
            for n in 0..per_writer {
                let aggregate = format!("agg-{}", rng.usize(0..5));
                let mut tx = pg.begin().await.unwrap();
                let mut ids = Vec::new();
                for _ in 0..rng.usize(1..=2) {
                    if rng.bool() {
                        ids.push(plain_insert(&mut tx, &table, &aggregate).await);
                    } else {
                        let e = sample_event(&aggregate, n);
                        ids.push(writer.enqueue(&mut tx, e).await.unwrap());
                    }
                }
                tokio::time::sleep(Duration::from_micros(rng.u64(0..4000))).await;
                if rng.u8(0..10) == 0 {
                    tx.rollback().await.unwrap();
                    rolled_back.extend(ids);
                    continue;
                }
                sqlx::query(&format!("INSERT INTO {log} (id) SELECT unnest($1::uuid[])"))
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
            }
            rolled_back
        }));
    }
    let mut rolled_back = Vec::new();
    for t in tasks {
        rolled_back.extend(t.await.unwrap());
    }

    // The database's own record: every committed event by seq, and its transaction's commit counter.
    let rows = sqlx::query(&format!(
        "SELECT e.aggregate_id, e.id, l.n FROM {} e JOIN {log} l USING (id) ORDER BY e.seq",
        table.qualified()
    ))
    .fetch_all(&pg)
    .await
    .unwrap();
    let committed: Vec<(String, Uuid)> = rows
        .iter()
        .map(|r| (r.get("aggregate_id"), r.get("id")))
        .collect();
    let mut last_n: HashMap<String, i64> = HashMap::new();
    let mut commit_order_breaks = 0;
    for r in &rows {
        let (agg, n): (String, i64) = (r.get("aggregate_id"), r.get("n"));
        if let Some(prev) = last_n.insert(agg, n) {
            if n < prev {
                commit_order_breaks += 1;
            }
        }
    }
    wait_delivered(&publisher, committed.len()).await;
    // Late re-deliveries would show here: wait until the outbox has nothing left to claim.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE processed_at IS NULL",
            table.qualified()
        ))
        .fetch_one(&pg)
        .await
        .unwrap();
        if left == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} events left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shutdown.cancel();
    for r in relays {
        r.await.unwrap();
    }
    let received: Vec<Uuid> = publisher.delivered().iter().map(|e| e.id).collect();
    // Rolled-back events are not in the outbox: received, they count as unexpected.
    let verdict = check(&committed, &received);
    println!(
        "{verdict} rolled_back={} commit_order_breaks={commit_order_breaks}",
        rolled_back.len()
    );
    assert_eq!(
        commit_order_breaks, 0,
        "seq order differs from commit order"
    );
    assert_eq!(
        (
            verdict.lost,
            verdict.order_violations,
            verdict.duplicates,
            verdict.unexpected
        ),
        (0, 0, 0, 0),
        "{verdict}"
    );
}

/// `COPY` into the outbox table is serialised per aggregate like an insert: while session A holds an
/// uncommitted event of X, session B's `COPY` of another event of X waits at its row, and its event
/// takes the later `seq`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_aggregates_event_waits_for_the_open_insert_of_that_aggregate() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let mut a = pg.begin().await.unwrap();
    let e1 = plain_insert(&mut a, &table, "x").await;
    let (b_conn, b_pid) = session(&pg).await;
    let t = table.clone();
    let b = tokio::spawn(async move {
        let mut conn = b_conn;
        sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
        let mut copy = conn
            .copy_in_raw(&format!(
                "COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN",
                t.qualified()
            ))
            .await
            .unwrap();
        copy.send(b"order\tx\torder.updated\t{}\n".as_slice())
            .await
            .unwrap();
        assert_eq!(copy.finish().await.unwrap(), 1);
        sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
    });
    let b_waits = blocked_or_done(&pg, b_pid, &b).await;
    a.commit().await.unwrap();
    b.await.unwrap();
    assert!(
        b_waits,
        "the COPY did not wait for the open insert of its aggregate"
    );
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(&format!(
        "SELECT id, seq FROM {} WHERE aggregate_id = 'x' ORDER BY seq",
        table.qualified()
    ))
    .fetch_all(&pg)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[0].0, e1,
        "the insert committed first keeps the earlier seq"
    );
}

/// Two transactions writing two aggregates in opposite orders deadlock on the writer-order locks:
/// the server fails one of them with SQLSTATE 40P01 (to be retried), the other commits, and nothing
/// waits for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_two_aggregates_in_opposite_orders_fail_one_with_a_deadlock() {
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let (mut t1, t1_pid) = session(&pg).await;
    let (mut t2, _) = session(&pg).await;
    sqlx::query("BEGIN").execute(&mut *t1).await.unwrap();
    sqlx::query("BEGIN").execute(&mut *t2).await.unwrap();
    plain_insert(&mut t1, &table, "a").await;
    plain_insert(&mut t2, &table, "b").await;
    // T1 now waits for T2's lock on b...
    let t = table.clone();
    let first = tokio::spawn(async move { insert_then_end(&mut t1, &t, "b").await });
    assert!(
        blocked_or_done(&pg, t1_pid, &first).await,
        "the first transaction did not wait for the second's aggregate"
    );
    // ...and T2 for T1's lock on a: a deadlock.
    let second = insert_then_end(&mut t2, &table, "a").await;
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first transaction still waits")
        .unwrap();
    let code = |r: &Result<(), sqlx::Error>| match r {
        Err(sqlx::Error::Database(e)) => e.code().map(|c| c.to_string()),
        _ => None,
    };
    let failed: Vec<Option<String>> = [&first, &second]
        .into_iter()
        .filter(|r| r.is_err())
        .map(code)
        .collect();
    assert_eq!(
        failed,
        vec![Some("40P01".to_string())],
        "first: {first:?}, second: {second:?}"
    );
    let count: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(
        count, 2,
        "the transaction that committed wrote both of its events"
    );
}
