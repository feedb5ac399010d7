//! The examples, run as users run them: the order service, the webhook relay, and the idempotent
//! consumers for RabbitMQ and Kafka. `cargo test --workspace` builds them next to the tests.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::Row;
use txoutbox_core::testkit::publisher_suite::event;
use txoutbox_core::Publisher;
use txoutbox_postgres::testing::{database_url, fresh_table, pool};

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "example {name} is not built at {}: run `cargo test --workspace` (it builds the examples)",
        path.display()
    );
    path
}

struct Proc {
    child: Child,
    out: Arc<Mutex<Vec<String>>>,
    /// The thread reading the child's output; it ends when the output does.
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Proc {
    fn start(mut c: Command) -> Proc {
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out: Arc<Mutex<Vec<String>>> = Arc::default();
        let (pipe, sink) = (child.stdout.take().unwrap(), out.clone());
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Proc {
            child,
            out,
            reader: Some(reader),
        }
    }

    fn wait_line(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.out.lock().unwrap().iter().any(|l| l.contains(needle)) {
            assert!(
                Instant::now() < deadline,
                "no output line with {needle:?}: {:?}",
                self.out.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_exit(&mut self, timeout: Duration) -> Vec<String> {
        let (status, out) = self.wait_end(timeout);
        assert!(status.success(), "example failed: {status}");
        out
    }

    /// Waits for the example to exit; its exit status and every line it wrote.
    fn wait_end(&mut self, timeout: Duration) -> (std::process::ExitStatus, Vec<String>) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Every line it wrote is read once its output ends.
                if let Some(reader) = self.reader.take() {
                    reader.join().unwrap();
                }
                return (status, self.out.lock().unwrap().clone());
            }
            assert!(
                Instant::now() < deadline,
                "example did not finish: {:?}",
                self.out.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn post(port: u16, path: &str, body: &str) -> (u16, String) {
    try_post(port, path, body).expect("the service answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_service_writes_the_order_and_its_event_together() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = Command::new(example("order_service"));
    c.env("DATABASE_URL", database_url())
        .env("LISTEN", format!("127.0.0.1:{port}"))
        .env("OUTBOX_SCHEMA", &schema);
    let service = Proc::start(c);
    service.wait_line("listening", Duration::from_secs(30));
    let (code, body) = post(
        port,
        "/orders",
        r#"{"customer_id":"c-1","total_cents":1250}"#,
    );
    assert_eq!(code, 201, "{body}");
    let (code, _) = post(port, "/orders", r#"{"customer_id":"c-2","total_cents":0}"#);
    assert_eq!(code, 422);
    let row = sqlx::query(&format!(
        "SELECT o.id, e.event_type, e.payload->>'customer_id' AS customer FROM \"{schema}\".orders o JOIN \"{schema}\".outbox_events e ON e.aggregate_id = o.id::text"
    ))
    .fetch_all(&pg)
    .await
    .unwrap();
    assert_eq!(
        row.len(),
        1,
        "one order, one event; the rejected order wrote neither"
    );
    assert_eq!(row[0].get::<String, _>("event_type"), "order.created");
    assert_eq!(row[0].get::<String, _>("customer"), "c-1");
    drop(service);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_relay_delivers_every_event() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    let mut c = Command::new(example("webhook_relay"));
    c.env("DATABASE_URL", database_url())
        .env("EVENTS", "3")
        .env("OUTBOX_SCHEMA", &schema)
        .env_remove("WEBHOOK_URL");
    let mut relay = Proc::start(c);
    let out = relay.wait_exit(Duration::from_secs(60));
    assert_eq!(
        out.iter()
            .filter(|l| l.starts_with("webhook received"))
            .count(),
        3,
        "{out:?}"
    );
    assert!(
        out.iter().any(|l| l.starts_with("relayed 3 events")),
        "{out:?}"
    );
}

async fn shipments(pg: &sqlx::PgPool, schema: &str) -> i64 {
    sqlx::query(&format!("SELECT count(*) AS n FROM \"{schema}\".shipments"))
        .fetch_one(pg)
        .await
        .unwrap()
        .get("n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_consumer_handles_a_redelivered_event_once() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    let fx = txoutbox_amqp::testing::Fixture::new().await;
    let mut c = Command::new(example("order_consumer_amqp"));
    c.env("DATABASE_URL", database_url())
        .env("AMQP_URL", txoutbox_amqp::testing::amqp_url())
        .env("EXCHANGE", &fx.exchange)
        .env("QUEUE", format!("{}.shipping", fx.exchange))
        .env("SCHEMA", &schema)
        .env("MAX_MESSAGES", "3");
    let mut consumer = Proc::start(c);
    consumer.wait_line("consuming", Duration::from_secs(30));
    let mut e = event("77", 0);
    e.event_type = "order.created".into();
    e.payload = br#"{"order_id": 77}"#.to_vec();
    let p = fx.publisher();
    for _ in 0..3 {
        assert!(
            p.publish(std::slice::from_ref(&e)).await[0].is_ok(),
            "the same event, delivered three times"
        );
    }
    let out = consumer.wait_exit(Duration::from_secs(60));
    assert_eq!(
        out.iter().filter(|l| l.starts_with("duplicate")).count(),
        2,
        "{out:?}"
    );
    assert_eq!(shipments(&pg, &schema).await, 1);
    fx.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_handles_a_redelivered_event_once() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    let fx = txoutbox_kafka::testing::Fixture::new(1).await;
    let mut e = event("88", 0);
    e.event_type = "order.created".into();
    e.payload = br#"{"order_id": 88}"#.to_vec();
    let p = fx.publisher();
    for _ in 0..3 {
        assert!(p.publish(std::slice::from_ref(&e)).await[0].is_ok());
    }
    let mut c = Command::new(example("order_consumer_kafka"));
    c.env("DATABASE_URL", database_url())
        .env("KAFKA_BROKERS", txoutbox_kafka::testing::brokers())
        .env("TOPIC", &fx.topic)
        .env("GROUP", format!("g-{}", uuid::Uuid::new_v4().simple()))
        .env("SCHEMA", &schema)
        .env("MAX_MESSAGES", "3");
    let mut consumer = Proc::start(c);
    let out = consumer.wait_exit(Duration::from_secs(90));
    assert_eq!(
        out.iter().filter(|l| l.starts_with("duplicate")).count(),
        2,
        "{out:?}"
    );
    assert_eq!(shipments(&pg, &schema).await, 1);
}

/// A record whose handling fails is not committed past: the consumer stops after its tries, and
/// started again it reads that record first, then the next ones (the handled ones are not read
/// again: their offsets were committed before it stopped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_reads_a_failed_record_again_after_a_restart() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    // The shipments table as the example makes it, with a fault: order 2 cannot be shipped yet.
    for sql in [
        format!("CREATE TABLE \"{schema}\".shipments (order_id bigint PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now())"),
        format!(
            "CREATE FUNCTION \"{schema}\".refuse_order_2() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN IF NEW.order_id = 2 THEN RAISE EXCEPTION 'order 2 cannot be shipped yet'; END IF; RETURN NEW; END $$"
        ),
        format!(
            "CREATE TRIGGER refuse_order_2 BEFORE INSERT ON \"{schema}\".shipments
             FOR EACH ROW EXECUTE FUNCTION \"{schema}\".refuse_order_2()"
        ),
    ] {
        sqlx::query(&sql).execute(&pg).await.unwrap();
    }
    let fx = txoutbox_kafka::testing::Fixture::new(1).await;
    let p = fx.publisher();
    for order in 1..=3 {
        let mut e = event(&order.to_string(), 0);
        e.event_type = "order.created".into();
        e.payload = format!(r#"{{"order_id": {order}}}"#).into_bytes();
        assert!(p.publish(std::slice::from_ref(&e)).await[0].is_ok());
    }
    let group = format!("g-{}", uuid::Uuid::new_v4().simple());
    let consumer = |max: &str| {
        let mut c = Command::new(example("order_consumer_kafka"));
        c.env("DATABASE_URL", database_url())
            .env("KAFKA_BROKERS", txoutbox_kafka::testing::brokers())
            .env("TOPIC", &fx.topic)
            .env("GROUP", &group)
            .env("SCHEMA", &schema)
            .env("MAX_MESSAGES", max);
        Proc::start(c)
    };
    let (status, out) = consumer("3").wait_end(Duration::from_secs(90));
    assert!(
        !status.success(),
        "the consumer stops on the failed record: {out:?}"
    );
    assert!(
        out.iter().any(|l| l.contains("failed 3 times: stopping")),
        "{out:?}"
    );
    assert_eq!(shipments(&pg, &schema).await, 1, "order 1 only");

    // The cause is fixed; started again, the consumer reads order 2, then order 3.
    sqlx::query(&format!(
        "DROP TRIGGER refuse_order_2 ON \"{schema}\".shipments"
    ))
    .execute(&pg)
    .await
    .unwrap();
    let out = consumer("2").wait_exit(Duration::from_secs(90));
    let created: Vec<&String> = out
        .iter()
        .filter(|l| l.starts_with("shipment created"))
        .collect();
    assert_eq!(created.len(), 2, "{out:?}");
    assert!(
        created[0].contains("order 2") && created[1].contains("order 3"),
        "{out:?}"
    );
    assert!(!out.iter().any(|l| l.starts_with("duplicate")), "{out:?}");
    assert_eq!(shipments(&pg, &schema).await, 3);
}

/// `POST path` with a JSON body; `None` when the service cannot be reached or the exchange breaks
/// off (it is stopping).
fn try_post(port: u16, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).ok()?;
    let mut response = String::new();
    s.read_to_string(&mut response).ok()?;
    let code = response.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, response))
}

fn get(port: u16, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, response)
}

/// Every aggregate id written (the orders' ids, and the backlog's), the aggregate ids of the event
/// rows still waiting, and those of the events received.
async fn written_waiting_and_received(
    pg: &sqlx::PgPool,
    schema: &str,
    backlog: &[String],
    got: &[txoutbox_amqp::testing::Delivered],
) -> (BTreeSet<String>, BTreeSet<String>, Vec<String>) {
    let mut written: BTreeSet<String> =
        sqlx::query_scalar::<_, String>(&format!("SELECT id::text FROM \"{schema}\".orders"))
            .fetch_all(pg)
            .await
            .unwrap()
            .into_iter()
            .collect();
    written.extend(backlog.iter().cloned());
    let waiting = sqlx::query_scalar::<_, String>(&format!(
        "SELECT aggregate_id FROM \"{schema}\".outbox_events WHERE processed_at IS NULL"
    ))
    .fetch_all(pg)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let received = got
        .iter()
        .map(|d| d.received.aggregate_id.clone().unwrap())
        .collect();
    (written, waiting, received)
}

/// What the fixture received once nothing more came for a second.
async fn received_when_quiet(
    fx: &txoutbox_amqp::testing::Fixture,
) -> Vec<txoutbox_amqp::testing::Delivered> {
    txoutbox_core::testkit::read_until_quiet(|| async { fx.got.lock().unwrap().clone() }).await
}

/// The service that runs its own relay (`order_service_with_relay`): each order's event reaches
/// RabbitMQ once; `/metrics`, `/healthz` and `/readyz` answer. SIGTERM while orders keep coming and
/// a backlog is being published stops it with every batch in flight settled and none aborted (an
/// event is either received and its row gone, or still waiting, never both); a restart publishes
/// what waited, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_service_with_relay_publishes_once_and_settles_on_sigterm() {
    let pg = pool(2).await;
    let schema = fresh_table(&pg).await.schema().to_string();
    let fx = txoutbox_amqp::testing::Fixture::new().await;
    let port = txoutbox_core::testkit::free_port();
    let command = || {
        let mut c = Command::new(example("order_service_with_relay"));
        c.env("DATABASE_URL", database_url())
            .env("AMQP_URL", txoutbox_amqp::testing::amqp_url())
            .env("AMQP_EXCHANGE", &fx.exchange)
            .env("LISTEN", format!("127.0.0.1:{port}"))
            .env("OUTBOX_SCHEMA", &schema);
        c
    };
    let mut service = Proc::start(command());
    service.wait_line("listening", Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, body) = get(port, "/readyz");
        if code == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {body}");
        std::thread::sleep(Duration::from_millis(100));
    }
    for i in 0..10 {
        let (code, body) = post(
            port,
            "/orders",
            &format!(r#"{{"customer_id":"c-{i}","total_cents":100}}"#),
        );
        assert_eq!(code, 201, "{body}");
    }
    fx.wait_for(10, Duration::from_secs(60)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, metrics) = get(port, "/metrics");
        if metrics.contains("outbox_events_published_total 10") {
            assert!(metrics.contains("adapters=\"amqp\""), "{metrics}");
            break;
        }
        assert!(Instant::now() < deadline, "published count:\n{metrics}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(get(port, "/healthz").0, 200);

    // A backlog keeps the relay's batches in flight, and orders keep coming, while SIGTERM lands.
    let backlog: Vec<String> = (0..5_000).map(|i| format!("b-{i}")).collect();
    sqlx::query(&format!(
        "INSERT INTO \"{schema}\".outbox_events (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'backlog', 'b-' || i, 'order.created', '{{}}' FROM generate_series(0, 4999) i"
    ))
    .execute(&pg)
    .await
    .unwrap();
    let accepted = Arc::new(Mutex::new(0usize));
    let writer = {
        let accepted = accepted.clone();
        std::thread::spawn(move || {
            let mut i = 0;
            while let Some((code, _)) = try_post(
                port,
                "/orders",
                &format!(r#"{{"customer_id":"w-{i}","total_cents":100}}"#),
            ) {
                if code == 201 {
                    *accepted.lock().unwrap() += 1;
                }
                i += 1;
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while *accepted.lock().unwrap() < 30 {
        assert!(Instant::now() < deadline, "the orders stopped coming");
        std::thread::sleep(Duration::from_millis(10));
    }
    let pid = service.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let out = service.wait_exit(Duration::from_secs(60));
    writer.join().unwrap();
    let stopped = out
        .iter()
        .find(|l| l.starts_with("stopped:"))
        .unwrap_or_else(|| panic!("{out:?}"));
    assert!(stopped.ends_with(" 0 batches aborted"), "{stopped}");

    // Each event: received once and its row gone, or its row still waiting; never both.
    let got = received_when_quiet(&fx).await;
    let (written, waiting, received) =
        written_waiting_and_received(&pg, &schema, &backlog, &got).await;
    let received_set: BTreeSet<&String> = received.iter().collect();
    assert_eq!(
        received_set.len(),
        received.len(),
        "an event received twice"
    );
    let neither: Vec<&String> = written
        .iter()
        .filter(|a| !received_set.contains(a) && !waiting.contains(*a))
        .collect();
    let both: Vec<&String> = waiting
        .iter()
        .filter(|a| received_set.contains(a))
        .collect();
    assert!(neither.is_empty(), "lost: {neither:?}");
    assert!(both.is_empty(), "published but not settled: {both:?}");
    assert!(
        received_set.iter().all(|a| written.contains(*a)),
        "an event nobody wrote"
    );
    eprintln!(
        "{} events written; {} received before the stop, {} waiting after it",
        written.len(),
        received.len(),
        waiting.len()
    );

    // A restart publishes what waited, each event once.
    let service = Proc::start(command());
    service.wait_line("listening", Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, waiting, _) = written_waiting_and_received(&pg, &schema, &backlog, &[]).await;
        if waiting.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} events still waiting",
            waiting.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = received_when_quiet(&fx).await;
    drop(service);
    let (written, _, received) = written_waiting_and_received(&pg, &schema, &backlog, &got).await;
    let received_set: BTreeSet<String> = received.iter().cloned().collect();
    assert_eq!(
        received.len(),
        received_set.len(),
        "an event received twice"
    );
    assert_eq!(received_set, written, "every event, once");
    fx.cleanup().await;
}
