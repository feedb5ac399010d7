//! The broker outage state machine ([`Outage`]): which batch outcomes find the broker
//! unreachable, which call marks it up again, how long the relay waits between readiness checks,
//! and how often it warns while the broker stays down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ErrorKind;
use crate::policy::RetryPolicy;
use crate::ports::PublishOutcome;

/// What the relay knows of an unreachable broker: while it is down, no batch is claimed until the
/// publisher's readiness check passes (see
/// [`Relay::wait_for_broker`](super::Relay::wait_for_broker)).
pub(super) struct Outage {
    /// Set when a batch found the broker unreachable.
    down: std::sync::atomic::AtomicBool,
    /// The pause before the next check, in milliseconds.
    pause_ms: AtomicU64,
    /// The first pause, in milliseconds: from the retry policy's `initial_backoff`.
    first_pause_ms: u64,
    /// When the relay last warned that the broker is unreachable.
    warned: std::sync::Mutex<Option<Instant>>,
    /// When the broker was last marked down.
    down_since: std::sync::Mutex<Option<Instant>>,
}

/// The longest pause between two checks of an unreachable broker (shorter when
/// `relay.retry.max_backoff` is).
const BROKER_CHECK_MAX_PAUSE: Duration = Duration::from_secs(10);

/// The shortest pause between two checks of an unreachable broker, whatever the retry policy says.
const BROKER_CHECK_MIN_PAUSE: Duration = Duration::from_millis(100);

/// How often the relay repeats that the broker is still unreachable.
const BROKER_WARN_EVERY: Duration = Duration::from_secs(60);

impl Outage {
    pub(super) fn new(retry: &RetryPolicy) -> Self {
        let first_pause_ms = retry
            .initial_backoff
            .clamp(BROKER_CHECK_MIN_PAUSE, BROKER_CHECK_MAX_PAUSE)
            .as_millis() as u64;
        Outage {
            down: Default::default(),
            pause_ms: AtomicU64::new(first_pause_ms),
            first_pause_ms,
            warned: Default::default(),
            down_since: Default::default(),
        }
    }

    pub(super) fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// The pause before the next check.
    pub(super) fn pause(&self) -> Duration {
        Duration::from_millis(self.pause_ms.load(Ordering::SeqCst))
    }

    /// Doubles the pause before the next check (within the policy's `max_backoff`, 100 ms..10 s);
    /// returns the new pause.
    pub(super) fn lengthen_pause(&self, retry: &RetryPolicy) -> Duration {
        let next = (self.pause() * 2)
            .min(retry.max_backoff)
            .clamp(BROKER_CHECK_MIN_PAUSE, BROKER_CHECK_MAX_PAUSE);
        self.pause_ms
            .store(next.as_millis() as u64, Ordering::SeqCst);
        next
    }

    /// The time the broker was last marked down; held while the state changes, so that a mark-down
    /// and a mark-up never interleave (see [`Outage::took_event`]).
    fn down_since(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.down_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks the broker down; true when it was up (the warning is then due, and given).
    pub(super) fn mark_down(&self) -> bool {
        let mut since = self.down_since();
        *since = Some(Instant::now());
        let was_up = !self.down.swap(true, Ordering::SeqCst);
        drop(since);
        if was_up {
            *self.warned_at() = Some(Instant::now());
        }
        was_up
    }

    /// A call that began at `call_started` had an event taken: the broker is up again, unless the
    /// call began before the broker was last found unreachable (a batch in flight at the outage
    /// whose first records went through before it: no news of the broker since). Returns whether
    /// it was down and is up now.
    pub(super) fn took_event(&self, call_started: Instant) -> bool {
        let since = self.down_since();
        if since.is_some_and(|down| call_started < down) {
            return false;
        }
        self.pause_ms.store(self.first_pause_ms, Ordering::SeqCst);
        self.down.swap(false, Ordering::SeqCst)
    }

    /// Marks the broker up after a passing readiness check; true when it was down.
    pub(super) fn checked_up(&self) -> bool {
        let _since = self.down_since();
        self.down.swap(false, Ordering::SeqCst)
    }

    /// Whether a minute has passed since the last warning (and if so, counts this one as given).
    pub(super) fn warning_due(&self) -> bool {
        let mut warned = self.warned_at();
        let due = warned.is_none_or(|at| at.elapsed() >= BROKER_WARN_EVERY);
        if due {
            *warned = Some(Instant::now());
        }
        due
    }

    fn warned_at(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Whether a batch's outcomes say the broker is unreachable: its events that failed failed with
/// connection errors or timeouts (the rest held back or not sent behind them), whatever it
/// published before (a batch in flight when the broker went away).
pub(super) fn broker_unreachable(outcomes: &[PublishOutcome]) -> bool {
    let mut connection = false;
    for o in outcomes {
        match o {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::Connection | ErrorKind::Timeout) => {
                connection = true;
            }
            Err(e) if matches!(e.kind(), ErrorKind::Backpressure | ErrorKind::Rejected) => {}
            Err(_) => return false,
        }
    }
    connection
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// A batch whose failures are all connection errors or timeouts finds the broker unreachable,
    /// also when it published some events before (in flight as the broker went away); a failure of
    /// an event's own says nothing of the broker.
    #[test]
    fn failures_of_the_connection_only_find_the_broker_unreachable() {
        let conn = || Err(Error::new(ErrorKind::Connection, "connection reset"));
        let own = || Err(Error::new(ErrorKind::InvalidInput, "header too long"));
        assert!(broker_unreachable(&[conn(), conn()]));
        assert!(broker_unreachable(&[Ok(()), conn()]));
        assert!(!broker_unreachable(&[Ok(()), Ok(())]));
        assert!(!broker_unreachable(&[conn(), own()]));
    }

    /// A batch in flight when another found the broker unreachable, whose first records went
    /// through before the outage, is no news that the broker is back: claiming stays paused (else
    /// full batches fail again, each counting an attempt). A call begun after the outage was noticed
    /// (a probe, a batch after a passing check) is.
    #[test]
    fn only_a_call_begun_after_the_outage_was_noticed_marks_the_broker_up() {
        let outage = Outage::new(&RetryPolicy::default());
        let before = Instant::now();
        std::thread::sleep(Duration::from_millis(5));
        assert!(outage.mark_down());
        assert!(!outage.took_event(before), "a call begun before the outage");
        assert!(outage.is_down());
        let after = Instant::now();
        assert!(outage.took_event(after), "a call begun after it");
        assert!(!outage.is_down());
    }
}
