//! The claim transaction is the lease on a batch: it must survive a role's short
//! `idle_in_transaction_session_timeout`, and when it is lost anyway (the session killed, the
//! connection dropped), the outcomes of the publish still count.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgPool, Row};
use txoutbox_core::testkit::{sample_event, Behavior, ScriptedPublisher};
use txoutbox_core::{CancellationToken, OrderingPolicy, Relay, RelayConfig, RetryPolicy};
use txoutbox_postgres::testing::{database_url, fresh_table, pool};
use txoutbox_postgres::{OutboxTable, PostgresStore, Writer};
use uuid::Uuid;

async fn write(pg: &PgPool, table: &OutboxTable, aggregates: &[&str]) -> Vec<Uuid> {
    let writer = Writer::new(table.clone());
    let mut tx = pg.begin().await.unwrap();
    let events = aggregates
        .iter()
        .enumerate()
        .map(|(n, a)| sample_event(a, n))
        .collect();
    let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
    ids
}

fn config(max_attempts: u32) -> RelayConfig {
    RelayConfig {
        batch_size: 10,
        max_in_flight: 1,
        poll_interval: Duration::from_millis(50),
        retry: RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(500),
            ..RetryPolicy::default()
        },
        ..RelayConfig::default()
    }
}

/// A login role of its own (dropped by the test) whose sessions run with `setting`
/// (`name = value`).
async fn role_with(admin: &PgPool, setting: &str) -> String {
    let role = format!("outbox_idle_{}", &Uuid::new_v4().simple().to_string()[..8]);
    sqlx::query(&format!("CREATE ROLE {role} LOGIN SUPERUSER"))
        .execute(admin)
        .await
        .unwrap();
    sqlx::query(&format!("ALTER ROLE {role} SET {setting}"))
        .execute(admin)
        .await
        .unwrap();
    role
}

async fn row(
    pg: &PgPool,
    table: &OutboxTable,
    id: Uuid,
) -> Option<(i32, Option<String>, bool, bool)> {
    sqlx::query(&format!(
        "SELECT attempts, last_error, processed_at IS NOT NULL AS done, dead_lettered_at IS NOT NULL AS dead FROM {} WHERE id = $1",
        table.qualified()
    ))
    .bind(id)
    .fetch_optional(pg)
    .await
    .unwrap()
    .map(|r| (r.get("attempts"), r.get("last_error"), r.get("done"), r.get("dead")))
}

/// A role whose sessions end after 1 s idle in a transaction (as the operations guide recommends
/// against forgotten transactions), and a broker that takes 2 s to acknowledge: the lease must outlive
/// the publish, so the event is published once and settled, not sent again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roles_short_idle_timeout_does_not_end_a_lease_during_a_publish() {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let role = role_with(&admin, "idle_in_transaction_session_timeout = '1s'").await;
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    let relay_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.username(&role))
        .await
        .unwrap();
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(&relay_pool)
        .await
        .unwrap();
    assert_eq!(
        timeout, "1s",
        "the role's setting is in force for the relay's sessions"
    );

    let ids = write(&admin, &table, &["a"]).await;
    let publisher = ScriptedPublisher::new();
    publisher.set_latency(Duration::from_secs(2));
    let store = PostgresStore::new(relay_pool.clone(), table.clone());
    let relay = Relay::new(Arc::new(store), publisher.clone(), config(10)).unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while row(&admin, &table, ids[0]).await.is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the event was not settled: published {} times, row {:?}",
            publisher.tries(ids[0]),
            row(&admin, &table, ids[0]).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let summary = task.await.unwrap();
    assert_eq!(publisher.tries(ids[0]), 1, "published more than once");
    assert_eq!(summary.settle_failures, 0);
    relay_pool.close().await;
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await
        .unwrap();
}

/// The claiming session is terminated (`pg_terminate_backend`) while the batch is being published:
/// one event fails for good, one is acknowledged. The lost lease's outcomes still count: the failed
/// event is dead-lettered with its error after its one attempt, the published one is settled and not
/// sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_mid_publish_still_counts_its_outcomes() {
    lease_lost_mid_publish(OrderingPolicy::PerAggregate).await;
}

/// The same with unordered claims, whose leases lock every row rather than partitions of the
/// aggregates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unordered_lease_lost_mid_publish_still_counts_its_outcomes() {
    lease_lost_mid_publish(OrderingPolicy::Unordered).await;
}

