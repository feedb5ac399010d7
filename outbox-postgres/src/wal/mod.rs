//! The WAL source's slot: the publication and the logical replication slot it reads, their setup,
//! status and removal.
//!
//! The WAL source's store ([`WalStore`]) streams the slot over a replication connection (the
//! `pg_walstream` crate's transport and pgoutput parser); [`WalReader`] reads it with the SQL slot
//! functions (`pg_logical_slot_peek_binary_changes`, `pg_replication_slot_advance`) over the sqlx
//! pool, for `outbox wal status` and tools: each such call decodes from the slot's restart position,
//! too slow for the relay (BENCHMARKS.md, eighth machine).
//!
//! The publication holds the outbox table's inserts only (`publish = 'insert'`: the relay's own
//! updates and deletes are not decoded) and is created before the slot (a slot older than its
//! publication fails to decode the changes in between). An abandoned slot keeps every WAL segment
//! from its restart position on: [`WalStatus::retained_bytes`] says how much, and `outbox wal drop`
//! removes both.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};

use outbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

mod decode;
mod store;
pub use decode::{
    MessageWriter, WalItem, WalPeek, WalReader, WalTransaction, DEFAULT_MESSAGE_PREFIX,
};
pub use store::{
    ReaderHandle, WalProgress, WalStore, CLAIMS_PAUSED_AFTER, STANDBY_RETRY,
    UNDECODABLE_AGGREGATE_TYPE,
};

/// The pgoutput protocol version read (1: whole transactions only, no streaming of transactions in
/// progress, so a peek never returns part of one).
pub const PROTO_VERSION: &str = "1";

/// The default amount of retained WAL above which `outbox wal status` and the relay warn: 1 GiB.
pub const DEFAULT_RETAINED_WAL_WARNING: u64 = 1 << 30;

/// `[wal]`: the WAL source's settings.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WalConfig {
    /// The replication slot. Default `<schema>_<table>_slot`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// The publication. Default `<schema>_<table>_pub`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publication: Option<String>,
    /// Bytes of WAL the slot may keep before `outbox wal status` (and the relay) warn: an abandoned
    /// slot keeps every segment and fills the disk. Default 1 GiB.
    pub retained_wal_warning: u64,
    /// The prefix of table-less events' messages (`pg_logical_emit_message(true, '<prefix>', ...)`).
    /// Messages are database-wide: give each outbox of a database its own. Default `outbox`.
    pub message_prefix: String,
    /// The table where events the WAL source could not publish at once wait, in order (retries,
    /// dead letters, and the later events of their aggregates); an outbox table of its own, made by
    /// `outbox wal setup`. Default `<table>_held`, in the outbox table's schema.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_table: Option<String>,
    /// Delete the outbox table's rows once their events are published or held (the table stays
    /// empty); `false` leaves the table to you (for example, writers that insert and delete the
    /// row in the same transaction, as with Debezium's outbox router). Default true.
    pub delete_published: bool,
    /// The most events read from the slot and not yet claimed that the reader holds in memory
    /// (the batches being published come on top: `relay.batch_size` x `relay.max_in_flight`). A
    /// relay that stops claiming (its broker is down) stops reading the slot at this mark. Default
    /// 2000.
    pub read_ahead: usize,
    /// The most payload bytes of the events read and not yet settled (a single transaction larger
    /// than this is still read whole). Default 16 MiB.
    pub read_ahead_bytes: usize,
}

impl Default for WalConfig {
    fn default() -> Self {
        WalConfig {
            slot: None,
            publication: None,
            retained_wal_warning: DEFAULT_RETAINED_WAL_WARNING,
            message_prefix: DEFAULT_MESSAGE_PREFIX.into(),
            held_table: None,
            delete_published: true,
            read_ahead: 2_000,
            read_ahead_bytes: 16 << 20,
        }
    }
}

impl WalConfig {
    /// The held table of `table` (`wal.held_table`, default `<table>_held`, in its schema).
    ///
    /// # Errors
    /// A config error naming `wal.held_table` when the name is not valid.
    pub fn held_table(&self, table: &OutboxTable) -> Result<OutboxTable, Error> {
        let name = self
            .held_table
            .clone()
            .unwrap_or_else(|| format!("{}_held", table.table()));
        let held = OutboxTable::new(table.schema(), name.as_str())
            .map_err(|e| Error::config(format!("wal.held_table = {name:?}: {}", e.message())))?;
        if &held == table {
            return Err(Error::config(format!(
                "wal.held_table = {name:?} is the outbox table itself: name another table"
            )));
        }
        Ok(held)
    }

