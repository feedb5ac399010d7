//! `outbox wal setup` as a function: the publication and the slot, the held table, and the mark
//! that makes the relay move the rows written before the new slot first. The binary's command and
//! the tests call it.

use sqlx::PgPool;

use txoutbox_core::Error;

use super::config::WalConfig;
use super::fallback::mark_new_slot;
use super::slot::WalSetup;
use crate::migrate::migrate;
use crate::table::OutboxTable;

/// What [`setup`] made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// The publication and the slot made (`false`: they existed).
    pub made: WalSetup,
    /// The held table.
    pub held: OutboxTable,
    /// The migrations applied to the held table (empty: it was up to date).
    pub held_migrations: Vec<i64>,
}

/// Makes what the WAL source of `table` needs under `config`, idempotently: the publication and the
/// slot ([`super::WalSlot::setup`]), the held table (migrated like the outbox table). A slot made
/// now does not hold the rows of `table` committed before its consistent point: with
/// `wal.delete_published`, when there are any, the relay moves them to the held table before it
/// streams ([`mark_new_slot`]).
///
/// # Errors
/// A config error (names, `wal_level`), a database error.
pub async fn setup(pool: &PgPool, table: &OutboxTable, config: &WalConfig) -> Result<Setup, Error> {
    let slot = config.slot(table)?;
    let made = slot.setup(pool).await?;
    let held = config.held_table(table)?;
    let held_migrations = migrate(pool, &held).await?;
    if made.slot && config.delete_published {
        mark_new_slot(pool, table, &held, slot.slot()).await?;
    }
    Ok(Setup {
        made,
        held,
        held_migrations,
    })
}
