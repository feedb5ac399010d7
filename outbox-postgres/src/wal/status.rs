//! Where a slot stands: its positions (cheap, for every metrics refresh) and the status of
//! `outbox wal status` (who reads it, its lag in bytes and seconds, the WAL it keeps).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};

use txoutbox_core::Error;

use super::decode::WalReader;
use super::slot::{wal_level, WalSlot};
use crate::error::map_sqlx;

impl WalSlot {
    /// The slot's lag and retained WAL in bytes, and its `wal_status`, without reading it (cheap
    /// enough for every metrics refresh): `None` when the slot does not exist in this database.
    ///
    /// # Errors
    /// A database error.
    pub async fn positions(&self, pool: &PgPool) -> Result<Option<SlotPositions>, Error> {
        let row: Option<(Option<i64>, Option<i64>, Option<String>)> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint, s.wal_status
             FROM pg_replication_slots s
             WHERE s.slot_name = $1 AND s.database = current_database()",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await
        .map_err(|e| map_sqlx("wal status", e))?;
        Ok(row.map(|(lag, retained, wal_status)| SlotPositions {
            lag_bytes: lag.unwrap_or(0),
            retained_bytes: retained.unwrap_or(0),
            wal_status,
        }))
    }

    /// Where the slot stands: whether it and the publication exist, who reads it, how far behind
    /// the server's WAL it is (bytes, and seconds since the oldest transaction it has not
    /// confirmed committed), and how much WAL it keeps on disk.
    ///
    /// # Errors
    /// A database error.
    pub async fn status(&self, pool: &PgPool) -> Result<WalStatus, Error> {
        let map = |e| map_sqlx("wal status", e);
        let wal_level = wal_level(pool).await?;
        let publication = !self.publication_missing(pool).await?;
        // A slot of this name in another database is refused, not reported as this outbox's.
        self.slot_here(pool).await?;
        let row = sqlx::query(
            "SELECT s.active, s.active_pid,
                    s.confirmed_flush_lsn::text AS confirmed_lsn, s.restart_lsn::text AS restart_lsn,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint AS lag_bytes,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn)::bigint AS retained_bytes,
                    s.wal_status, s.safe_wal_size
             FROM pg_replication_slots s WHERE s.slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(pool)
        .await
        .map_err(map)?;
        let mut status = WalStatus {
            slot: self.slot.clone(),
            publication: self.publication.clone(),
            wal_level,
            publication_exists: publication,
            ..WalStatus::default()
        };
        let Some(row) = row else {
            return Ok(status);
        };
        status.slot_exists = true;
        status.active = row.try_get("active").map_err(map)?;
        status.active_pid = row.try_get("active_pid").map_err(map)?;
        status.confirmed_lsn = row.try_get("confirmed_lsn").map_err(map)?;
        status.restart_lsn = row.try_get("restart_lsn").map_err(map)?;
        status.lag_bytes = row.try_get("lag_bytes").map_err(map)?;
        status.retained_bytes = row.try_get("retained_bytes").map_err(map)?;
        status.wal_status = row.try_get("wal_status").map_err(map)?;
        status.safe_wal_size = row.try_get("safe_wal_size").map_err(map)?;
        status.covers_table = publication && self.publication_covers_table(pool).await?;
        let lost = status.wal_status.as_deref() == Some("lost");
        if !status.covers_table {
            status.lag_unknown = Some(
                "the publication does not hold the outbox table (run `outbox wal setup`)".into(),
            );
        } else if lost {
            status.lag_unknown = Some(
                "the slot lost WAL it needed (wal_status lost): drop it and set it up again".into(),
            );
        } else if status.active {
            status.lag_unknown = Some("a reader holds the slot right now".into());
        } else {
            match self.oldest_unconfirmed_commit(pool).await {
                Ok(Some(Some(t))) => {
                    status.oldest_unconfirmed_commit = Some(t);
                    status.lag_seconds =
                        Some((Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0);
                }
                Ok(Some(None)) => status.lag_seconds = Some(0.0),
                Ok(None) => {
                    status.lag_unknown = Some(format!(
                        "none of the first {STATUS_PEEK} changes the slot holds is this outbox's"
                    ));
                }
                Err(e) => status.lag_unknown = Some(format!("the slot could not be read: {e}")),
            }
        }
        Ok(status)
    }

    /// The commit time of the first transaction the slot holds with an event of this outbox (a row
    /// of its table or a message with its prefix) that is not confirmed: `Some(Some(t))`;
    /// `Some(None)` when the slot holds none; `None` when the first [`STATUS_PEEK`] changes held
    /// none of this outbox's but there are more. Nothing is consumed.
    async fn oldest_unconfirmed_commit(
        &self,
        pool: &PgPool,
    ) -> Result<Option<Option<DateTime<Utc>>>, Error> {
        let peek = WalReader::new(self.clone()).peek(pool, STATUS_PEEK).await?;
        let first = peek
            .transactions
            .iter()
            .find(|t| !t.items.is_empty())
            .map(|t| t.commit_time);
        Ok(match first {
            Some(t) => Some(Some(t)),
            None if peek.cut => None,
            None => Some(None),
        })
    }
}

/// How many changes `outbox wal status` reads to find the oldest unconfirmed event.
pub const STATUS_PEEK: i32 = 1000;

/// A slot's positions ([`WalSlot::positions`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SlotPositions {
    /// Bytes of WAL written since the confirmed position.
    pub lag_bytes: i64,
    /// Bytes of WAL the slot keeps (from its restart position).
    pub retained_bytes: i64,
    /// PostgreSQL's `wal_status` of the slot.
    pub wal_status: Option<String>,
}

