//! Table-less events while the reader falls back to the table, and the slot can still be read (the
//! table taken out of the publication, a slot made again that the fallback has not left yet): they
//! are read from the slot, without streaming it, and go to the held table in their place among
//! the table's rows, so that an aggregate written both ways keeps its order.
//!
//! Each round of the fallback is one `REPEATABLE READ` transaction:
//! 1. Its snapshot decides what it moves: the table's rows it sees, and the slot's transactions it
//!    sees committed (a peek of the slot up to the WAL position read just after the snapshot, with
//!    the transactions' ids tested against it).
//! 2. The rows and the table-less events go to the held table in one statement, merged by `seq`:
//!    a table-less event written by [`MessageWriter::emit`] carries a number of the table's
//!    sequence, taken under its aggregate's writer-order lock, so a row of its aggregate written
//!    after it has a larger one, and one written before it committed before it. One written
//!    without it (plain SQL) goes after the round's rows, and only while no fence limits the move.
//! 3. The slot is advanced past the transactions the round (or one before it) dealt with whole:
//!    their table-less events are in the held table, their rows (decoded while the table is
//!    published) gone from the table. Those it dealt with beyond that position are kept in the
//!    fallback's mark ([`Taken`]), and the stream that follows the fallback skips their table-less
//!    events: no event is published twice without a crash.
//!
//! [`MessageWriter::emit`]: crate::wal::MessageWriter::emit

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;
use uuid::Uuid;

use txoutbox_core::Error;

use super::confirm::{delete_published, refusal};
use super::decode::{Decoder, Origin, WalItem, WalTransaction, PGOUTPUT_SETTINGS, PROTO_VERSION};
use super::held::{held_unnest, HeldArrays, HeldRow, HELD_STATE, STATE_COLUMNS};
use super::mark::FallbackMark;
use super::shared::Inner;
use super::taken::Taken;
use crate::error::map_sqlx;
use crate::row::{INSERT_COLUMNS, INSERT_UNNESTED};

/// The pgoutput bytes one round reads from the slot at most (the transaction that crosses it is
/// read whole); a round that stops there moves only the rows of the transactions it read.
const WINDOW_BYTES: usize = 64 << 20;

/// A transaction as a round reads it from the slot.
struct Read {
    xid: u32,
    commit_lsn: u64,
    /// A message that is not transactional, handed over alone (its own dead letter).
    alone: bool,
    transaction: WalTransaction,
}

/// What a round read from the slot.
struct Window {
    transactions: Vec<Read>,
    seqs: HashMap<Uuid, i64>,
    undecodable_messages: HashSet<u64>,
    /// The read stopped at [`WINDOW_BYTES`].
    cut: bool,
}

/// Reads the slot's transactions committed before `upto` (a WAL position), without consuming them,
/// on `conn` (the round's transaction).
async fn read_window(
    inner: &Inner,
    conn: &mut PgConnection,
    origin: Origin,
    upto: i64,
) -> Result<Window, Error> {
    use futures::TryStreamExt;
    let map = |e| map_sqlx("wal fallback: read the slot's table-less events", e);
    let slot = inner.reader.slot();
    let mut decoder = Decoder::new(slot, origin).recording();
    let mut transactions = Vec::new();
    let mut bytes = 0usize;
    let mut cut = false;
    {
        // pgoutput writes the columns as the calling session's output functions do: fixed here,
        // for this transaction, whatever the role's or database's settings.
        let sql = format!(
            "WITH s AS MATERIALIZED (SELECT {PGOUTPUT_SETTINGS})
             SELECT (c.lsn - '0/0'::pg_lsn)::bigint, c.xid::text::bigint, c.data
             FROM s LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes(
                 $1, '0/0'::pg_lsn + $2::numeric, NULL,
                 'proto_version', $3, 'publication_names', $4, 'messages', 'true') c ON true"
        );
        let mut rows = sqlx::query_as::<_, (Option<i64>, Option<i64>, Option<Vec<u8>>)>(&sql)
            .bind(slot.slot())
            .bind(upto)
            .bind(PROTO_VERSION)
            .bind(slot.publication())
            .fetch(&mut *conn);
        while let Some((lsn, xid, data)) = rows.try_next().await.map_err(map)? {
            let (Some(lsn), Some(xid), Some(data)) = (lsn, xid, data) else {
                continue;
            };
            let lsn = u64::try_from(lsn).unwrap_or(0);
            bytes = bytes.saturating_add(data.len());
            if let Some(t) = decoder.feed(lsn, &data)? {
                // A transaction ends at its commit; a message hands itself over only when it is
                // not transactional.
                let alone = data.first() == Some(&b'M');
                transactions.push(Read {
                    xid: u32::try_from(xid).unwrap_or(0),
                    commit_lsn: if alone { lsn } else { decoder.commit_lsn() },
                    alone,
                    transaction: t,
                });
                if bytes >= WINDOW_BYTES {
                    cut = true;
                    break;
                }
            }
        }
    }
    let recorded = decoder.take_recorded();
    Ok(Window {
        transactions,
        seqs: recorded.seqs,
        undecodable_messages: recorded.undecodable_messages,
        cut,
    })
}

