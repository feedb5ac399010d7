//! Seeds, serialised scenarios, waits on conditions and the soak factor: what every
//! scenario uses to run.

use std::sync::OnceLock;
use std::time::Duration;

/// The seed of this test process's random choices: `OUTBOX_TEST_SEED`, else a random one.
pub fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        std::env::var("OUTBOX_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..))
    })
}

/// A random generator for `what` (a scenario, a writer), derived from [`seed`], which it prints so
/// that a failing run can be replayed with `OUTBOX_TEST_SEED`.
pub fn rng(what: &str) -> fastrand::Rng {
    let seed = seed();
    println!("{what}: seed={seed} (OUTBOX_TEST_SEED={seed} replays its random choices)");
    let stream = what.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    fastrand::Rng::with_seed(seed ^ stream)
}

/// Runs the heavy scenarios of one test binary one at a time: on two cores, four relays, brokers and
/// writers at once leave each scenario's deadlines to luck. Hold the guard for the whole scenario.
pub async fn one_at_a_time() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// Waits until `condition` holds, checking every 50 ms, at most `within`; panics with `what`.
pub async fn wait_until<F, Fut>(within: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (waited {within:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How much longer the soak variant runs (`OUTBOX_SOAK=<factor>`, default 1).
pub fn soak_factor() -> usize {
    std::env::var("OUTBOX_SOAK")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|f| *f >= 1)
        .unwrap_or(1)
}
