//! The operations endpoint: `/metrics` (Prometheus text), `/healthz` (the relay makes progress, see
//! [`crate::health::Liveness`]) and `/readyz` (the database and the broker answer, see
//! [`crate::health::Readiness`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use txoutbox_core::{CancellationToken, Error, ErrorKind};

use crate::health::{ready_text, Liveness, Readiness};
use crate::metrics::Metrics;

/// What the endpoints look at.
#[derive(Clone)]
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

/// The address a probe on this host reaches the endpoint at: `listen` itself, or loopback when it
/// listens on every address (`0.0.0.0`, `::`).
pub fn local_address(listen: std::net::SocketAddr) -> std::net::SocketAddr {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

/// `GET path` from the endpoint at `addr` (HTTP/1.1, `Connection: close`), within `timeout`: the
/// status code and the body (at most 64 KiB of it).
///
/// # Errors
/// [`ErrorKind::Connection`] naming the address when it cannot be reached, does not answer within
/// `timeout`, or answers something that is not HTTP.
pub async fn get_status(
    addr: std::net::SocketAddr,
    path: &str,
    timeout: std::time::Duration,
) -> Result<(u16, String), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fail = |what: String| {
        Error::new(
            ErrorKind::Connection,
            format!("http://{addr}{path}: {what}"),
        )
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| fail(format!("cannot connect ({e}); is the relay running with http.enabled = true and this http.listen?")))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| fail(format!("cannot send the request ({e})")))?;
        let mut response = Vec::new();
        stream
            .take(64 * 1024)
            .read_to_end(&mut response)
            .await
            .map_err(|e| fail(format!("cannot read the answer ({e})")))?;
        Ok::<_, Error>(response)
    };
    let response = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| fail(format!("no answer within {timeout:?}")))??;
    let text = String::from_utf8_lossy(&response);
    let status = text
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| fail("the answer is not HTTP".to_string()))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    Ok((status, body))
}