/// A snapshot as `pg_current_snapshot()` writes it (`xmin:xmax:xip,...`): which transactions it
/// sees committed.
#[derive(Debug)]
struct Snapshot {
    xmin: u64,
    xmax: u64,
    running: HashSet<u64>,
}

impl Snapshot {
    fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let running = parts
            .next()
            .unwrap_or("")
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        Some(Snapshot {
            xmin,
            xmax,
            running,
        })
    }

    /// Whether the committed transaction `xid` (32 bits, as the slot names it; recent, so within
    /// 2^31 of `xmax`) committed before the snapshot was taken.
    fn sees(&self, xid: u32) -> bool {
        // As PostgreSQL compares 32-bit ids: the nearest of the epochs, within 2^31 of xmax.
        let diff = i64::from(xid.wrapping_sub(self.xmax as u32) as i32);
        let Ok(full) = u64::try_from(i64::try_from(self.xmax).unwrap_or(i64::MAX) + diff) else {
            return true;
        };
        full < self.xmin || (full < self.xmax && !self.running.contains(&full))
    }
}

/// A table-less event a round puts in the held table, where it goes among the rows (`seq`).
struct Placed {
    seq: i64,
    row: HeldRow,
}

/// One round (see the module's documentation): moves up to `chunk` rows of the outbox table
/// (with `seq` up to `fence`, when set) and the table-less events that go before or among them to
/// the held table, advances the slot past what it dealt with whole, and keeps the rest in `taken`
/// (saved in the mark, with `fence`, in the round's transaction). Returns how many events it put
/// in the held table.
///
/// # Errors
/// A database error.
pub(super) async fn round(
    inner: &Inner,
    conn: &mut PgConnection,
    origin: Origin,
    fence: Option<i64>,
    chunk: i64,
    taken: &mut Taken,
) -> Result<usize, Error> {
    let map = |e| {
        map_sqlx(
            "wal fallback: move rows and table-less events to the held table",
            e,
        )
    };
    let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(map)?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    // The first statement takes the snapshot; the position is read after it, so every
    // transaction the snapshot sees committed before it.
    let (snapshot, upto): (String, i64) = sqlx::query_as(
        "SELECT pg_current_snapshot()::text, (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint",
    )
    .fetch_one(&mut *tx)
    .await
    .map_err(map)?;
    let snapshot = Snapshot::parse(&snapshot).ok_or_else(|| {
        Error::new(
            txoutbox_core::ErrorKind::Unexpected,
            format!("the server's snapshot {snapshot:?} is not xmin:xmax:xip"),
        )
    })?;
    sqlx::query("SELECT set_config('outbox.writer_order', 'off', true)")
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    let window = read_window(inner, &mut tx, origin, upto).await?;
    // A read that stopped early moves only rows that cannot come after a table-less event not
    // read yet: those of the transactions it read, and those whose seq is at most one it read (a
    // row of the same aggregate as an event read later took its number after that event's
    // transaction committed, so after every transaction read).
    let (bound, only): (Option<i64>, Option<Vec<Uuid>>) = if window.cut {
        (
            Some(window.seqs.values().copied().max().unwrap_or(0)),
            Some(
                window
                    .transactions
                    .iter()
                    .flat_map(|r| r.transaction.row_ids.iter().copied())
                    .collect(),
            ),
        )
    } else {
        (None, None)
    };
    let source = inner.source.qualified();
    let held = inner.held.table().qualified();
    let picked: Vec<(Uuid, i64)> = sqlx::query_as(&format!(
        "SELECT s.id, s.seq FROM {source} s
         WHERE s.processed_at IS NULL
           AND ($1::bigint IS NULL OR s.seq <= $1)
           AND ($3::bigint IS NULL OR s.seq <= $3 OR s.id = ANY($4))
           AND NOT EXISTS (SELECT 1 FROM {held} h WHERE h.id = s.id)
         ORDER BY s.seq
         LIMIT $2"
    ))
    .bind(fence)
    .bind(chunk)
    .bind(bound)
    .bind(&only)
    .fetch_all(&mut *tx)
    .await
    .map_err(map)?;
    // Every row the round may move is moved: the table-less events after them go too (those
    // without a seq only when nothing limits the rows).
    let full = i64::try_from(picked.len()).unwrap_or(i64::MAX) >= chunk;
    let upper = if full {
        picked.last().map_or(0, |(_, s)| *s)
    } else {
        i64::MAX
    };
    let all_rows = !full && !window.cut;
    let (placed, newly) = place(&window, &snapshot, taken, fence, upper, all_rows);
    let ids: Vec<Uuid> = picked.iter().map(|(id, _)| *id).collect();
    insert_merged(inner, &mut tx, &ids, &placed).await?;
    let refused = delete_moved(inner, &mut tx, &ids).await?;
    for (end, commit) in newly {
        taken.ends.insert(end, commit);
    }
    let through = dealt_with_through(inner, &mut tx, &window, &snapshot, taken).await?;
    taken.ends.retain(|end, _| *end > through);
    FallbackMark {
        fence,
        taken: taken.clone(),
    }
    .save(&mut tx, inner.held.table(), inner.reader.slot().slot())
    .await?;
    tx.commit().await.map_err(map)?;
    if refused {
        delete_published(inner, conn, &ids).await?;
    }
    if !ids.is_empty() {
        inner
            .fallbacks
            .moved
            .fetch_add(ids.len() as u64, std::sync::atomic::Ordering::SeqCst);
    }
    if through > 0 {
        inner.reader.confirm_on(conn, through).await?;
    }
    Ok(ids.len() + placed.len())
}

