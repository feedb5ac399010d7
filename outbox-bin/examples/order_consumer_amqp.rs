//! A RabbitMQ consumer that handles `order.created` idempotently through the inbox: each delivery's
//! event id (its `message_id`) is recorded in `processed_events` in the same transaction as the
//! handler's write, so a redelivered message is acknowledged without being handled twice.
//!
//! ```sh
//! cargo run -p txoutbox --example order_consumer_amqp
//! ```
//! Environment: `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database), `AMQP_URL`,
//! `EXCHANGE` (default `outbox.events`), `QUEUE` (default `shipping.order-created`), `SCHEMA` (default
//! `shipping`), `MAX_MESSAGES` (stop after that many deliveries; default: run until Ctrl-C).

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use txoutbox_postgres::{connect, Inbox, OutboxTable, Processed};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let database_url = env("DATABASE_URL", txoutbox_postgres::DEFAULT_DATABASE_URL);
    let amqp_url = env("AMQP_URL", txoutbox_amqp::DEFAULT_URL);
    let exchange = env("EXCHANGE", txoutbox_amqp::DEFAULT_EXCHANGE);
    let queue = env("QUEUE", "shipping.order-created");
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

    let conn = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .exchange_declare(
            exchange.clone().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            queue.clone().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.clone().into(),
            exchange.into(),
            "order.created".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "order-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("consuming order.created");

    let mut seen = 0;
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        let Some(event_id) = txoutbox_amqp::event_id(&delivery.properties) else {
            eprintln!("message without an event id: rejected");
            delivery
                .nack(BasicNackOptions {
                    requeue: false,
                    ..Default::default()
                })
                .await?;
            continue;
        };
        let payload: serde_json::Value = serde_json::from_slice(&delivery.data).unwrap_or_default();
        let order_id = payload["order_id"].as_i64().unwrap_or_default();
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
            Ok(Processed::Done(())) => {
                println!("shipment created for order {order_id} (event {event_id})");
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Ok(Processed::Duplicate) => {
                println!("duplicate event {event_id} acknowledged without handling");
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Err(e) => {
                eprintln!("event {event_id} failed, requeued: {e}");
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await?;
            }
        }
        seen += 1;
        if max.is_some_and(|m| seen >= m) {
            break;
        }
    }
    Ok(())
}
