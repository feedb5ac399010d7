//! Input the database refuses never makes the WAL source read the same events again and again:
//! messages PostgreSQL cannot store (in text or in jsonb) and tens of thousands of undecodable messages in one
//! transaction are dead-lettered; rows a foreign key or a trigger keeps from being deleted stay,
//! their events published once; a role without DELETE fails readiness, naming the grant, and reads
//! nothing until it is granted. Each judged by the number of times each event was delivered and by
//! the slot's confirmed position passing the transactions.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::HashMap;
use std::time::Duration;

use txoutbox_core::testkit::{sample_event, ScriptedPublisher};
use txoutbox_core::{CancellationToken, ErrorKind, Store};
use txoutbox_postgres::testing::url_named;
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::wal::{WalStore, UNDECODABLE_AGGREGATE_TYPE};
use txoutbox_postgres::{OutboxTable, PostgresStore, Writer};
use txoutbox_tests::harness::{outbox_bin, outbox_cli, wait_until};
use txoutbox_tests::wal::{run_store, wal_position, WalSource};
use uuid::Uuid;

/// Whether the server has the slot confirmed at `position` or past it (the reader confirms an idle
/// slot's position too, whatever else writes WAL meanwhile).
async fn confirmed_past(pool: &sqlx::PgPool, wal: &WalSource, position: u64) -> bool {
    sqlx::query_scalar::<_, Option<i64>>(
        "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots
         WHERE slot_name = $1",
    )
    .bind(wal.slot.slot())
    .fetch_one(pool)
    .await
    .unwrap()
    .is_some_and(|c| c as u64 >= position)
}

/// Writes one event for each of `aggregates` aggregates, `rounds` times, through the writer.
async fn write(
    pool: &sqlx::PgPool,
    table: &OutboxTable,
    aggregates: usize,
    rounds: usize,
) -> Vec<Uuid> {
    let writer = Writer::new(table.clone());
    let mut ids = Vec::new();
    for round in 0..rounds {
        let mut tx = pool.begin().await.unwrap();
        let events = (0..aggregates)
            .map(|a| sample_event(&format!("agg-{a}"), round))
            .collect();
        ids.extend(writer.enqueue_many(&mut tx, events).await.unwrap());
        writer.commit(tx).await.unwrap();
    }
    ids
}

