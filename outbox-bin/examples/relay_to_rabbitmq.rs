//! Relays an outbox table to RabbitMQ: writes a few orders with their events (one transaction each),
//! binds a queue to the exchange, relays, and prints what the queue received.
//!
//! ```sh
//! cargo run -p txoutbox --example relay_to_rabbitmq
//! ```
//! Reads `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database) and `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::sync::Arc;

use lapin::options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use txoutbox_amqp::{AmqpConfig, AmqpPublisher};
use txoutbox_core::{NewEvent, Publisher, Relay, RelayConfig};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let amqp = AmqpConfig {
        url: std::env::var("AMQP_URL").unwrap_or_else(|_| txoutbox_amqp::DEFAULT_URL.into()),
        exchange: "outbox.example".into(),
        ..AmqpConfig::default()
    };

    // The outbox table, and a queue bound to the exchange so the messages have somewhere to go.
    let pool = connect(&database_url, 4).await?;
    let table = OutboxTable::new("outbox_example", "outbox_events")?;
    migrate(&pool, &table).await?;
    let publisher = Arc::new(AmqpPublisher::new(amqp.clone())?);
    publisher.check().await?; // connects and declares the exchange
    let conn =
        lapin::Connection::connect(&amqp.url, lapin::ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            "outbox.example.orders".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            "outbox.example.orders".into(),
            amqp.exchange.clone().into(),
            "order.*".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let store = PostgresStore::new(pool.clone(), table.clone());
    let relay = Relay::new(Arc::new(store), publisher, RelayConfig::default())?;
    let writer = Writer::new(table).with_wake(relay.wake_handle());
    for id in 1..=3 {
        let mut tx = pool.begin().await?;
        // ... the business write goes here, in the same transaction ...
        let event = NewEvent::new(
            "order",
            id.to_string(),
            "order.created",
            serde_json::json!({ "order_id": id }),
        );
        writer.enqueue(&mut tx, event).await?;
        writer.commit(tx).await?;
    }
    let summary = relay.drain().await;
    println!("relayed {} events", summary.published);

    while let Some(msg) = channel
        .basic_get(
            "outbox.example.orders".into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let props = &msg.delivery.properties;
        println!(
            "received {} message_id={} body={}",
            props
                .kind()
                .as_ref()
                .map(|k| k.to_string())
                .unwrap_or_default(),
            props
                .message_id()
                .as_ref()
                .map(|k| k.to_string())
                .unwrap_or_default(),
            String::from_utf8_lossy(&msg.delivery.data)
        );
    }
    Ok(())
}
