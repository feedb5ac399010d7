//! What `/healthz` and `/readyz` answer.
//!
//! - **Liveness** ([`Liveness`]): the relay is wedged when, for `http.liveness_timeout`, it has
//!   neither settled a batch, nor found nothing to claim, nor lost a claim to a dropped database
//!   connection, nor checked an unreachable broker again, while work is due: the oldest pending event
//!   (as the last statistics refresh saw it, aged since) is older than the timeout, or the statistics
//!   query itself has hung that long. A relay waiting out a broker outage checks the broker every few
//!   seconds and stays live (a restart would not help); one whose claims hang or keep failing (a lock,
//!   a statement or lock time-out, a pool that hands out no connection), whose loop has died, or whose
//!   runtime is starved, does not.
//! - **Readiness** ([`Readiness`]): the database and the broker answer their checks. One check runs
//!   at a time whatever the number of probes, its result is kept for [`READY_CACHE`], and a probe
//!   waits at most `http.ready_timeout` for it. The answer names what is not ready, never the
//!   error's text (which may carry host and user names); the error itself goes to the log.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use txoutbox_core::{Publisher, Store};

/// How long a readiness result is reused: probes closer together share one check.
pub const READY_CACHE: Duration = Duration::from_secs(1);

/// The longest one readiness check may run before it is abandoned (each client's own timeouts end
/// it well before: the pool's `acquire_timeout`, Kafka's metadata timeout, SQS's operation timeout).
const CHECK_LIMIT: Duration = Duration::from_secs(60);

/// Tracks whether the relay makes progress while work is due.
#[derive(Debug)]
pub struct Liveness {
    timeout: Duration,
    state: Mutex<LiveState>,
}

#[derive(Debug, Clone, Copy)]
struct LiveState {
    /// The last sign of progress (or the start).
    progress: Instant,
    /// The last statistics refresh: when, and the oldest pending event's age then.
    stats: Option<(Instant, Option<f64>)>,
    /// When the statistics refresh in flight started (`None`: none in flight).
    refreshing: Option<Instant>,
}

