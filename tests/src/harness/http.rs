//! Plain HTTP reads of a relay's endpoints (`/readyz`, `/metrics`).

use std::time::Duration;

/// `GET http://<addr><path>`: the status code, or `None` when nothing answered within 5 s.
pub fn http_status(addr: &str, path: &str) -> Option<u16> {
    http_get(addr, path).map(|(status, _)| status)
}

/// `GET http://<addr><path>`: the status code and the body, or `None` when nothing answered
/// within 5 s.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Some((status, body))
}

/// The value of the sample `name` (a whole sample name, labels included when it has some) in a
/// Prometheus text exposition, or `None` when it has no such sample.
pub fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok()).flatten()
    })
}
