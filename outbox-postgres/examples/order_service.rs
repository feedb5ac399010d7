//! An HTTP order service (axum) that writes each order and its `order.created` event in one
//! transaction. A relay (`outbox relay`, or the library) publishes the events.
//!
//! ```sh
//! cargo run -p txoutbox-postgres --example order_service
//! curl -X POST 127.0.0.1:8080/orders -H 'content-type: application/json' -d '{"customer_id":"c-1","total_cents":1250}'
//! ```
//! Environment: `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database), `LISTEN` (default
//! `127.0.0.1:8080`), `OUTBOX_SCHEMA` (default `public`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use txoutbox_core::NewEvent;
use txoutbox_postgres::{connect, migrate, OutboxTable, Writer};

#[derive(Clone)]
struct App {
    pool: PgPool,
    writer: Writer,
    orders: Arc<str>,
}

#[derive(Deserialize)]
struct NewOrder {
    customer_id: String,
    total_cents: i64,
}

#[derive(Serialize)]
struct Created {
    order_id: i64,
    event_id: txoutbox_core::Uuid,
}

async fn create_order(
    State(app): State<App>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<Created>), (StatusCode, String)> {
    let fail = |e: &dyn std::fmt::Display| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    if order.total_cents <= 0 {
        return Err((
            StatusCode::UNPROCESSABLE_ENTITY,
            "total_cents must be positive".into(),
        ));
    }
    // The order and its event commit together, or not at all.
    let mut tx = app.pool.begin().await.map_err(|e| fail(&e))?;
    let (order_id,): (i64,) = sqlx::query_as(&format!(
        "INSERT INTO {} (customer_id, total_cents) VALUES ($1, $2) RETURNING id",
        app.orders
    ))
    .bind(&order.customer_id)
    .bind(order.total_cents)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| fail(&e))?;
    let event = NewEvent::new(
        "order",
        order_id.to_string(),
        "order.created",
        serde_json::json!({ "order_id": order_id, "customer_id": order.customer_id, "total_cents": order.total_cents }),
    );
    let event_id = app
        .writer
        .enqueue(&mut tx, event)
        .await
        .map_err(|e| fail(&e))?;
    app.writer.commit(tx).await.map_err(|e| fail(&e))?;
    Ok((StatusCode::CREATED, Json(Created { order_id, event_id })))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let schema = std::env::var("OUTBOX_SCHEMA").unwrap_or_else(|_| "public".into());
    let pool = connect(&url, 8).await?;
    let table = OutboxTable::new(&schema, "outbox_events")?;
    migrate(&pool, &table).await?;
    let orders: Arc<str> = format!("\"{schema}\".orders").into();
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer_id text NOT NULL, total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
    ))
    .execute(&pool)
    .await?;
    let app = App {
        pool,
        writer: Writer::new(table),
        orders,
    };
    let router = Router::new()
        .route("/orders", post(create_order))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("order service listening on {listen}");
    axum::serve(listener, router).await?;
    Ok(())
}