    /// Checks the reader's settings.
    ///
    /// # Errors
    /// A config error naming the setting.
    pub fn validate(&self) -> Result<(), Error> {
        if self.read_ahead == 0 || self.read_ahead_bytes == 0 {
            return Err(Error::config(
                "wal.read_ahead and wal.read_ahead_bytes must be positive (defaults 2000 and 16777216)",
            ));
        }
        Ok(())
    }

    /// The slot of `table` these settings name.
    ///
    /// # Errors
    /// A config error naming `wal.slot` or `wal.publication`.
    pub fn slot(&self, table: &OutboxTable) -> Result<WalSlot, Error> {
        if self.message_prefix.is_empty() {
            return Err(Error::config(
                "wal.message_prefix is empty: expected a prefix such as \"outbox\"",
            ));
        }
        Ok(WalSlot::new(
            table.clone(),
            self.slot.as_deref(),
            self.publication.as_deref(),
        )?
        .with_message_prefix(self.message_prefix.clone()))
    }
}

/// The publication and slot of one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalSlot {
    table: OutboxTable,
    slot: String,
    publication: String,
    prefix: String,
}

/// A slot or publication name: 1 to 63 characters of a-z, 0-9 and `_`.
fn check_name(key: &str, value: &str) -> Result<(), Error> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(Error::config(format!(
            "{key} = {value:?}: expected 1 to 63 characters of a-z, 0-9 and _ (the rule of PostgreSQL's replication slot names)"
        )))
    }
}

impl WalSlot {
    /// The slot and publication of `table`, named `slot` and `publication`, or by default
    /// `<schema>_<table>` with `_slot` and `_pub` (unique per table in a database).
    ///
    /// # Errors
    /// A config error naming `wal.slot` or `wal.publication` when a name is not valid.
    pub fn new(
        table: OutboxTable,
        slot: Option<&str>,
        publication: Option<&str>,
    ) -> Result<Self, Error> {
        let base = format!("{}_{}", table.schema(), table.table());
        let slot = slot.map_or_else(|| format!("{base}_slot"), str::to_string);
        let publication = publication.map_or_else(|| format!("{base}_pub"), str::to_string);
        check_name("wal.slot", &slot)?;
        check_name("wal.publication", &publication)?;
        Ok(WalSlot {
            table,
            slot,
            publication,
            prefix: DEFAULT_MESSAGE_PREFIX.into(),
        })
    }

    /// Takes logical decoding messages with `prefix` as table-less events (default `outbox`).
    /// Messages are database-wide: several outboxes of one database that write table-less events
    /// need a prefix each.
    pub fn with_message_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The prefix of table-less events' messages.
    pub fn message_prefix(&self) -> &str {
        &self.prefix
    }

    /// The slot's name.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// The publication's name.
    pub fn publication(&self) -> &str {
        &self.publication
    }

