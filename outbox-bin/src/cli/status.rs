//! `outbox status`: pending events, the oldest pending age, dead letters and what they hold back,
//! by event type, as text or JSON.

use txoutbox_postgres::OutboxTable;

use super::{store, Failure};
use crate::config::Config;

pub(super) async fn cmd_status(
    config: &Config,
    table: OutboxTable,
    json: bool,
) -> Result<(), Failure> {
    let pg = store(config, table.clone()).await?;
    let stats = pg.stats_complete().await?.under(config.relay.ordering);
    if json {
        let v = serde_json::json!({ "table": table.qualified(), "stats": stats });
        println!("{v}");
        return Ok(());
    }
    println!("outbox {}", table.qualified());
    match stats.oldest_pending_age_seconds {
        Some(age) => println!("pending:      {} (oldest {:.1} s)", stats.pending, age),
        None => println!("pending:      {}", stats.pending),
    }
    println!("dead letters: {}", stats.dead_letters);
    if stats.held_back > 0 {
        println!(
            "held back:    {} events of {} aggregates, behind their dead letters \
             (outbox dead-letters retry or discard releases them)",
            stats.held_back, stats.held_back_aggregates
        );
    }
    if !stats.by_event_type.is_empty() {
        println!();
        println!(
            "{:<40} {:>10} {:>10} {:>12}",
            "event type", "pending", "dead", "oldest (s)"
        );
        for t in &stats.by_event_type {
            let oldest = t
                .oldest_pending_age_seconds
                .map(|a| format!("{a:.1}"))
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<40} {:>10} {:>10} {:>12}",
                t.event_type, t.pending, t.dead_letters, oldest
            );
        }
    }
    Ok(())
}
