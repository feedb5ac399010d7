//! Publishers that need no broker client.

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{json, Value};

use crate::error::{Error, ErrorKind};
use crate::event::Event;
use crate::ports::{PublishOutcome, Publisher};

/// The aggregates that failed in a batch: a publisher sends no later event of theirs in the same
/// call (see the `Publisher::publish` contract), so a broker never receives an aggregate out of order.
#[derive(Debug, Default)]
pub struct Fence<'a> {
    failed: HashSet<(&'a str, &'a str)>,
}

impl<'a> Fence<'a> {
    /// No aggregate fenced yet.
    pub fn new() -> Self {
        Fence::default()
    }

    /// True when an earlier event of `event`'s aggregate failed.
    pub fn holds(&self, event: &Event) -> bool {
        self.failed
            .contains(&(event.aggregate_type.as_str(), event.aggregate_id.as_str()))
    }

    /// Records that `event` failed: later events of its aggregate are held back.
    pub fn close(&mut self, event: &'a Event) {
        self.failed
            .insert((event.aggregate_type.as_str(), event.aggregate_id.as_str()));
    }

    /// The retryable error reported for an event held back by the fence.
    pub fn not_sent(adapter: &'static str) -> Error {
        Error::new(
            ErrorKind::Rejected,
            "not sent: an earlier event of the aggregate failed in this batch",
        )
        .with_context("adapter", adapter)
    }
}

/// Turns per-event slots into outcomes; a slot left empty (a publisher bug) becomes a retryable
/// failure rather than a success or a panic.
pub fn finish(outcomes: Vec<Option<PublishOutcome>>) -> Vec<PublishOutcome> {
    outcomes
        .into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                Err(
                    Error::new(ErrorKind::Unexpected, "no outcome recorded for this event")
                        .temporary(),
                )
            })
        })
        .collect()
}

/// Writes each event as one JSON line (to standard output by default): handy for a first run, for
/// piping into other tools, and for debugging routing.
///
/// Each line holds `id`, `aggregate_type`, `aggregate_id`, `event_type`, `content_type`, `headers`,
/// `destination`, `created_at`, `attempt` and `payload`: the JSON document itself for JSON payloads,
/// the text for other UTF-8 payloads, and `payload_hex` for anything else. An event counts as
/// published once its line was written and flushed.
pub struct JsonLinesPublisher {
    out: Arc<Mutex<Box<dyn Write + Send>>>,
    /// Set while a write is under way: a call made meanwhile is back-pressure, not another thread
    /// waiting on the output.
    writing: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for JsonLinesPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonLinesPublisher").finish_non_exhaustive()
    }
}

impl JsonLinesPublisher {
    /// Writes to standard output.
    pub fn stdout() -> Self {
        Self::new(Box::new(std::io::stdout()))
    }

    /// Writes to `out`.
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        JsonLinesPublisher {
            out: Arc::new(Mutex::new(out)),
            writing: Arc::default(),
        }
    }

    /// The JSON line of one event (without the newline).
    pub fn line(event: &Event) -> Value {
        let mut v = json!({
            "id": event.id,
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
            "event_type": event.event_type,
            "content_type": event.content_type,
            "headers": event.headers,
            "destination": event.destination,
            "created_at": event.created_at,
            "attempt": event.attempt(),
        });
        let parsed = if event.is_json() {
            serde_json::from_slice::<Value>(&event.payload).ok()
        } else {
            None
        };
        if let Some(obj) = v.as_object_mut() {
            match (parsed, event.payload_str()) {
                (Some(doc), _) => {
                    obj.insert("payload".into(), doc);
                }
                (None, Some(text)) => {
                    obj.insert("payload".into(), Value::String(text.to_string()));
                }
                (None, None) => {
                    let hex: String = event.payload.iter().map(|b| format!("{b:02x}")).collect();
                    obj.insert("payload_hex".into(), Value::String(hex));
                }
            }
        }
        v
    }
}

#[async_trait]
impl Publisher for JsonLinesPublisher {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        let mut buf = Vec::with_capacity(events.len() * 256);
        for e in events {
            // Serialising a `Value` cannot fail; fall back to an empty object rather than panic.
            let _ = serde_json::to_writer(&mut buf, &Self::line(e));
            buf.push(b'\n');
        }
        // The write blocks while the reader of the output is slow (a full pipe): it runs on a
        // blocking thread, never on the runtime's, so the relay's timers, health endpoints and
        // shutdown keep working meanwhile.
        use std::sync::atomic::Ordering;
        if self.writing.swap(true, Ordering::SeqCst) {
            let e = Error::new(
                ErrorKind::Backpressure,
                "the previous write to the output has not finished (its reader is slow)",
            )
            .with_context("adapter", "stdout");
            return vec![Err(e); events.len()];
        }
        let (out, writing) = (self.out.clone(), self.writing.clone());
        let write = move || {
            let result = match out.lock() {
                Ok(mut out) => out.write_all(&buf).and_then(|_| out.flush()),
                Err(_) => Err(std::io::Error::other("output lock poisoned")),
            };
            writing.store(false, Ordering::SeqCst);
            result
        };
        let result = match tokio::task::spawn_blocking(write).await {
            Ok(result) => result,
            Err(e) => Err(std::io::Error::other(format!(
                "the writing thread failed: {e}"
            ))),
        };
        match result {
            Ok(()) => vec![Ok(()); events.len()],
            Err(e) => {
                let err = Error::new(ErrorKind::Connection, "writing JSON lines failed")
                    .with_context("adapter", "stdout")
                    .with_source(e);
                vec![Err(err); events.len()]
            }
        }
    }

    async fn check(&self) -> Result<(), Error> {
        Ok(())
    }

    fn name(&self) -> &str {
        "stdout"
    }

    /// A call is written with one `write_all`: it succeeds or fails as a whole.
    fn keeps_order(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn ev(payload: &[u8], ct: &str) -> Event {
        Event {
            id: uuid::Uuid::now_v7(),
            aggregate_type: "order".into(),
            aggregate_id: "1".into(),
            event_type: "order.created".into(),
            payload: payload.to_vec(),
            content_type: ct.into(),
            headers: BTreeMap::from([("traceparent".to_string(), "00-x".to_string())]),
            destination: None,
            created_at: chrono::Utc::now(),
            attempts: 0,
        }
    }

    #[tokio::test]
    async fn writes_one_line_per_event() {
        let sink = Shared::default();
        let p = JsonLinesPublisher::new(Box::new(sink.clone()));
        let events = vec![
            ev(br#"{"total":3}"#, "application/json"),
            ev(b"plain", "text/plain"),
            ev(&[0xff, 0x00], "application/octet-stream"),
        ];
        let out = p.publish(&events).await;
        assert!(out.iter().all(|o| o.is_ok()));
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0]["payload"], json!({"total": 3}));
        assert_eq!(lines[0]["id"], json!(events[0].id));
        assert_eq!(lines[0]["headers"]["traceparent"], json!("00-x"));
        assert_eq!(lines[1]["payload"], json!("plain"));
        assert_eq!(lines[2]["payload_hex"], json!("ff00"));
    }
}
