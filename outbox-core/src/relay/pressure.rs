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

/// When claiming may go on, and the pause the next push-back waits.
#[derive(Debug)]
pub(super) struct Pressure {
    state: Mutex<(Option<Instant>, Duration)>,
}

impl Default for Pressure {
    fn default() -> Self {
        Pressure {
            state: Mutex::new((None, FIRST_PAUSE)),
        }
    }
}

impl Pressure {
    fn state(&self) -> std::sync::MutexGuard<'_, (Option<Instant>, Duration)> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A batch met back-pressure: claiming pauses; returns the pause.
    pub(super) fn pushed_back(&self) -> Duration {
        let mut st = self.state();
        let pause = st.1;
        st.0 = Some(Instant::now() + pause);
        st.1 = (pause * 2).min(MAX_PAUSE);
        pause
    }

    /// A batch went through without back-pressure: the next pause starts short again.
    pub(super) fn relieved(&self) {
        self.state().1 = FIRST_PAUSE;
    }

    /// How long claiming still waits, if it does.
    pub(super) fn remaining(&self) -> Option<Duration> {
        let until = self.state().0?;
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
        assert_eq!(p.pushed_back(), FIRST_PAUSE);
        assert_eq!(p.remaining(), Some(FIRST_PAUSE));
        assert_eq!(p.pushed_back(), FIRST_PAUSE * 2);
        for _ in 0..10 {
            p.pushed_back();
        }
        assert_eq!(p.pushed_back(), MAX_PAUSE);
        tokio::time::advance(MAX_PAUSE).await;
        assert_eq!(p.remaining(), None);
        p.relieved();
        assert_eq!(p.pushed_back(), FIRST_PAUSE);
    }
}