/// Each id delivered exactly once, and nothing else.
fn delivered_once(publisher: &ScriptedPublisher, ids: &[Uuid]) {
    let mut times: HashMap<Uuid, usize> = HashMap::new();
    for e in publisher.delivered() {
        *times.entry(e.id).or_default() += 1;
    }
    let twice = times.values().filter(|n| **n > 1).count();
    assert_eq!(twice, 0, "{twice} events delivered more than once");
    for id in ids {
        assert_eq!(times.get(id), Some(&1), "{id} delivered once");
    }
    assert_eq!(times.len(), ids.len(), "nothing unexpected delivered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_and_50k_undecodable_messages_in_one_transaction_are_dead_lettered() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let wal = WalSource::setup(&table).await;
    let prefix = table.schema().to_string();
    let mut tx = pool.begin().await.unwrap();
    let writer = Writer::new(table.clone());
    let events = (0..10)
        .map(|a| sample_event(&format!("agg-{a}"), 0))
        .collect();
    let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
    // 50,000 messages that are not events: each a dead letter of its own aggregate (its
    // position), which with a writer-order lock per aggregate would exhaust the lock table.
    sqlx::query(
        "SELECT count(pg_logical_emit_message(true, $1, 'not an event ' || g))
         FROM generate_series(1, 50000) g",
    )
    .bind(&prefix)
    .execute(&mut *tx)
    .await
    .unwrap();
    // JSON that PostgreSQL cannot store: a NUL in a text field, \u0000 and a lone surrogate in
    // the payload.
    // The same JSON as bytes with a JSON content type goes to jsonb too.
    let base64_json = format!(
        r#"{{"aggregate_type":"o","aggregate_id":"b","event_type":"e","content_type":"application/json","payload_base64":"{}"}}"#,
        txoutbox_core::format::base64(br#"{"x":"\u0000"}"#)
    );
    for content in [
        r#"{"aggregate_type":"o","aggregate_id":"a\u0000b","event_type":"e","payload":{}}"#,
        r#"{"aggregate_type":"o","aggregate_id":"n","event_type":"e","payload":{"x":"\u0000"}}"#,
        r#"{"aggregate_type":"o","aggregate_id":"s","event_type":"e","payload":{"x":"\ud83d"}}"#,
        base64_json.as_str(),
    ] {
        sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
            .bind(&prefix)
            .bind(content)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let written = wal_position(&pool).await;

    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let store = wal.store(txoutbox_core::Wake::new()).await;
    let task = run_store(store.clone(), publisher.clone(), &shutdown);
    wait_until(
        Duration::from_secs(180),
        "the events published, the rest dead-lettered, the transaction confirmed",
        || async {
            publisher.delivered().len() >= ids.len()
                && store.held().stats().await.unwrap().dead_letters == 50_004
                && confirmed_past(&pool, &wal, written).await
        },
    )
    .await;
    shutdown.cancel();
    task.await.unwrap();
    delivered_once(&publisher, &ids);
    let errors: Vec<(String, String)> = sqlx::query_as(&format!(
        "SELECT aggregate_type, last_error FROM {} WHERE dead_lettered_at IS NOT NULL
           AND last_error NOT LIKE '%not a JSON object%'",
        wal.held.qualified()
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(errors.iter().all(|(t, _)| t == UNDECODABLE_AGGREGATE_TYPE));
    let text = format!("{errors:?}");
    assert!(text.contains("NUL character"), "{text}");
    assert!(text.contains("lone surrogate"), "{text}");
    assert!(text.contains("\\\\u0000"), "{text}");
}

/// A foreign key into the outbox table holds one row, a trigger that raises another: they stay,
/// every event is published once, and the slot moves past them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_a_foreign_key_or_a_trigger_keeps_stay_and_are_published_once() {
    let pool = pool(4).await;
    let table = fresh_table(&pool).await;
    let wal = WalSource::setup(&table).await;
    let t = table.qualified();
    let schema = table.schema();
    for sql in [
        format!("CREATE TABLE \"{schema}\".refs (event_id uuid REFERENCES {t} (id))"),
        format!(
            "CREATE FUNCTION \"{schema}\".keep() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RAISE EXCEPTION 'audit: rows of agg-3 are kept'; END $$"
        ),
        format!(
            "CREATE TRIGGER keep BEFORE DELETE ON {t} FOR EACH ROW
             WHEN (OLD.aggregate_id = 'agg-3') EXECUTE FUNCTION \"{schema}\".keep()"
        ),
    ] {
        sqlx::query(&sql).execute(&pool).await.unwrap();
    }
    let ids = write(&pool, &table, 6, 4).await;
    sqlx::query(&format!("INSERT INTO \"{schema}\".refs VALUES ($1)"))
        .bind(ids[1])
        .execute(&pool)
        .await
        .unwrap();
    let written = wal_position(&pool).await;

    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let store = wal.store(txoutbox_core::Wake::new()).await;
    let task = run_store(store.clone(), publisher.clone(), &shutdown);
    wait_until(
        Duration::from_secs(60),
        "every event published and the writes confirmed",
        || async {
            publisher.delivered().len() >= ids.len() && confirmed_past(&pool, &wal, written).await
        },
    )
    .await;
    // A reader that read them again would publish them again meanwhile.
    tokio::time::sleep(Duration::from_secs(2)).await;
    shutdown.cancel();
    task.await.unwrap();
    delivered_once(&publisher, &ids);
    let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {t}"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 1 + 4, "the referenced row and agg-3's four stay");
}

/// A role for a relay of `table`'s WAL source: LOGIN, `REPLICATION` when `replication`, the
/// grants the README gives it (DELETE on the outbox table when `delete`).
async fn relay_role(
    admin: &sqlx::PgPool,
    table: &OutboxTable,
    wal: &WalSource,
    replication: bool,
    delete: bool,
) -> String {
    let role = format!("outbox_dba_{}", &Uuid::new_v4().simple().to_string()[..10]);
    let schema = table.schema();
    let t = table.qualified();
    let held = wal.held.qualified();
    let attributes = if replication {
        "LOGIN REPLICATION"
    } else {
        "LOGIN"
    };
    let on_table = if delete { "SELECT, DELETE" } else { "SELECT" };
    for sql in [
        format!("CREATE ROLE {role} {attributes}"),
        format!("GRANT USAGE ON SCHEMA \"{schema}\" TO {role}"),
        format!("GRANT {on_table} ON {t} TO {role}"),
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {held} TO {role}"),
        format!("GRANT USAGE ON ALL SEQUENCES IN SCHEMA \"{schema}\" TO {role}"),
    ] {
        sqlx::query(&sql).execute(admin).await.unwrap();
    }
    role
}

/// Ends `role`'s sessions and drops it.
async fn drop_role(admin: &sqlx::PgPool, role: &str) {
    let _ = sqlx::query(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"
    ))
    .execute(admin)
    .await;
    for sql in [
        format!("DROP OWNED BY {role}"),
        format!("DROP ROLE IF EXISTS {role}"),
    ] {
        let _ = sqlx::query(&sql).execute(admin).await;
    }
}

/// The test database's URL, logging in as `role`.
fn role_url(role: &str) -> String {
    let url = txoutbox_postgres::testing::database_url();
    let (scheme, rest) = url.split_once("://").unwrap();
    let rest = rest.split_once('@').map_or(rest, |(_, h)| h);
    format!("{scheme}://{role}@{rest}")
}

/// A WAL store whose pool logs in as `role`.
async fn store_as(role: &str, wal: &WalSource) -> (WalStore, sqlx::PgPool) {
    let role_pool = txoutbox_postgres::connect(&role_url(role), 6)
        .await
        .unwrap();
    let store = WalStore::new(
        role_pool.clone(),
        wal.slot.clone(),
        PostgresStore::new(role_pool.clone(), wal.held.clone()),
        &wal.config,
    )
    .unwrap()
    .with_held_poll_interval(Duration::from_millis(50));
    (store, role_pool)
}

/// A relay over a store whose role was missing something, running until `shutdown`.
struct Granted {
    store: WalStore,
    role_pool: sqlx::PgPool,
    task: tokio::task::JoinHandle<()>,
    shutdown: CancellationToken,
}

/// Once the role has what it lacked: every event is published, once, and readiness is green.
async fn granted_then_everything_once(g: Granted, publisher: &ScriptedPublisher, ids: &[Uuid]) {
    wait_until(Duration::from_secs(60), "every event published", || async {
        publisher.delivered().len() >= ids.len()
    })
    .await;
    g.store.check().await.unwrap();
    g.shutdown.cancel();
    g.task.await.unwrap();
    delivered_once(publisher, ids);
    drop(g.store);
    g.role_pool.close().await;
}

/// A relay role without DELETE on the outbox table (wal.delete_published needs it): readiness fails
/// naming the grant, nothing is read; once granted, every event is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_delete_fails_readiness_and_reads_nothing_until_granted() {
    let admin = pool(4).await;
    let table = fresh_table(&admin).await;
    let wal = WalSource::setup(&table).await;
    let role = relay_role(&admin, &table, &wal, true, false).await;
    let t = table.qualified();
    let (store, role_pool) = store_as(&role, &wal).await;
    let ids = write(&admin, &table, 5, 4).await;

    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let task = run_store(store.clone(), publisher.clone(), &shutdown);
    let e = store.check().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.message()
            .contains(&format!("GRANT SELECT, DELETE ON {t} TO {role}")),
        "{e}"
    );
    assert!(e.message().contains("wal.delete_published = false"), "{e}");
    // The reader tries again every second and reads nothing meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        publisher.delivered().len(),
        0,
        "nothing read without the grant"
    );

    sqlx::query(&format!("GRANT DELETE ON {t} TO {role}"))
        .execute(&admin)
        .await
        .unwrap();
    granted_then_everything_once(
        Granted {
            store,
            role_pool,
            task,
            shutdown,
        },
        &publisher,
        &ids,
    )
    .await;
    drop(wal);
    drop_role(&admin, &role).await;
}