async fn lease_lost_mid_publish(ordering: OrderingPolicy) {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let ids = write(&admin, &table, &["bad", "good"]).await;
    let publisher = ScriptedPublisher::new();
    publisher.on_event(ids[0], Behavior::FailPermanent);
    // Long enough for the session to be found and ended while the batch is in the publisher, on a
    // slow machine too; the outcomes are awaited for 30 s.
    publisher.set_latency(Duration::from_secs(10));
    let store = PostgresStore::new(pool(4).await, table.clone());
    let cfg = RelayConfig {
        ordering,
        ..config(1)
    };
    let relay = Relay::new(Arc::new(store), publisher.clone(), cfg).unwrap();
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    let task = tokio::spawn(async move { relay.run(s).await });

    // Once the batch is in the publisher, end the session that holds its lease.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while publisher.calls() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing was published"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
         WHERE state = 'idle in transaction' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()",
    )
    .bind(table.schema())
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        killed,
        vec![true],
        "exactly the claiming session was terminated"
    );

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let bad = row(&admin, &table, ids[0]).await;
        let good = row(&admin, &table, ids[1]).await;
        if good.is_none() && bad.as_ref().is_some_and(|b| b.3) {
            let (attempts, error, _, _) = bad.unwrap();
            assert_eq!(attempts, 1);
            assert!(
                error
                    .as_deref()
                    .unwrap_or("")
                    .contains("scripted permanent failure"),
                "{error:?}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not settled: bad {bad:?}, good {good:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    task.await.unwrap();
    assert_eq!(
        publisher.tries(ids[0]),
        1,
        "the failed event was attempted again"
    );
    assert_eq!(
        publisher.tries(ids[1]),
        1,
        "the published event was sent again"
    );
}

/// The relay's connections ask the server for TCP keepalives, so that a relay whose host vanishes
/// loses its sessions, and the aggregates they lock, in about 25 s rather than hours.
#[tokio::test]
async fn the_relays_connections_carry_server_side_keepalives() {
    let relay_pool = txoutbox_postgres::connect(&database_url(), 2)
        .await
        .unwrap();
    let over_tcp: bool = sqlx::query_scalar("SELECT inet_client_addr() IS NOT NULL")
        .fetch_one(&relay_pool)
        .await
        .unwrap();
    assert!(
        over_tcp,
        "this test needs DATABASE_URL to reach the server over TCP (keepalives do not apply to a Unix socket)"
    );
    for (setting, value) in [
        ("tcp_keepalives_idle", "10"),
        ("tcp_keepalives_interval", "5"),
        ("tcp_keepalives_count", "3"),
        ("tcp_user_timeout", "25000"),
    ] {
        let shown: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(&relay_pool)
            .await
            .unwrap();
        assert_eq!(shown, value, "{setting}");
    }
}

/// A role whose idle sessions the server ends after 1 s (`idle_session_timeout`, as managed
/// PostgreSQL services and operations guides set against idle connections), running the relay
/// binary on its defaults while events come in bursts with quiet spells between them: after each
/// burst, the test waits until the server has ended some of the relay's pooled sessions, then writes
/// the next one. The relay takes every burst on connections the server has closed under it: every
/// event published, in order, once; no claim or settle failure in its log; the relay alive and
/// exiting cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roles_idle_session_timeout_ending_pooled_sessions_costs_the_relay_nothing() {
    use txoutbox_tests::harness::{
        assert_clean_verdict, relay_log_dir, report, wait_until, Broker, RelayProcess, Sink,
    };
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let role = role_with(&admin, "idle_session_timeout = '1s'").await;
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    let tag = format!(
        "outbox-test-idle-{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    let url = format!(
        "postgres://{role}@{}:{}/{}?application_name={tag}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("test")
    );
    let sink = Sink::new(Broker::Amqp).await;
    // Polls 2 s apart once idle: each poll after a quiet spell meets sessions the server has ended.
    let relay = RelayProcess::start(
        &table,
        &sink,
        &[
            ("DATABASE_URL", url.as_str()),
            ("OUTBOX_RELAY__POLL_INTERVAL", "2s"),
        ],
    );
    let sessions = |admin: PgPool, tag: String| async move {
        sqlx::query_scalar::<_, i32>("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind(tag)
            .fetch_all(&admin)
            .await
            .unwrap()
    };
    let mut committed: Vec<(String, Uuid)> = Vec::new();
    let mut ended = 0usize;
    for round in 0..6 {
        let aggregates: Vec<String> = (0..20).map(|n| format!("agg-{}", n % 5)).collect();
        let names: Vec<&str> = aggregates.iter().map(String::as_str).collect();
        let ids = write(&admin, &table, &names).await;
        committed.extend(aggregates.into_iter().zip(ids));
        sink.wait_all(&committed, Duration::from_secs(60)).await;
        assert_no_failure_logged(&table);
        let received = sink.received(committed.len(), Duration::ZERO).await;
        assert!(
            committed.iter().all(|(_, id)| received.contains(id)),
            "round {round}: the burst was not published within 60 s (see {})",
            relay_log_dir(&table).display()
        );
        // A quiet spell: the server ends sessions of the relay that stay idle for a second.
        let before = sessions(admin.clone(), tag.clone()).await;
        wait_until(
            Duration::from_secs(60),
            "the server ends an idle session of the relay",
            || {
                let (admin, tag, before) = (admin.clone(), tag.clone(), before.clone());
                async move {
                    let now = sessions(admin, tag).await;
                    before.is_empty() || before.iter().any(|pid| !now.contains(pid))
                }
            },
        )
        .await;
        let now = sessions(admin.clone(), tag.clone()).await;
        ended += before.iter().filter(|pid| !now.contains(pid)).count();
    }
    println!("the server ended {ended} of the relay's sessions while idle");
    assert!(
        ended > 0,
        "the server ended none of the relay's sessions: nothing was tried"
    );
    let mut relay = relay;
    assert!(relay.alive(), "the relay must not exit");
    assert_eq!(
        relay.terminate(Duration::from_secs(60)),
        Some(0),
        "a clean exit on SIGTERM"
    );
    let v = sink.judge(&committed).await;
    report("idle_session_timeout", Broker::Amqp, &v);
    assert_clean_verdict(&v);
    assert_no_failure_logged(&table);
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&admin)
        .await
        .unwrap();
}

