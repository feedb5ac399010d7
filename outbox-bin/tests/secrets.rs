//! Secrets never appear in anything the binary prints: a relay with a distinctive password in each
//! place a configuration holds one, run against an unreachable database, and against a reachable
//! database with an unreachable broker (every publisher), at debug level; everything it printed is
//! searched for the password.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use txoutbox_postgres::testing::database_url;

const PASSWORD: &str = "Pw-4e1f-never-printed";

/// `outbox <args>` with the password in the database URL `db`, the AMQP URL, a Kafka SASL password
/// and the AWS secret key, every broker at `broker_port`, where nothing listens.
fn with_secrets(publisher: &str, db: &str, broker_port: u16, args: &[&str]) -> Command {
    let table = unmigrated_table();
    let mut c = outbox(&table, args);
    c.env("DATABASE_URL", db)
        .env("OUTBOX_LOG__LEVEL", "debug")
        .env("OUTBOX_PUBLISHER__TYPE", publisher)
        .env(
            "OUTBOX_AMQP__URL",
            format!("amqp://relay:{PASSWORD}@127.0.0.1:{broker_port}/%2f"),
        )
        .env("OUTBOX_AMQP__CONNECT_TIMEOUT", "1s")
        .env("OUTBOX_KAFKA__BROKERS", format!("127.0.0.1:{broker_port}"))
        .env("OUTBOX_SQS__QUEUE", "outbox-secrets-test")
        .env("OUTBOX_SQS__REGION", "us-east-1")
        .env(
            "OUTBOX_SQS__ENDPOINT_URL",
            format!("http://127.0.0.1:{broker_port}"),
        )
        .env("AWS_ACCESS_KEY_ID", "relay")
        .env("AWS_SECRET_ACCESS_KEY", PASSWORD);
    c
}

/// A config file adding the Kafka SASL password (properties have no environment form).
fn sasl_config() -> std::path::PathBuf {
    let path = workdir().join("sasl.toml");
    std::fs::write(
        &path,
        format!(
            "[kafka.properties]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanisms\" = \"PLAIN\"\n\"sasl.username\" = \"relay\"\n\"sasl.password\" = \"{PASSWORD}\"\n\"sasl.oauthbearer.config\" = \"principal=relay clientSecret={PASSWORD}\"\n"
        ),
    )
    .unwrap();
    path
}

fn assert_never_printed(what: &str, stdout: &str, stderr: &str) {
    assert!(
        !stdout.contains(PASSWORD) && !stderr.contains(PASSWORD),
        "{what}: the password was printed:\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
}

/// The database URL at `port` with the password, in its two forms: in the user part, and as a
/// query parameter (which sqlx accepts too).
fn dbs_with_password(port: u16) -> [String; 2] {
    [
        format!("postgres://postgres:{PASSWORD}@127.0.0.1:{port}/test"),
        format!("postgres://postgres@127.0.0.1:{port}/test?sslmode=disable&password={PASSWORD}"),
    ]
}

#[test]
fn an_unreachable_database_never_shows_the_password() {
    let sasl = sasl_config();
    for publisher in ["amqp", "kafka", "sqs"] {
        let db_port = free_port();
        for (db, args) in dbs_with_password(db_port).into_iter().flat_map(|db| {
            [
                vec!["relay"],
                vec!["status"],
                vec!["migrate"],
                vec!["config"],
            ]
            .map(|args| (db.clone(), args))
        }) {
            let mut all = vec!["--config", sasl.to_str().unwrap()];
            all.extend(args.iter().copied());
            let out = with_secrets(publisher, &db, free_port(), &all)
                .env("OUTBOX_DATABASE__ACQUIRE_TIMEOUT", "1s")
                .output()
                .unwrap();
            let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
            if args[0] != "config" {
                assert_eq!(out.status.code(), Some(1), "{publisher} {args:?}: {stderr}");
                assert!(
                    stderr.contains(&format!("127.0.0.1:{db_port}")),
                    "{publisher} {args:?}: the error names the database it could not reach: {stderr}"
                );
            }
            assert_never_printed(&format!("{publisher} {args:?}"), &stdout, &stderr);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_never_shows_the_password() {
    let sasl = sasl_config();
    // The test database takes any password (trust); the relay reaches it and then fails at the broker.
    let url = database_url();
    let db = url.replacen(
        "postgres://postgres@",
        &format!("postgres://postgres:{PASSWORD}@"),
        1,
    );
    assert!(
        db.contains(PASSWORD),
        "DATABASE_URL has an unexpected form for this test: {url}"
    );
    for publisher in ["amqp", "kafka", "sqs"] {
        let table = unmigrated_table();
        let broker_port = free_port();
        let mut migrate = with_secrets(publisher, &db, broker_port, &["migrate"]);
        migrate.env("OUTBOX_DATABASE__SCHEMA", table.schema());
        let out = migrate.output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        insert_plain(&table, "secret-1", 3).await;
        let mut c = with_secrets(
            publisher,
            &db,
            broker_port,
            &["--config", sasl.to_str().unwrap(), "relay"],
        );
        c.env("OUTBOX_DATABASE__SCHEMA", table.schema())
            .env("OUTBOX_RELAY__RETRY__INITIAL_BACKOFF", "100ms")
            .env("OUTBOX_RELAY__RETRY__MAX_BACKOFF", "500ms");
        let mut relay = Running::start(c);
        // Until the relay has reported failed attempts to publish (or given up starting).
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let logs = relay.logs.lock().unwrap().join("\n");
            let exited = relay.child.try_wait().unwrap().is_some();
            if exited || logs.matches("\"level\":\"WARN\"").count() >= 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{publisher}: no failure reported within 120 s:\n{logs}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        if relay.child.try_wait().unwrap().is_none() {
            relay.signal("-TERM");
            relay.wait_exit(Duration::from_secs(60));
        }
        relay.join_output();
        let stdout = relay.lines.lock().unwrap().join("\n");
        let stderr = relay.logs.lock().unwrap().join("\n");
        assert!(
            stderr.contains(&format!("127.0.0.1:{broker_port}")),
            "{publisher}: the failures name the broker's address:\n{stderr}"
        );
        assert_never_printed(publisher, &stdout, &stderr);
    }
}
