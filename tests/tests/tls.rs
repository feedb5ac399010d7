//! TLS with a private CA, as managed servers are reached. `scripts/test-env.sh` makes a throwaway
//! CA, a server certificate for the name `localhost` only, and a second CA that signed nothing,
//! and serves TLS from PostgreSQL (`ssl = on`), RabbitMQ (127.0.0.1:5671) and the SQS endpoint
//! (HTTPS on 127.0.0.1:4567, in front of the same moto). Each client verifies the certificate
//! against the CA: `outbox migrate`, `status`, the writer, both relay sources (the WAL source's
//! replication connection included) and the publishers. A wrong CA, or a host name the certificate
//! does not hold, stops the relay at start with an error naming the setting to fix.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::path::PathBuf;
use std::time::Duration;

use txoutbox_postgres::testing::{fresh_table, pool, unmigrated_table};
use txoutbox_postgres::OutboxTable;
use txoutbox_tests::harness::{
    logged, outbox_cli, relay_log_dir, write_through, Broker, RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};
use uuid::Uuid;

/// The test CA's directory: `OUTBOX_TEST_TLS_DIR`, or where `scripts/test-env.sh` makes it.
fn tls_dir() -> PathBuf {
    let dir = PathBuf::from(
        std::env::var("OUTBOX_TEST_TLS_DIR").unwrap_or_else(|_| "/var/lib/outbox-test/tls".into()),
    );
    assert!(
        dir.join("ca.pem").exists() && dir.join("other-ca.pem").exists(),
        "the test CA is missing from {}: run `bash scripts/test-env.sh` (it makes the CA and turns on the TLS listeners)",
        dir.display()
    );
    dir
}

fn ca(name: &str) -> String {
    tls_dir().join(name).display().to_string()
}

/// The test database over TLS, verified against `ca_file` (`ca.pem`, `other-ca.pem`), reached by
/// `host` (`localhost` is the certificate's name; `127.0.0.1` is not).
fn postgres_url(host: &str, ca_file: &str) -> String {
    let base = std::env::var("POSTGRES_TLS_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/test".into());
    format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        base.replace("@localhost:", &format!("@{host}:")),
        ca(ca_file)
    )
}

fn amqps_url(host: &str) -> String {
    std::env::var("AMQP_TLS_URL")
        .unwrap_or_else(|_| "amqps://guest:guest@localhost:5671/%2f".into())
        .replace("@localhost:", &format!("@{host}:"))
}

fn sqs_https_endpoint(host: &str) -> String {
    std::env::var("SQS_TLS_ENDPOINT_URL")
        .unwrap_or_else(|_| "https://localhost:4567".into())
        .replace("//localhost:", &format!("//{host}:"))
}

fn kafka_tls_brokers(host: &str) -> String {
    std::env::var("KAFKA_TLS_BROKERS")
        .unwrap_or_else(|_| "localhost:9094".into())
        .replace("localhost:", &format!("{host}:"))
}

/// Runs the `outbox` CLI with `env` over `table`; its exit code and output.
fn cli(table: &OutboxTable, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut all = vec![("OUTBOX_DATABASE__SCHEMA", table.schema())];
    all.extend_from_slice(env);
    outbox_cli(args, &all)
}

/// Whether every session named `name` is encrypted (and there is one).
async fn sessions_encrypted(pg: &sqlx::PgPool, name: &str) -> bool {
    let (n, all): (i64, Option<bool>) = sqlx::query_as(
        "SELECT count(*), bool_and(s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
         WHERE a.application_name = $1",
    )
    .bind(name)
    .fetch_one(pg)
    .await
    .unwrap();
    n > 0 && all == Some(true)
}

