//! Relays an outbox table to an SQS FIFO queue: creates the queue, writes a few orders with their
//! events (one transaction each), relays them, and prints what the queue holds.
//!
//! ```sh
//! AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test cargo run -p txoutbox --example relay_to_sqs
//! ```
//! Reads `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database) and `SQS_ENDPOINT_URL`
//! (default `http://127.0.0.1:4566`, the local emulator).

use std::sync::Arc;

use aws_sdk_sqs::types::QueueAttributeName;
use txoutbox_core::{NewEvent, Relay, RelayConfig};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};
use txoutbox_sqs::{SqsConfig, SqsPublisher};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let endpoint =
        std::env::var("SQS_ENDPOINT_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into());

    let publisher = SqsPublisher::new(SqsConfig {
        queue: "outbox-example-orders.fifo".into(),
        endpoint_url: Some(endpoint),
        ..SqsConfig::default()
    })
    .await?;
    let queue_url = publisher
        .client()
        .create_queue()
        .queue_name("outbox-example-orders.fifo")
        .attributes(QueueAttributeName::FifoQueue, "true")
        .send()
        .await?
        .queue_url()
        .unwrap_or_default()
        .to_string();

    let pool = connect(&database_url, 4).await?;
    let table = OutboxTable::new("outbox_example", "outbox_events")?;
    migrate(&pool, &table).await?;
    let client = publisher.client().clone();
    let store = PostgresStore::new(pool.clone(), table.clone());
    let relay = Relay::new(Arc::new(store), Arc::new(publisher), RelayConfig::default())?;
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
    println!("relayed {} events to {queue_url}", summary.published);

    let out = client
        .receive_message()
        .queue_url(&queue_url)
        .max_number_of_messages(10)
        .message_attribute_names("All")
        .send()
        .await?;
    for m in out.messages() {
        let id = m
            .message_attributes()
            .and_then(|a| a.get("outbox-event-id"))
            .and_then(|v| v.string_value())
            .unwrap_or_default();
        println!("received event {id}: {}", m.body().unwrap_or_default());
        if let Some(h) = m.receipt_handle() {
            client
                .delete_message()
                .queue_url(&queue_url)
                .receipt_handle(h)
                .send()
                .await?;
        }
    }
    Ok(())
}