/// The table-less events of the window this round places, and the transactions they complete
/// (by end and commit position): those the snapshot sees committed, not taken already, whose every
/// event can go now (a `seq` up to `upper`, the last row moved, and to the fence; without a `seq`,
/// only when `all_rows` and no fence). A transaction is taken whole or not at all.
fn place(
    window: &Window,
    snapshot: &Snapshot,
    taken: &Taken,
    fence: Option<i64>,
    upper: i64,
    all_rows: bool,
) -> (Vec<Placed>, Vec<(u64, u64)>) {
    let mut placed = Vec::new();
    let mut newly = Vec::new();
    for read in &window.transactions {
        let t = &read.transaction;
        if taken.has(t) || !(read.alone || snapshot.sees(read.xid)) {
            continue;
        }
        let events = tableless_items(window, t);
        if events.is_empty() {
            continue;
        }
        let mut these = Vec::with_capacity(events.len());
        for item in &events {
            let seq = match item {
                WalItem::Event(e) => window.seqs.get(&e.id).copied(),
                WalItem::Undecodable { .. } => None,
            };
            let at = match seq {
                Some(s) if s <= upper && fence.is_none_or(|f| s <= f) => s,
                None if all_rows && fence.is_none() => i64::MAX,
                _ => break,
            };
            these.push(Placed {
                seq: at,
                row: HeldRow::of_item(item, t.commit_time),
            });
        }
        if these.len() == events.len() {
            placed.extend(these);
            newly.push((t.end_lsn, read.commit_lsn));
        }
    }
    // Stable: events of one transaction, and those without a seq, keep their commit order.
    placed.sort_by_key(|p| p.seq);
    (placed, newly)
}

/// The items of `t` that are table-less: events that are not rows, and messages that could not be
/// events.
fn tableless_items<'a>(window: &Window, t: &'a WalTransaction) -> Vec<&'a WalItem> {
    let rows: HashSet<&Uuid> = t.row_ids.iter().collect();
    t.items
        .iter()
        .filter(|item| match item {
            WalItem::Event(e) => !rows.contains(&e.id),
            WalItem::Undecodable { lsn, .. } => window.undecodable_messages.contains(lsn),
        })
        .collect()
}

/// Puts the rows `ids` of the outbox table (with their delivery state) and the table-less events
/// `placed` in the held table, in one statement, in `seq` order.
async fn insert_merged(
    inner: &Inner,
    conn: &mut PgConnection,
    ids: &[Uuid],
    placed: &[Placed],
) -> Result<(), Error> {
    if ids.is_empty() && placed.is_empty() {
        return Ok(());
    }
    let arrays = HeldArrays::of(placed.iter().map(|p| &p.row));
    let seqs: Vec<i64> = placed.iter().map(|p| p.seq).collect();
    let sql = format!(
        "INSERT INTO {held} ({INSERT_COLUMNS}, {STATE_COLUMNS})
         SELECT {INSERT_COLUMNS}, {STATE_COLUMNS} FROM (
             SELECT {INSERT_COLUMNS}, {STATE_COLUMNS}, s.seq AS k, 0::bigint AS o
             FROM {source} s WHERE s.id = ANY($16)
             UNION ALL
             SELECT {INSERT_UNNESTED}, {HELD_STATE}, k.seq, u.ord
             FROM {unnest} JOIN UNNEST($15::int8[]) WITH ORDINALITY AS k(seq, ord) ON k.ord = u.ord
         ) m
         ORDER BY k, o
         ON CONFLICT (id) DO NOTHING",
        held = inner.held.table().qualified(),
        source = inner.source.qualified(),
        unnest = held_unnest(),
    );
    arrays
        .bind(sqlx::query(&sql))
        .bind(&seqs)
        .bind(ids)
        .execute(&mut *conn)
        .await
        .map_err(|e| {
            map_sqlx(
                "wal fallback: move rows and table-less events to the held table",
                e,
            )
        })?;
    Ok(())
}

