//! Schema migrations.
//!
//! The SQL lives in `outbox-postgres/migrations/` as plain files written for the default names
//! (`outbox_events` in the search path), so users of other migration tools can apply them as they
//! are. They are embedded with `sqlx::migrate!`; [`migrate`] renders them for the configured schema
//! and table and applies the ones not yet applied, recording them in `<table>_migrations` next to the
//! outbox table (not in `_sqlx_migrations`, so the application's own sqlx migrations are untouched).

use sqlx::migrate::Migrator;
use sqlx::{Executor, PgPool};

use txoutbox_core::{Error, ErrorKind};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// The embedded migrations, as written for the default names.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// One migration rendered for a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedMigration {
    /// Version (from the file name).
    pub version: i64,
    /// Description (from the file name).
    pub description: String,
    /// The SQL, with names replaced by the configured ones.
    pub sql: String,
}

/// Replaces the default names in `sql` with the table's names: `outbox_events` becomes the qualified
/// table, `outbox_dead_letters` the qualified view, and `outbox_events_<suffix>` (index names) becomes
/// `<table>_<suffix>`.
pub fn render_sql(sql: &str, table: &OutboxTable) -> String {
    render_names(sql, "outbox_events", Some("outbox_dead_letters"), table)
}

/// Replaces `default` (the table as written in a migration file) with `table`'s qualified name,
/// `<default>_<suffix>` with `<table>_<suffix>`, and `view` (if any) with the table's dead-letters view.
pub(crate) fn render_names(
    sql: &str,
    default: &str,
    view: Option<&str>,
    table: &OutboxTable,
) -> String {
    let prefix = format!("{default}_");
    let mut out = String::with_capacity(sql.len() + 64);
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word == default {
            out.push_str(&table.qualified());
        } else if Some(word.as_str()) == view {
            out.push_str(&format!(
                "\"{}\".\"{}\"",
                table.schema(),
                table.dead_letters_view()
            ));
        } else if let Some(rest) = word.strip_prefix(prefix.as_str()) {
            out.push_str(&format!("\"{}_{rest}\"", table.table()));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in sql.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Every embedded migration, rendered for `table`, in version order.
pub fn rendered(table: &OutboxTable) -> Vec<RenderedMigration> {
    MIGRATOR
        .iter()
        .map(|m| RenderedMigration {
            version: m.version,
            description: m.description.to_string(),
            sql: render_sql(&m.sql, table),
        })
        .collect()
}

/// The whole schema as one SQL script for `table` (what `outbox migrate --print` shows).
pub fn schema_sql(table: &OutboxTable) -> String {
    let mut s = format!("CREATE SCHEMA IF NOT EXISTS \"{}\";\n\n", table.schema());
    for m in rendered(table) {
        s.push_str(&format!("-- migration {} {}\n", m.version, m.description));
        s.push_str(m.sql.trim_end());
        s.push_str("\n\n");
    }
    s
}

fn checksum(sql: &str) -> String {
    // FNV-1a 64: stable, dependency-free; detects edits of an applied migration.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in sql.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The versions of the migrations `table` has not had yet (all of them when it was never
/// migrated); reads only.
///
/// # Errors
/// A database error.
pub async fn pending(pool: &PgPool, table: &OutboxTable) -> Result<Vec<i64>, Error> {
    let bookkeeping = table.qualified_derived("migrations");
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&bookkeeping)
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("migration check", e))?;
    let applied: Vec<i64> = if exists {
        sqlx::query_scalar(&format!("SELECT version FROM {bookkeeping}"))
            .fetch_all(pool)
            .await
            .map_err(|e| map_sqlx("migration check", e))?
    } else {
        Vec::new()
    };
    Ok(rendered(table)
        .into_iter()
        .map(|m| m.version)
        .filter(|v| !applied.contains(v))
        .collect())
}

/// Applies the migrations not yet applied to `table`, in one transaction, and returns their versions.
///
/// Idempotent and safe to run from several processes at once, for one table or several tables of one
/// schema (an advisory lock per schema serialises them).
///
/// # Errors
/// A database error, or [`ErrorKind::Config`] when an applied migration differs from the embedded one.
pub async fn migrate(pool: &PgPool, table: &OutboxTable) -> Result<Vec<i64>, Error> {
    apply(pool, table, rendered(table)).await
}

/// Applies `migrations` (rendered for `table`) that `<table>_migrations` does not list yet.
pub(crate) async fn apply(
    pool: &PgPool,
    table: &OutboxTable,
    migrations: Vec<RenderedMigration>,
) -> Result<Vec<i64>, Error> {
    // `IF NOT EXISTS` and `IF EXISTS` make the server send a notice for each object already there or
    // not there yet ("schema ... already exists, skipping"): nothing a user migrating needs to read.
    let mut tx = pool
        .begin_with("BEGIN; SET LOCAL client_min_messages = warning")
        .await
        .map_err(|e| map_sqlx("migrate", e))?;
    // One migration at a time per schema, not only per table: `CREATE SCHEMA IF NOT EXISTS` is not
    // safe against itself (of two transactions creating the same new schema, the second fails with
    // 23505 once the first commits), and replicas starting at once may migrate two tables of one new
    // schema (two outbox tables, an outbox and its inbox or held table). Then the table's own lock,
    // always in that order: earlier releases took only the table's, and a rolling upgrade runs both.
    let schema_key = format!("outbox-migrate:\"{}\"", table.schema());
    let table_key = format!("outbox-migrate:{}", table.qualified());
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1)), pg_advisory_xact_lock(hashtext($2))")
        .bind(&schema_key)
        .bind(&table_key)
        .execute(&mut *tx)
        .await
        .map_err(|e| map_sqlx("migrate", e))?;
    let bookkeeping = table.qualified_derived("migrations");
    let setup = format!(
        "CREATE SCHEMA IF NOT EXISTS \"{}\";
         CREATE TABLE IF NOT EXISTS {bookkeeping} (
             version bigint PRIMARY KEY,
             description text NOT NULL,
             checksum text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );",
        table.schema()
    );
    (&mut *tx)
        .execute(sqlx::raw_sql(&setup))
        .await
        .map_err(|e| map_sqlx("migrate", e))?;
    let applied: Vec<(i64, String)> =
        sqlx::query_as(&format!("SELECT version, checksum FROM {bookkeeping}"))
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| map_sqlx("migrate", e))?;
    let mut done = Vec::new();
    for m in migrations {
        let sum = checksum(&m.sql);
        if let Some((_, old)) = applied.iter().find(|(v, _)| *v == m.version) {
            if *old != sum {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "migration {} ({}) of {} was applied with different SQL: restore the original migration file or fix {bookkeeping} by hand",
                        m.version,
                        m.description,
                        table.qualified()
                    ),
                ));
            }
            continue;
        }
        (&mut *tx)
            .execute(sqlx::raw_sql(&m.sql))
            .await
            .map_err(|e| map_sqlx("migrate", e).with_context("migration", m.version))?;
        sqlx::query(&format!(
            "INSERT INTO {bookkeeping} (version, description, checksum) VALUES ($1, $2, $3)"
        ))
        .bind(m.version)
        .bind(&m.description)
        .bind(&sum)
        .execute(&mut *tx)
        .await
        .map_err(|e| map_sqlx("migrate", e))?;
        done.push(m.version);
    }
    tx.commit().await.map_err(|e| map_sqlx("migrate", e))?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names() {
        let t = OutboxTable::new("billing", "events").unwrap();
        let sql = "CREATE INDEX outbox_events_pending_idx ON outbox_events (seq);\nDROP VIEW IF EXISTS outbox_dead_letters;\nSELECT my_outbox_events_x FROM outbox_events;";
        assert_eq!(
            render_sql(sql, &t),
            "CREATE INDEX \"events_pending_idx\" ON \"billing\".\"events\" (seq);\nDROP VIEW IF EXISTS \"billing\".\"events_dead_letters\";\nSELECT my_outbox_events_x FROM \"billing\".\"events\";"
        );
    }

    #[test]
    fn embedded_migrations_render_for_the_default_table() {
        let all = rendered(&OutboxTable::default());
        assert!(!all.is_empty());
        assert!(all[0]
            .sql
            .contains("CREATE TABLE IF NOT EXISTS \"public\".\"outbox_events\""));
        assert!(schema_sql(&OutboxTable::default()).contains("\"public\".\"outbox_dead_letters\""));
    }
}
