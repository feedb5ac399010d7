//! What a reading hands over again, and is not published twice: a slot is streamed from its
//! confirmed position, so a reading decodes again what an earlier one (this relay's or another's)
//! took in and did not confirm, and, after a fallback, rows that the fallback moved to the held
//! table. The outbox table tells: with `wal.delete_published` the WAL source deletes a row only once
//! its event is published or in the held table (or marks it processed where the database refuses
//! the delete). So a row event of a transaction committed before the reading started whose row is
//! gone (or processed) is not taken in again. Checked after a fallback and after a reading that
//! ended early: those publish nothing twice without a crash.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::Error;

use super::decode::WalTransaction;
use super::shared::Inner;
use super::taken::Taken;
use crate::error::map_sqlx;

/// The WAL position at which a reading started: transactions that committed before it may have
/// been dealt with already (see the module's documentation). `0` when nothing is checked
/// (`wal.delete_published = false`: the table keeps its rows, and nothing was moved from it).
#[derive(Debug, Clone, Default)]
pub(super) struct ReplayGuard {
    until: u64,
    /// The transactions whose table-less events the fallback put in the held table.
    taken: Taken,
}

impl ReplayGuard {
    /// The guard of a reading about to stream: after a fallback (`fell_back`, this relay's or one
    /// it finished for another), or once a reading of this relay ended after deleting rows it had
    /// not confirmed, the server's WAL insert position now (every transaction that committed
    /// before this call, every row a fallback moved, ends at or before it); otherwise none (a
    /// relay starting afresh reads what it reads again as a crash leaves it, and a backlog in the
    /// slot costs no check).
    ///
    /// # Errors
    /// A database error.
    pub(super) async fn at_start(
        inner: &Inner,
        conn: &mut PgConnection,
        fell_back: bool,
    ) -> Result<Self, Error> {
        let needed = fell_back || inner.left_unconfirmed.load(Ordering::SeqCst);
        if !inner.settings.delete_published || !needed {
            return Ok(ReplayGuard::default());
        }
        let until: i64 = sqlx::query_scalar(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                          ELSE pg_current_wal_insert_lsn() END - '0/0'::pg_lsn)::bigint",
        )
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal read", e))?;
        Ok(ReplayGuard {
            until: u64::try_from(until).unwrap_or(0),
            taken: Taken::default(),
        })
    }

    /// The guard, told which transactions' table-less events the fallback before it took.
    pub(super) fn with_taken(mut self, taken: Taken) -> Self {
        self.taken = taken;
        self
    }

    /// The ids of the table-less events of `t` the fallback took: not taken in again.
    pub(super) fn taken_in(&self, t: &WalTransaction) -> Vec<Uuid> {
        self.taken.taken_in(t)
    }

    /// Whether a transaction ending at `end_lsn` (a part's commit position) is checked.
    pub(super) fn covers(&self, end_lsn: u64) -> bool {
        end_lsn != 0 && end_lsn <= self.until
    }

    /// Of the rows `ids` (row events of transactions this guard covers), those whose row is gone
    /// from the outbox table or marked processed: their events are published or in the held table.
    ///
    /// # Errors
    /// A database error.
    pub(super) async fn dealt_with(
        &self,
        inner: &Inner,
        conn: &mut PgConnection,
        ids: &[Uuid],
    ) -> Result<HashSet<Uuid>, Error> {
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        let gone: Vec<Uuid> = sqlx::query_scalar(&format!(
            "SELECT u.id FROM unnest($1::uuid[]) AS u(id)
             WHERE NOT EXISTS (SELECT 1 FROM {} s WHERE s.id = u.id AND s.processed_at IS NULL)",
            inner.source.qualified()
        ))
        .bind(ids)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal read", e))?;
        Ok(gone.into_iter().collect())
    }
}
