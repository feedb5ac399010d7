//! `outbox healthcheck`: asks the running relay's `/healthz`, for container health checks (exit 0
//! when it answers 200, 1 otherwise).

use std::time::Duration;

use super::{usage, Failure};
use crate::config::Config;

pub(super) async fn cmd_healthcheck(
    config: &Config,
    addr: Option<String>,
    timeout: Duration,
) -> Result<(), Failure> {
    let addr = match addr {
        None => crate::http::local_address(config.http.listen),
        Some(given) => tokio::net::lookup_host(&given)
            .await
            .ok()
            .and_then(|found| {
                // localhost: the IPv4 loopback, which the relay's default listen address is.
                let found: Vec<_> = found.collect();
                found
                    .iter()
                    .find(|a| a.is_ipv4())
                    .or(found.first())
                    .copied()
            })
            .ok_or_else(|| {
                usage(format!(
                    "--addr {given}: expected HOST:PORT, such as localhost:9464"
                ))
            })?,
    };
    let (status, body) = crate::http::get_status(addr, "/healthz", timeout).await?;
    if status == 200 {
        println!("healthy: {}", body.trim());
        Ok(())
    } else {
        Err(Failure {
            code: 1,
            message: format!("unhealthy (HTTP {status}): {}", body.trim()),
        })
    }
}
