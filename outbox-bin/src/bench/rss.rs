//! The process's resident set size: read from /proc (Linux), and sampled during a run so that the
//! report can give its peak (`peak_rss_bytes`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The resident set size of this process, from /proc (Linux); `None` elsewhere.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Samples the RSS every 50 ms until dropped; `peak()` is the largest seen.
pub(super) struct RssSampler {
    peak: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl RssSampler {
    pub(super) fn start() -> Self {
        let peak = Arc::new(AtomicU64::new(rss_bytes().unwrap_or(0)));
        let stop = CancellationToken::new();
        let (p, s) = (peak.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                if let Some(r) = rss_bytes() {
                    p.fetch_max(r, Ordering::Relaxed);
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = s.cancelled() => return,
                }
            }
        });
        RssSampler { peak, stop }
    }

    pub(super) fn peak(&self) -> Option<u64> {
        Some(self.peak.load(Ordering::Relaxed)).filter(|p| *p > 0)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
