//! The wake-up handle ([`Wake`]): the writer side ends an idle relay's pause with it as soon as it
//! committed new events.

use std::sync::Arc;

use tokio::sync::Notify;

/// Wakes an idle relay at once (for instance after the writer committed new events).
///
/// Cheap to clone; waking a busy relay makes its next pause end immediately.
#[derive(Debug, Clone, Default)]
pub struct Wake(Arc<Notify>);

impl Wake {
    /// A new handle, not yet attached to a relay.
    pub fn new() -> Self {
        Wake::default()
    }

    /// Ends the relay's current (or next) pause.
    pub fn wake(&self) {
        self.0.notify_one();
    }

    /// Waits until woken (consumes the wake-up). The relay waits on this between polls.
    pub async fn notified(&self) {
        self.0.notified().await;
    }
}
