//! Back-pressure: a publisher that cannot take more right now (a full local queue, an output still
//! busy) is a reason to wait, not a failure. Its events go back unchanged and claiming pauses,
//! from 50 ms doubling to 1 s while the publisher keeps pushing back.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The first pause after a publisher pushed back.
const FIRST_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause while it goes on pushing back.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// How often a publisher that goes on pushing back is reported at warning level.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// When claiming may go on, the pause the next push-back waits, and when a lasting push-back was
/// last reported.
#[derive(Debug)]
pub(super) struct Pressure {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    until: Option<Instant>,
    next_pause: Duration,
    warned: Option<Instant>,
}

impl Default for Pressure {
    fn default() -> Self {
        Pressure {
            state: Mutex::new(State {
                until: None,
                next_pause: FIRST_PAUSE,
                warned: None,
            }),
        }
    }
}

impl Pressure {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A batch met back-pressure: claiming pauses. Returns the pause, and whether the push-back
    /// has lasted (the pause is at its longest) and was not reported at warning level within a
    /// minute: a publisher that never takes its events again must not stay silent.
    pub(super) fn pushed_back(&self) -> (Duration, bool) {
        let mut st = self.state();
        let now = Instant::now();
        let pause = st.next_pause;
        st.until = Some(now + pause);
        st.next_pause = (pause * 2).min(MAX_PAUSE);
        let warn = pause == MAX_PAUSE && st.warned.is_none_or(|w| now - w >= WARN_EVERY);
        if warn {
            st.warned = Some(now);
        }
        (pause, warn)
    }

    /// A batch went through without back-pressure: the next pause starts short again.
    pub(super) fn relieved(&self) {
        let mut st = self.state();
        st.next_pause = FIRST_PAUSE;
        st.warned = None;
    }

    /// How long claiming still waits, if it does.
    pub(super) fn remaining(&self) -> Option<Duration> {
        let until = self.state().until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn pauses_double_while_pushed_back_and_start_short_after_relief() {
        let p = Pressure::default();
        assert_eq!(p.remaining(), None);
        assert_eq!(p.pushed_back(), (FIRST_PAUSE, false));
        assert_eq!(p.remaining(), Some(FIRST_PAUSE));
        assert_eq!(p.pushed_back(), (FIRST_PAUSE * 2, false));
        let warnings = (0..10).filter(|_| p.pushed_back().1).count();
        assert_eq!(warnings, 1, "a lasting push-back is reported once");
        assert_eq!(
            p.pushed_back(),
            (MAX_PAUSE, false),
            "not again within a minute"
        );
        tokio::time::advance(WARN_EVERY).await;
        assert_eq!(p.remaining(), None);
        assert_eq!(p.pushed_back(), (MAX_PAUSE, true), "and again after one");
        p.relieved();
        assert_eq!(p.pushed_back(), (FIRST_PAUSE, false));
    }
}
