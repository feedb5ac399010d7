//! The run loop: claims batches while the broker is reachable (one event as a probe while it is
//! not), hands each to a task that publishes and settles it, and on shutdown lets those tasks
//! finish until the deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn, Instrument};

use super::decide::decide;
use super::observer::{BatchReport, RelaySummary};
use super::outage::broker_unreachable;
use super::publish::publish_in_calls;
use super::{Relay, Shared};
use crate::ports::{Action, Batch, ClaimRequest, PublishOutcome, Settlement};

impl Relay {
    /// Runs until `shutdown` is cancelled, then shuts down gracefully (see the module docs).
    pub async fn run(&self, shutdown: CancellationToken) -> RelaySummary {
        self.run_inner(shutdown, false).await
    }

    /// Publishes until no event is publishable (the outbox is empty, or what is left is backing off,
    /// held back or dead), then returns. For tests, benchmarks and one-shot jobs. Events a
    /// publisher pushes back on are still publishable: a drain waits for it as long as it does.
    pub async fn drain(&self) -> RelaySummary {
        self.run_inner(CancellationToken::new(), true).await
    }

    async fn pause(&self, d: Duration, shutdown: &CancellationToken) {
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = self.wake.notified() => {}
            _ = shutdown.cancelled() => {}
        }
    }

    /// With the broker found unreachable: waits a pause (the retry policy's `initial_backoff`,
    /// doubling while the broker stays unreachable, up to its `max_backoff`; between 100 ms and 10 s),
    /// then checks the publisher (its readiness check). Returns whether the check passed; when it did
    /// not, the caller claims one event as a probe (a check can fail where publishing works, e.g. a
    /// role allowed to send but not to read queue attributes).
    async fn wait_for_broker(&self, shutdown: &CancellationToken) -> bool {
        let cfg = &self.shared.config;
        let publisher = &self.shared.publisher;
        let outage = &self.shared.outage;
        tokio::select! {
            _ = tokio::time::sleep(outage.pause()) => {}
            _ = shutdown.cancelled() => return false,
        }
        let checked = tokio::select! {
            r = tokio::time::timeout(cfg.publish_timeout, publisher.check()) => r,
            _ = shutdown.cancelled() => return false,
        };
        let next = outage.lengthen_pause(&cfg.retry);
        self.shared
            .observer
            .broker_checked(matches!(checked, Ok(Ok(()))));
        let error = match checked {
            Ok(Ok(())) => {
                info!(
                    publisher = publisher.name(),
                    "the broker answers its readiness check; claiming resumes"
                );
                outage.checked_up();
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "the readiness check took longer than relay.publish_timeout".to_string(),
        };
        if outage.warning_due() {
            warn!(
                publisher = publisher.name(),
                error = %error,
                check_every_ms = next.as_millis() as u64,
                "the broker is still unreachable; probing it with one event at a time"
            );
        } else {
            debug!(error = %error, retry_in_ms = next.as_millis() as u64, "the broker is still unreachable");
        }
        false
    }

    async fn run_inner(&self, shutdown: CancellationToken, until_idle: bool) -> RelaySummary {
        let cfg = &self.shared.config;
        let request = cfg.claim_request(self.shared.publisher.as_ref());
        let permits = Arc::new(Semaphore::new(cfg.max_in_flight));
        let mut tasks: JoinSet<()> = JoinSet::new();
        let mut idle_pause = cfg.min_poll_interval;
        let mut store_pause = Duration::from_millis(100);
        info!(
            publisher = self.shared.publisher.name(),
            batch_size = cfg.batch_size,
            max_in_flight = cfg.max_in_flight,
            ordering = cfg.ordering.as_str(),
            "relay started"
        );
        loop {
            while let Some(done) = tasks.try_join_next() {
                report_join(done);
            }
            if shutdown.is_cancelled() {
                break;
            }
            // While the broker is unreachable: a pause and a readiness check each round; while the
            // check fails, one event goes as a probe instead of a batch.
            let mut probe = false;
            if !until_idle && self.shared.outage.is_down() {
                probe = !self.wait_for_broker(&shutdown).await;
                if shutdown.is_cancelled() {
                    break;
                }
            }
            // After back-pressure: a pause before the next claim (a wake-up does not end it).
            if let Some(pause) = self.shared.pressure.remaining() {
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = shutdown.cancelled() => break,
                }
                continue;
            }
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = shutdown.cancelled() => break,
            };
            // A batch in flight may have found the broker unreachable, or met back-pressure, while
            // this one waited.
            if (!until_idle && !probe && self.shared.outage.is_down())
                || self.shared.pressure.remaining().is_some()
            {
                drop(permit);
                continue;
            }
            let started = Instant::now();
            let this_request = if probe {
                ClaimRequest {
                    limit: 1,
                    probe: true,
                    ..request
                }
            } else {
                request
            };
            let claimed = tokio::select! {
                r = self.shared.store.claim(this_request) => r,
                _ = shutdown.cancelled() => break,
            };
            match claimed {
                Err(e) => {
                    drop(permit);
                    self.shared.observer.store_error("claim", &e);
                    warn!(error = %e, retry_in_ms = store_pause.as_millis() as u64, "claim failed; retrying");
                    self.pause(store_pause, &shutdown).await;
                    store_pause = (store_pause * 2).min(cfg.store_retry_max_backoff);
                }
                Ok(batch) if batch.events.is_empty() => {
                    drop(permit);
                    store_pause = Duration::from_millis(100);
                    self.shared.observer.claimed(0, started.elapsed());
                    if let Err(e) = batch.lease.release().await {
                        debug!(error = %e, "releasing an empty claim failed");
                    }
                    if until_idle {
                        if tasks.is_empty() {
                            break;
                        }
                        while let Some(done) = tasks.join_next().await {
                            report_join(done);
                        }
                        continue;
                    }
                    self.pause(idle_pause, &shutdown).await;
                    idle_pause = (idle_pause * 2).min(cfg.poll_interval);
                }
                Ok(batch) => {
                    store_pause = Duration::from_millis(100);
                    idle_pause = cfg.min_poll_interval;
                    let full = batch.events.len() >= cfg.batch_size;
                    self.shared
                        .observer
                        .claimed(batch.events.len(), started.elapsed());
                    let shared = self.shared.clone();
                    let span = tracing::debug_span!("outbox.batch", size = batch.events.len());
                    tasks.spawn(process_batch(shared, batch, permit, probe).instrument(span));
                    if !full && !until_idle {
                        self.pause(cfg.min_poll_interval, &shutdown).await;
                    }
                }
            }
        }
        let aborted = self.finish(tasks).await;
        let summary = self.shared.totals.summary(aborted);
        info!(
            published = summary.published,
            retried = summary.retried,
            dead_lettered = summary.dead_lettered,
            aborted_batches = summary.aborted_batches,
            "relay stopped"
        );
        summary
    }

    /// Lets in-flight batches finish until the shutdown deadline, then aborts the rest.
    async fn finish(&self, mut tasks: JoinSet<()>) -> u64 {
        if tasks.is_empty() {
            return 0;
        }
        let deadline = Instant::now() + self.shared.config.shutdown_timeout;
        info!(in_flight = tasks.len(), "finishing in-flight batches");
        loop {
            tokio::select! {
                next = tasks.join_next() => match next {
                    Some(done) => report_join(done),
                    None => return 0,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let aborted = tasks.len() as u64;
                    warn!(aborted_batches = aborted, "shutdown deadline reached; releasing the batches still in flight");
                    tasks.abort_all();
                    while tasks.join_next().await.is_some() {}
                    return aborted;
                }
            }
        }
    }
}

