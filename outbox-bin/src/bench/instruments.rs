//! What the runs that start relays share: the observer counting settled events and timing each
//! step of a batch ([`Counter`]), the wait for a run to settle, the publisher wrapper that adds a
//! delay or records acknowledgements ([`Wrapped`]), and joining a run's tasks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use uuid::Uuid;

use txoutbox_core::{
    BatchReport, Error, ErrorKind, Event, PublishOutcome, Publisher, RelayObserver,
};

use super::report::{percentile, ratio, StageFigures};

pub(super) async fn join<T>(t: tokio::task::JoinHandle<T>) -> Result<T, Error> {
    t.await.map_err(|e| {
        Error::new(
            ErrorKind::Unexpected,
            format!("a benchmark task failed: {e}"),
        )
        .with_source(e)
    })
}

/// Counts settled events across the relays of a run.
#[derive(Default)]
pub(super) struct Counter {
    published: AtomicU64,
    dead_lettered: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Durations of the claims that returned events, in ms.
    claims_ms: Mutex<Vec<f64>>,
    /// Per settled batch: events, publish ms, settle ms.
    batches: Mutex<Vec<(usize, f64, f64)>>,
}

impl RelayObserver for Counter {
    fn claimed(&self, count: usize, duration: Duration) {
        if count > 0 {
            if let Ok(mut c) = self.claims_ms.lock() {
                c.push(duration.as_secs_f64() * 1000.0);
            }
        }
    }

    fn event_failed(&self, _event: &Event, error: &Error, _d: txoutbox_core::FailureDecision) {
        if let Ok(mut e) = self.last_error.lock() {
            *e = Some(error.to_string());
        }
    }

    fn batch_settled(&self, report: &BatchReport) {
        if let Ok(mut b) = self.batches.lock() {
            b.push((
                report.claimed,
                report.publish_duration.as_secs_f64() * 1000.0,
                report.settle_duration.as_secs_f64() * 1000.0,
            ));
        }
        if report.settle_error.is_none() {
            self.published
                .fetch_add(report.published as u64, Ordering::Relaxed);
            self.dead_lettered
                .fetch_add(report.dead_lettered as u64, Ordering::Relaxed);
        }
    }
}

impl Counter {
    /// Where the relay's time went: claim, publish and settle medians and 99th percentiles.
    pub(super) fn stages(&self) -> StageFigures {
        let mut claims = self.claims_ms.lock().map(|c| c.clone()).unwrap_or_default();
        let batches = self.batches.lock().map(|b| b.clone()).unwrap_or_default();
        let mut publish: Vec<f64> = batches.iter().map(|b| b.1).collect();
        let mut settle: Vec<f64> = batches.iter().map(|b| b.2).collect();
        for v in [&mut claims, &mut publish, &mut settle] {
            v.sort_by(f64::total_cmp);
        }
        let events: usize = batches.iter().map(|b| b.0).sum();
        StageFigures {
            batches: batches.len(),
            mean_batch_events: ratio(events as f64, batches.len() as f64).unwrap_or(0.0),
            claim_p50_ms: percentile(&claims, 50.0),
            claim_p99_ms: percentile(&claims, 99.0),
            publish_p50_ms: percentile(&publish, 50.0),
            publish_p99_ms: percentile(&publish, 99.0),
            settle_p50_ms: percentile(&settle, 50.0),
            settle_p99_ms: percentile(&settle, 99.0),
        }
    }

    fn last_error(&self) -> String {
        self.last_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_else(|| "no error recorded".into())
    }
}

/// Waits until `events` were published; fails on a dead letter or when nothing moves for 60 s.
pub(super) async fn wait_for_settled(
    counter: &Counter,
    events: u64,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(), Error> {
    let mut last = (0, Instant::now());
    let mut last_report = Instant::now();
    loop {
        let published = counter.published.load(Ordering::Relaxed);
        let dead = counter.dead_lettered.load(Ordering::Relaxed);
        if dead > 0 {
            return Err(Error::new(
                ErrorKind::Unexpected,
                format!(
                    "{dead} events were dead-lettered during the benchmark (last error: {}); check the publisher's destination",
                    counter.last_error()
                ),
            ));
        }
        if published >= events {
            return Ok(());
        }
        if published != last.0 {
            last = (published, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "no progress for 60 s at {published} of {events} events (last error: {})",
                    counter.last_error()
                ),
            ));
        }
        if last_report.elapsed() >= Duration::from_secs(2) {
            progress(&format!("  {published} / {events}"));
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `publisher`, each call of which takes `delay` more (none when zero).
pub(super) fn delayed(publisher: Arc<dyn Publisher>, delay: Duration) -> Arc<dyn Publisher> {
    if delay.is_zero() {
        publisher
    } else {
        Arc::new(Wrapped {
            inner: publisher,
            delay,
            acks: None,
        })
    }
}

/// The target's publisher as a benchmark run uses it: each call takes `delay` more
/// (`--publish-delay`), and the time of each acknowledgement is kept when `acks` is set.
pub(super) struct Wrapped {
    pub(super) inner: Arc<dyn Publisher>,
    pub(super) delay: Duration,
    pub(super) acks: Option<Mutex<Vec<(Uuid, Instant)>>>,
}

#[async_trait]
impl Publisher for Wrapped {
    async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let outcomes = self.inner.publish(events).await;
        if let Some(Ok(mut acks)) = self.acks.as_ref().map(Mutex::lock) {
            let now = Instant::now();
            for (e, o) in events.iter().zip(&outcomes) {
                if o.is_ok() {
                    acks.push((e.id, now));
                }
            }
        }
        outcomes
    }

    async fn check(&self) -> Result<(), Error> {
        self.inner.check().await
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn keeps_order(&self) -> bool {
        self.inner.keeps_order()
    }

    fn same_call(&self, earlier: &Event, later: &Event) -> bool {
        self.inner.same_call(earlier, later)
    }

    fn call_limit(&self) -> Option<txoutbox_core::CallLimit> {
        self.inner.call_limit()
    }
}
