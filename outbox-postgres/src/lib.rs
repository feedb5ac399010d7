#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

mod config;
mod error;
mod grants;
mod inbox;
pub mod migrate;
pub mod notify;
#[cfg(feature = "ops")]
#[cfg_attr(docsrs, doc(cfg(feature = "ops")))]
pub mod ops;
mod pool;
pub mod pooler;
mod row;
mod store;
mod table;
#[cfg(feature = "test-utils")]
pub mod testing;
pub mod wal;
mod writer;

pub use config::{
    redact_url, DatabaseConfig, Source, DEFAULT_CLEANUP_BATCH_SIZE, DEFAULT_CLEANUP_INTERVAL,
    DEFAULT_DATABASE_URL,
};
pub use error::classify_sqlstate;
// Shared by the workspace's adapters and binary, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub use error::map_sqlx;
pub use grants::is_missing_grant;
pub use inbox::{Inbox, InboxError, Processed, DEFAULT_INBOX_TABLE, INBOX_MIGRATOR};
pub use migrate::{migrate, schema_sql};
pub use pool::{connect, connect_config};
// The row decoding the binary's bench measures, not a promise to users: hidden from the docs,
// it may change in any release.
#[doc(hidden)]
pub use row::{decode_event, EVENT_COLUMNS};
pub use store::operator::{
    CleanupBatch, CleanupLock, DeadLetter, DeadLetterDetail, DeadLetterFilter,
};
pub use store::{PostgresStore, Retention, DEFAULT_STATS_MAX_ROWS};
pub use table::{OutboxTable, DEFAULT_SCHEMA, DEFAULT_TABLE};
pub use writer::{Writer, DEFAULT_MAX_PAYLOAD_BYTES};

/// Re-exported so users need not depend on sqlx versions by hand.
pub use sqlx;
