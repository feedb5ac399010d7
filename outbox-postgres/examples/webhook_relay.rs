//! A custom relay composed from the crates, without the `outbox` binary: its own `Publisher` that
//! POSTs each event as JSON to a webhook, over the PostgreSQL store.
//!
//! ```sh
//! cargo run -p txoutbox-postgres --example webhook_relay
//! ```
//! Environment: `DATABASE_URL` (default `txoutbox_postgres::DEFAULT_DATABASE_URL`, the local server's `postgres` database), `WEBHOOK_URL`
//! (default: a receiver this example starts on 127.0.0.1, which prints what it gets), `EVENTS`
//! (how many demo events to write first, default 5), `OUTBOX_SCHEMA` (default `outbox_webhook`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use axum::routing::post;
use axum::Router;
use futures_core::future::BoxFuture;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use txoutbox_core::publishers::JsonLinesPublisher;
use txoutbox_core::{
    Error, ErrorKind, Event, NewEvent, PublishOutcome, Publisher, Relay, RelayConfig,
};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore, Writer};

/// POSTs each event to `url`; 2xx = published, 408/429/5xx = retryable, other 4xx = permanent.
struct WebhookPublisher {
    url: hyper::Uri,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl WebhookPublisher {
    fn post(&self, event: &Event) -> BoxFuture<'_, PublishOutcome> {
        let body = JsonLinesPublisher::line(event).to_string();
        let request = hyper::Request::post(self.url.clone())
            .header("content-type", "application/json")
            .header("idempotency-key", event.id.to_string())
            .body(Full::new(Bytes::from(body)));
        Box::pin(async move {
            let request = request.map_err(|e| {
                Error::new(ErrorKind::InvalidInput, "cannot build the request").with_source(e)
            })?;
            let response = self.client.request(request).await.map_err(|e| {
                Error::new(ErrorKind::Connection, "webhook unreachable").with_source(e)
            })?;
            let status = response.status();
            match status.as_u16() {
                200..=299 => Ok(()),
                408 | 429 | 500..=599 => Err(Error::new(
                    ErrorKind::Rejected,
                    format!("webhook answered {status}"),
                )),
                _ => Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!("webhook answered {status}"),
                )
                .permanent()),
            }
        })
    }
}

#[async_trait]
impl Publisher for WebhookPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        // Concurrent requests, one outcome per event, in input order. They never race within an
        // aggregate: this publisher's `keeps_order` is false (the default), so the relay puts at
        // most one event of an aggregate in a call and sends the next once this one succeeded.
        futures::future::join_all(events.iter().map(|e| self.post(e))).await
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }

    fn name(&self) -> &str {
        "webhook"
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| txoutbox_postgres::DEFAULT_DATABASE_URL.into());
    let events: usize = std::env::var("EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let schema = std::env::var("OUTBOX_SCHEMA").unwrap_or_else(|_| "outbox_webhook".into());

    // The webhook: the one given, or a local receiver that counts and prints.
    let received = Arc::new(AtomicUsize::new(0));
    let url = match std::env::var("WEBHOOK_URL") {
        Ok(u) => u,
        Err(_) => {
            let counter = received.clone();
            let app = Router::new().route(
                "/hook",
                post(move |body: String| {
                    let counter = counter.clone();
                    async move {
                        counter.fetch_add(1, Ordering::SeqCst);
                        println!("webhook received {body}");
                        "ok"
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            tokio::spawn(async move { axum::serve(listener, app).await });
            format!("http://{addr}/hook")
        }
    };

    let pool = connect(&database_url, 4).await?;
    let table = OutboxTable::new(&schema, "outbox_events")?;
    migrate(&pool, &table).await?;
    let writer = Writer::new(table.clone());
    for i in 0..events {
        let mut tx = pool.begin().await?;
        writer
            .enqueue(
                &mut tx,
                NewEvent::new(
                    "order",
                    format!("o-{i}"),
                    "order.created",
                    serde_json::json!({ "n": i }),
                ),
            )
            .await?;
        writer.commit(tx).await?;
    }

    let publisher = WebhookPublisher {
        url: url.parse()?,
        client: Client::builder(TokioExecutor::new()).build_http(),
    };
    let store = PostgresStore::new(pool, table);
    let relay = Relay::new(Arc::new(store), Arc::new(publisher), RelayConfig::default())?;
    let summary = relay.drain().await;
    println!(
        "relayed {} events to {url} ({} retried, {} dead-lettered)",
        summary.published, summary.retried, summary.dead_lettered
    );
    Ok(())
}
