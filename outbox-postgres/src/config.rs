//! Database settings for programs that wire the store from configuration (such as the `outbox` binary).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use txoutbox_core::{duration, Error};

use crate::store::Retention;
use crate::table::{OutboxTable, DEFAULT_SCHEMA, DEFAULT_TABLE};

/// The default database URL: the local server, as user `postgres`.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The default time between two automatic cleanup rounds (`database.cleanup_interval`).
pub const DEFAULT_CLEANUP_INTERVAL: Duration = Duration::from_secs(300);

/// The default rows per cleanup statement (`database.cleanup_batch_size`).
pub const DEFAULT_CLEANUP_BATCH_SIZE: u32 = 1000;

/// Settings of the database side: where the outbox is and how it is kept.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct DatabaseConfig {
    /// `postgres://user:password@host:port/database`. Default the local server as `postgres`
    /// (`DATABASE_URL` overrides the file). The password is never logged.
    pub url: String,
    /// A URL that reaches PostgreSQL itself (or a session-mode pool), for what needs a server
    /// session of its own: the WAL source's replication connection and reader lock, and LISTEN
    /// (`notify`). Needed only when `url` goes through a connection pooler in transaction mode
    /// (PgBouncer and the poolers of managed offerings), which the relay finds out at start.
    /// Default: unset, `url` serves both.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub direct_url: Option<String>,
    /// Connections in the pool. The relay needs `relay.max_in_flight` (each batch in flight holds
    /// one) + 1 (statistics) + 1 (readiness check) + 1 more with `notify` (the listener holds one);
    /// the `outbox` binary refuses less. Default 8.
    pub pool_size: u32,
    /// Schema of the outbox table. Default `public`.
    pub schema: String,
    /// Outbox table. Default `outbox_events`.
    pub table: String,
    /// Keep published rows this long instead of deleting them at once; then the relay removes them
    /// (`auto_cleanup`), or `outbox cleanup` does. Default: unset, published rows are deleted.
    #[cfg_attr(feature = "schema", schemars(with = "Option<String>", extend("format" = "duration")))]
    #[serde(with = "duration::serde_opt", skip_serializing_if = "Option::is_none")]
    pub keep_processed_for: Option<Duration>,
    /// With `keep_processed_for` set, the relay removes expired rows itself every `cleanup_interval`,
    /// `cleanup_batch_size` rows per short transaction, one batch at a time across relays (an
    /// advisory lock; a relay that finds it taken ends its round). It holds one more pool connection
    /// while it runs. Default true.
    pub auto_cleanup: bool,
    /// Time between two automatic cleanup rounds (the first runs when the relay starts). Default 5m.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub cleanup_interval: Duration,
    /// Rows deleted per cleanup statement (automatic and `outbox cleanup`'s default), 1 to 100000.
    /// Default 1000.
    pub cleanup_batch_size: u32,
    /// Wake the relay with LISTEN/NOTIFY: `outbox migrate` installs a statement trigger that sends one
    /// payload-free notification per inserting transaction. Costs the writers a server-wide lock
    /// at commit (BENCHMARKS-HISTORY.md, "Writers with NOTIFY"); polling stays on as the fallback. Default false.
    pub notify: bool,
    /// Time allowed to get a connection from the pool. Default 10 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "duration::serde_str")]
    pub acquire_timeout: Duration,
    /// The most rows of each kind (pending, dead letters) one statistics refresh reads (`/metrics`
    /// every `http.stats_interval`, `outbox status`): a larger backlog is counted over several
    /// refreshes, each going on from where the last stopped, and shows the last complete count
    /// (`outbox_stats_estimated` is then 1). Bounds the cost of statistics on a large backlog. At
    /// least 1000. Default 100000.
    pub stats_max_rows: u64,
    /// Where the relay reads events: `polling` (the outbox table, claimed by partitions of the aggregates) or
    /// `wal` (a logical replication slot: the table's inserts and table-less events, in commit
    /// order; see `[wal]` and `outbox wal setup`). Default `polling`.
    pub source: Source,
}

/// Where the relay reads events (`database.source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum Source {
    /// The outbox table, polled.
    #[default]
    Polling,
    /// A logical replication slot (the WAL source).
    Wal,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: DEFAULT_DATABASE_URL.into(),
            direct_url: None,
            pool_size: 8,
            schema: DEFAULT_SCHEMA.into(),
            table: DEFAULT_TABLE.into(),
            keep_processed_for: None,
            auto_cleanup: true,
            cleanup_interval: DEFAULT_CLEANUP_INTERVAL,
            cleanup_batch_size: DEFAULT_CLEANUP_BATCH_SIZE,
            notify: false,
            acquire_timeout: Duration::from_secs(10),
            stats_max_rows: crate::store::DEFAULT_STATS_MAX_ROWS,
            source: Source::Polling,
        }
    }
}