impl Liveness {
    /// A relay starting now, judged wedged after `timeout` without progress while work is due.
    pub fn new(timeout: Duration) -> Self {
        Liveness {
            timeout,
            state: Mutex::new(LiveState {
                progress: Instant::now(),
                stats: None,
                refreshing: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LiveState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The relay settled a batch, found nothing to claim, or checked an unreachable broker.
    pub fn progressed(&self) {
        self.lock().progress = Instant::now();
    }

    /// A statistics refresh starts.
    pub fn refreshing(&self) {
        let mut st = self.lock();
        st.refreshing.get_or_insert_with(Instant::now);
    }

    /// A statistics refresh failed (it ended: the database answered, with an error).
    pub fn refresh_failed(&self) {
        self.lock().refreshing = None;
    }

    /// A statistics refresh saw the oldest pending event at `oldest_pending_age_seconds`.
    pub fn saw_stats(&self, oldest_pending_age_seconds: Option<f64>) {
        let mut st = self.lock();
        st.stats = Some((Instant::now(), oldest_pending_age_seconds));
        st.refreshing = None;
    }

    /// `Err` with the reason when the relay is wedged at `now`.
    ///
    /// # Errors
    /// A sentence saying for how long nothing progressed and how old the oldest due event is.
    pub fn verdict_at(&self, now: Instant) -> Result<(), String> {
        let st = *self.lock();
        let still = now.saturating_duration_since(st.progress);
        if still <= self.timeout {
            return Ok(());
        }
        // Claims and the statistics both hanging: whether work is due cannot be known, and the
        // relay is stuck either way.
        if let Some(started) = st.refreshing {
            let hung = now.saturating_duration_since(started);
            if hung > self.timeout {
                return Err(format!(
                    "no batch settled and no claim completed for {} s, and the statistics query has hung for {} s \
                     (http.liveness_timeout = {})",
                    still.as_secs(),
                    hung.as_secs(),
                    txoutbox_core::duration::format(self.timeout)
                ));
            }
        }
        let Some((seen, Some(age))) = st.stats else {
            return Ok(());
        };
        let oldest = Duration::from_secs_f64(age.max(0.0)) + now.saturating_duration_since(seen);
        if oldest <= self.timeout {
            return Ok(());
        }
        Err(format!(
            "no batch settled and no claim completed for {} s while the oldest pending event is {} s old \
             (http.liveness_timeout = {})",
            still.as_secs(),
            oldest.as_secs(),
            txoutbox_core::duration::format(self.timeout)
        ))
    }
}

/// What one readiness check found: `(component, problem)` for each component not ready.
type Problems = Vec<(&'static str, &'static str)>;

/// The components' outcomes so far, as a check in flight fills them in: `Some(true)` answers,
/// `Some(false)` does not, `None` not known yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Outcomes {
    database: Option<bool>,
    broker: Option<bool>,
}

impl Outcomes {
    fn complete(&self) -> bool {
        self.database.is_some() && self.broker.is_some()
    }

    fn problems(&self) -> Problems {
        let mut problems = Vec::new();
        for (what, outcome) in [("database", self.database), ("broker", self.broker)] {
            match outcome {
                Some(true) => {}
                Some(false) => problems.push((what, "unavailable (the relay's log has the error)")),
                None => problems.push((what, "no answer within http.ready_timeout")),
            }
        }
        problems
    }
}

/// Single-flight, cached readiness checks of the store and the publisher.
pub struct Readiness {
    store: Arc<dyn Store>,
    publisher: Arc<dyn Publisher>,
    timeout: Duration,
    state: Mutex<ReadyState>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct ReadyState {
    last: Option<(Instant, Outcomes)>,
    running: Option<watch::Receiver<Outcomes>>,
    /// The components whose failure was last logged, so that a lasting failure is logged once,
    /// not per probe, however its text changes between probes (a reconnect's countdown).
    logged: Option<Vec<&'static str>>,
}

/// Runs one component's check on a task of its own, at most [`CHECK_LIMIT`] (then it is aborted): a
/// check that panics counts as failed, like one that errs.
async fn contained(
    check: impl std::future::Future<Output = Result<(), txoutbox_core::Error>> + Send + 'static,
) -> Result<Result<(), txoutbox_core::Error>, tokio::time::error::Elapsed> {
    let mut task = tokio::spawn(check);
    match tokio::time::timeout(CHECK_LIMIT, &mut task).await {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(join)) => Ok(Err(txoutbox_core::Error::new(
            txoutbox_core::ErrorKind::Unexpected,
            format!("the check failed unexpectedly: {join}"),
        ))),
        Err(elapsed) => {
            task.abort();
            Err(elapsed)
        }
    }
}

/// Clears the check in flight when its task ends, normally or not.
struct Finished(Arc<Readiness>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.lock().running = None;
    }
}

impl Readiness {
    fn lock(&self) -> std::sync::MutexGuard<'_, ReadyState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Checks `store` and `publisher`; a probe waits at most `timeout` for the answer.
    pub fn new(
        store: Arc<dyn Store>,
        publisher: Arc<dyn Publisher>,
        timeout: Duration,
    ) -> Arc<Self> {
        Arc::new(Readiness {
            store,
            publisher,
            timeout,
            state: Mutex::new(ReadyState::default()),
        })
    }

    /// The components not ready (empty: ready). Reuses a result younger than [`READY_CACHE`], or
    /// joins the check in flight, or starts one; waits at most the readiness timeout, after which a
    /// component still checking counts as not ready (the check goes on, and the next probe joins it).
    pub async fn check(self: &Arc<Self>) -> Problems {
        let mut rx = {
            let mut st = self.lock();
            if let Some((at, outcomes)) = &st.last {
                if at.elapsed() < READY_CACHE {
                    return outcomes.problems();
                }
            }
            match &st.running {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(Outcomes::default());
                    st.running = Some(rx.clone());
                    let this = self.clone();
                    tokio::spawn(async move {
                        // However the check ends (a panic in a client included), the next probe
                        // starts a new one.
                        let _done = Finished(this.clone());
                        this.run_checks(tx).await;
                    });
                    rx
                }
            }
        };
        let _ = tokio::time::timeout(self.timeout, rx.wait_for(Outcomes::complete)).await;
        let outcomes = *rx.borrow();
        outcomes.problems()
    }

    /// Runs both checks at once, publishing each outcome as it comes, then keeps the result.
    async fn run_checks(&self, tx: watch::Sender<Outcomes>) {
        let errors = Mutex::new(Vec::new());
        let record = |what: &'static str, result: Result<Result<(), txoutbox_core::Error>, _>| {
            let error = match result {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {} s", CHECK_LIMIT.as_secs())),
            };
            let ok = error.is_none();
            if let Some(e) = error {
                if let Ok(mut errors) = errors.lock() {
                    errors.push((what, format!("{what}: {e}")));
                }
            }
            ok
        };
        let db = async {
            let store = self.store.clone();
            let r = contained(async move { store.check().await }).await;
            let ok = record("database", r);
            tx.send_modify(|o| o.database = Some(ok));
        };
        let broker = async {
            let publisher = self.publisher.clone();
            let r = contained(async move { publisher.check().await }).await;
            let ok = record("broker", r);
            tx.send_modify(|o| o.broker = Some(ok));
        };
        tokio::join!(db, broker);
        let mut errors = errors.into_inner().unwrap_or_default();
        errors.sort();
        let mut st = self.lock();
        st.last = Some((Instant::now(), *tx.borrow()));
        let failing: Vec<&'static str> = errors.iter().map(|(what, _)| *what).collect();
        if st.logged.as_ref() != Some(&failing) {
            if errors.is_empty() {
                if st.logged.is_some() {
                    info!("readiness: the database and the broker answer again");
                }
            } else {
                let texts: Vec<&str> = errors.iter().map(|(_, e)| e.as_str()).collect();
                warn!(problems = %texts.join("; "), "readiness check failed");
            }
            st.logged = Some(failing);
        }
    }
}

