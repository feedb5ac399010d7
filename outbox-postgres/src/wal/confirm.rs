//! Confirms: the settled transactions at the front of the buffer are confirmed (their outbox
//! rows deleted first, with `wal.delete_published`), and the stream reports the position to the
//! server.

use std::sync::atomic::Ordering;
use std::time::Instant;

use sqlx::PgConnection;

use outbox_core::Error;

use super::buffer::Inner;
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
    if inner.settings.delete_published && !row_ids.is_empty() {
        sqlx::query(&format!(
            "DELETE FROM {} WHERE id = ANY($1)",
            inner.source.qualified()
        ))
        .bind(&row_ids)
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal delete published rows", e))?;
    }
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
