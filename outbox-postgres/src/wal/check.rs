//! Where the slot stands for the reader: what keeps it from being streamed ([`SlotProblem`]),
//! its confirmed position, and the identity of its publication and table ([`Identity`]), read in
//! one statement ([`check_slot`]); and the errors readiness and the log give for a slot that
//! cannot be streamed.

use std::sync::atomic::Ordering;

use sqlx::PgConnection;
use tracing::warn;

use txoutbox_core::{Error, ErrorKind};

use super::progress::FallbackReason;
use super::shared::Inner;
use crate::error::map_sqlx;

/// Why the slot cannot be streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotProblem {
    /// No slot of this name in this database (dropped, or not made after a failover).
    Missing,
    /// The slot lost WAL it needed (`wal_status = 'lost'`: `max_slot_wal_keep_size`).
    Lost,
    /// The publication does not exist.
    NoPublication,
    /// The publication does not hold the outbox table (removed from it, or the table dropped and
    /// made again): its inserts are not decoded.
    TableNotPublished,
}

impl SlotProblem {
    /// Whether the slot's WAL from its last confirmed position on is gone (table-less events of
    /// that range are not read by any slot).
    pub(super) fn loses_messages(self) -> bool {
        matches!(self, SlotProblem::Missing | SlotProblem::Lost)
    }

    /// The reason it gives the reader to fall back.
    pub(super) fn reason(self) -> FallbackReason {
        match self {
            SlotProblem::Missing => FallbackReason::SlotMissing,
            SlotProblem::Lost => FallbackReason::SlotLost,
            SlotProblem::NoPublication => FallbackReason::NoPublication,
            SlotProblem::TableNotPublished => FallbackReason::TableNotPublished,
        }
    }

    pub(super) fn describe(self, inner: &Inner) -> String {
        let slot = inner.reader.slot();
        match self {
            SlotProblem::Missing => format!(
                "the replication slot {} does not exist (dropped, or not made again after a failover)",
                slot.slot()
            ),
            SlotProblem::Lost => format!(
                "the replication slot {} lost WAL it needed (wal_status lost: max_slot_wal_keep_size)",
                slot.slot()
            ),
            SlotProblem::NoPublication => {
                format!("the publication {} does not exist", slot.publication())
            }
            SlotProblem::TableNotPublished => format!(
                "the publication {} does not hold {} (removed from it, or the table dropped and made again): its inserts are not decoded",
                slot.publication(),
                inner.source.qualified()
            ),
        }
    }
}

/// Where the slot stands for the reader: what keeps it from being streamed, and its confirmed
/// position.
pub(super) struct SlotCheck {
    pub(super) problem: Option<SlotProblem>,
    pub(super) confirmed: Option<u64>,
    /// The publication, its entry for the outbox table and the table (their oids): one that
    /// changes under a stream (the table removed from the publication and added again, the
    /// publication or the table made again) may have let rows pass undecoded.
    pub(super) identity: Identity,
}

/// The publication, its entry for the outbox table and the table (their oids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Identity {
    publication: Option<i64>,
    entry: Option<i64>,
    table: Option<i64>,
}

/// What [`check_slot`] reads of the slot and the publication.
#[derive(sqlx::FromRow)]
struct SlotRow {
    slot_exists: bool,
    wal_status: Option<String>,
    confirmed: Option<i64>,
    publication: bool,
    covers: bool,
    pub_oid: Option<i64>,
    rel_oid: Option<i64>,
    table_oid: Option<i64>,
}

/// Looks at the slot, the publication and whether it holds the outbox table.
///
/// # Errors
/// A database error.
pub(super) async fn check_slot(inner: &Inner, conn: &mut PgConnection) -> Result<SlotCheck, Error> {
    let slot = inner.reader.slot();
    let row: SlotRow = sqlx::query_as(
        "SELECT s.slot_name IS NOT NULL AS slot_exists, s.wal_status,
                (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint AS confirmed,
                EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $2) AS publication,
                EXISTS (SELECT 1 FROM pg_publication_tables
                        WHERE pubname = $2 AND schemaname = $3 AND tablename = $4) AS covers,
                (SELECT p.oid::bigint FROM pg_publication p WHERE p.pubname = $2) AS pub_oid,
                (SELECT pr.oid::bigint FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                 WHERE p.pubname = $2 AND pr.prrelid = to_regclass($5)) AS rel_oid,
                to_regclass($5)::oid::bigint AS table_oid
         FROM (SELECT 1) one
         LEFT JOIN pg_replication_slots s ON s.slot_name = $1 AND s.database = current_database()",
    )
    .bind(slot.slot())
    .bind(slot.publication())
    .bind(inner.source.schema())
    .bind(inner.source.table())
    .bind(inner.source.qualified())
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal check", e))?;
    // A slot another session is still making has no confirmed position until it is consistent:
    // rows committed before that point are not in it, so it is not there yet.
    let problem = if !row.slot_exists || row.confirmed.is_none() {
        Some(SlotProblem::Missing)
    } else if row.wal_status.as_deref() == Some("lost") {
        Some(SlotProblem::Lost)
    } else if !row.publication {
        Some(SlotProblem::NoPublication)
    } else if !row.covers {
        Some(SlotProblem::TableNotPublished)
    } else {
        None
    };
    let confirmed = row.confirmed.and_then(|c| u64::try_from(c).ok());
    if problem.is_none() {
        if let Some(c) = confirmed {
            inner
                .fallbacks
                .slot_confirmed
                .fetch_max(c, Ordering::SeqCst);
        }
    }
    Ok(SlotCheck {
        problem,
        confirmed,
        identity: Identity {
            publication: row.pub_oid,
            entry: row.rel_oid,
            table: row.table_oid,
        },
    })
}

/// The error of a slot that cannot be streamed, for readiness: why, and what the relay does.
pub(super) fn not_ready(inner: &Inner, problem: SlotProblem) -> Error {
    let reason = problem.describe(inner);
    let what = if !inner.settings.delete_published {
        "nothing is published meanwhile (wal.delete_published is off); run `outbox wal setup`"
    } else if inner.settings.auto_recreate {
        "the relay publishes from the outbox table meanwhile and makes the slot again (wal.auto_recreate; when it cannot, its log says why, and `outbox wal setup` makes it)"
    } else {
        "the relay publishes from the outbox table meanwhile; run `outbox wal setup` (wal.auto_recreate is off)"
    };
    Error::new(ErrorKind::Connection, format!("{reason}: {what}"))
}

/// Logs a warning once when the reader found the slot unreadable while streaming.
pub(super) fn warn_unreadable(inner: &Inner, problem: SlotProblem) -> Error {
    let e = not_ready(inner, problem);
    warn!(error = %e, "the slot cannot be streamed");
    e
}
