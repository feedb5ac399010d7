//! A Kafka consumer that handles `order.created` idempotently through the inbox: each record's event
//! id (its `outbox-event-id` header) is recorded in `processed_events` in the same transaction as the
//! handler's write; the offset is committed after, so a redelivered record is skipped, not re-handled.
//!
//! A record whose handling fails is tried again a few times; if it still fails, the consumer commits
//! the offsets of the records it handled and stops with an error, without committing past the
//! failed one: started again, it reads that record first. (Going on to the next record would commit
//! an offset past it, and it would never be read again.)
//!
//! ```sh
//! cargo run -p txoutbox --example order_consumer_kafka
//! ```
//! Environment: `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database), `KAFKA_BROKERS`,
//! `TOPIC` (default `outbox.event.order`), `GROUP` (default `shipping`), `SCHEMA` (default `shipping`),
//! `MAX_MESSAGES` (stop after that many records; default: run until Ctrl-C).

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use txoutbox_postgres::{connect, Inbox, OutboxTable, Processed};

/// Tries of a record's handling before the consumer stops.
const TRIES: u32 = 3;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let database_url = env("DATABASE_URL", txoutbox_postgres::DEFAULT_DATABASE_URL);
    let brokers = env("KAFKA_BROKERS", txoutbox_kafka::DEFAULT_BROKERS);
    let topic = env("TOPIC", "outbox.event.order");
    let group = env("GROUP", "shipping");
    let schema = env("SCHEMA", "shipping");
    let max: Option<usize> = std::env::var("MAX_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok());

    let pool = connect(&database_url, 4).await?;
    let inbox = Inbox::with_table(
        OutboxTable::new(&schema, "processed_events")?,
        "shipping.order-created",
    )?;
    inbox.migrate(&pool).await?;
    let shipments = format!("\"{schema}\".shipments");
    sqlx::query(&format!("CREATE TABLE IF NOT EXISTS {shipments} (order_id bigint PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now())"))
        .execute(&pool)
        .await?;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", "6000")
        .create()?;
    consumer.subscribe(&[&topic])?;
    println!("consuming {topic}");

    let mut seen = 0;
    // The next offset to read of each partition, as far as records were handled.
    let mut handled: HashMap<i32, i64> = HashMap::new();
    loop {
        let message = consumer.recv().await?;
        let Some(event_id) = txoutbox_kafka::event_id(&message) else {
            eprintln!(
                "record without an event id at offset {}: skipped",
                message.offset()
            );
            consumer.commit_message(&message, CommitMode::Async)?;
            continue;
        };
        let payload: serde_json::Value =
            serde_json::from_slice(message.payload().unwrap_or_default()).unwrap_or_default();
        if payload.get("order_id").is_none() {
            consumer.commit_message(&message, CommitMode::Async)?;
            continue;
        }
        let order_id = payload["order_id"].as_i64().unwrap_or_default();
        let mut tries = 0;
        let outcome = loop {
            tries += 1;
            let table = shipments.clone();
            let outcome = inbox
                .process(&pool, event_id, move |conn| {
                    Box::pin(async move {
                        sqlx::query(&format!("INSERT INTO {table} (order_id) VALUES ($1)"))
                            .bind(order_id)
                            .execute(&mut *conn)
                            .await?;
                        Ok::<_, sqlx::Error>(())
                    })
                })
                .await;
            match outcome {
                Err(e) if tries < TRIES => {
                    eprintln!("event {event_id} failed (try {tries} of {TRIES}): {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => break other,
            }
        };
        match outcome {
            Ok(Processed::Done(())) => {
                println!("shipment created for order {order_id} (event {event_id})")
            }
            Ok(Processed::Duplicate) => println!("duplicate event {event_id} skipped"),
            // Nothing past this record is committed: the consumer stops, and reads it again
            // when started again.
            Err(e) => {
                let mut positions = TopicPartitionList::new();
                for (partition, next) in &handled {
                    positions.add_partition_offset(&topic, *partition, Offset::Offset(*next))?;
                }
                if positions.count() > 0 {
                    if let Err(c) = consumer.commit(&positions, CommitMode::Sync) {
                        // Those records are read again and skipped by the inbox.
                        eprintln!("the offsets of the handled records were not committed: {c}");
                    }
                }
                println!(
                    "event {event_id} (offset {}) failed {TRIES} times: stopping; it is read again when the consumer starts again",
                    message.offset()
                );
                return Err(e.into());
            }
        }
        handled.insert(message.partition(), message.offset() + 1);
        consumer.commit_message(&message, CommitMode::Async)?;
        seen += 1;
        if max.is_some_and(|m| seen >= m) {
            return Ok(());
        }
    }
}
