//! `outbox cleanup`: removes published rows kept longer than `--older-than` (default
//! `database.keep_processed_for`), in delete statements of `--batch-size` rows each.

use std::time::Duration;

use tracing::info;

use txoutbox_postgres::OutboxTable;

use super::{store, usage, Failure};
use crate::config::Config;

pub(super) async fn cmd_cleanup(
    config: &Config,
    table: OutboxTable,
    older_than: Option<Duration>,
    batch_size: Option<i64>,
) -> Result<(), Failure> {
    let batch_size = batch_size.unwrap_or(i64::from(config.database.cleanup_batch_size));
    let Some(older_than) = older_than.or(config.database.keep_processed_for) else {
        return Err(usage(
            "cleanup needs --older-than <DURATION> (or database.keep_processed_for in the configuration)",
        ));
    };
    if batch_size <= 0 {
        return Err(usage(format!(
            "--batch-size {batch_size}: expected a positive number"
        )));
    }
    let pg = store(config, table.clone()).await?;
    let total = pg
        .cleanup(older_than, batch_size, |n| {
            eprintln!("cleanup: removed {n} rows so far")
        })
        .await?;
    info!(removed = total, older_than = %txoutbox_core::duration::format(older_than), "cleanup done");
    println!(
        "removed {total} published rows older than {} from {}",
        txoutbox_core::duration::format(older_than),
        table.qualified()
    );
    Ok(())
}
