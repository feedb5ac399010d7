//! The operations endpoint: `/metrics` (Prometheus text), `/healthz` (the relay makes progress, see
//! [`Liveness`]) and `/readyz` (the database and the broker answer, see [`Readiness`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use txoutbox_core::{CancellationToken, Error, ErrorKind};

use super::health::{ready_text, Liveness, Readiness};
use super::metrics::Metrics;

/// What the endpoints look at ([`RelayService::ops`](super::RelayService::ops)).
#[derive(Clone, Debug)]
pub struct Ops {
    /// The metrics rendered by `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Judged by `/healthz`.
    pub liveness: Arc<Liveness>,
    /// Checked by `/readyz`.
    pub readiness: Arc<Readiness>,
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

async fn healthz(State(ops): State<Ops>) -> impl IntoResponse {
    match ops.liveness.verdict_at(tokio::time::Instant::now()) {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("stalled: {why}\n")),
    }
}

async fn readyz(State(ops): State<Ops>) -> impl IntoResponse {
    let problems = ops.readiness.check().await;
    let status = if problems.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, ready_text(&problems))
}

/// The router of the endpoints: `GET /metrics`, `/healthz` and `/readyz`. Merge it into a
/// service's own router, or serve it on a port of its own with [`serve`].
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
/// A configuration error naming the address when it cannot be bound.
pub async fn serve(
    listen: std::net::SocketAddr,
    ops: Ops,
    shutdown: CancellationToken,
) -> Result<impl std::future::Future<Output = ()>, Error> {
    let listener = TcpListener::bind(listen).await.map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("cannot listen on {listen} ({e}): choose a free address"),
        )
    })?;
    let app = router(ops);
    Ok(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await;
    })
}
