//! The `outbox` binary end to end, against the real PostgreSQL and RabbitMQ.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use sqlx::Row;
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::OutboxTable;

#[test]
fn help_teaches_and_usage_errors_exit_2() {
    let out = Command::new(bin()).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = text(&out.stdout);
    for word in [
        "migrate",
        "relay",
        "status",
        "dead-letters",
        "cleanup",
        "publish-test",
        "OUTBOX_RELAY__BATCH_SIZE",
        "Exit codes",
    ] {
        assert!(help.contains(word), "--help must mention {word}:\n{help}");
    }
    let out = Command::new(bin()).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// A secret no output may show: distinctive, so that finding it anywhere is never a coincidence.
const SECRET: &str = "Xq7-secret-9zP";

/// `name` from `config/`, with a secret in every place the configuration holds one: the database URL,
/// the AMQP URL and a Kafka SASL password.
fn example_with_secrets(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let mut text = std::fs::read_to_string(example(name)).unwrap();
    text = text.replace(
        "postgres://postgres@",
        &format!("postgres://postgres:{SECRET}@"),
    );
    text = text.replace("guest:guest@", &format!("guest:{SECRET}@"));
    let sasl = format!("\"sasl.password\" = \"{SECRET}\"");
    if text.contains("[kafka.properties]") {
        text = text.replace("[kafka.properties]", &format!("[kafka.properties]\n{sasl}"));
    } else {
        text.push_str(&format!("\n[kafka.properties]\n{sasl}\n"));
    }
    if !text.contains("[amqp]") {
        text.push_str(&format!(
            "\n[amqp]\nurl = \"amqp://relay:{SECRET}@127.0.0.1:5672/%2f\"\n"
        ));
    }
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn example_configs_load() {
    let dir = workdir();
    for name in ["stdout.toml", "amqp.toml", "kafka.toml", "sqs.toml"] {
        let path = example_with_secrets(name, &dir);
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .matches(SECRET)
                .count()
                >= 3,
            "{name}: the copy holds the secret in each place"
        );
        let out = Command::new(bin())
            .args(["--config", path.to_str().unwrap(), "config"])
            .current_dir(&dir)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{name}: {}", text(&out.stderr));
        let shown = text(&out.stdout);
        assert!(shown.contains("[database]"), "{name}: {shown}");
        assert!(
            !shown.contains(SECRET) && !text(&out.stderr).contains(SECRET),
            "{name}: secrets are redacted: {shown}"
        );
        assert!(
            shown.contains("postgres:***@"),
            "{name}: the redacted URL still shows where it points: {shown}"
        );
    }
}

#[test]
fn bad_config_files_name_the_problem() {
    let cases: &[(&str, &str)] = &[
        (
            "[relay]\nbatch_size = 0\n",
            "relay.batch_size = 0: expected 1 to 100000",
        ),
        ("[relay]\nbatchsize = 10\n", "unknown field `batchsize`"),
        ("[relay]\npoll_interval = \"fast\"\n", "relay.poll_interval"),
        (
            "[relay.retry]\njitter = 3.0\n",
            "retry.jitter = 3: expected a fraction between 0.0 and 1.0",
        ),
        (
            "[database]\ntable = \"Orders; drop\"\n",
            "database.table = \"Orders; drop\" is not a valid name",
        ),
        ("[database]\nurl = \"mysql://root@db/x\"\n", "database.url"),
        ("[publisher]\ntype = \"pigeon\"\n", "publisher.type"),
        (
            "[publisher]\ntype = \"amqp\"\n[amqp]\nrouting_key = \"{nope}\"\n",
            "amqp.routing_key",
        ),
        (
            "[publisher]\ntype = \"amqp\"\n[amqp]\nurl = \"http://x\"\n",
            "amqp.url",
        ),
        ("[http]\nlisten = \"not an address\"\n", "http.listen"),
        ("[log]\nformat = \"xml\"\n", "log.format"),
        ("this is = = not toml", "is not valid TOML"),
        // A producer queue that cannot hold one record of max_message_bytes: librdkafka would
        // answer "queue full" to such a record for ever.
        (
            "[publisher]\ntype = \"kafka\"\n[kafka]\nmax_message_bytes = 4000000\n\
             [kafka.properties]\n\"queue.buffering.max.kbytes\" = \"2048\"\n",
            "raise it to at least 3907",
        ),
    ];
    for (body, expected) in cases {
        let dir = workdir();
        let file = dir.join("bad.toml");
        std::fs::write(&file, body).unwrap();
        let out = Command::new(bin())
            .args(["--config", file.to_str().unwrap(), "config"])
            .current_dir(&dir)
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{body:?} must be a configuration error: {err}"
        );
        assert!(
            err.contains(expected),
            "{body:?}: expected {expected:?} in {err:?}"
        );
    }
    let out = Command::new(bin())
        .args(["config"])
        .env("OUTBOX_RELAY__MAX_IN_FLIGHT", "many")
        .current_dir(workdir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("relay.max_in_flight (from OUTBOX_RELAY__MAX_IN_FLIGHT)"),
        "{}",
        text(&out.stderr)
    );
    // The environment never changes a setting's text.
    let out = Command::new(bin())
        .args(["config"])
        .env("OUTBOX_PUBLISHER__TYPE", "kafka")
        .env("OUTBOX_KAFKA__TOPIC", "0042")
        .current_dir(workdir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("topic = \"0042\""),
        "{}",
        text(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_relay_status_metrics_and_sigterm() {
    let pg = pool(2).await;
    let table = unmigrated_table();
    let printed = run(outbox(&table, &["migrate", "--print"]));
    assert!(text(&printed.stdout).contains("CREATE TABLE IF NOT EXISTS"));
    let out = run(outbox(&table, &["migrate"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("applied migrations"));
    // What the user reads is what was done, not the server's notices about objects it skipped.
    assert_eq!(
        text(&out.stderr),
        "",
        "a first migration prints nothing else"
    );
    let out = run(outbox(&table, &["migrate"]));
    assert!(
        text(&out.stdout).contains("is up to date"),
        "idempotent: {}",
        text(&out.stdout)
    );
    assert_eq!(text(&out.stderr), "", "nor does a second one");

    insert_plain(&table, "o-1", 5).await;
    let out = run(outbox(&table, &["status", "--json"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stats"]["pending"], 5);

    let port = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("OUTBOX_HTTP__STATS_INTERVAL", "100ms");
    let mut relay = Running::start(c);
    let lines = relay.wait_lines(5, Duration::from_secs(30));
    assert_eq!(lines.len(), 5, "every event printed as a JSON line");
    let first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(first["aggregate_id"], "o-1");
    assert_eq!(first["payload"]["n"], 0);
    let ns: Vec<i64> = lines
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["payload"]["n"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(ns, vec![0, 1, 2, 3, 4], "in order");

    let (code, _) = http_get(port, "/healthz");
    assert_eq!(code, 200);
    let (code, body) = http_get(port, "/readyz");
    assert_eq!(code, 200, "{body}");
    // The lines are written by the publisher; the counter moves once the batch is settled, a moment
    // later: wait for it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m1) = http_get(port, "/metrics");
        if metric(&m1, "outbox_events_published_total") == 5.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{m1}");
        std::thread::sleep(Duration::from_millis(50));
    }
    insert_plain(&table, "o-2", 3).await;
    relay.wait_lines(8, Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m2) = http_get(port, "/metrics");
        if metric(&m2, "outbox_events_published_total") == 8.0
            && metric(&m2, "outbox_events_pending") == 0.0
        {
            assert!(m2.contains("outbox_batch_duration_seconds_bucket"));
            assert!(m2.contains("outbox_oldest_pending_age_seconds"));
            break;
        }
        assert!(Instant::now() < deadline, "metrics did not move: {m2}");
        std::thread::sleep(Duration::from_millis(100));
    }

    // The health check of the image reaches the relay at http.listen.
    let mut check = outbox(&table, &["healthcheck"]);
    check.env("OUTBOX_HTTP__LISTEN", format!("0.0.0.0:{port}"));
    let out = run(check);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "healthy: ok\n");
    let out = run(outbox(
        &table,
        &["healthcheck", "--addr", &format!("localhost:{port}")],
    ));
    assert_eq!(
        out.status.code(),
        Some(0),
        "a host name: {}",
        text(&out.stderr)
    );
    let out = run(outbox(&table, &["healthcheck", "--addr", "nowhere"]));
    assert_eq!(out.status.code(), Some(1), "never 2 (Docker reserves it)");
    assert!(
        text(&out.stderr).contains("expected HOST:PORT"),
        "{}",
        text(&out.stderr)
    );

    relay.signal("-TERM");
    assert_eq!(
        relay.wait_exit(Duration::from_secs(60)),
        0,
        "SIGTERM is a clean exit"
    );
    // No relay there: exit 1, saying what to check.
    let mut check = outbox(&table, &["healthcheck", "--timeout", "2s"]);
    check.env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"));
    let out = run(check);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot connect")
            && text(&out.stderr).contains("http.enabled = true"),
        "{}",
        text(&out.stderr)
    );
    let out = run(outbox(&table, &["status"]));
    assert!(
        text(&out.stdout).contains("pending:      0"),
        "{}",
        text(&out.stdout)
    );
    let _ = pg;
}

/// Waits (at most `within`) until `condition` holds; panics naming `what` and the last `detail`.
fn wait_for(within: Duration, what: &str, mut condition: impl FnMut() -> (bool, String)) {
    let deadline = Instant::now() + within;
    loop {
        let (done, detail) = condition();
        if done {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {detail}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_remove_expired_kept_rows_themselves_one_at_a_time() {
    let pg = pool(2).await;
    let table = unmigrated_table();
    let out = run(outbox(&table, &["migrate"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // Counted from a thread of its own with a runtime and a connection of its own each time (the
    // waits below block this runtime's thread; a pooled connection would outlive the runtime that
    // opened it, and fail in the next one).
    let count = |filter: &str| {
        let sql = format!("SELECT count(*) FROM {} WHERE {filter}", table.qualified());
        move || {
            let sql = sql.clone();
            std::thread::spawn(move || {
                tokio::runtime::Runtime::new().unwrap().block_on(async {
                    use sqlx::Connection;
                    let url = txoutbox_postgres::testing::database_url();
                    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
                    let n = sqlx::query_scalar::<_, i64>(&sql)
                        .fetch_one(&mut conn)
                        .await
                        .unwrap();
                    conn.close().await.unwrap();
                    n
                })
            })
            .join()
            .unwrap()
        }
    };
    let processed = count("processed_at IS NOT NULL");
    let rows = count("true");
    // Someone else cleans this table (its cleanup lock is held) while the relays start and publish.
    let mut holder = pg.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('outbox-cleanup'), hashtext($1))")
        .bind(table.qualified())
        .execute(&mut *holder)
        .await
        .unwrap();
    let ports = [free_port(), free_port()];
    let relays: Vec<Running> = ports
        .iter()
        .map(|port| {
            let mut c = outbox(&table, &["relay"]);
            c.env("OUTBOX_HTTP__ENABLED", "true")
                .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
                .env("OUTBOX_DATABASE__KEEP_PROCESSED_FOR", "1s")
                .env("OUTBOX_DATABASE__CLEANUP_INTERVAL", "1s")
                .env("OUTBOX_DATABASE__CLEANUP_BATCH_SIZE", "7");
            Running::start(c)
        })
        .collect();
    for r in &relays {
        r.wait_log(
            "automatic cleanup of published rows is on",
            Duration::from_secs(30),
        );
    }
    insert_plain(&table, "o-1", 20).await;
    insert_plain(&table, "o-2", 20).await;
    wait_for(
        Duration::from_secs(60),
        "every event published and kept",
        || {
            let n = processed();
            (n == 40, format!("{n} processed"))
        },
    );
    // Expired now (kept 1 s); each relay's next rounds find the lock taken and skip.
    std::thread::sleep(Duration::from_millis(1100));
    let busy = |port: u16| {
        metric(
            &http_get(port, "/metrics").1,
            "outbox_cleanup_runs_total{outcome=\"busy\"}",
        )
    };
    let before: Vec<f64> = ports.iter().map(|p| busy(*p)).collect();
    wait_for(
        Duration::from_secs(60),
        "both relays skip a round after expiry",
        || {
            let now: Vec<f64> = ports.iter().map(|p| busy(*p)).collect();
            (
                now[0] > before[0] && now[1] > before[1],
                format!("busy rounds {before:?} -> {now:?}"),
            )
        },
    );
    assert_eq!(rows(), 40, "nothing removed while another session cleans");
    holder.commit().await.unwrap();
    wait_for(Duration::from_secs(60), "the expired rows removed", || {
        let n = rows();
        (n == 0, format!("{n} rows left"))
    });
    // A relay counts its removals once the server has answered its delete: the sum is read when
    // both have, and is exactly the rows there were (none removed twice).
    wait_for(
        Duration::from_secs(30),
        "the removals counted by the relays",
        || {
            let metrics: Vec<String> = ports.iter().map(|p| http_get(*p, "/metrics").1).collect();
            let removed: f64 = metrics
                .iter()
                .map(|m| metric(m, "outbox_cleanup_rows_removed_total"))
                .sum();
            assert!(removed <= 40.0, "{metrics:?}");
            (
                removed == 40.0,
                format!("{removed} removals counted: {metrics:?}"),
            )
        },
    );
    wait_for(
        Duration::from_secs(30),
        "a round that found nothing left",
        || {
            let done: Vec<f64> = ports
                .iter()
                .map(|p| {
                    metric(
                        &http_get(*p, "/metrics").1,
                        "outbox_cleanup_runs_total{outcome=\"done\"}",
                    )
                })
                .collect();
            (
                done.iter().all(|d| *d >= 1.0),
                format!("done rounds {done:?}"),
            )
        },
    );
    let last = metric(
        &http_get(ports[0], "/metrics").1,
        "outbox_cleanup_last_success_timestamp_seconds",
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        last > now - 600.0 && last <= now + 1.0,
        "last success {last}, now {now}"
    );
    for r in &relays {
        r.signal("-TERM");
    }
    for mut r in relays {
        assert_eq!(r.wait_exit(Duration::from_secs(60)), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_setup_status_and_drop_commands() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let slot = format!("{}_outbox_events_slot", table.schema());
    // The slot is dropped however the test ends: a forgotten slot keeps WAL for ever.
    struct DropSlot(OutboxTable);
    impl Drop for DropSlot {
        fn drop(&mut self) {
            let _ = run(outbox(&self.0, &["wal", "drop", "--yes"]));
        }
    }
    let _guard = DropSlot(table.clone());
    let out = run(outbox(&table, &["wal", "setup"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&format!("slot {slot}: created")),
        "{}",
        text(&out.stdout)
    );
    let out = run(outbox(&table, &["wal", "setup"]));
    assert!(
        text(&out.stdout).contains(&format!("slot {slot}: exists")),
        "{}",
        text(&out.stdout)
    );

    insert_plain(&table, "o-1", 3).await;
    let out = run(outbox(&table, &["wal", "status", "--json"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["slot"], slot);
    assert_eq!(status["slot_exists"], true);
    assert_eq!(status["wal_level"], "logical");
    assert!(status["lag_bytes"].as_i64().unwrap() > 0, "{status}");
    assert!(status["lag_seconds"].as_f64().is_some(), "{status}");
    assert!(status["oldest_unconfirmed_commit"].is_string(), "{status}");
    assert_eq!(status["retains_too_much"], false);
    let out = run(outbox(&table, &["wal", "status"]));
    let shown = text(&out.stdout);
    assert!(
        shown.contains("retained WAL:") && shown.contains("since the oldest unconfirmed commit"),
        "{shown}"
    );
    // Above the configured amount of retained WAL: a loud warning.
    let mut c = outbox(&table, &["wal", "status"]);
    c.env("OUTBOX_WAL__RETAINED_WAL_WARNING", "1");
    let out = run(c);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains(&format!("WARNING: slot {slot} keeps")),
        "{}",
        text(&out.stderr)
    );

    let out = run(outbox(&table, &["wal", "drop"]));
    assert_eq!(out.status.code(), Some(2), "drop wants --yes");
    assert!(text(&out.stderr).contains("--yes"), "{}", text(&out.stderr));
    let out = run(outbox(&table, &["wal", "drop", "--yes"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains(&format!("slot {slot}: dropped")),
        "{}",
        text(&out.stdout)
    );
    let out = run(outbox(&table, &["wal", "status", "--json"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["slot_exists"], false);
    assert_eq!(status["publication_exists"], false);
    let _ = pg;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_source_needs_its_setup_and_its_operators_tools_work_on_the_held_table() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    struct DropSlot(OutboxTable);
    impl Drop for DropSlot {
        fn drop(&mut self) {
            let _ = run(outbox(&self.0, &["wal", "drop", "--yes"]));
        }
    }
    let _guard = DropSlot(table.clone());
    let wal = |args: &[&str]| {
        let mut c = outbox(&table, args);
        c.env("OUTBOX_DATABASE__SOURCE", "wal");
        c
    };
    // Before `outbox wal setup`: the relay refuses to start (a configuration error), naming the
    // command.
    let out = run(wal(&["relay"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("outbox wal setup")
            && text(&out.stderr).contains("outbox_events_held"),
        "{}",
        text(&out.stderr)
    );
    // The operators' tools name it too (not `outbox migrate`), and so does `outbox check`.
    let out = run(wal(&["status"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("run `outbox wal setup`"),
        "{}",
        text(&out.stderr)
    );
    let out = run(wal(&["check"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout).contains("FAIL  wal") && text(&out.stdout).contains("outbox wal setup"),
        "{}",
        text(&out.stdout)
    );
    let out = run(wal(&["wal", "setup"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = run(wal(&["check"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(
        text(&out.stdout).contains("ok    wal"),
        "{}",
        text(&out.stdout)
    );
    let out = run(wal(&["wal", "setup"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("held table")
            && text(&out.stdout).contains("outbox_events_held"),
        "{}",
        text(&out.stdout)
    );
    // A dead letter in the held table: status and dead-letters see it under the WAL source.
    sqlx::query(&format!(
        "INSERT INTO \"{}\".outbox_events_held (aggregate_type, aggregate_id, event_type, payload, dead_lettered_at, last_error)
         VALUES ('order', 'h-1', 'order.created', '{{}}', now(), 'refused')",
        table.schema()
    ))
    .execute(&pg)
    .await
    .unwrap();
    let out = run(wal(&["status", "--json"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stats"]["dead_letters"], 1, "{status}");
    assert!(
        status["table"]
            .as_str()
            .unwrap()
            .contains("outbox_events_held"),
        "{status}"
    );
    let out = run(wal(&["dead-letters", "list"]));
    assert!(text(&out.stdout).contains("h-1"), "{}", text(&out.stdout));
    // The polling source's view of the same table has none.
    let out = run(outbox(&table, &["status", "--json"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stats"]["dead_letters"], 0, "{status}");
    // A switch back to polling while the held table holds it: refused, naming the way back.
    let out = run(outbox(&table, &["relay"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains(
            "outbox_events_held\" still holds 1 unpublished events (1 of them dead letters)"
        ) && text(&out.stderr).contains("database.source = \"wal\""),
        "{}",
        text(&out.stderr)
    );
    // A polling role that may not read the held table cannot tell: it starts, and says so.
    let role = format!(
        "outbox_dba_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA \"{}\" TO {role}", table.schema()),
        format!(
            "GRANT SELECT, UPDATE, DELETE ON {} TO {role}",
            table.qualified()
        ),
    ] {
        sqlx::query(&sql).execute(&pg).await.unwrap();
    }
    let url =
        txoutbox_postgres::testing::database_url().replacen("postgres@", &format!("{role}@"), 1);
    let mut c = outbox(&table, &["relay"]);
    c.env("DATABASE_URL", &url);
    let mut relay = Running::start(c);
    relay.wait_log(
        "cannot read the WAL source's held table",
        Duration::from_secs(30),
    );
    relay.wait_log("relay running", Duration::from_secs(30));
    relay.signal("-TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(30)), 0);
    drop(relay);
    for sql in [
        format!("DROP OWNED BY {role}"),
        format!("DROP ROLE IF EXISTS {role}"),
    ] {
        let _ = sqlx::query(&sql).execute(&pg).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_and_cleanup_commands() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    insert_plain(&table, "d-1", 2).await;
    insert_plain(&table, "d-2", 1).await;
    sqlx::query(&format!(
        "UPDATE {} SET dead_lettered_at = now(), attempts = 10, last_error = 'payload_too_large (permanent): too big' WHERE aggregate_id IN ('d-1', 'd-2') AND (aggregate_id = 'd-2' OR (payload->>'n')::int = 0)",
        table.qualified()
    )).execute(&pg).await.unwrap();
    sqlx::query(&format!(
        "UPDATE {} SET event_type = 'invoice.paid' WHERE aggregate_id = 'd-2'",
        table.qualified()
    ))
    .execute(&pg)
    .await
    .unwrap();

    let out = run(outbox(&table, &["dead-letters", "list", "--json"]));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let list: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(
        list[0]["last_error"],
        "payload_too_large (permanent): too big"
    );
    let first_id = list[0]["id"].as_str().unwrap().to_string();
    let human = run(outbox(&table, &["dead-letters", "list"]));
    assert!(text(&human.stdout).contains("too big"));
    // d-1's second event waits behind its first, dead-lettered: status says so.
    let out = run(outbox(&table, &["status"]));
    assert!(
        text(&out.stdout).contains("held back:    1 events of 1 aggregates"),
        "{}",
        text(&out.stdout)
    );
    let out = run(outbox(&table, &["status", "--json"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["stats"]["held_back"].as_i64(), Some(1), "{status}");
    assert_eq!(status["stats"]["held_back_aggregates"].as_i64(), Some(1));
    // One dead letter whole, and what waits behind it.
    let d1 = list.iter().find(|d| d["aggregate_id"] == "d-1").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let out = run(outbox(
        &table,
        &["dead-letters", "show", "--id", &d1, "--json"],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["held_back"], 1, "{shown}");
    assert_eq!(
        shown["last_error"],
        "payload_too_large (permanent): too big"
    );
    assert_eq!(shown["attempts"], 10);
    let payload: serde_json::Value =
        serde_json::from_str(shown["payload"].as_str().unwrap()).unwrap();
    assert_eq!(payload["n"], 0, "{shown}");
    let out = run(outbox(&table, &["dead-letters", "show", "--id", &d1]));
    let human = text(&out.stdout);
    assert!(
        human.contains("held back:     1 later events") && human.contains("\"n\": 0"),
        "{human}"
    );
    let missing = uuid::Uuid::new_v4().to_string();
    let out = run(outbox(&table, &["dead-letters", "show", "--id", &missing]));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no dead letter"),
        "{}",
        text(&out.stderr)
    );
    // Listing by aggregate and by age.
    let listed = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["dead-letters", "list", "--json"];
        all.extend_from_slice(args);
        let out = run(outbox(&table, &all));
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        rows.iter()
            .map(|d| d["aggregate_id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        listed(&["--aggregate-type", "order", "--aggregate-id", "d-2"]),
        vec!["d-2"]
    );
    assert_eq!(listed(&["--aggregate-type", "order"]).len(), 2);
    assert!(listed(&["--older-than", "1h"]).is_empty());
    let out = run(outbox(
        &table,
        &["dead-letters", "retry", "--id", &d1, "--all", "--yes"],
    ));
    assert_eq!(out.status.code(), Some(2), "one selection at a time");

    let out = run(outbox(&table, &["dead-letters", "retry"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("needs --id"),
        "{}",
        text(&out.stderr)
    );
    let out = run(outbox(&table, &["dead-letters", "discard", "--all"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("add --yes"),
        "{}",
        text(&out.stderr)
    );

    let out = run(outbox(
        &table,
        &["dead-letters", "retry", "--id", &first_id],
    ));
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("retrying 1 dead letters"));
    assert!(
        text(&out.stderr).contains("dead letters made pending again"),
        "every change is logged: {}",
        text(&out.stderr)
    );
    let out = run(outbox(
        &table,
        &["dead-letters", "discard", "--event-type", "invoice.paid"],
    ));
    assert!(text(&out.stdout).contains("discarded 1 dead letters"));
    let out = run(outbox(
        &table,
        &["dead-letters", "discard", "--all", "--yes"],
    ));
    assert!(text(&out.stdout).contains("discarded 0 dead letters"));
    let out = run(outbox(&table, &["status", "--json"]));
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            status["stats"]["pending"].as_i64(),
            status["stats"]["dead_letters"].as_i64()
        ),
        (Some(2), Some(0))
    );
    assert_eq!(status["stats"]["held_back"].as_i64(), Some(0), "released");

    // Cleanup removes only old published rows, in bounded batches, with progress.
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, processed_at)
         SELECT 'order', 'old', 'order.created', '{{}}', now() - interval '2 hours' FROM generate_series(1, 5)",
        table.qualified()
    )).execute(&pg).await.unwrap();
    let out = run(outbox(&table, &["cleanup"]));
    assert_eq!(out.status.code(), Some(2), "no age given");
    let out = run(outbox(
        &table,
        &["cleanup", "--older-than", "1h", "--batch-size", "2"],
    ));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("removed 5 published rows older than 1h"),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("cleanup: removed 4 rows so far"),
        "{}",
        text(&out.stderr)
    );
    let left: i64 = sqlx::query(&format!("SELECT count(*) AS n FROM {}", table.qualified()))
        .fetch_one(&pg)
        .await
        .unwrap()
        .get("n");
    assert_eq!(left, 2, "pending rows untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_is_a_runtime_error() {
    let table = OutboxTable::default();
    let mut c = outbox(&table, &["status"]);
    c.env(
        "DATABASE_URL",
        format!("postgres://postgres@127.0.0.1:{}/x", free_port()),
    );
    let out = run(c);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot connect to PostgreSQL at 127.0.0.1"),
        "{}",
        text(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_mode_wakes_an_idle_relay() {
    let table = unmigrated_table();
    let mut c = outbox(&table, &["migrate"]);
    c.env("OUTBOX_DATABASE__NOTIFY", "true");
    assert_eq!(run(c).status.code(), Some(0));
    // Polls only once an hour: only a notification can make the relay see new events in time.
    let port = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("OUTBOX_DATABASE__NOTIFY", "true")
        .env("OUTBOX_RELAY__POLL_INTERVAL", "1h")
        .env("OUTBOX_RELAY__MIN_POLL_INTERVAL", "1h")
        .env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"));
    let mut relay = Running::start(c);
    relay.wait_log(
        "listening for outbox notifications",
        Duration::from_secs(30),
    );
    relay.wait_log("relay started", Duration::from_secs(30));
    // The relay has claimed once (nothing is in the outbox yet: an empty claim) and is idle, in a
    // one-hour pause: only the notification can make it see the next events in time.
    let claims = |body: &str| metric(body, "outbox_claim_duration_seconds_count");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = http_get(port, "/metrics");
        if claims(&body) >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "the relay never claimed: {body}");
        std::thread::sleep(Duration::from_millis(20));
    }
    insert_plain(&table, "n-1", 2).await;
    let lines = relay.wait_lines(2, Duration::from_secs(30));
    assert_eq!(lines.len(), 2, "the notification woke the relay");
    relay.signal("-INT");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)), 0);
    // Switching notify off removes its trigger again (the writers' ordering trigger stays).
    assert_eq!(run(outbox(&table, &["migrate"])).status.code(), Some(0));
    let pg = pool(1).await;
    let triggers: Vec<String> = sqlx::query_scalar("SELECT t.tgname::text FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace s ON s.oid = c.relnamespace WHERE s.nspname = $1 AND NOT t.tgisinternal")
        .bind(table.schema()).fetch_all(&pg).await.unwrap();
    assert_eq!(triggers, vec!["outbox_events_writer_order".to_string()]);
}

#[test]
fn sigterm_while_starting_is_a_clean_exit() {
    // A "database" that accepts connections and never answers: the relay stays in its start-up.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let held = std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in silent.incoming().take(4).flatten() {
            open.push(stream);
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let table = unmigrated_table();
    let mut c = outbox(&table, &["relay"]);
    c.env(
        "DATABASE_URL",
        format!("postgres://postgres@127.0.0.1:{port}/test"),
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    // Signals handled, and the database connection under way (it never completes).
    wait_handles_sigterm(child.id());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while accepted.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay never connected to the database"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the relay is still starting"
    );
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("shutdown requested while starting"),
        "{}",
        text(&out.stderr)
    );
    drop(held);
}

/// A relay whose standard output nobody reads (the JSON lines fill the pipe and the write blocks with
/// its batch claimed): the runtime is not stalled, so `/readyz` and `/metrics` answer, and SIGTERM
/// ends the process within the shutdown deadline although the write never returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdout_nobody_reads_stalls_neither_the_endpoints_nor_the_exit() {
    let table = unmigrated_table();
    let mut c = outbox(&table, &["migrate"]);
    c.env("OUTBOX_DATABASE__NOTIFY", "true");
    assert_eq!(run(c).status.code(), Some(0));
    let pg = pool(2).await;
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'order', 'a' || (g % 40), 'order.created', jsonb_build_object('n', g, 'blob', repeat('x', 8000)) \
         FROM generate_series(1, 400) g",
        table.qualified()
    ))
    .execute(&pg)
    .await
    .unwrap();
    let (tag, url) = txoutbox_postgres::testing::database_url_named("outbox-ready");
    let port = free_port();
    let mut c = outbox(&table, &["relay"]);
    c.env("DATABASE_URL", url)
        .env("OUTBOX_DATABASE__NOTIFY", "true")
        .env("OUTBOX_RELAY__MAX_IN_FLIGHT", "2")
        .env("OUTBOX_RELAY__BATCH_SIZE", "20")
        .env("OUTBOX_RELAY__SHUTDOWN_TIMEOUT", "2s")
        .env("OUTBOX_HTTP__ENABLED", "true")
        .env("OUTBOX_HTTP__LISTEN", format!("127.0.0.1:{port}"))
        .env("OUTBOX_HTTP__STATS_INTERVAL", "200ms")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = c.spawn().unwrap();
    // Never read: the pipe fills up and the writes block.
    let _unread = child.stdout.take().unwrap();
    wait_for_held_claims(
        &pg,
        &tag,
        1,
        Duration::from_secs(60),
        "no batch stood blocked on the write",
    )
    .await;
    for _ in 0..5 {
        let (code, body) = tokio::task::spawn_blocking(move || http_get(port, "/readyz"))
            .await
            .unwrap();
        assert_eq!(code, 200, "readiness with the output blocked: {body}");
        let (code, _) = tokio::task::spawn_blocking(move || http_get(port, "/metrics"))
            .await
            .unwrap();
        assert_eq!(code, 200);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let n = txoutbox_postgres::testing::sessions_holding_a_claim(&pg, &tag).await;
    assert!(
        n >= 1,
        "the write was still blocked while the endpoints answered"
    );
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("SIGTERM did not end a relay whose stdout nobody reads (within 30 s)");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A table that was never migrated is a runtime failure (exit 1, saying to migrate), not a
/// configuration error (exit 2), though the server reports it while the command runs.
#[test]
fn an_unmigrated_table_is_a_runtime_error_that_says_to_migrate() {
    let table = unmigrated_table();
    let out = run(outbox(&table, &["status"]));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("migrate"),
        "{}",
        text(&out.stderr)
    );
    let mut c = outbox(&table, &["status"]);
    c.env("OUTBOX_RELAY__BATCH_SIZE", "0");
    let out = run(c);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}

/// `outbox check`: one line per check, the fix named; exit 2 on a setting or the schema, 1 on a
/// server down, 0 once all is well. `outbox config` refuses what the relay would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_each_problem_and_its_fix() {
    let table = unmigrated_table();
    let out = run(outbox(&table, &["check"]));
    let shown = text(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{shown}{}", text(&out.stderr));
    for line in ["ok    configuration", "ok    database", "ok    broker"] {
        assert!(shown.contains(line), "{line}: {shown}");
    }
    assert!(
        shown.contains("FAIL  schema") && shown.contains("run `outbox migrate`"),
        "{shown}"
    );
    assert_eq!(run(outbox(&table, &["migrate"])).status.code(), Some(0));
    let out = run(outbox(&table, &["check"]));
    let shown = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{shown}{}", text(&out.stderr));
    for line in [
        "ok    configuration",
        "ok    database",
        "ok    pooler",
        "ok    schema",
        "ok    privileges",
        "ok    broker",
    ] {
        assert!(shown.contains(line), "{line}: {shown}");
    }
    // A pool the relay would refuse: `outbox config` says so (exit 2), and so does `check`.
    let mut c = outbox(&table, &["config"]);
    c.env("OUTBOX_DATABASE__POOL_SIZE", "2");
    let out = run(c);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("database.pool_size"),
        "{}",
        text(&out.stderr)
    );
    let mut c = outbox(&table, &["check"]);
    c.env("OUTBOX_DATABASE__POOL_SIZE", "2");
    let out = run(c);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stdout).contains("FAIL  configuration"));
    // A database that does not answer: a runtime failure (1), the cause named.
    let mut c = outbox(&table, &["check"]);
    c.env(
        "DATABASE_URL",
        format!("postgres://postgres@127.0.0.1:{}/test", free_port()),
    );
    let out = run(c);
    let shown = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{shown}");
    assert!(
        shown.contains("FAIL  database") && shown.to_lowercase().contains("refused"),
        "{shown}"
    );
}