/// `outbox migrate` and `status`, the writer, and the polling relay over TLS; the relay's
/// sessions encrypted; a wrong CA and a wrong host name refused at start, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_with_a_private_ca_polling() {
    let pg = pool(2).await;
    let table = unmigrated_table();
    let url = postgres_url("localhost", "ca.pem");
    let (code, out) = cli(&table, &["migrate"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, Some(0), "migrate over TLS: {out}");
    let (code, out) = cli(&table, &["status"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, Some(0), "status over TLS: {out}");
    for (bad, names) in [
        (postgres_url("localhost", "other-ca.pem"), "sslrootcert"),
        (postgres_url("127.0.0.1", "ca.pem"), "host name"),
    ] {
        let (code, out) = cli(&table, &["migrate"], &[("DATABASE_URL", &bad)]);
        assert_eq!(code, Some(2), "{out}");
        assert!(out.contains(names) && out.contains("database.url"), "{out}");
    }
    let sink = Sink::new(Broker::Amqp).await;
    for (bad, names) in [
        (postgres_url("localhost", "other-ca.pem"), "sslrootcert"),
        (postgres_url("127.0.0.1", "ca.pem"), "host name"),
    ] {
        let before = logged(&table, names);
        let relay = RelayProcess::start_at(&bad, &table, &sink, &[]);
        assert_eq!(relay.exit_code(), Some(2));
        assert!(logged(&table, names) > before, "the refusal names {names}");
    }
    let relay = RelayProcess::start_at(&url, &table, &sink, &[]);
    let committed = write_through(&url, &table, 30).await;
    sink.assert_delivered(&committed, Duration::from_secs(60))
        .await;
    assert!(
        sessions_encrypted(&pg, &relay.tag).await,
        "the relay's sessions are not all encrypted"
    );
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// The WAL source over TLS: the replication connection (its own client) verifies the CA too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_with_a_private_ca_wal_source() {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup(&table).await;
    let url = postgres_url("localhost", "ca.pem");
    let sink = Sink::new(Broker::Amqp).await;
    let relay = RelayProcess::start_at(&url, &table, &sink, &pairs(&source.relay_env(&[])));
    let committed = write_through(&url, &table, 30).await;
    sink.assert_delivered(&committed, Duration::from_secs(90))
        .await;
    let walsender_encrypted: Option<bool> = sqlx::query_scalar(
        "SELECT s.ssl FROM pg_replication_slots r JOIN pg_stat_ssl s ON s.pid = r.active_pid
         WHERE r.slot_name = $1",
    )
    .bind(source.slot.slot())
    .fetch_optional(&pg)
    .await
    .unwrap();
    assert_eq!(
        walsender_encrypted,
        Some(true),
        "the slot's replication connection is not encrypted"
    );
    assert!(sessions_encrypted(&pg, &relay.tag).await);
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

/// A publisher over TLS (`env` points it there) delivers what the writer commits; each of
/// `refused` (settings, and the text the refusal must hold) stops the relay at start.
async fn publisher_over_tls(
    broker: Broker,
    env: &[(&str, &str)],
    refused: &[(Vec<(&str, &str)>, &str)],
) {
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    // The HTTPS endpoint stands in front of the shared moto: a queue there (not one of a
    // recording endpoint of its own).
    // The Kafka broker behind TLS is a broker of its own: its topic is made and read over TLS.
    let sink = match broker {
        Broker::Sqs => Sink::Sqs(txoutbox_sqs::testing::Fixture::new(true).await),
        Broker::Kafka => Sink::Kafka(
            txoutbox_kafka::testing::Fixture::create_with(
                &kafka_tls_brokers("localhost"),
                &format!("outbox.test.{}", Uuid::new_v4().simple()),
                2,
                &[
                    ("security.protocol", "ssl"),
                    ("ssl.ca.location", &ca("ca.pem")),
                ],
            )
            .await,
        ),
        Broker::Amqp => Sink::new(broker).await,
    };
    let direct = txoutbox_postgres::testing::database_url();
    for (settings, names) in refused {
        let before = logged(&table, names);
        let relay = RelayProcess::start_at(&direct, &table, &sink, settings);
        assert_eq!(relay.exit_code(), Some(2), "refused: {names}");
        assert!(logged(&table, names) > before, "the refusal names {names}");
    }
    let relay = RelayProcess::start_at(&direct, &table, &sink, env);
    let committed = write_through(&direct, &table, 30).await;
    sink.assert_delivered(&committed, Duration::from_secs(90))
        .await;
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_over_tls_with_a_private_ca() {
    let (good, ca_pem, other) = (amqps_url("localhost"), ca("ca.pem"), ca("other-ca.pem"));
    let wrong_host = amqps_url("127.0.0.1");
    publisher_over_tls(
        Broker::Amqp,
        &[
            ("OUTBOX_AMQP__URL", &good),
            ("OUTBOX_AMQP__TLS_CA_FILE", &ca_pem),
        ],
        &[
            // The public roots only: the private CA is not among them.
            (vec![("OUTBOX_AMQP__URL", &good)], "amqp.tls_ca_file"),
            (
                vec![
                    ("OUTBOX_AMQP__URL", &good),
                    ("OUTBOX_AMQP__TLS_CA_FILE", &other),
                ],
                "amqp.tls_ca_file",
            ),
            (
                vec![
                    ("OUTBOX_AMQP__URL", &wrong_host),
                    ("OUTBOX_AMQP__TLS_CA_FILE", &ca_pem),
                ],
                "not valid for the host name in amqp.url",
            ),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_over_https_with_a_private_ca() {
    let (good, ca_pem, other) = (
        sqs_https_endpoint("localhost"),
        ca("ca.pem"),
        ca("other-ca.pem"),
    );
    let wrong_host = sqs_https_endpoint("127.0.0.1");
    publisher_over_tls(
        Broker::Sqs,
        &[
            ("OUTBOX_SQS__ENDPOINT_URL", &good),
            ("OUTBOX_SQS__CA_FILE", &ca_pem),
        ],
        &[
            (vec![("OUTBOX_SQS__ENDPOINT_URL", &good)], "sqs.ca_file"),
            (
                vec![
                    ("OUTBOX_SQS__ENDPOINT_URL", &good),
                    ("OUTBOX_SQS__CA_FILE", &other),
                ],
                "sqs.ca_file",
            ),
            (
                vec![
                    ("OUTBOX_SQS__ENDPOINT_URL", &wrong_host),
                    ("OUTBOX_SQS__CA_FILE", &ca_pem),
                ],
                "not valid for the host name in sqs.endpoint_url",
            ),
        ],
    )
    .await;
}

/// Kafka over TLS (librdkafka's OpenSSL, through `kafka.properties`): `security.protocol = ssl`
/// and `ssl.ca.location`. librdkafka does not say why it refused a certificate: each refusal
/// names both `ssl.ca.location` and the host name in `kafka.brokers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_over_tls_with_a_private_ca() {
    let (ca_pem, other) = (ca("ca.pem"), ca("other-ca.pem"));
    let wrong_host = kafka_tls_brokers("127.0.0.1");
    let ssl = ("OUTBOX_KAFKA__PROPERTIES__SECURITY.PROTOCOL", "ssl");
    let ca_location = "OUTBOX_KAFKA__PROPERTIES__SSL.CA.LOCATION";
    let names_both = "\"ssl.ca.location\" to the certificate (PEM) of the CA that signed it, and connect with a host name in kafka.brokers";
    publisher_over_tls(
        Broker::Kafka,
        &[ssl, (ca_location, &ca_pem)],
        &[
            (vec![ssl, (ca_location, &other)], names_both),
            (
                vec![
                    ssl,
                    (ca_location, &ca_pem),
                    ("OUTBOX_KAFKA__BROKERS", &wrong_host),
                ],
                names_both,
            ),
        ],
    )
    .await;
}
