//! `[wal]`: the WAL source's settings ([`WalConfig`]), and the slot, publication and held table
//! they name.

use serde::Serialize;

use txoutbox_core::Error;

use super::slot::WalSlot;
use crate::table::OutboxTable;
use crate::writer::message::DEFAULT_MESSAGE_PREFIX;

/// The default amount of retained WAL above which `outbox wal status` and the relay warn: 1 GiB.
pub const DEFAULT_RETAINED_WAL_WARNING: u64 = 1 << 30;

/// `[wal]`: the WAL source's settings.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// When the slot is missing (dropped, not made again after a failover), has lost WAL it
    /// needed, or its publication does not hold the outbox table, the relay publishes from the
    /// outbox table meanwhile and makes the slot and publication again itself, then streams again.
    /// `false` leaves making them to you (`outbox wal setup`); the relay still publishes from the
    /// table meanwhile. Making them needs the `REPLICATION` attribute and ownership of the table
    /// (for the publication). Default true.
    pub auto_recreate: bool,
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
            auto_recreate: true,
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