    /// The outbox table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// Creates the publication (the table's inserts) and then the slot (`pgoutput`), each unless it
    /// exists. Returns what was created.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the server's `wal_level` is not `logical` (naming the setting and
    /// the restart it needs) or the table does not exist (run `outbox migrate`); a database error.
    pub async fn setup(&self, pool: &PgPool) -> Result<WalSetup, Error> {
        check_wal_level(&wal_level(pool).await?)?;
        let map = |e| map_sqlx("wal setup", e);
        let mut created = WalSetup::default();
        let has_publication = !self.publication_missing(pool).await?;
        let slot = self.slot_here(pool).await?;
        if !has_publication && slot.is_some() {
            // A slot older than its publication cannot decode the changes in between.
            return Err(Error::config(format!(
                "the slot {} exists but its publication {} does not: the slot cannot decode the outbox's changes made without it; \
                 drop the slot (`outbox wal drop --yes`; events it holds and no relay published are not published by it) and run `outbox wal setup` again",
                self.slot, self.publication
            )));
        }
        if !has_publication {
            let table_exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(self.table.qualified())
                .fetch_one(pool)
                .await
                .map_err(map)?;
            if !table_exists {
                return Err(Error::config(format!(
                    "{} does not exist: run `outbox migrate` before `outbox wal setup`",
                    self.table.qualified()
                )));
            }
            // publish_via_partition_root: rows of a partitioned outbox come out as the table's.
            let create = format!(
                "CREATE PUBLICATION \"{}\" FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
                self.publication,
                self.table.qualified()
            );
            match sqlx::query(&create).execute(pool).await {
                Ok(_) => created.publication = true,
                // Another `outbox wal setup` made it meanwhile (duplicate object, or the catalog's
                // unique index when both inserted at once).
                Err(e) if matches!(sqlstate(&e).as_deref(), Some("42710" | "23505")) => {}
                Err(e) => return Err(map(e)),
            }
        } else if !self.publication_covers_table(pool).await? {
            // The table was dropped and made again: the publication lost it.
            let add = format!(
                "ALTER PUBLICATION \"{}\" ADD TABLE {}",
                self.publication,
                self.table.qualified()
            );
            match sqlx::query(&add).execute(pool).await {
                Ok(_) => created.publication = true,
                // Another `outbox wal setup` added it meanwhile.
                Err(e) if matches!(sqlstate(&e).as_deref(), Some("42710" | "23505")) => {}
                Err(e) => return Err(map(e)),
            }
        }
        if self.slot_here(pool).await?.is_some() {
            return Ok(created);
        }
        // Creating a logical slot waits for the transactions running at that moment, in every
        // database: bounded, and the error names them.
        let mut tx = pool.begin().await.map_err(map)?;
        sqlx::query("SET LOCAL statement_timeout = '60s'")
            .execute(&mut *tx)
            .await
            .map_err(map)?;
        let made = sqlx::query("SELECT pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(&self.slot)
            .execute(&mut *tx)
            .await;
        match made {
            Ok(_) => {
                tx.commit().await.map_err(map)?;
                created.slot = true;
            }
            // Another `outbox wal setup` made it meanwhile.
            Err(e) if matches!(sqlstate(&e).as_deref(), Some("42710" | "23505")) => {}
            Err(e) if sqlstate(&e).as_deref() == Some("57014") => {
                let blocking: Vec<String> = sqlx::query_scalar(
                    "SELECT format('pid %s (%s, %s, since %s)', pid, datname, coalesce(application_name, ''), xact_start)
                     FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
                     ORDER BY xact_start LIMIT 5",
                )
                .fetch_all(pool)
                .await
                .unwrap_or_default();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "creating the slot {} waited 60 s for transactions running when it started ({}): let them end, then run `outbox wal setup` again",
                        self.slot,
                        if blocking.is_empty() { "none left now".to_string() } else { blocking.join("; ") }
                    ),
                ));
            }
            Err(e) => return Err(map(e)),
        }
        Ok(created)
    }

    /// Drops the slot and then the publication, each if it exists. Returns what was dropped.
    ///
    /// # Errors
    /// A database error; SQLSTATE 55006 (a reader holds the slot right now) says to stop the relays
    /// reading it first.
    pub async fn drop(&self, pool: &PgPool) -> Result<WalSetup, Error> {
        let mut dropped = WalSetup::default();
        // Never another database's slot of the same name (slot_here refuses it).
        if self.slot_here(pool).await?.is_some() {
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&self.slot)
                .execute(pool)
                .await
                .map_err(|e| {
                    let in_use = matches!(&e, sqlx::Error::Database(db) if db.code().as_deref() == Some("55006"));
                    let error = map_sqlx("wal drop", e);
                    if in_use {
                        Error::new(
                            ErrorKind::Rejected,
                            format!(
                                "the slot {} is being read right now: stop the relays that read it, then drop it",
                                self.slot
                            ),
                        )
                        .with_source(error)
                    } else {
                        error
                    }
                })?;
            dropped.slot = true;
        }
        dropped.publication = !self.publication_missing(pool).await?;
        let drop = format!("DROP PUBLICATION IF EXISTS \"{}\"", self.publication);
        sqlx::query(&drop)
            .execute(pool)
            .await
            .map_err(|e| map_sqlx("wal drop", e))?;
        Ok(dropped)
    }

    /// The slot of this name in this database, if any; an error when a slot of this name belongs
    /// to another database (slot names are cluster-wide), or is not a pgoutput logical slot.
    async fn slot_here(&self, pool: &PgPool) -> Result<Option<()>, Error> {
        let row: Option<(Option<String>, String, Option<String>)> = sqlx::query_as(
            "SELECT database::text, slot_type::text, plugin::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await
        .map_err(|e| map_sqlx("wal", e))?;
        let here: String = sqlx::query_scalar("SELECT current_database()::text")
            .fetch_one(pool)
            .await
            .map_err(|e| map_sqlx("wal", e))?;
        match row {
            None => Ok(None),
            Some((Some(db), kind, Some(plugin))) if db == here && kind == "logical" && plugin == "pgoutput" => {
                Ok(Some(()))
            }
            Some((db, kind, plugin)) => Err(Error::config(format!(
                "a replication slot named {} already exists on this server for {} ({} slot, plugin {}): slot names are server-wide; \
                 choose another with wal.slot (and wal.publication)",
                self.slot,
                db.map_or("no database".into(), |d| format!("database {d}")),
                kind,
                plugin.unwrap_or_else(|| "none".into())
            ))),
        }
    }

    /// Whether the publication holds the outbox table.
    async fn publication_covers_table(&self, pool: &PgPool) -> Result<bool, Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                            WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
        )
        .bind(&self.publication)
        .bind(self.table.schema())
        .bind(self.table.table())
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("wal", e))
    }

    async fn publication_missing(&self, pool: &PgPool) -> Result<bool, Error> {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
                .bind(&self.publication)
                .fetch_one(pool)
                .await
                .map_err(|e| map_sqlx("wal status", e))?;
        Ok(!exists)
    }

    /// The slot's lag and retained WAL in bytes, and its `wal_status`, without reading it (cheap
    /// enough for every metrics refresh): `None` when the slot does not exist in this database.
    ///
    /// # Errors
    /// A database error.
    pub async fn positions(&self, pool: &PgPool) -> Result<Option<SlotPositions>, Error> {
        let row: Option<(Option<i64>, Option<i64>, Option<String>)> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint, s.wal_status
             FROM pg_replication_slots s
             WHERE s.slot_name = $1 AND s.database = current_database()",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await
        .map_err(|e| map_sqlx("wal status", e))?;
        Ok(row.map(|(lag, retained, wal_status)| SlotPositions {
            lag_bytes: lag.unwrap_or(0),
            retained_bytes: retained.unwrap_or(0),
            wal_status,
        }))
    }

    /// Where the slot stands: whether it and the publication exist, who reads it, how far behind
    /// the server's WAL it is (bytes, and seconds since the oldest transaction it has not
    /// confirmed committed), and how much WAL it keeps on disk.
    ///
    /// # Errors
    /// A database error.
    pub async fn status(&self, pool: &PgPool) -> Result<WalStatus, Error> {
        let map = |e| map_sqlx("wal status", e);
        let wal_level = wal_level(pool).await?;
        let publication = !self.publication_missing(pool).await?;
        // A slot of this name in another database is refused, not reported as this outbox's.
        self.slot_here(pool).await?;
        let row = sqlx::query(
            "SELECT s.active, s.active_pid,
                    s.confirmed_flush_lsn::text AS confirmed_lsn, s.restart_lsn::text AS restart_lsn,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS lag_bytes,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes,
                    s.wal_status, s.safe_wal_size
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await
        .map_err(map)?;
        let mut status = WalStatus {
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            wal_level,
            publication_exists: publication,
            ..WalStatus::default()
        };
        let Some(row) = row else {
            return Ok(status);
        };
        status.slot_exists = true;
        status.active = row.try_get("active").map_err(map)?;
        status.active_pid = row.try_get("active_pid").map_err(map)?;
        status.confirmed_lsn = row.try_get("confirmed_lsn").map_err(map)?;
        status.restart_lsn = row.try_get("restart_lsn").map_err(map)?;
        status.lag_bytes = row.try_get("lag_bytes").map_err(map)?;
        status.retained_bytes = row.try_get("retained_bytes").map_err(map)?;
        status.wal_status = row.try_get("wal_status").map_err(map)?;
        status.safe_wal_size = row.try_get("safe_wal_size").map_err(map)?;
        status.covers_table = publication && self.publication_covers_table(pool).await?;
        let lost = status.wal_status.as_deref() == Some("lost");
        if !status.covers_table {
            status.lag_unknown = Some(
                "the publication does not hold the outbox table (run `outbox wal setup`)".into(),
            );
        } else if lost {
            status.lag_unknown = Some(
                "the slot lost WAL it needed (wal_status lost): drop it and set it up again".into(),
            );
        } else if status.active {
            status.lag_unknown = Some("a reader holds the slot right now".into());
        } else {
            match self.oldest_unconfirmed_commit(pool).await {
                Ok(Some(Some(t))) => {
                    status.oldest_unconfirmed_commit = Some(t);
                    status.lag_seconds =
                        Some((Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0);
                }
                Ok(Some(None)) => status.lag_seconds = Some(0.0),
                Ok(None) => {
                    status.lag_unknown = Some(format!(
                        "none of the first {STATUS_PEEK} changes the slot holds is this outbox's"
                    ));
                }
                Err(e) => status.lag_unknown = Some(format!("the slot could not be read: {e}")),
            }
        }
        Ok(status)
    }

    /// The commit time of the first transaction the slot holds with an event of this outbox (a row
    /// of its table or a message with its prefix) that is not confirmed: `Some(Some(t))`;
    /// `Some(None)` when the slot holds none; `None` when the first [`STATUS_PEEK`] changes held
    /// none of this outbox's but there are more. Nothing is consumed.
    async fn oldest_unconfirmed_commit(
        &self,
        pool: &PgPool,
    ) -> Result<Option<Option<DateTime<Utc>>>, Error> {
        let peek = WalReader::new(self.clone()).peek(pool, STATUS_PEEK).await?;
        let first = peek
            .transactions
            .iter()
            .find(|t| !t.items.is_empty())
            .map(|t| t.commit_time);
        Ok(match first {
            Some(t) => Some(Some(t)),
            None if peek.cut => None,
            None => Some(None),
        })
    }
}

/// How many changes `outbox wal status` reads to find the oldest unconfirmed event.
pub const STATUS_PEEK: i32 = 1000;

/// The SQLSTATE of a database error.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// A PostgreSQL timestamp (microseconds since 2000-01-01 UTC) as a UTC time.
pub fn postgres_time(micros: i64) -> DateTime<Utc> {
    const POSTGRES_EPOCH_SECS: i64 = 946_684_800;
    DateTime::from_timestamp_micros(micros.saturating_add(POSTGRES_EPOCH_SECS * 1_000_000))
        .unwrap_or_default()
}

/// The server's `wal_level`.
///
/// # Errors
/// A database error.
pub async fn wal_level(pool: &PgPool) -> Result<String, Error> {
    sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("wal", e))
}

