//! The client side of the operations endpoint (served by [`txoutbox_postgres::ops::http`]): where
//! a probe on this host reaches it, and one `GET`, for `outbox healthcheck`.

use txoutbox_core::{Error, ErrorKind};

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
