//! `outbox wal`: the WAL source's publication and replication slot: setup, status (lag, retained
//! WAL, a warning above `wal.retained_wal_warning`) and drop.

use clap::Subcommand;
use tracing::{info, warn};

use txoutbox_postgres::wal::WalSlot;
use txoutbox_postgres::{connect_config, OutboxTable};

use super::{usage, Failure};
use crate::config::Config;

/// `wal` subcommands.
#[derive(Debug, Subcommand)]
pub enum WalCommand {
    /// Create the publication (the outbox table's inserts) and the logical replication slot, each
    /// unless it exists (needs wal_level = logical).
    Setup,
    /// Show the slot: whether it exists and is read, its lag (bytes, and seconds since the oldest
    /// transaction it holds committed) and the WAL it keeps on disk; warns above
    /// wal.retained_wal_warning.
    Status {
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot and the publication (stop the relays reading it first). WAL the slot kept is
    /// released; events it held that were not published are not published by it any more.
    Drop {
        /// Confirm.
        #[arg(long)]
        yes: bool,
    },
}

pub(super) async fn cmd_wal(
    config: &Config,
    table: OutboxTable,
    command: WalCommand,
) -> Result<(), Failure> {
    let slot = config.wal.slot(&table)?;
    let pool = connect_config(&config.database).await?;
    match command {
        WalCommand::Setup => {
            let txoutbox_postgres::wal::Setup {
                made: created,
                held,
                held_migrations: applied,
            } = txoutbox_postgres::wal::setup(&pool, &table, &config.wal).await?;
            let said = |made: bool| if made { "created" } else { "exists" };
            println!(
                "publication {}: {}\nslot {}: {}\nheld table {}: {}",
                slot.publication(),
                said(created.publication),
                slot.slot(),
                said(created.slot),
                held.qualified(),
                if applied.is_empty() {
                    "up to date".to_string()
                } else {
                    format!("applied migrations {applied:?}")
                }
            );
            info!(
                slot = slot.slot(),
                publication = slot.publication(),
                ?created,
                "wal setup"
            );
            Ok(())
        }
        WalCommand::Status { json } => wal_status(config, &slot, &pool, json).await,
        WalCommand::Drop { yes } => {
            if !yes {
                return Err(usage(format!(
                    "wal drop removes the slot {} and the publication {}; events they hold that are not published yet are not published by them any more: add --yes to confirm",
                    slot.slot(),
                    slot.publication()
                )));
            }
            let dropped = slot.drop(&pool).await?;
            let said = |gone: bool| if gone { "dropped" } else { "absent" };
            println!(
                "slot {}: {}\npublication {}: {}",
                slot.slot(),
                said(dropped.slot),
                slot.publication(),
                said(dropped.publication)
            );
            info!(slot = slot.slot(), ?dropped, "wal drop");
            Ok(())
        }
    }
}

/// `outbox wal status`: where the slot stands (or as JSON), with a warning while it keeps more WAL
/// than `wal.retained_wal_warning`.
async fn wal_status(
    config: &Config,
    slot: &WalSlot,
    pool: &sqlx::PgPool,
    json: bool,
) -> Result<(), Failure> {
    let status = slot.status(pool).await?;
    let too_much = status.retains_too_much(config.wal.retained_wal_warning);
    if json {
        let mut value = serde_json::to_value(&status).map_err(|e| Failure {
            code: 1,
            message: format!("cannot render the status: {e}"),
        })?;
        value["retains_too_much"] = too_much.into();
        println!("{value}");
    } else {
        print!("{}", wal_status_text(&status));
    }
    if too_much {
        warn!(
            slot = slot.slot(),
            retained_bytes = status.retained_bytes,
            wal_status = status.wal_status.as_deref(),
            limit = config.wal.retained_wal_warning,
            "the slot keeps more WAL than wal.retained_wal_warning (or is losing WAL): read it (outbox relay with the WAL source) or drop it (outbox wal drop), before the disk fills"
        );
        eprintln!(
            "WARNING: slot {} keeps {} of WAL (wal.retained_wal_warning = {}): read it or drop it (outbox wal drop) before the disk fills",
            slot.slot(),
            status.retained_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
            bytes_text(config.wal.retained_wal_warning)
        );
    }
    Ok(())
}

/// `bytes` for a person: B, KiB, MiB or GiB.
fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `outbox wal status` for a person.
fn wal_status_text(s: &txoutbox_postgres::wal::WalStatus) -> String {
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let mut out = format!(
        "wal_level:    {}\npublication:  {} ({})\nslot:         {} ({})\n",
        s.wal_level,
        s.publication,
        if s.publication_exists {
            "exists"
        } else {
            "missing"
        },
        s.slot,
        if s.slot_exists { "exists" } else { "missing" }
    );
    if s.slot_exists {
        out += &format!(
            "read now:     {}{}\nconfirmed:    {}\nlag:          {}{}\nretained WAL: {} (wal_status {})\n",
            yes_no(s.active),
            s.active_pid.map_or(String::new(), |p| format!(" (pid {p})")),
            s.confirmed_lsn.as_deref().unwrap_or("?"),
            s.lag_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
            match (s.lag_seconds, &s.lag_unknown) {
                (Some(secs), _) => format!(", {secs:.1} s since the oldest unconfirmed commit"),
                (None, Some(why)) => format!(", seconds unknown: {why}"),
                (None, None) => ", seconds unknown".into(),
            },
            s.retained_bytes.map_or("?".into(), |b| bytes_text(b.max(0) as u64)),
            s.wal_status.as_deref().unwrap_or("?")
        );
    }
    out
}
