//! Confirms: the settled transactions at the front of the buffer are confirmed (their outbox
//! rows deleted first, with `wal.delete_published`), and the stream reports the position to the
//! server.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgConnection;

use tracing::{debug, error, warn};
use uuid::Uuid;

use txoutbox_core::Error;

use super::buffer::{EntryState, Inner};
use super::held::move_failed;
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

/// How long a reading that fails waits for the batches in flight before it ends (see
/// [`settle_before_leaving`]).
const LEAVE_WAIT: Duration = Duration::from_secs(30);

/// Before a reading that failed ends (the publication changed, the slot went, the stream broke):
/// no more batches are handed out of the buffer, those in flight are waited for (at most
/// [`LEAVE_WAIT`]), failed events go to the held table, and the rows of every event published or
/// in the held table are deleted. The fallback that may follow moves only rows not yet dealt with,
/// and the next reading skips those it reads again ([`super::replay`]): without this, events
/// published since the last confirm would be published a second time. A database that does not
/// answer leaves it undone (a reconnection is a crash's case).
pub(super) async fn settle_before_leaving(inner: &Inner, conn: &mut PgConnection) {
    inner.state().active = false;
    let deadline = Instant::now() + LEAVE_WAIT;
    loop {
        let in_flight = inner.state().in_flight;
        if in_flight == 0 {
            break;
        }
        if Instant::now() >= deadline {
            warn!(
                in_flight,
                waited_s = LEAVE_WAIT.as_secs(),
                "the WAL reader stops reading with batches still in flight: their events are read again, and published again if those batches succeed"
            );
            break;
        }
        tokio::select! {
            _ = inner.reader_wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    let settled = async {
        move_failed(inner, conn).await?;
        let ids = dealt_with_rows(inner);
        if !ids.is_empty() {
            // Before the delete: a reading that follows must check what it reads again.
            inner.left_unconfirmed.store(true, Ordering::SeqCst);
        }
        delete_published(inner, conn, &ids).await
    };
    if let Err(e) = settled.await {
        debug!(error = %e, "the rows of events published before the reading failed are not deleted: they are read again");
    }
}

/// The rows of the buffer's events that are published or in the held table.
fn dealt_with_rows(inner: &Inner) -> Vec<Uuid> {
    let st = inner.state();
    let mut ids = Vec::new();
    for t in &st.txns {
        let open: HashSet<Uuid> = t
            .entries
            .iter()
            .filter(|e| e.state != EntryState::Done)
            .map(|e| e.event.id)
            .collect();
        ids.extend(t.row_ids.iter().filter(|id| !open.contains(id)));
    }
    ids
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