pub use txoutbox_core::redact_url;

impl std::fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &redact_url(&self.url))
            .field("direct_url", &self.direct_url.as_deref().map(redact_url))
            .field("pool_size", &self.pool_size)
            .field("schema", &self.schema)
            .field("table", &self.table)
            .field("keep_processed_for", &self.keep_processed_for)
            .field("auto_cleanup", &self.auto_cleanup)
            .field("cleanup_interval", &self.cleanup_interval)
            .field("cleanup_batch_size", &self.cleanup_batch_size)
            .field("notify", &self.notify)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("stats_max_rows", &self.stats_max_rows)
            .field("source", &self.source)
            .finish()
    }
}

impl DatabaseConfig {
    /// Checks the values; returns the validated table.
    ///
    /// # Errors
    /// A config error naming the key (`database.<key>`), the value and what is expected.
    pub fn validate(&self) -> Result<OutboxTable, Error> {
        if !(self.url.starts_with("postgres://") || self.url.starts_with("postgresql://")) {
            return Err(Error::config(format!(
                "database.url = {:?}: expected postgres://user[:password]@host[:port]/database",
                redact_url(&self.url)
            )));
        }
        if let Some(direct) = &self.direct_url {
            if !(direct.starts_with("postgres://") || direct.starts_with("postgresql://")) {
                return Err(Error::config(format!(
                    "database.direct_url = {:?}: expected postgres://user[:password]@host[:port]/database (the server itself, not a pooler)",
                    redact_url(direct)
                )));
            }
        }
        if !(1..=1000).contains(&self.pool_size) {
            return Err(Error::config(format!(
                "database.pool_size = {}: expected 1 to 1000",
                self.pool_size
            )));
        }
        if self.stats_max_rows < 1000 {
            return Err(Error::config(format!(
                "database.stats_max_rows = {}: expected at least 1000 (default {})",
                self.stats_max_rows,
                crate::store::DEFAULT_STATS_MAX_ROWS
            )));
        }
        if self.cleanup_interval < Duration::from_secs(1) {
            return Err(Error::config(format!(
                "database.cleanup_interval = {}: expected at least 1s (default {})",
                duration::format(self.cleanup_interval),
                duration::format(DEFAULT_CLEANUP_INTERVAL)
            )));
        }
        if !(1..=100_000).contains(&self.cleanup_batch_size) {
            return Err(Error::config(format!(
                "database.cleanup_batch_size = {}: expected 1 to 100000 (default {DEFAULT_CLEANUP_BATCH_SIZE})",
                self.cleanup_batch_size
            )));
        }
        if self.acquire_timeout.is_zero() {
            return Err(Error::config(
                "database.acquire_timeout = 0s: expected a positive duration such as 10s",
            ));
        }
        OutboxTable::new(&self.schema, &self.table)
    }

    /// Whether the relay removes expired kept rows itself (`keep_processed_for` set and
    /// `auto_cleanup` on).
    pub fn cleans_automatically(&self) -> bool {
        self.keep_processed_for.is_some() && self.auto_cleanup
    }

    /// What happens to published rows.
    pub fn retention(&self) -> Retention {
        if self.keep_processed_for.is_some() {
            Retention::Keep
        } else {
            Retention::Delete
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_secrets_are_redacted() {
        let c = DatabaseConfig {
            url: "postgres://app:s3cret@db:5432/shop".into(),
            ..DatabaseConfig::default()
        };
        assert!(c.validate().is_ok());
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(redact_url(&c.url), "postgres://app:***@db:5432/shop");
        assert_eq!(c.retention(), Retention::Delete);
        let keep = DatabaseConfig {
            keep_processed_for: Some(Duration::from_secs(3600)),
            ..DatabaseConfig::default()
        };
        assert_eq!(keep.retention(), Retention::Keep);
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |c: DatabaseConfig| c.validate().unwrap_err().message().to_string();
        assert!(bad(DatabaseConfig {
            url: "mysql://x".into(),
            ..DatabaseConfig::default()
        })
        .starts_with("database.url"));
        assert!(bad(DatabaseConfig {
            pool_size: 0,
            ..DatabaseConfig::default()
        })
        .starts_with("database.pool_size"));
        assert!(bad(DatabaseConfig {
            table: "Bad-Name".into(),
            ..DatabaseConfig::default()
        })
        .starts_with("database.table"));
        assert!(bad(DatabaseConfig {
            cleanup_interval: Duration::from_millis(500),
            ..DatabaseConfig::default()
        })
        .starts_with("database.cleanup_interval"));
        assert!(bad(DatabaseConfig {
            cleanup_batch_size: 0,
            ..DatabaseConfig::default()
        })
        .starts_with("database.cleanup_batch_size"));
    }
}