fn report_join(result: Result<(), tokio::task::JoinError>) {
    if let Err(e) = result {
        if e.is_panic() {
            error!(error = %e, "a batch task panicked; its events were released and will be published again");
        }
    }
}

/// Publishes and settles one batch. A `probe` (one event sent while the broker is unreachable) that
/// finds the broker still unreachable is put back without counting an attempt (the outage is not the
/// event's fault, and probing must not use up its attempts), behind a delay, so that the next probe
/// takes another event.
async fn process_batch(
    shared: Arc<Shared>,
    batch: Batch,
    permit: OwnedSemaphorePermit,
    probe: bool,
) {
    let Batch { events, lease } = batch;
    let cfg = &shared.config;
    let started = Instant::now();
    let publish_span = tracing::info_span!(
        "outbox.publish",
        publisher = shared.publisher.name(),
        events = events.len()
    );
    #[cfg(feature = "opentelemetry")]
    crate::trace::link_events(&publish_span, &events);
    let (events, outcomes) = publish_in_calls(&shared, events)
        .instrument(publish_span)
        .await;
    let publish_duration = started.elapsed();
    let unreachable = note_broker_state(&shared, &outcomes, started);
    let mut report = BatchReport {
        claimed: events.len(),
        publish_duration,
        ..BatchReport::default()
    };
    let settlements = if probe && unreachable {
        // Put back without an attempt, for twice the pause before the next probe: that probe finds
        // this event not yet due and takes another, so one event whose own destination never
        // answers cannot hold every probe (nor be sent again and again if a timeout hid a delivery).
        let delay = shared.outage.pause() * 2;
        report.retried = events.len();
        events
            .iter()
            .zip(&outcomes)
            .map(|(e, o)| Settlement {
                id: e.id,
                action: Action::Retry {
                    attempts: e.attempts,
                    delay,
                    error: match o {
                        Err(err) => format!("probe while the broker is unreachable: {err}"),
                        Ok(()) => "probe while the broker is unreachable".to_string(),
                    },
                },
            })
            .collect()
    } else {
        decide(
            &events,
            outcomes,
            &cfg.retry,
            cfg.ordering,
            shared.observer.as_ref(),
            &mut report,
        )
    };
    if report.backpressured > 0 {
        let (pause, lasting) = shared.pressure.pushed_back();
        let error = report.backpressure.as_deref().unwrap_or_default();
        if lasting {
            warn!(
                publisher = shared.publisher.name(),
                events = report.backpressured,
                error,
                pause_ms = pause.as_millis() as u64,
                "the publisher keeps pushing back; claiming pauses between tries"
            );
        } else {
            debug!(
                events = report.backpressured,
                error,
                pause_ms = pause.as_millis() as u64,
                "the publisher pushed back; claiming pauses"
            );
        }
    } else if report.published > 0 {
        shared.pressure.relieved();
    }
    let settle_started = Instant::now();
    let result = lease.settle(settlements).await;
    drop(permit);
    report.settle_duration = settle_started.elapsed();
    report.total_duration = started.elapsed();
    if let Err(e) = result {
        shared.observer.store_error("settle", &e);
        error!(
            error = %e,
            events = events.len(),
            "settling a batch failed; its events were released and will be published again"
        );
        report.settle_error = Some(e);
    } else {
        debug!(
            claimed = report.claimed,
            published = report.published,
            retried = report.retried,
            dead_lettered = report.dead_lettered,
            released = report.released,
            publish_ms = report.publish_duration.as_millis() as u64,
            settle_ms = report.settle_duration.as_millis() as u64,
            "batch settled"
        );
    }
    shared.totals.add(&report);
    shared.observer.batch_settled(&report);
}

/// Marks the broker down when a batch found it unreachable (the claim loop then waits for the
/// publisher's check), and up again when a batch whose publish began after that published
/// something (`started`); returns whether it was found unreachable.
fn note_broker_state(shared: &Shared, outcomes: &[PublishOutcome], started: Instant) -> bool {
    let publisher = shared.publisher.name();
    if broker_unreachable(outcomes) {
        if shared.outage.mark_down() {
            warn!(
                publisher,
                "the broker is unreachable: no more batches are claimed until it answers its readiness check"
            );
        }
        return true;
    }
    if outcomes.iter().any(Result::is_ok) && shared.outage.took_event(started) {
        info!(
            publisher,
            "the broker took an event again; claiming resumes"
        );
    }
    false
}