/// Formats the problems for `/readyz`.
pub fn ready_text(problems: &Problems) -> String {
    if problems.is_empty() {
        return "ready\n".into();
    }
    let mut s = String::from("not ready\n");
    for (what, problem) in problems {
        s.push_str(&format!("{what}: {problem}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use async_trait::async_trait;
    use txoutbox_core::testkit::MemoryStore;
    use txoutbox_core::{Batch, ClaimRequest, Error, ErrorKind, Event, PublishOutcome, StoreStats};

    #[test]
    fn liveness_fails_only_without_progress_while_work_is_due() {
        let l = Liveness::new(Duration::from_secs(10));
        let start = Instant::now();
        let later = |s: u64| start + Duration::from_secs(s);
        assert!(
            l.verdict_at(later(60)).is_ok(),
            "no statistics yet: nothing known due"
        );
        l.saw_stats(None);
        assert!(l.verdict_at(later(60)).is_ok(), "nothing pending");
        l.saw_stats(Some(3.0));
        assert!(l.verdict_at(later(5)).is_ok(), "progress 5 s ago is recent");
        let e = l.verdict_at(later(12)).unwrap_err();
        assert!(e.contains("http.liveness_timeout = 10s"), "{e}");
        l.progressed();
        assert!(
            l.verdict_at(Instant::now() + Duration::from_secs(9))
                .is_ok(),
            "progress clears it"
        );
        let l = Liveness::new(Duration::from_secs(10));
        l.saw_stats(Some(1.0));
        assert!(
            l.verdict_at(later(10)).is_ok(),
            "an event 1 s old, seen just now, is not 10 s old yet"
        );
        assert!(
            l.verdict_at(later(12)).is_err(),
            "statistics that stopped coming age with the clock"
        );
        let l = Liveness::new(Duration::from_secs(10));
        l.refreshing();
        assert!(l.verdict_at(later(9)).is_ok());
        let e = l.verdict_at(later(12)).unwrap_err();
        assert!(e.contains("statistics query has hung"), "{e}");
        l.refresh_failed();
        assert!(
            l.verdict_at(later(12)).is_ok(),
            "a refresh that fails ended: nothing known due"
        );
    }

    /// A store whose check fails with a message that names a host and a user, or hangs.
    struct Checked {
        inner: MemoryStore,
        fail: bool,
    }

    #[async_trait]
    impl Store for Checked {
        async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error> {
            self.inner.claim(request).await
        }
        async fn stats(&self) -> Result<StoreStats, Error> {
            self.inner.stats().await
        }
        async fn check(&self) -> Result<(), Error> {
            if self.fail {
                return Err(Error::new(
                    ErrorKind::Connection,
                    "password authentication failed for user \"alice\" at db.internal.example:5432",
                ));
            }
            Ok(())
        }
    }

    /// A publisher whose check takes `delay` and is counted.
    struct SlowCheck {
        delay: Duration,
        calls: AtomicUsize,
    }

    #[async_trait]
    impl Publisher for SlowCheck {
        async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
            events.iter().map(|_| Ok(())).collect()
        }
        async fn check(&self) -> Result<(), Error> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            Ok(())
        }
        fn name(&self) -> &str {
            "slow"
        }
    }

    fn readiness(
        fail: bool,
        delay: Duration,
        timeout: Duration,
    ) -> (Arc<Readiness>, Arc<SlowCheck>) {
        let publisher = Arc::new(SlowCheck {
            delay,
            calls: AtomicUsize::new(0),
        });
        let store = Arc::new(Checked {
            inner: MemoryStore::new(),
            fail,
        });
        (Readiness::new(store, publisher.clone(), timeout), publisher)
    }

    #[tokio::test]
    async fn one_check_at_a_time_whatever_the_probes_and_results_reused() {
        let (r, p) = readiness(false, Duration::from_millis(300), Duration::from_secs(5));
        let probes: Vec<_> = (0..20)
            .map(|_| {
                let r = r.clone();
                tokio::spawn(async move { r.check().await })
            })
            .collect();
        for probe in probes {
            assert!(probe.await.unwrap().is_empty(), "ready");
        }
        assert_eq!(p.calls.load(Ordering::SeqCst), 1, "20 probes, one check");
        assert!(r.check().await.is_empty());
        assert_eq!(
            p.calls.load(Ordering::SeqCst),
            1,
            "a fresh result is reused"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.calls.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < deadline, "the cached result never expired");
            r.check().await;
        }
    }

    #[tokio::test]
    async fn a_slow_component_is_reported_alone_and_its_check_is_not_repeated() {
        let (r, p) = readiness(false, Duration::from_secs(3), Duration::from_millis(200));
        let problems = r.check().await;
        assert_eq!(
            problems,
            vec![("broker", "no answer within http.ready_timeout")],
            "the database answered in time; only the broker is late"
        );
        for _ in 0..5 {
            r.check().await;
        }
        assert_eq!(
            p.calls.load(Ordering::SeqCst),
            1,
            "later probes join the check still in flight"
        );
    }

    #[tokio::test]
    async fn not_ready_names_the_component_never_the_error_text() {
        let (r, _) = readiness(true, Duration::ZERO, Duration::from_secs(5));
        let text = ready_text(&r.check().await);
        assert!(
            text.starts_with("not ready\ndatabase: unavailable"),
            "{text}"
        );
        for secret in ["alice", "db.internal", "5432", "password"] {
            assert!(!text.contains(secret), "{secret:?} in {text}");
        }
    }

    /// A publisher whose check panics.
    struct Panics(AtomicUsize);

    #[async_trait]
    impl Publisher for Panics {
        async fn publish(&self, events: &[Event]) -> Vec<PublishOutcome> {
            events.iter().map(|_| Ok(())).collect()
        }
        async fn check(&self) -> Result<(), Error> {
            self.0.fetch_add(1, Ordering::SeqCst);
            panic!("a client library panicked");
        }
        fn name(&self) -> &str {
            "panics"
        }
    }

    #[tokio::test]
    async fn a_check_that_panics_is_not_ready_and_does_not_wedge_readiness() {
        let publisher = Arc::new(Panics(AtomicUsize::new(0)));
        let store = Arc::new(Checked {
            inner: MemoryStore::new(),
            fail: false,
        });
        let r = Readiness::new(store, publisher.clone(), Duration::from_secs(5));
        let problems = r.check().await;
        assert!(
            problems.iter().any(|(what, _)| *what == "broker"),
            "{problems:?}"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while publisher.0.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < deadline, "no new check after the panic");
            let problems = r.check().await;
            assert!(!problems.is_empty());
        }
    }
}
