//! Confirms: the settled transactions at the front of the buffer are confirmed (their outbox
//! rows deleted first, with `wal.delete_published`), and the stream reports the position to the
//! server.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sqlx::PgConnection;

use tracing::error;
use uuid::Uuid;

use txoutbox_core::Error;

use super::shared::Inner;
use super::stream::{Stream, CONFIRM_EVERY};
use crate::error::map_sqlx;

/// Confirms the settled transactions at the front (deleting their outbox rows first when the
/// source table is emptied): the stream reports the position to the server.
pub(super) async fn confirm_settled(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &Stream,
    last_confirm: &mut Instant,
    now: bool,
) -> Result<(), Error> {
    let (target, row_ids, count) = {
        let st = inner.state();
        let mut target = None;
        let mut row_ids = Vec::new();
        let mut count = 0u64;
        let mut events = 0;
        for t in &st.txns {
            if !t.settled() {
                break;
            }
            target = Some(t.end_lsn);
            row_ids.extend_from_slice(&t.row_ids);
            count += 1;
            events += t.entries.len();
        }
        // The outbox rows are deleted in batches: one statement every CONFIRM_EVERY, or sooner
        // when half the read-ahead is settled.
        let due = now
            || last_confirm.elapsed() >= CONFIRM_EVERY
            || events >= inner.settings.read_ahead / 2;
        if !due {
            target = None;
        }
        (target, row_ids, count)
    };
    let Some(target) = target else {
        return Ok(());
    };
    delete_published(inner, conn, &row_ids).await?;
    stream.confirm(target);
    *last_confirm = Instant::now();
    let mut st = inner.state();
    for _ in 0..count {
        st.txns.pop_front();
    }
    st.confirmed = st.confirmed.max(target);
    drop(st);
    stream.settled.fetch_add(count, Ordering::SeqCst);
    Ok(())
}

/// Deletes the outbox rows `ids` (their events published or in the held table) when
/// `wal.delete_published`.
///
/// A refusal retrying cannot cure (a foreign key into the outbox table, a trigger that raises)
/// does not stop the reader: the rows the database refuses to delete stay, logged with the cause and
/// the fix; their events are published and are not read again (stopping here would read them again
/// and publish them again, for ever). A missing DELETE privilege is an error naming the grant:
/// the reader then stops reading until it is granted ([`check_reader_privileges`]).
///
/// # Errors
/// A database error retrying may cure; the missing privilege.
pub(super) async fn delete_published(
    inner: &Inner,
    conn: &mut PgConnection,
    ids: &[Uuid],
) -> Result<(), Error> {
    if !inner.settings.delete_published || ids.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "DELETE FROM {} WHERE id = ANY($1)",
        inner.source.qualified()
    );
    let e = match sqlx::query(&sql).bind(ids).execute(&mut *conn).await {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    match refusal(&e) {
        Some(Refusal::Privilege) => {
            // The role's own privileges name the grant; else a trigger's statement is refused.
            check_reader_privileges(inner, conn).await?;
        }
        Some(Refusal::Row) => {}
        None => return Err(map_sqlx("wal delete published rows", e)),
    }
    // One at a time: the rows that can go, go.
    let mut kept = 0usize;
    let mut first: Option<String> = None;
    for id in ids {
        if let Err(e) = sqlx::query(&sql)
            .bind(std::slice::from_ref(id))
            .execute(&mut *conn)
            .await
        {
            if refusal(&e).is_none() {
                return Err(map_sqlx("wal delete published rows", e));
            }
            kept += 1;
            first.get_or_insert_with(|| e.to_string());
            // Marked published where the database lets it (a foreign key or a DELETE trigger does
            // not stop an UPDATE): a fallback to the table does not publish it again.
            let _ = sqlx::query(&format!(
                "UPDATE {} SET processed_at = now() WHERE id = $1",
                inner.source.qualified()
            ))
            .bind(id)
            .execute(&mut *conn)
            .await;
        }
    }
    error!(
        rows = kept,
        table = %inner.source.qualified(),
        error = first.unwrap_or_default(),
        "the database refuses to delete rows of the outbox table whose events are published or in the held table (a foreign key into it, or a trigger): they stay, and their events are not read again; drop the constraint or trigger, or set wal.delete_published = false and delete the rows yourself"
    );
    Ok(())
}

/// A DELETE's failure that retrying cannot cure.
pub(super) enum Refusal {
    /// SQLSTATE 42501: a privilege is missing (the role's, or one a trigger's statement needs).
    Privilege,
    /// A constraint (class 23: a foreign key into the table) or a trigger that raises (P0001).
    Row,
}

pub(super) fn refusal(e: &sqlx::Error) -> Option<Refusal> {
    let code = e.as_database_error()?.code()?;
    match code.as_ref() {
        "42501" => Some(Refusal::Privilege),
        "P0001" => Some(Refusal::Row),
        c if c.starts_with("23") => Some(Refusal::Row),
        _ => None,
    }
}

/// The relay's role has `REPLICATION`, may write the held table (and draw from its sequence) and,
/// with `wal.delete_published`, DELETE from the outbox table: an error naming the grant when it
/// may not.
///
/// # Errors
/// The missing privilege; a database error.
pub(super) async fn check_reader_privileges(
    inner: &Inner,
    conn: &mut PgConnection,
) -> Result<(), Error> {
    // The slot is read over a replication connection, which the server opens only for a role
    // with REPLICATION (the pool's role: both connections are made from the same settings).
    crate::grants::check_replication(
        conn,
        "reading the slot needs (the replication connection is refused without it)",
    )
    .await?;
    // The held table: the reader moves events there (its writer-order trigger draws from its
    // sequence), and the relays publish them from it.
    crate::grants::check_privileges(
        conn,
        inner.held.table(),
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
        true,
        "the WAL source needs on its held table (the reader moves events there, the relays publish them from it)",
    )
    .await?;
    if !inner.settings.delete_published {
        return Ok(());
    }
    // A DELETE with a WHERE clause reads the column it filters on: SELECT too.
    crate::grants::check_privileges(
        conn,
        &inner.source,
        &["SELECT", "DELETE"],
        false,
        "wal.delete_published needs (the WAL source deletes the rows it published; or set wal.delete_published = false); nothing is read from the slot meanwhile",
    )
    .await
}
