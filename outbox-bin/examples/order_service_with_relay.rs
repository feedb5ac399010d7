//! An order service that runs its own relay to RabbitMQ, in the same process: `POST /orders` writes
//! the order and its `order.created` event in one transaction; the relay publishes the event to the
//! exchange; `/metrics`, `/healthz` and `/readyz` are the `outbox` binary's (the shipped alert rules
//! and dashboard work unchanged). SIGTERM or Ctrl-C stops it cleanly: the HTTP server stops taking
//! requests and finishes those in progress, then the relay publishes and settles its batches in
//! flight, then the process exits.
//!
//! ```sh
//! cargo run -p txoutbox --example order_service_with_relay
//! curl -X POST 127.0.0.1:8080/orders -H 'content-type: application/json' -d '{"customer_id":"c-1","total_cents":1250}'
//! curl 127.0.0.1:8080/metrics
//! ```
//! Environment: `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`), `AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `AMQP_EXCHANGE` (default `outbox.events`),
//! `LISTEN` (default `127.0.0.1:8080`), `OUTBOX_SCHEMA` (default `public`), and
//! `KEEP_PROCESSED_FOR_SECS` (unset: published rows are deleted; set: they are kept that long, and
//! the relay removes them itself).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use txoutbox_amqp::{AmqpConfig, AmqpPublisher};
use txoutbox_core::{CancellationToken, NewEvent, RelayConfig};
use txoutbox_postgres::ops::{BuildInfo, CleanupSchedule, OpsConfig, RelayService};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Retention, Writer};

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
    // Commits, then wakes the relay: the event is claimed at once, not at the next poll.
    app.writer.commit(tx).await.map_err(|e| fail(&e))?;
    Ok((StatusCode::CREATED, Json(Created { order_id, event_id })))
}

/// Resolves on SIGTERM (what Kubernetes and systemd send) or Ctrl-C. The handlers are installed
/// when it is called, before the service says it listens.
fn stop_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        #[cfg(unix)]
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let schema = std::env::var("OUTBOX_SCHEMA").unwrap_or_else(|_| "public".into());
    let keep: Option<Duration> = match std::env::var("KEEP_PROCESSED_FOR_SECS") {
        Ok(s) => Some(
            s.parse::<f64>()
                .ok()
                .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    format!("KEEP_PROCESSED_FOR_SECS = {s:?} is not a positive number of seconds")
                })?,
        ),
        Err(_) => None,
    };
    let amqp = AmqpConfig {
        url: std::env::var("AMQP_URL").unwrap_or_else(|_| txoutbox_amqp::DEFAULT_URL.into()),
        exchange: std::env::var("AMQP_EXCHANGE").unwrap_or_else(|_| "outbox.events".into()),
        ..AmqpConfig::default()
    };

    // The handlers' pool, the outbox table and the business table.
    let pool = connect(&url, 8).await?;
    let table = OutboxTable::new(&schema, "outbox_events")?;
    migrate(&pool, &table).await?;
    let orders: Arc<str> = format!("\"{schema}\".orders").into();
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer_id text NOT NULL, total_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"
    ))
    .execute(&pool)
    .await?;

    // The relay: a pool of its own, sized for it, so requests never wait behind batches in flight.
    let relay_config = RelayConfig::default();
    let ops = OpsConfig {
        cleanup: keep.map(CleanupSchedule::keeping),
        build: BuildInfo {
            version: env!("CARGO_PKG_VERSION").into(),
            commit: "unknown".into(),
            adapters: "amqp".into(),
        },
        ..OpsConfig::default()
    };
    let relay_pool = connect(&url, RelayService::connections_needed(&relay_config, &ops)).await?;
    let retention = if keep.is_some() {
        Retention::Keep
    } else {
        Retention::Delete
    };
    let store = PostgresStore::with_retention(relay_pool, table.clone(), retention);
    let publisher = Arc::new(AmqpPublisher::new(amqp)?);
    let relay = RelayService::polling(store, publisher, relay_config, ops)?;

    let app = App {
        pool,
        writer: Writer::new(table).with_wake(relay.wake_handle()),
        orders,
    };
    let router = Router::new()
        .route("/orders", post(create_order))
        .with_state(app)
        .merge(relay.router());

    // Bound first: a port taken stops the service before its relay claims anything.
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    let signal = stop_signal()?;
    let stop_relay = CancellationToken::new();
    let relay = tokio::spawn(relay.run(stop_relay.clone()));
    println!("order service listening on {listen}");
    // On SIGTERM the server stops taking requests and finishes those in progress; then the relay
    // stops, publishing and settling its batches in flight before `run` returns. Events committed
    // meanwhile wait in the outbox for the next start.
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(signal)
        .await;
    stop_relay.cancel();
    let summary = relay.await?;
    println!(
        "stopped: {} events published, {} dead-lettered, {} batches aborted",
        summary.published, summary.dead_lettered, summary.aborted_batches
    );
    served?;
    Ok(())
}
