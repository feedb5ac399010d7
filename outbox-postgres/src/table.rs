//! Where the outbox lives: schema and table names, validated as identifiers.

use txoutbox_core::{Error, ErrorKind};

/// Default schema.
pub const DEFAULT_SCHEMA: &str = "public";
/// Default table, the classic name.
pub const DEFAULT_TABLE: &str = "outbox_events";

const MAX_TABLE_LEN: usize = 40;
const MAX_SCHEMA_LEN: usize = 63;

/// A validated schema + table pair. Names are lower-case identifiers (`[a-z_][a-z0-9_]*`), so they are
/// safe to place in SQL; they are quoted anyway.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OutboxTable {
    schema: String,
    table: String,
}

impl Default for OutboxTable {
    fn default() -> Self {
        OutboxTable {
            schema: DEFAULT_SCHEMA.into(),
            table: DEFAULT_TABLE.into(),
        }
    }
}

fn check_identifier(key: &str, value: &str, max: usize) -> Result<(), Error> {
    let mut chars = value.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !first_ok || !rest_ok || value.len() > max {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "{key} = {value:?} is not a valid name: expected 1 to {max} characters of a-z, 0-9 and _, not starting with a digit (for example \"outbox_events\")"
            ),
        ));
    }
    Ok(())
}

impl OutboxTable {
    /// The table `table` in schema `schema`.
    ///
    /// # Errors
    /// A config error naming the key when a name is not a plain lower-case identifier (table names
    /// are limited to 40 characters so that index names derived from them fit).
    pub fn new(schema: impl Into<String>, table: impl Into<String>) -> Result<Self, Error> {
        Self::named("database", schema, table)
    }

    /// As [`OutboxTable::new`], for a table configured elsewhere: errors name `<section>.schema` and
    /// `<section>.table` (the inbox's table is `inbox.table`, not `database.table`).
    ///
    /// # Errors
    /// As [`OutboxTable::new`].
    pub fn named(
        section: &str,
        schema: impl Into<String>,
        table: impl Into<String>,
    ) -> Result<Self, Error> {
        let (schema, table) = (schema.into(), table.into());
        check_identifier(&format!("{section}.schema"), &schema, MAX_SCHEMA_LEN)?;
        check_identifier(&format!("{section}.table"), &table, MAX_TABLE_LEN)?;
        Ok(OutboxTable { schema, table })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// `"schema"."table"`.
    pub fn qualified(&self) -> String {
        format!("\"{}\".\"{}\"", self.schema, self.table)
    }

    /// The dead-letters view name: `outbox_dead_letters` for `outbox_events`, else `<table>_dead_letters`.
    pub fn dead_letters_view(&self) -> String {
        match self.table.strip_suffix("_events") {
            Some(stem) => format!("{stem}_dead_letters"),
            None => format!("{}_dead_letters", self.table),
        }
    }

    /// A name derived from the table (`<table>_<suffix>`), qualified with the schema.
    pub(crate) fn qualified_derived(&self, suffix: &str) -> String {
        format!("\"{}\".\"{}_{suffix}\"", self.schema, self.table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        let t = OutboxTable::new("billing", "outbox_events").unwrap();
        assert_eq!(t.qualified(), "\"billing\".\"outbox_events\"");
        assert_eq!(t.dead_letters_view(), "outbox_dead_letters");
        assert_eq!(
            OutboxTable::new("s", "events2")
                .unwrap()
                .dead_letters_view(),
            "events2_dead_letters"
        );
        assert_eq!(
            OutboxTable::default().qualified(),
            "\"public\".\"outbox_events\""
        );
    }

    #[test]
    fn rejects_anything_else_naming_the_key() {
        for (schema, table, key) in [
            ("public", "outbox; DROP TABLE users", "database.table"),
            ("public", "Outbox", "database.table"),
            ("public", "1outbox", "database.table"),
            ("public", "", "database.table"),
            (
                "public",
                "a_very_long_table_name_that_goes_on_and_on",
                "database.table",
            ),
            ("pub\"lic", "outbox_events", "database.schema"),
            ("", "outbox_events", "database.schema"),
        ] {
            let err = OutboxTable::new(schema, table).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Config);
            assert!(err.message().starts_with(key), "{err}");
            assert!(err.message().contains("expected"), "{err}");
        }
    }
}
