//! The publication and the logical replication slot of one outbox table ([`WalSlot`]): their
//! names, setup and removal, and the server's `wal_level` they need.

use serde::Serialize;
use sqlx::PgPool;

use txoutbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;
use crate::table::OutboxTable;
use crate::writer::message::DEFAULT_MESSAGE_PREFIX;

/// The publication and slot of one outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalSlot {
    pub(super) table: OutboxTable,
    pub(super) slot: String,
    pub(super) publication: String,
    pub(super) prefix: String,
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
    /// exists (a slot that lost WAL it needed is dropped and made again). Returns what was created.
    ///
    /// # Errors
    /// [`ErrorKind::Config`] when the server's `wal_level` is not `logical` (naming the setting and
    /// the restart it needs) or the table does not exist (run `outbox migrate`); a database error.
    pub async fn setup(&self, pool: &PgPool) -> Result<WalSetup, Error> {
        check_wal_level(&wal_level(pool).await?)?;
        let map = |e| map_sqlx("wal setup", e);
        // The slot first: a setup makes the publication before the slot, so a slot seen here has
        // its publication visible to the read after it, even while another setup is making both.
        let mut slot = self.slot_here(pool).await?;
        if slot.is_some() && self.lost(pool).await? {
            // It cannot be read any more (max_slot_wal_keep_size): made again below. The relay
            // moves the outbox table's rows written before the new one to its held table.
            self.drop_slot(pool, true).await.map_err(map)?;
            slot = None;
        }
        let mut created = WalSetup {
            publication: self.ensure_publication(pool, slot.is_some()).await?,
            slot: false,
        };
        if self.slot_here(pool).await?.is_none() {
            created.slot = self.create_slot(pool).await?;
        }
        Ok(created)
    }

    /// Makes the publication, or adds the table to it when the table was made again; true when
    /// this call did either.
    async fn ensure_publication(&self, pool: &PgPool, slot_exists: bool) -> Result<bool, Error> {
        let map = |e| map_sqlx("wal setup", e);
        let has_publication = !self.publication_missing(pool).await?;
        if !has_publication && slot_exists {
            // A slot older than its publication cannot decode the changes in between.
            return Err(Error::config(format!(
                "the slot {} exists but its publication {} does not: the slot cannot decode the outbox's changes made without it; \
                 drop the slot (`outbox wal drop --yes`; events it holds and no relay published are not published by it) and run `outbox wal setup` again",
                self.slot, self.publication
            )));
        }
        let statement = if !has_publication {
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
            format!(
                "CREATE PUBLICATION \"{}\" FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
                self.publication,
                self.table.qualified()
            )
        } else if !self.publication_covers_table(pool).await? {
            // The table was dropped and made again: the publication lost it.
            format!(
                "ALTER PUBLICATION \"{}\" ADD TABLE {}",
                self.publication,
                self.table.qualified()
            )
        } else {
            return Ok(false);
        };
        match sqlx::query(&statement).execute(pool).await {
            Ok(_) => Ok(true),
            // Another `outbox wal setup` did it meanwhile (duplicate object, or the catalog's
            // unique index when both inserted at once).
            Err(e) if matches!(sqlstate(&e).as_deref(), Some("42710" | "23505")) => Ok(false),
            Err(e) => Err(map(e)),
        }
    }

    /// Makes the slot (`pgoutput`); true when this call made it. Creating a logical slot waits for
    /// the transactions running at that moment, in every database: bounded, and the error names
    /// them.
    async fn create_slot(&self, pool: &PgPool) -> Result<bool, Error> {
        let map = |e| map_sqlx("wal setup", e);
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
                Ok(true)
            }
            // Another `outbox wal setup` made it meanwhile.
            Err(e) if matches!(sqlstate(&e).as_deref(), Some("42710" | "23505")) => Ok(false),
            Err(e) if sqlstate(&e).as_deref() == Some("57014") => {
                let blocking: Vec<String> = sqlx::query_scalar(
                    "SELECT format('pid %s (%s, %s, since %s)', pid, datname, coalesce(application_name, ''), xact_start)
                     FROM pg_stat_activity WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
                     ORDER BY xact_start LIMIT 5",
                )
                .fetch_all(pool)
                .await
                .unwrap_or_default();
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "creating the slot {} waited 60 s for transactions running when it started ({}): let them end, then run `outbox wal setup` again",
                        self.slot,
                        if blocking.is_empty() { "none left now".to_string() } else { blocking.join("; ") }
                    ),
                ))
            }
            Err(e) => Err(map(e)),
        }
    }

    /// Drops this database's slot of this name, if there is one (with `only_lost`, only one that
    /// lost WAL it needed). The one statement every drop of the slot runs.
    ///
    /// # Errors
    /// The database's error (SQLSTATE 55006: a session reads the slot right now).
    pub(crate) async fn drop_slot<'c>(
        &self,
        executor: impl sqlx::PgExecutor<'c>,
        only_lost: bool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name = $1 AND database = current_database()
               AND (NOT $2 OR wal_status = 'lost')",
        )
        .bind(&self.slot)
        .bind(only_lost)
        .execute(executor)
        .await
        .map(|_| ())
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
            self.drop_slot(pool, false)
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
    pub(super) async fn slot_here(&self, pool: &PgPool) -> Result<Option<()>, Error> {
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

    /// Whether the slot lost WAL it needed (`wal_status = 'lost'`): it cannot be read.
    async fn lost(&self, pool: &PgPool) -> Result<bool, Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots
                            WHERE slot_name = $1 AND database = current_database() AND wal_status = 'lost')",
        )
        .bind(&self.slot)
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("wal", e))
    }

    /// Whether the publication holds the outbox table.
    pub(super) async fn publication_covers_table(&self, pool: &PgPool) -> Result<bool, Error> {
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

    pub(super) async fn publication_missing(&self, pool: &PgPool) -> Result<bool, Error> {
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
                .bind(&self.publication)
                .fetch_one(pool)
                .await
                .map_err(|e| map_sqlx("wal status", e))?;
        Ok(!exists)
    }
}

/// The SQLSTATE of a database error.
fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
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

/// A config error naming the fix unless the held table `held` exists (`outbox wal setup` makes it,
/// with the publication and the slot).
///
/// # Errors
/// As said; a database error.
pub async fn held_table_exists(pool: &PgPool, held: &OutboxTable) -> Result<(), Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(held.qualified())
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("held table check", e))?;
    if exists {
        return Ok(());
    }
    Err(Error::config(format!(
        "database.source = \"wal\" but the held table {} does not exist: run `outbox wal setup` (after `outbox migrate`; it makes the publication, the slot and that table)",
        held.qualified()
    )))
}

/// The WAL source's pre-flight, before a relay reads or a check reports: the server's `wal_level`
/// is `logical` and the held table `held` exists; a config error naming the fix otherwise.
///
/// # Errors
/// As said; a database error.
pub async fn preflight(pool: &PgPool, held: &OutboxTable) -> Result<(), Error> {
    check_wal_level(&wal_level(pool).await?)?;
    held_table_exists(pool, held).await
}

/// What [`WalSlot::setup`] created or [`WalSlot::drop`] dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct WalSetup {
    /// The publication.
    pub publication: bool,
    /// The slot.
    pub slot: bool,
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
}