/// `Ok` when `wal_level` is `logical`, else a config error naming the setting and the restart.
///
/// # Errors
/// As said.
pub fn check_wal_level(wal_level: &str) -> Result<(), Error> {
    if wal_level == "logical" {
        return Ok(());
    }
    Err(Error::config(format!(
        "the server's wal_level is {wal_level}; the WAL source needs logical: set wal_level = logical \
         (ALTER SYSTEM SET wal_level = logical, or in postgresql.conf) and restart PostgreSQL (the \
         setting takes effect only at a restart), or use the polling source"
    )))
}

/// A slot's positions ([`WalSlot::positions`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SlotPositions {
    /// Bytes of WAL written since the confirmed position.
    pub lag_bytes: i64,
    /// Bytes of WAL the slot keeps (from its restart position).
    pub retained_bytes: i64,
    /// PostgreSQL's `wal_status` of the slot.
    pub wal_status: Option<String>,
}

impl SlotPositions {
    /// Whether the slot keeps more than `limit` bytes of WAL, or is losing WAL it needs.
    pub fn retains_too_much(&self, limit: u64) -> bool {
        u64::try_from(self.retained_bytes).unwrap_or(0) > limit
            || matches!(self.wal_status.as_deref(), Some("unreserved" | "lost"))
    }
}