/// The relay's steps that go to the database, as its log names them when they fail, and the
/// server's own words (and code) for a session it ended while idle.
const DATABASE_STEP_FAILURES: &[&str] = &[
    "claim failed",
    "settling a batch failed",
    "lease was lost",
    "cannot count the outbox",
    "automatic cleanup failed",
    "idle-session timeout",
    "57P05",
];

/// No step of the relays over `table` that goes to the database failed (their logs).
fn assert_no_failure_logged(table: &OutboxTable) {
    let mut failures = Vec::new();
    for entry in std::fs::read_dir(txoutbox_tests::harness::relay_log_dir(table)).unwrap() {
        let log = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        failures.extend(
            log.lines()
                .filter(|l| DATABASE_STEP_FAILURES.iter().any(|f| l.contains(f)))
                .map(str::to_string),
        );
    }
    assert!(
        failures.is_empty(),
        "sessions the server ended while idle must cost the relay no failed claim or settle: {failures:#?}"
    );
}

/// A relay cut off from the database without a reset (every packet of its claim's connection
/// dropped, both ways) while it holds a batch: the server's keepalive probes go unanswered, it ends
/// the session, and another relay claims the aggregate within about 25 s (README, guarantee 4),
/// not after the kernel's two hours nor the lease's own hold time (130 s on defaults). The cut-off
/// relay's pool is a plain one, opened without `txoutbox_postgres::connect`'s keepalives (as a
/// service's own pool may be): the claim sets them on its connection itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_without_a_reset_frees_its_aggregates_within_the_keepalive_bound() {
    let admin = pool(2).await;
    let table = fresh_table(&admin).await;
    let ids = write(&admin, &table, &["x", "x"]).await;
    let relay_a = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&database_url())
        .await
        .unwrap();
    let a = PostgresStore::new(relay_a, table.clone());
    let request = || {
        let mut r = txoutbox_core::ClaimRequest::new(10, OrderingPolicy::PerAggregate);
        r.hold_for = Duration::from_secs(130);
        r
    };
    let held = txoutbox_core::Store::claim(&a, request()).await.unwrap();
    assert_eq!(held.events.len(), 2);
    let (pid, port): (i32, i32) = sqlx::query_as(
        "SELECT pid, client_port FROM pg_stat_activity
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'
           AND strpos(query, $1) > 0",
    )
    .bind(table.schema())
    .fetch_one(&admin)
    .await
    .expect("the claim's session over TCP (DATABASE_URL must reach the server over TCP)");
    let port = u16::try_from(port)
        .expect("the claim's session over TCP (DATABASE_URL must reach the server over TCP)");
    let cut = txoutbox_tests::net::NetFault::blackhole(port);
    let started = std::time::Instant::now();
    let relay_b = txoutbox_postgres::connect(&database_url(), 2)
        .await
        .unwrap();
    let b = PostgresStore::new(relay_b, table.clone());
    let taken = loop {
        let batch = txoutbox_core::Store::claim(&b, request()).await.unwrap();
        if !batch.events.is_empty() {
            break batch;
        }
        batch.lease.release().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the cut-off relay's session still holds its aggregate after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let freed = started.elapsed();
    println!("a relay cut off without a reset: its aggregate was claimable again after {freed:?}");
    assert_eq!(
        taken.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        ids,
        "the other relay takes the aggregate's events, in order"
    );
    let alive: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
    assert!(!alive, "the server ended the cut-off session");
    taken.lease.release().await.unwrap();
    drop(cut);
    drop(held);
}
