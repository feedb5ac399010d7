//! What this binary is: its version, the commit it was built from and the adapters compiled in
//! (see `build.rs`). `outbox --version` prints them, the relay's start-up log line carries them,
//! and `outbox_build_info` exposes them as labels.

/// The crate version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from (`unknown` outside a checkout without `OUTBOX_COMMIT`).
pub const COMMIT: &str = env!("OUTBOX_BUILD_COMMIT");

/// The publishers compiled in, comma-separated (besides `stdout`, always there), or `none`.
pub const ADAPTERS: &str = env!("OUTBOX_BUILD_ADAPTERS");

/// `outbox --version`: `0.1.0 (commit 0123456789ab; adapters amqp,kafka,sqs)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OUTBOX_BUILD_COMMIT"),
    "; adapters ",
    env!("OUTBOX_BUILD_ADAPTERS"),
    ")"
);

/// The labels of `outbox_build_info`: this build's version, commit and adapters.
pub fn labels() -> txoutbox_postgres::ops::BuildInfo {
    txoutbox_postgres::ops::BuildInfo {
        version: VERSION.into(),
        commit: COMMIT.into(),
        adapters: ADAPTERS.into(),
    }
}
