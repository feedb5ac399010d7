//! `outbox migrate`: creates or upgrades the outbox table (and the WAL source's held table), and
//! installs or removes the NOTIFY trigger as `database.notify` says; `--print` shows the SQL.

use txoutbox_postgres::{connect_config, migrate, notify, schema_sql, OutboxTable, Source};

use super::Failure;
use crate::config::Config;

pub(super) async fn cmd_migrate(
    config: &Config,
    table: &OutboxTable,
    print: bool,
) -> Result<(), Failure> {
    if print {
        print!("{}", schema_sql(table));
        if config.database.notify {
            println!("-- database.notify = true: `outbox migrate` also installs a statement trigger calling pg_notify('{}', '')", notify::channel(table)?);
        }
        return Ok(());
    }
    let pool = connect_config(&config.database).await?;
    let applied = migrate(&pool, table).await?;
    if config.database.source == Source::Wal {
        let held = config.wal.held_table(table)?;
        let held_applied = migrate(&pool, &held).await?;
        if !held_applied.is_empty() {
            println!(
                "{} (the WAL source's held table): applied migrations {:?}",
                held.qualified(),
                held_applied
            );
        }
    }
    if config.database.notify {
        notify::install_notify_trigger(&pool, table).await?;
    } else {
        notify::remove_notify_trigger(&pool, table).await?;
    }
    if applied.is_empty() {
        println!("{} is up to date", table.qualified());
    } else {
        println!("{}: applied migrations {:?}", table.qualified(), applied);
    }
    Ok(())
}
