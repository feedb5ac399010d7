//! `outbox dead-letters`: list, show, retry or discard dead letters, chosen by id, event type,
//! aggregate, or all of them.

use std::time::Duration;

use clap::{Args, Subcommand};
use tracing::info;

use txoutbox_postgres::{DeadLetterDetail, DeadLetterFilter, OutboxTable, PostgresStore};

use super::{store, usage, Failure};
use crate::config::Config;

/// Which dead letters: one of --id, --event-type, --aggregate-type (with --aggregate-id or not),
/// --all.
#[derive(Debug, Args)]
pub struct Selection {
    /// These event ids (repeatable).
    #[arg(long = "id", value_name = "UUID")]
    pub ids: Vec<uuid::Uuid>,
    /// Every dead letter of this event type.
    #[arg(long)]
    pub event_type: Option<String>,
    /// Every dead letter of this aggregate type (with --aggregate-id, of that aggregate only).
    #[arg(long)]
    pub aggregate_type: Option<String>,
    /// With --aggregate-type: the aggregate's id.
    #[arg(long, requires = "aggregate_type")]
    pub aggregate_id: Option<String>,
    /// Every dead letter.
    #[arg(long)]
    pub all: bool,
}

/// `dead-letters` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// List dead letters, oldest first (all of them unless --id, --event-type or --aggregate-type
    /// narrows, or --older-than).
    List {
        /// Which ones.
        #[command(flatten)]
        selection: Selection,
        /// Only those dead-lettered longer ago than this (e.g. 1h, 2d).
        #[arg(long, value_name = "DURATION", value_parser = txoutbox_core::duration::parse)]
        older_than: Option<Duration>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print one dead letter whole: payload, headers, destination, error, and how many events of its
    /// aggregate wait behind its first dead letter.
    Show {
        /// The dead letter's event id.
        #[arg(long)]
        id: uuid::Uuid,
        /// Machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make dead letters pending again (attempts reset, last error kept).
    Retry {
        /// Which ones (one of --id, --event-type, --aggregate-type, --all).
        #[command(flatten)]
        selection: Selection,
        /// Confirm --all.
        #[arg(long)]
        yes: bool,
    },
    /// Delete dead letters for good.
    Discard {
        /// Which ones (one of --id, --event-type, --aggregate-type, --all).
        #[command(flatten)]
        selection: Selection,
        /// Confirm --all.
        #[arg(long)]
        yes: bool,
    },
}

fn filter_of(selection: &Selection, yes: bool, action: &str) -> Result<DeadLetterFilter, Failure> {
    let given = [
        !selection.ids.is_empty(),
        selection.event_type.is_some(),
        selection.aggregate_type.is_some(),
        selection.all,
    ];
    if given.iter().filter(|g| **g).count() > 1 {
        return Err(usage(format!(
            "`dead-letters {action}` takes one of --id, --event-type, --aggregate-type or --all"
        )));
    }
    if !selection.ids.is_empty() {
        return Ok(DeadLetterFilter::Ids(selection.ids.clone()));
    }
    if let Some(t) = &selection.event_type {
        return Ok(DeadLetterFilter::EventType(t.clone()));
    }
    if let Some(t) = &selection.aggregate_type {
        return Ok(DeadLetterFilter::Aggregate {
            aggregate_type: t.clone(),
            aggregate_id: selection.aggregate_id.clone(),
        });
    }
    if selection.all {
        if !yes {
            return Err(usage(format!(
                "`dead-letters {action} --all` changes every dead letter: add --yes to confirm"
            )));
        }
        return Ok(DeadLetterFilter::All);
    }
    Err(usage(format!(
        "`dead-letters {action}` needs --id <UUID>, --event-type <TYPE>, --aggregate-type <TYPE> [--aggregate-id <ID>] or --all --yes"
    )))
}

pub(super) async fn cmd_dead_letters(
    config: &Config,
    table: OutboxTable,
    command: DeadLetterCommand,
) -> Result<(), Failure> {
    let pg = store(config, table).await?;
    match command {
        DeadLetterCommand::List {
            selection,
            older_than,
            limit,
            json,
        } => list(&pg, &selection, older_than, limit, json).await,
        DeadLetterCommand::Show { id, json } => show(&pg, id, json).await,
        DeadLetterCommand::Retry { selection, yes } => {
            let filter = filter_of(&selection, yes, "retry")?;
            let n = pg.retry_dead_letters(&filter).await?;
            info!(count = n, filter = ?filter, "dead letters made pending again");
            println!("retrying {n} dead letters");
            Ok(())
        }
        DeadLetterCommand::Discard { selection, yes } => {
            let filter = filter_of(&selection, yes, "discard")?;
            let n = pg.discard_dead_letters(&filter).await?;
            info!(count = n, filter = ?filter, "dead letters discarded");
            println!("discarded {n} dead letters");
            Ok(())
        }
    }
}

/// `dead-letters list`: one line each (or JSON), those `selection` names, else all.
async fn list(
    pg: &PostgresStore,
    selection: &Selection,
    older_than: Option<Duration>,
    limit: i64,
    json: bool,
) -> Result<(), Failure> {
    let filter = if !selection.ids.is_empty()
        || selection.event_type.is_some()
        || selection.aggregate_type.is_some()
    {
        filter_of(selection, true, "list")?
    } else {
        DeadLetterFilter::All
    };
    let rows = pg.dead_letters(&filter, older_than, limit).await?;
    if json {
        println!(
            "{}",
            serde_json::to_string(&rows).unwrap_or_else(|_| "[]".into())
        );
        return Ok(());
    }
    if rows.is_empty() {
        println!("no dead letters");
    }
    for d in rows {
        println!(
            "{}  {}  {}/{}  attempts={}  dead since {}\n    {}",
            d.id,
            d.event_type,
            d.aggregate_type,
            d.aggregate_id,
            d.attempts,
            d.dead_lettered_at
                .map(|t| t.to_rfc3339())
                .unwrap_or_default(),
            d.last_error.unwrap_or_default()
        );
    }
    Ok(())
}

/// `dead-letters show`: one dead letter whole (or as JSON).
async fn show(pg: &PostgresStore, id: uuid::Uuid, json: bool) -> Result<(), Failure> {
    let Some(d) = pg.dead_letter(id).await? else {
        return Err(Failure {
            code: 1,
            message: format!("no dead letter with id {id} (outbox dead-letters list shows them)"),
        });
    };
    let payload = match std::str::from_utf8(&d.event.payload) {
        Ok(text) => serde_json::Value::String(text.to_string()),
        Err(_) => serde_json::Value::Null,
    };
    let payload_hex = payload.is_null().then(|| {
        d.event
            .payload
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    });
    if json {
        let v = serde_json::json!({
            "id": d.letter.id,
            "aggregate_type": d.letter.aggregate_type,
            "aggregate_id": d.letter.aggregate_id,
            "event_type": d.letter.event_type,
            "attempts": d.letter.attempts,
            "last_error": d.letter.last_error,
            "created_at": d.letter.created_at,
            "dead_lettered_at": d.letter.dead_lettered_at,
            "destination": d.event.destination,
            "content_type": d.event.content_type,
            "headers": d.event.headers,
            "payload": payload,
            "payload_hex": payload_hex,
            "held_back": d.held_back,
            "blocking": d.blocking,
        });
        println!("{v}");
        return Ok(());
    }
    print_letter(&d, &payload, payload_hex.as_deref());
    Ok(())
}

/// A dead letter for a terminal: its fields, then its payload as text with control characters
/// escaped (or in hex when it is not UTF-8).
fn print_letter(d: &DeadLetterDetail, payload: &serde_json::Value, payload_hex: Option<&str>) {
    let l = &d.letter;
    println!("dead letter {}", l.id);
    println!("  aggregate:     {}/{}", l.aggregate_type, l.aggregate_id);
    println!("  event type:    {}", l.event_type);
    println!("  attempts:      {}", l.attempts);
    println!("  written:       {}", l.created_at.to_rfc3339());
    if let Some(at) = l.dead_lettered_at {
        println!("  dead since:    {}", at.to_rfc3339());
    }
    println!(
        "  destination:   {}",
        d.event
            .destination
            .as_deref()
            .unwrap_or("(the configured routing)")
    );
    println!(
        "  last error:    {}",
        l.last_error.as_deref().unwrap_or("").escape_default()
    );
    let behind = if d.blocking == l.id {
        "behind this dead letter, the first of its aggregate".to_string()
    } else {
        format!("behind {}, the aggregate's first dead letter", d.blocking)
    };
    println!(
        "  held back:     {} later events of its aggregate, {behind}",
        d.held_back
    );
    println!("  content type:  {}", d.event.content_type);
    println!("  headers:");
    for (k, v) in &d.event.headers {
        println!("    {k}: {v}");
    }
    // Shown as text with control characters escaped (a terminal is not a place for them),
    // at most 64 KiB of it; --json gives it all.
    const SHOWN: usize = 64 * 1024;
    let size = d.event.payload.len();
    match (payload.as_str(), &payload_hex) {
        (Some(text), _) => {
            let shown: String = text
                .chars()
                .take(SHOWN)
                .flat_map(|c| match c {
                    '\n' | '\t' => vec![c],
                    c if c.is_control() => c.escape_default().collect(),
                    c => vec![c],
                })
                .collect();
            println!("  payload ({size} bytes):\n{shown}");
        }
        (None, Some(hex)) => println!(
            "  payload ({size} bytes, not UTF-8, hex):\n{}",
            &hex[..hex.len().min(2 * SHOWN)]
        ),
        _ => {}
    }
    if size > SHOWN {
        println!("  (first {SHOWN} bytes shown; --json prints it all)");
    }
}
