//! Relays an outbox table to Kafka: writes a few orders with their events (one transaction each),
//! relays them to the topic `outbox.event.order`, and prints what a consumer reads back.
//!
//! ```sh
//! cargo run -p txoutbox --example relay_to_kafka
//! ```
//! Reads `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database) and `KAFKA_BROKERS`
//! (default `127.0.0.1:9092`).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use txoutbox_core::{NewEvent, Relay, RelayConfig};
use txoutbox_kafka::{KafkaConfig, KafkaPublisher};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let brokers =
        std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| txoutbox_kafka::DEFAULT_BROKERS.into());

    let pool = connect(&database_url, 4).await?;
    let table = OutboxTable::new("outbox_example", "outbox_events")?;
    migrate(&pool, &table).await?;
    let publisher = KafkaPublisher::new(KafkaConfig {
        brokers: brokers.clone(),
        ..KafkaConfig::default()
    })?;
    let store = PostgresStore::new(pool.clone(), table.clone());
    let relay = Relay::new(Arc::new(store), Arc::new(publisher), RelayConfig::default())?;
    let writer = Writer::new(table).with_wake(relay.wake_handle());

    let run = uuid_like();
    for id in 1..=3 {
        let mut tx = pool.begin().await?;
        // ... the business write goes here, in the same transaction ...
        let event = NewEvent::new(
            "order",
            format!("{run}-{id}"),
            "order.created",
            serde_json::json!({ "order_id": id }),
        );
        writer.enqueue(&mut tx, event).await?;
        writer.commit(tx).await?;
    }
    let summary = relay.drain().await;
    println!("relayed {} events to outbox.event.order", summary.published);

    // Read the topic back and show this run's messages.
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "outbox-example")
        .set("enable.auto.commit", "false")
        .create()?;
    let metadata = consumer.fetch_metadata(Some("outbox.event.order"), Duration::from_secs(10))?;
    let mut tpl = TopicPartitionList::new();
    for t in metadata.topics() {
        for p in t.partitions() {
            tpl.add_partition_offset(t.name(), p.id(), Offset::Beginning)?;
        }
    }
    consumer.assign(&tpl)?;
    let mut shown = 0;
    while shown < 3 {
        let Some(message) = consumer.poll(Duration::from_secs(10)) else {
            break;
        };
        let message = message?;
        let key = String::from_utf8_lossy(message.key().unwrap_or_default()).into_owned();
        if key.starts_with(&run) {
            println!(
                "received key={key} partition={} value={}",
                message.partition(),
                String::from_utf8_lossy(message.payload().unwrap_or_default())
            );
            shown += 1;
        }
    }
    Ok(())
}

fn uuid_like() -> String {
    format!(
        "{:x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    )
}