/// What [`WalSlot::setup`] created or [`WalSlot::drop`] dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WalSetup {
    /// The publication.
    pub publication: bool,
    /// The slot.
    pub slot: bool,
}

/// Where a slot stands ([`WalSlot::status`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WalStatus {
    /// The slot's name.
    pub slot: String,
    /// The publication's name.
    pub publication: String,
    /// The server's `wal_level` (the WAL source needs `logical`).
    pub wal_level: String,
    /// Whether the publication exists.
    pub publication_exists: bool,
    /// Whether the slot exists.
    pub slot_exists: bool,
    /// Whether a session reads the slot right now.
    pub active: bool,
    /// That session's process id.
    pub active_pid: Option<i32>,
    /// The position confirmed: everything before it is settled.
    pub confirmed_lsn: Option<String>,
    /// The oldest WAL position the slot keeps.
    pub restart_lsn: Option<String>,
    /// Bytes of WAL written since the confirmed position.
    pub lag_bytes: Option<i64>,
    /// Seconds since the commit of the oldest transaction of this outbox not confirmed (0 when
    /// there is none; `None` when it cannot be told, see [`WalStatus::lag_unknown`]).
    pub lag_seconds: Option<f64>,
    /// Why the lag in seconds cannot be told, when it cannot.
    pub lag_unknown: Option<String>,
    /// Whether the publication holds the outbox table (it must, for the slot to carry its rows).
    pub covers_table: bool,
    /// The commit time of that transaction.
    pub oldest_unconfirmed_commit: Option<DateTime<Utc>>,
    /// Bytes of WAL the slot keeps on disk (from its restart position).
    pub retained_bytes: Option<i64>,
    /// PostgreSQL's `wal_status` of the slot: `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes that can still be written before the slot is in danger (`max_slot_wal_keep_size`;
    /// `None` when unlimited).
    pub safe_wal_size: Option<i64>,
}

