//! The operations endpoint: `/metrics` (Prometheus text), `/healthz` (the process is alive) and
//! `/readyz` (the database and the broker answer).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use outbox_core::{CancellationToken, Error, ErrorKind, Publisher, Store};

use crate::metrics::Metrics;

/// What the endpoints look at.
#[derive(Clone)]
pub struct Ops {
    /// The metrics rendered by `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Checked by `/readyz`.
    pub store: Arc<dyn Store>,
    /// Checked by `/readyz`.
    pub publisher: Arc<dyn Publisher>,
    /// Time each readiness check may take.
    pub ready_timeout: Duration,
}

async fn metrics(State(ops): State<Ops>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        ops.metrics.render(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn check<F: std::future::Future<Output = Result<(), Error>>>(
    what: &str,
    timeout: Duration,
    f: F,
) -> Result<(), String> {
    match tokio::time::timeout(timeout, f).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!(
            "{what}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}

async fn readyz(State(ops): State<Ops>) -> impl IntoResponse {
    let (db, broker) = tokio::join!(
        check("database", ops.ready_timeout, ops.store.check()),
        check("broker", ops.ready_timeout, ops.publisher.check()),
    );
    let problems: Vec<String> = [db, broker].into_iter().filter_map(Result::err).collect();
    if problems.is_empty() {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{}\n", problems.join("\n")),
        )
    }
}

/// The router of the endpoints.
pub fn router(ops: Ops) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(ops)
}

/// Binds `listen` now (so a taken port fails at start-up) and returns the server future, which runs
/// until `shutdown`.
///
/// # Errors
/// A config error naming the address when it cannot be bound.
pub async fn serve(
    listen: std::net::SocketAddr,
    ops: Ops,
    shutdown: CancellationToken,
) -> Result<impl std::future::Future<Output = ()>, Error> {
    let listener = TcpListener::bind(listen).await.map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("http.listen = {listen}: cannot listen there ({e}); choose a free address or set http.enabled = false"),
        )
    })?;
    let app = router(ops);
    Ok(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    })
}
