//! Writes orders and their `order.created` events in one transaction each, then relays the events to
//! standard output as JSON lines.
//!
//! ```sh
//! cargo run -p txoutbox-postgres --example orders_to_stdout            # 5 orders
//! ORDERS=100 cargo run -p txoutbox-postgres --example orders_to_stdout
//! ```
//! Reads `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database).

use std::sync::Arc;

use txoutbox_core::publishers::JsonLinesPublisher;
use txoutbox_core::{NewEvent, Relay, RelayConfig};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let orders: i64 = std::env::var("ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);

    let pool = connect(&url, 8).await?;
    let table = OutboxTable::default();
    migrate(&pool, &table).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            customer_id text NOT NULL,
            total_cents bigint NOT NULL,
            created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;

    let store = PostgresStore::new(pool.clone(), table.clone());
    let relay = Relay::new(
        Arc::new(store),
        Arc::new(JsonLinesPublisher::stdout()),
        RelayConfig::default(),
    )?;
    let writer = Writer::new(table).with_wake(relay.wake_handle());

    for i in 0..orders {
        // The business row and its event commit together, or not at all.
        let mut tx = pool.begin().await?;
        let customer = format!("customer-{}", i % 3);
        let total = 1_000 + i * 250;
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO orders (customer_id, total_cents) VALUES ($1, $2) RETURNING id",
        )
        .bind(&customer)
        .bind(total)
        .fetch_one(&mut *tx)
        .await?;
        let event = NewEvent::new(
            "order",
            id.to_string(),
            "order.created",
            serde_json::json!({ "order_id": id, "customer_id": customer, "total_cents": total }),
        );
        writer.enqueue(&mut tx, event).await?;
        writer.commit(tx).await?;
    }

    let summary = relay.drain().await;
    eprintln!(
        "wrote {orders} orders; relayed {} events ({} retried, {} dead-lettered)",
        summary.published, summary.retried, summary.dead_lettered
    );
    Ok(())
}