impl SlotPositions {
    /// Whether the slot keeps more than `limit` bytes of WAL, or is losing WAL it needs.
    pub fn retains_too_much(&self, limit: u64) -> bool {
        u64::try_from(self.retained_bytes).unwrap_or(0) > limit
            || matches!(self.wal_status.as_deref(), Some("unreserved" | "lost"))
    }
}

/// Where a slot stands ([`WalSlot::status`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct WalStatus {
    /// The slot's name.
    pub slot: String,
    /// The publication's name.
    pub publication: String,
    /// The server's `wal_level` (the WAL source needs `logical`).
    pub wal_level: String,
    /// Whether the publication exists.
    pub publication_exists: bool,
    /// Whether the slot exists.
    pub slot_exists: bool,
    /// Whether a session reads the slot right now.
    pub active: bool,
    /// That session's process id.
    pub active_pid: Option<i32>,
    /// The position confirmed: everything before it is settled.
    pub confirmed_lsn: Option<String>,
    /// The oldest WAL position the slot keeps.
    pub restart_lsn: Option<String>,
    /// Bytes of WAL written since the confirmed position.
    pub lag_bytes: Option<i64>,
    /// Seconds since the commit of the oldest transaction of this outbox not confirmed (0 when
    /// there is none; `None` when it cannot be told, see [`WalStatus::lag_unknown`]).
    pub lag_seconds: Option<f64>,
    /// Why the lag in seconds cannot be told, when it cannot.
    pub lag_unknown: Option<String>,
    /// Whether the publication holds the outbox table (it must, for the slot to carry its rows).
    pub covers_table: bool,
    /// The commit time of that transaction.
    pub oldest_unconfirmed_commit: Option<DateTime<Utc>>,
    /// Bytes of WAL the slot keeps on disk (from its restart position).
    pub retained_bytes: Option<i64>,
    /// PostgreSQL's `wal_status` of the slot: `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Bytes that can still be written before the slot is in danger (`max_slot_wal_keep_size`;
    /// `None` when unlimited).
    pub safe_wal_size: Option<i64>,
}

impl WalStatus {
    /// Whether the slot keeps more than `limit` bytes of WAL, or is losing WAL it needs.
    pub fn retains_too_much(&self, limit: u64) -> bool {
        let over = self
            .retained_bytes
            .is_some_and(|b| u64::try_from(b).unwrap_or(0) > limit);
        let endangered = matches!(self.wal_status.as_deref(), Some("unreserved" | "lost"));
        over || endangered
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::config::DEFAULT_RETAINED_WAL_WARNING;

    #[test]
    fn too_much_retained_wal_or_an_endangered_slot_warns() {
        let s = WalStatus {
            retained_bytes: Some(2 << 30),
            ..WalStatus::default()
        };
        assert!(s.retains_too_much(DEFAULT_RETAINED_WAL_WARNING));
        assert!(!s.retains_too_much(4 << 30));
        let lost = WalStatus {
            retained_bytes: Some(10),
            wal_status: Some("lost".into()),
            ..WalStatus::default()
        };
        assert!(lost.retains_too_much(DEFAULT_RETAINED_WAL_WARNING));
    }
}