/// A relay role without `REPLICATION`: the replication connection is refused, so readiness (and
/// `outbox check`, which runs the same check) fails naming `ALTER ROLE ... REPLICATION`, and
/// nothing is read; once altered, every event is published once and readiness is green.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_replication_fails_readiness_and_reads_nothing_until_altered() {
    let admin = pool(4).await;
    let table = fresh_table(&admin).await;
    let wal = WalSource::setup(&table).await;
    let role = relay_role(&admin, &table, &wal, false, true).await;
    let (store, role_pool) = store_as(&role, &wal).await;
    let ids = write(&admin, &table, 5, 4).await;

    let publisher = ScriptedPublisher::new();
    let shutdown = CancellationToken::new();
    let task = run_store(store.clone(), publisher.clone(), &shutdown);
    let e = store.check().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(
        e.message()
            .contains(&format!("ALTER ROLE {role} REPLICATION")),
        "{e}"
    );
    // `outbox check` as that role says the same.
    let mut env: Vec<(String, String)> = wal.relay_env(&[]);
    env.push(("DATABASE_URL".into(), role_url(&role)));
    env.push(("OUTBOX_DATABASE__SCHEMA".into(), table.schema().to_string()));
    let env_refs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (code, out) = outbox_cli(&["check"], &env_refs);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains(&format!("ALTER ROLE {role} REPLICATION")),
        "{out}"
    );
    // The reader tries again every second and reads nothing meanwhile.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(publisher.delivered().len(), 0, "nothing read without it");

    sqlx::query(&format!("ALTER ROLE {role} REPLICATION"))
        .execute(&admin)
        .await
        .unwrap();
    granted_then_everything_once(
        Granted {
            store,
            role_pool,
            task,
            shutdown,
        },
        &publisher,
        &ids,
    )
    .await;
    drop(wal);
    drop_role(&admin, &role).await;
}

