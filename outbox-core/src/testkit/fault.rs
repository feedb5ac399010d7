//! A publisher that fails events on purpose around a real one: seeded random retryable failures
//! and a poisoned aggregate, for fault scenarios against real brokers.

use std::sync::Arc;

use crate::Publisher;

/// Wraps a real publisher and fails events on purpose: each event fails retryably (without being
/// sent) with probability `retryable_per_mille / 1000`, and every event of `poisoned` fails
/// permanently. Later events of a failed aggregate in the same call are held back, as real publishers
/// do.
pub struct FaultInjector {
    /// The publisher the events that are not failed go to.
    pub inner: Arc<dyn Publisher>,
    /// Chance, per thousand, that an event fails retryably.
    pub retryable_per_mille: u32,
    /// The aggregate whose every event fails permanently.
    pub poisoned: String,
    rng: std::sync::Mutex<fastrand::Rng>,
}

impl FaultInjector {
    /// Fails events of `inner` as described above, its random choices drawn from `rng` (seed it
    /// to replay a run).
    pub fn new(
        inner: Arc<dyn Publisher>,
        retryable_per_mille: u32,
        poisoned: &str,
        rng: fastrand::Rng,
    ) -> Self {
        FaultInjector {
            inner,
            retryable_per_mille,
            poisoned: poisoned.to_string(),
            rng: std::sync::Mutex::new(rng),
        }
    }
}

#[async_trait::async_trait]
impl Publisher for FaultInjector {
    async fn publish(&self, events: &[crate::Event]) -> Vec<crate::PublishOutcome> {
        use crate::publishers::{finish, Fence};
        use crate::{Error, ErrorKind};
        let mut outcomes: Vec<Option<crate::PublishOutcome>> = vec![None; events.len()];
        let mut fence = Fence::new();
        let mut send = Vec::new();
        for (i, e) in events.iter().enumerate() {
            if fence.holds(e) {
                outcomes[i] = Some(Err(Fence::not_sent("fault-injector")));
            } else if e.aggregate_id == self.poisoned {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::InvalidInput,
                    "injected permanent failure",
                )));
                fence.close(e);
            } else if self
                .rng
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .u32(0..1000)
                < self.retryable_per_mille
            {
                outcomes[i] = Some(Err(Error::new(
                    ErrorKind::Connection,
                    "injected retryable failure",
                )));
                fence.close(e);
            } else {
                send.push(i);
            }
        }
        let batch: Vec<crate::Event> = send.iter().map(|i| events[*i].clone()).collect();
        let sent = self.inner.publish(&batch).await;
        for (i, o) in send.into_iter().zip(sent) {
            outcomes[i] = Some(o);
        }
        finish(outcomes)
    }

    async fn check(&self) -> Result<(), crate::Error> {
        self.inner.check().await
    }

    fn name(&self) -> &str {
        "fault-injector"
    }

    // The broker's own ordering and limits, so that the relay drives it as it drives the broker
    // alone (whole runs in one call where the broker keeps them in order).
    fn keeps_order(&self) -> bool {
        self.inner.keeps_order()
    }

    fn same_call(&self, earlier: &crate::Event, later: &crate::Event) -> bool {
        self.inner.same_call(earlier, later)
    }

    fn call_limit(&self) -> Option<crate::CallLimit> {
        self.inner.call_limit()
    }
}
