//! The held table's marks: work a reader has not finished, kept across a crash in a row of the held
//! table (already processed, so never claimed; `outbox cleanup` leaves it), one per kind, written
//! and read the same way whatever the kind. A fallback not finished ([`Mark::Fallback`],
//! [`FallbackMark`]) and a large transaction handed over in parts ([`Mark::Spill`],
//! `held::SpillMark`) each keep a small JSON object there.

use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::Error;

use super::taken::Taken;
use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// The aggregate and event type of the held table's fallback mark row (a fallback not finished).
pub const FALLBACK_MARK_TYPE: &str = "(wal fallback mark)";

/// The aggregate and event type of the held table's spill mark row (a large transaction being
/// handed over).
pub const SPILL_MARK_TYPE: &str = "(wal spill mark)";

/// A kind of mark: its row's id and type are fixed, so that each kind has one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mark {
    /// A fallback to the outbox table not finished.
    Fallback,
    /// A transaction too large to hold whole, handed over in parts.
    Spill,
}

impl Mark {
    /// Every kind.
    #[cfg(test)]
    const ALL: [Mark; 2] = [Mark::Fallback, Mark::Spill];

    const fn id(self) -> Uuid {
        match self {
            Mark::Fallback => Uuid::from_u128(0x6f75_7462_6f78_2d77_616c_2d66_656e_6365),
            Mark::Spill => Uuid::from_u128(0x6f75_7462_6f78_2d77_616c_2d73_7069_6c6c),
        }
    }

    /// Its row's aggregate and event type.
    pub(super) const fn type_name(self) -> &'static str {
        match self {
            Mark::Fallback => FALLBACK_MARK_TYPE,
            Mark::Spill => SPILL_MARK_TYPE,
        }
    }

    /// The mark's content in `held`, if there is one.
    ///
    /// # Errors
    /// A database error.
    pub(super) async fn load(
        self,
        conn: &mut PgConnection,
        held: &OutboxTable,
    ) -> Result<Option<serde_json::Value>, Error> {
        sqlx::query_scalar(&format!(
            "SELECT payload FROM {} WHERE id = $1",
            held.qualified()
        ))
        .bind(self.id())
        .fetch_optional(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal held table mark", e))
    }

    /// Writes the mark with `content` (the slot it is of as its aggregate id), replacing the one
    /// there; in the caller's transaction when `conn` is one.
    ///
    /// # Errors
    /// A database error.
    pub(super) async fn save(
        self,
        conn: &mut PgConnection,
        held: &OutboxTable,
        slot: &str,
        content: serde_json::Value,
    ) -> Result<(), Error> {
        sqlx::query(&format!(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, processed_at)
             VALUES ($1, $2, $3, $2, $4, now())
             ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload, processed_at = now()",
            held.qualified()
        ))
        .bind(self.id())
        .bind(self.type_name())
        .bind(slot)
        .bind(content)
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal held table mark", e))?;
        Ok(())
    }

    /// Removes the mark.
    ///
    /// # Errors
    /// A database error.
    pub(super) async fn clear(
        self,
        conn: &mut PgConnection,
        held: &OutboxTable,
    ) -> Result<(), Error> {
        sqlx::query(&format!("DELETE FROM {} WHERE id = $1", held.qualified()))
            .bind(self.id())
            .execute(&mut *conn)
            .await
            .map_err(|e| map_sqlx("wal held table mark", e))?;
        Ok(())
    }
}

/// A fallback to the outbox table that has not finished, kept in the held table (one row, already
/// processed, never claimed; `outbox cleanup` leaves it): `fence` is `None` while no slot can be
/// streamed, then the largest `seq` that may have committed before the slot's consistent point.
/// A reader that finds it moves the rows up to the fence before it streams, whichever relay wrote
/// it; `outbox wal setup` writes one when it makes the slot ([`mark_new_slot`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct FallbackMark {
    pub(super) fence: Option<i64>,
    /// The slot's transactions whose table-less events are in the held table already, beyond its
    /// confirmed position (see `wal::tableless`).
    pub(super) taken: Taken,
}

impl FallbackMark {
    /// The held table's mark, if any.
    pub(super) async fn load(
        conn: &mut PgConnection,
        held: &OutboxTable,
    ) -> Result<Option<FallbackMark>, Error> {
        Ok(Mark::Fallback
            .load(conn, held)
            .await?
            .map(|p| FallbackMark {
                fence: p.get("fence").and_then(serde_json::Value::as_i64),
                taken: p
                    .get("taken")
                    .and_then(|t| serde_json::from_value(t.clone()).ok())
                    .unwrap_or_default(),
            }))
    }

    /// Writes the mark; in the caller's transaction when `conn` is one.
    pub(super) async fn save(
        &self,
        conn: &mut PgConnection,
        held: &OutboxTable,
        slot: &str,
    ) -> Result<(), Error> {
        let content = if self.taken.is_empty() {
            serde_json::json!({ "fence": self.fence })
        } else {
            serde_json::json!({ "fence": self.fence, "taken": self.taken })
        };
        Mark::Fallback.save(conn, held, slot, content).await
    }

    pub(super) async fn clear(conn: &mut PgConnection, held: &OutboxTable) -> Result<(), Error> {
        Mark::Fallback.clear(conn, held).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marks_of_the_held_table_are_what_cleanup_leaves() {
        let (prefix, suffix) = crate::row::MARK_TYPES
            .split_once('%')
            .expect("a LIKE pattern");
        for mark in Mark::ALL {
            let name = mark.type_name();
            assert!(name.starts_with(prefix) && name.ends_with(suffix), "{name}");
        }
        assert_ne!(Mark::Fallback.id(), Mark::Spill.id());
        assert!(
            !crate::row::MARK_TYPES.contains('_'),
            "no single-character wildcard"
        );
    }
}