impl WalStatus {
    /// Whether the slot keeps more than `limit` bytes of WAL, or is losing WAL it needs.
    pub fn retains_too_much(&self, limit: u64) -> bool {
        let over = self
            .retained_bytes
            .is_some_and(|b| u64::try_from(b).unwrap_or(0) > limit);
        let endangered = matches!(self.wal_status.as_deref(), Some("unreserved" | "lost"));
        over || endangered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_slot_rules_and_default_per_table() {
        let t = OutboxTable::new("shop", "outbox_events").unwrap();
        let w = WalSlot::new(t.clone(), None, None).unwrap();
        assert_eq!(w.slot(), "shop_outbox_events_slot");
        assert_eq!(w.publication(), "shop_outbox_events_pub");
        let e = WalSlot::new(t.clone(), Some("Bad-Name"), None).unwrap_err();
        assert!(e.message().starts_with("wal.slot = \"Bad-Name\""), "{e}");
        let e = WalSlot::new(t, None, Some(&"p".repeat(64))).unwrap_err();
        assert!(e.message().starts_with("wal.publication"), "{e}");
    }

    #[test]
    fn wal_level_other_than_logical_names_the_setting_and_the_restart() {
        assert!(check_wal_level("logical").is_ok());
        let e = check_wal_level("replica").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("wal_level is replica")
                && e.message().contains("wal_level = logical")
                && e.message().contains("restart PostgreSQL"),
            "{e}"
        );
    }

    #[test]
    fn postgres_timestamps_count_from_2000() {
        assert_eq!(postgres_time(0).to_rfc3339(), "2000-01-01T00:00:00+00:00");
        assert_eq!(
            postgres_time(86_400_000_001).timestamp_micros(),
            946_771_200_000_001
        );
    }

    #[test]
    fn too_much_retained_wal_or_an_endangered_slot_warns() {
        let s = WalStatus {
            retained_bytes: Some(2 << 30),
            ..WalStatus::default()
        };
        assert!(s.retains_too_much(DEFAULT_RETAINED_WAL_WARNING));
        assert!(!s.retains_too_much(4 << 30));
        let lost = WalStatus {
            retained_bytes: Some(10),
            wal_status: Some("lost".into()),
            ..WalStatus::default()
        };
        assert!(lost.retains_too_much(DEFAULT_RETAINED_WAL_WARNING));
    }
}