/// The replication connection is made from the settings the pool's sessions use, the libpq
/// environment included: a relay whose URL names neither user nor TLS mode, run with `PGUSER` (a
/// role of its own) and `PGSSLMODE`, streams the slot as that role, with TLS exactly when the
/// pool has it, under the pool's `application_name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_takes_the_pools_role_and_tls_from_the_environment() {
    let admin = pool(4).await;
    let table = fresh_table(&admin).await;
    let wal = WalSource::setup(&table).await;
    let role = relay_role(&admin, &table, &wal, true, true).await;
    // The test database's URL without its user.
    let url = role_url(&role).replacen(&format!("{role}@"), "", 1);
    for (mode, tls) in [("disable", false), ("require", true)] {
        let (tag, url) = url_named(&url, "outbox-test-env");
        let mut c = std::process::Command::new(outbox_bin());
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") || k.starts_with("PG") {
                c.env_remove(k);
            }
        }
        c.arg("relay")
            .current_dir(std::env::temp_dir())
            .env("DATABASE_URL", &url)
            .env("PGUSER", &role)
            .env("PGSSLMODE", mode)
            .env("OUTBOX_DATABASE__SCHEMA", table.schema())
            .env("OUTBOX_PUBLISHER__TYPE", "stdout")
            .env("OUTBOX_HTTP__ENABLED", "false")
            .envs(wal.relay_env(&[]))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let mut relay = c.spawn().unwrap();
        let sessions = || async {
            sqlx::query_as::<_, (String, String, bool)>(
                "SELECT a.backend_type, a.usename::text, coalesce(s.ssl, false)
                 FROM pg_stat_activity a LEFT JOIN pg_stat_ssl s USING (pid)
                 WHERE a.application_name = $1",
            )
            .bind(&tag)
            .fetch_all(&admin)
            .await
            .unwrap()
        };
        wait_until(
            Duration::from_secs(60),
            &format!("a walsender under the relay's application_name (PGSSLMODE={mode})"),
            || async {
                sessions()
                    .await
                    .iter()
                    .any(|(kind, _, _)| kind == "walsender")
            },
        )
        .await;
        for (kind, user, ssl) in sessions().await {
            assert_eq!(
                user, role,
                "PGSSLMODE={mode}: a {kind} session runs as {user}"
            );
            assert_eq!(
                ssl, tls,
                "PGSSLMODE={mode}: a {kind} session with TLS {ssl}"
            );
        }
        let _ = relay.kill();
        let _ = relay.wait();
    }
    drop(wal);
    drop_role(&admin, &role).await;
}