/// Deletes the moved rows `ids` from the outbox table, in the round's transaction (a savepoint
/// keeps it usable when the database refuses: the rows are then deleted after the commit, one at
/// a time, as [`delete_published`] does). Returns whether it refused.
async fn delete_moved(inner: &Inner, conn: &mut PgConnection, ids: &[Uuid]) -> Result<bool, Error> {
    if ids.is_empty() || !inner.settings.delete_published {
        return Ok(false);
    }
    let map = |e| map_sqlx("wal fallback: delete the moved rows", e);
    sqlx::query("SAVEPOINT outbox_move")
        .execute(&mut *conn)
        .await
        .map_err(map)?;
    let deleted = sqlx::query(&format!(
        "DELETE FROM {} WHERE id = ANY($1)",
        inner.source.qualified()
    ))
    .bind(ids)
    .execute(&mut *conn)
    .await;
    match deleted {
        Ok(_) => Ok(false),
        Err(e) if refusal(&e).is_some() => {
            sqlx::query("ROLLBACK TO SAVEPOINT outbox_move")
                .execute(&mut *conn)
                .await
                .map_err(map)?;
            Ok(true)
        }
        Err(e) => Err(map(e)),
    }
}

/// The position just past the last transaction of the window's longest run from its start that
/// is dealt with whole (0 for none): seen by the round's snapshot, its table-less events taken (or
/// none), and its rows (decoded while the table is published) gone from the outbox table or marked
/// processed.
async fn dealt_with_through(
    inner: &Inner,
    conn: &mut PgConnection,
    window: &Window,
    snapshot: &Snapshot,
    taken: &Taken,
) -> Result<u64, Error> {
    let rows: Vec<Uuid> = window
        .transactions
        .iter()
        .flat_map(|r| r.transaction.row_ids.iter().copied())
        .collect();
    let waiting: HashSet<Uuid> = if rows.is_empty() {
        HashSet::new()
    } else {
        sqlx::query_scalar::<_, Uuid>(&format!(
            "SELECT s.id FROM {} s WHERE s.id = ANY($1) AND s.processed_at IS NULL",
            inner.source.qualified()
        ))
        .bind(&rows)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal fallback", e))?
        .into_iter()
        .collect()
    };
    let mut through = 0;
    for read in &window.transactions {
        let t = &read.transaction;
        // One the snapshot does not see: its rows look gone from the table, and are not.
        if !(read.alone || snapshot.sees(read.xid)) {
            break;
        }
        let events_done = taken.has(t) || tableless_items(window, t).is_empty();
        // A row that could not be an event has no id to look up: the stream reads it.
        let rows_done = t.row_ids.iter().all(|id| !waiting.contains(id))
            && t.items.iter().all(|item| match item {
                WalItem::Undecodable { lsn, .. } => window.undecodable_messages.contains(lsn),
                WalItem::Event(_) => true,
            });
        if !(events_done && rows_done) {
            break;
        }
        through = t.end_lsn;
    }
    Ok(through)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_sees_what_committed_before_it() {
        let s = Snapshot::parse("100:105:101,103").unwrap();
        assert!(s.sees(99));
        assert!(s.sees(100));
        assert!(!s.sees(101));
        assert!(s.sees(102));
        assert!(!s.sees(103));
        assert!(s.sees(104));
        assert!(!s.sees(105));
        assert!(!s.sees(200));
        assert!(Snapshot::parse("7:7:").unwrap().sees(6));
        assert!(Snapshot::parse("nonsense").is_none());
    }

    #[test]
    fn a_snapshot_past_the_first_epoch_places_32_bit_ids_in_it() {
        let epoch = 1u64 << 32;
        let s = Snapshot::parse(&format!("{}:{}:", epoch + 10, epoch + 20)).unwrap();
        assert!(s.sees(5));
        assert!(s.sees(15));
        // After the snapshot, in its epoch.
        assert!(!s.sees(25));
        // The end of the epoch before: long committed.
        assert!(s.sees(u32::MAX));
        // A snapshot near the end of an epoch, and a transaction just past it.
        let s = Snapshot::parse(&format!("{}:{}:", epoch - 10, epoch - 5)).unwrap();
        assert!(s.sees(u32::MAX - 20));
        assert!(!s.sees(3));
    }
}
