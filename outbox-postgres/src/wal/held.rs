//! The hand-over to the held table: failed events (with the later events of their aggregates),
//! events of aggregates that still wait there, and changes that are not events (as dead letters)
//! are written to it, in commit order, in one statement per hand-over.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use tracing::{debug, warn};
use uuid::Uuid;

use txoutbox_core::{Action, Error, Event};

use super::buffer::{aggregate_key, Entry, EntryState, State, Txn};
use super::confirm::delete_published;
use super::decode::{Piece, WalItem, WalTransaction};
use super::mark::Mark;
use super::replay::ReplayGuard;
use super::shared::Inner;
use crate::error::map_sqlx;
use crate::row::{Columns, INSERT_ARRAYS, INSERT_COLUMNS, INSERT_UNNESTED};

/// Events the reader could not read as events are dead-lettered under this aggregate type.
pub const UNDECODABLE_AGGREGATE_TYPE: &str = "(undecodable)";

/// One row for the held table.
pub(super) struct HeldRow {
    event: Event,
    attempts: i32,
    retry_in: Option<f64>,
    error: Option<String>,
    dead: bool,
}

impl HeldRow {
    pub(super) fn waiting(event: Event) -> Self {
        HeldRow {
            event,
            attempts: 0,
            retry_in: None,
            error: None,
            dead: false,
        }
    }

    /// The held row of a transaction's `item`: its event, waiting, or the dead letter of a change
    /// that is not one (its transaction committed `at`).
    pub(super) fn of_item(item: &WalItem, at: DateTime<Utc>) -> Self {
        match item {
            WalItem::Event(e) => HeldRow::waiting(e.clone()),
            WalItem::Undecodable {
                id,
                lsn,
                error,
                raw,
            } => HeldRow::undecodable(*id, *lsn, error.clone(), raw.clone(), at),
        }
    }

    /// The dead letter of a change that is not an event (a NUL in what is wrong, which quotes the
    /// change, is written as `\0`: PostgreSQL's text cannot hold it).
    pub(super) fn undecodable(
        id: Uuid,
        lsn: u64,
        error: String,
        raw: String,
        at: DateTime<Utc>,
    ) -> Self {
        let error = error.replace('\0', "\\0");
        warn!(lsn = format!("{lsn:X}"), error = %error, "a change of the slot is not an event: dead-lettered");
        HeldRow {
            event: undecodable_event(id, lsn, raw, at),
            attempts: 0,
            retry_in: None,
            error: Some(error),
            dead: true,
        }
    }

    fn failed(event: Event, action: &Action) -> Self {
        match action {
            Action::Retry {
                attempts,
                delay,
                error,
            } => HeldRow {
                event,
                attempts: i32::try_from(*attempts).unwrap_or(i32::MAX),
                retry_in: Some(delay.as_secs_f64()),
                error: Some(error.clone()),
                dead: false,
            },
            Action::DeadLetter { attempts, error } => HeldRow {
                event,
                attempts: i32::try_from(*attempts).unwrap_or(i32::MAX),
                retry_in: None,
                error: Some(error.clone()),
                dead: true,
            },
            Action::Published | Action::Release => HeldRow::waiting(event),
        }
    }
}

/// Writes `rows` to the held table, in order, in one statement (events already there are left as
/// they are: a replay after a crash), with the spill mark `handed` in the same transaction.
/// The held table's writer-order lock is off for it: this reader is the table's only writer, and a
/// lock per aggregate for tens of thousands of aggregates would exhaust the server's lock table.
async fn insert_held(
    inner: &Inner,
    conn: &mut PgConnection,
    rows: &[HeldRow],
    handed: Option<SpillMark>,
) -> Result<(), Error> {
    if rows.is_empty() && handed.is_none() {
        return Ok(());
    }
    let map = |e| map_sqlx("wal move to the held table", e);
    let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(map)?;
    sqlx::query("SELECT set_config('outbox.writer_order', 'off', true)")
        .execute(&mut *tx)
        .await
        .map_err(map)?;
    insert_rows(inner, &mut tx, rows).await?;
    if let Some(mark) = handed {
        mark.save(inner, &mut tx).await?;
    }
    tx.commit().await.map_err(map)
}

async fn insert_rows(
    inner: &Inner,
    conn: &mut PgConnection,
    rows: &[HeldRow],
) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "INSERT INTO {} ({INSERT_COLUMNS}, {STATE_COLUMNS})
         SELECT {INSERT_UNNESTED}, {HELD_STATE} FROM {}
         ORDER BY u.ord
         ON CONFLICT (id) DO NOTHING",
        inner.held.table().qualified(),
        held_unnest()
    );
    let arrays = HeldArrays::of(rows.iter());
    arrays
        .bind(sqlx::query(&sql))
        .execute(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal move to the held table", e))?;
    Ok(())
}

/// The columns of a row's delivery state, kept when it moves to the held table.
pub(super) const STATE_COLUMNS: &str =
    "created_at, attempts, retry_after, last_error, dead_lettered_at";

/// The rows [`HeldArrays::bind`] binds (as `$1` to `$14`), unnested as `u`, in order (`u.ord`).
pub(super) fn held_unnest() -> String {
    format!(
        "UNNEST({INSERT_ARRAYS}, $10::timestamptz[], $11::int4[], $12::float8[], $13::text[], $14::bool[])
         WITH ORDINALITY AS u({INSERT_COLUMNS}, c, n, r, err, dead, ord)"
    )
}

/// The values of [`STATE_COLUMNS`] from [`held_unnest`].
pub(super) const HELD_STATE: &str = "u.c, u.n,
    CASE WHEN u.r IS NULL THEN NULL ELSE now() + u.r * interval '1 second' END,
    u.err, CASE WHEN u.dead THEN now() END";

/// Held rows as the arrays of an INSERT (see [`held_unnest`]).
pub(super) struct HeldArrays {
    columns: Columns,
    created: Vec<DateTime<Utc>>,
    attempts: Vec<i32>,
    retry_in: Vec<Option<f64>>,
    errors: Vec<Option<String>>,
    dead: Vec<bool>,
}

impl HeldArrays {
    pub(super) fn of<'a>(rows: impl ExactSizeIterator<Item = &'a HeldRow>) -> Self {
        let n = rows.len();
        let mut a = HeldArrays {
            columns: Columns::with_capacity(n),
            created: Vec::with_capacity(n),
            attempts: Vec::with_capacity(n),
            retry_in: Vec::with_capacity(n),
            errors: Vec::with_capacity(n),
            dead: Vec::with_capacity(n),
        };
        for r in rows {
            a.columns.push_event(&r.event);
            a.created.push(r.event.created_at);
            a.attempts.push(r.attempts);
            a.retry_in.push(r.retry_in);
            a.errors.push(r.error.clone());
            a.dead.push(r.dead);
        }
        a
    }

    /// Binds the arrays as `$1` to `$14`; further parameters follow.
    pub(super) fn bind<'q>(
        &'q self,
        q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        self.columns
            .bind(q)
            .bind(&self.created)
            .bind(&self.attempts)
            .bind(&self.retry_in)
            .bind(&self.errors)
            .bind(&self.dead)
    }
}

/// Moves each failed event, with the later events of its aggregate in hand, to the held table.
pub(super) async fn move_failed(inner: &Inner, conn: &mut PgConnection) -> Result<bool, Error> {
    // Under the lock: pick the groups and mark them moving (claims skip them).
    let (rows, moving) = {
        let mut st = inner.state();
        if st.failed == 0 {
            return Ok(false);
        }
        let mut rows = Vec::new();
        let mut moving = Moving::default();
        for (end, i) in failed_groups(&st).into_iter().flatten() {
            let Some(e) = st.entry_mut(end, i) else {
                continue;
            };
            rows.push(match &e.state {
                EntryState::Failed(a) => HeldRow::failed(e.event.clone(), a),
                _ => HeldRow::waiting(e.event.clone()),
            });
            moving.mark(&mut st, end, i);
        }
        (rows, moving)
    };
    if rows.is_empty() {
        return Ok(false);
    }
    let result = insert_held(inner, conn, &rows, None).await;
    moving.finish(&mut inner.state(), result.is_ok());
    result?;
    debug!(events = rows.len(), "moved to the held table");
    held_changed(inner);
    Ok(true)
}

/// For each aggregate with a failed event in the buffer, the positions of that event and of the
/// ready ones after it; an aggregate another batch still holds some of waits for the next round.
fn failed_groups(st: &State) -> Vec<Vec<(u64, usize)>> {
    let mut failed_aggs: Vec<(&str, &str)> = Vec::new();
    for e in st.txns.iter().flat_map(|t| &t.entries) {
        if let EntryState::Failed(_) = e.state {
            let a = (
                e.event.aggregate_type.as_str(),
                e.event.aggregate_id.as_str(),
            );
            if !failed_aggs.contains(&a) {
                failed_aggs.push(a);
            }
        }
    }
    let mut groups = Vec::new();
    for (at, ai) in failed_aggs {
        let mut group = Vec::new();
        let mut busy = false;
        let mut started = false;
        for t in &st.txns {
            for (i, e) in t.entries.iter().enumerate() {
                if e.event.aggregate_type != at || e.event.aggregate_id != ai {
                    continue;
                }
                match &e.state {
                    EntryState::Done => {}
                    EntryState::Failed(_) => {
                        started = true;
                        group.push((t.end_lsn, i));
                    }
                    EntryState::InFlight(_) | EntryState::Moving => busy = true,
                    EntryState::Ready => {
                        if started {
                            group.push((t.end_lsn, i));
                        }
                    }
                }
            }
        }
        if !busy {
            groups.push(group);
        }
    }
    groups
}

/// Entries of the buffer marked moving to the held table (claims skip them), with the states to
/// put back should the hand-over fail.
#[derive(Default)]
struct Moving {
    positions: Vec<(u64, usize)>,
    previous: Vec<EntryState>,
}

impl Moving {
    /// Marks the entry at (`end`, `i`) moving, keeping its state.
    fn mark(&mut self, st: &mut State, end: u64, i: usize) {
        let Some(e) = st.entry_mut(end, i) else {
            return;
        };
        self.previous.push(e.state.clone());
        self.positions.push((end, i));
        st.set_state(end, i, EntryState::Moving);
    }

    /// After the hand-over: done when it went in (`handed`), else back to the states they had.
    fn finish(self, st: &mut State, handed: bool) {
        for ((end, i), state) in self.positions.into_iter().zip(self.previous) {
            st.set_state(end, i, if handed { EntryState::Done } else { state });
        }
    }
}

/// How far a transaction handed over in parts is in the held table: `handed` of its items, counted
/// in the order the slot sends them. Kept in the held table (one row per table, already
/// processed, never claimed), written with each part, so that a reader that stopped in the middle
/// and reads the transaction again skips what was handed over, published or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SpillMark {
    commit_lsn: u64,
    handed: u64,
}

impl SpillMark {
    /// The mark of the held table (a mark of another transaction counts nothing for this one).
    async fn load(inner: &Inner, conn: &mut PgConnection, commit_lsn: u64) -> Result<u64, Error> {
        let mark = Mark::Spill.load(conn, inner.held.table()).await?;
        let field = |m: &serde_json::Value, k: &str| m.get(k).and_then(serde_json::Value::as_u64);
        Ok(match mark {
            Some(m) if field(&m, "commit_lsn") == Some(commit_lsn) => {
                field(&m, "handed").unwrap_or(0)
            }
            _ => 0,
        })
    }

    async fn save(&self, inner: &Inner, conn: &mut PgConnection) -> Result<(), Error> {
        Mark::Spill
            .save(
                conn,
                inner.held.table(),
                inner.reader.slot().slot(),
                serde_json::json!({"commit_lsn": self.commit_lsn, "handed": self.handed}),
            )
            .await
    }
}

/// The reader's count of the transaction being handed over in parts.
#[derive(Debug, Default)]
pub(super) struct Spilling {
    /// The transaction (its commit position), the items of it seen in this reading, and how many
    /// of them the held table had before this reading.
    current: Option<(u64, u64, u64)>,
}

/// Hands a part of a transaction too large to hold in memory (see [`Piece`]) to the held table,
/// after every event of the buffer not yet settled, so that the held table keeps commit order; with
/// `wal.delete_published` the part's outbox rows are deleted after. Returns false,
/// doing nothing, while a batch holds events of the buffer (call again once it is settled). The
/// last part leaves its transaction in the buffer with no event, to be confirmed in its turn.
///
/// A reader that stopped in the middle reads the transaction again from its start: the items the
/// held table's [`SpillMark`] counts as handed over are skipped.
pub(super) async fn spill(
    inner: &Inner,
    conn: &mut PgConnection,
    part: &WalTransaction,
    spilling: &mut Spilling,
    guard: &ReplayGuard,
) -> Result<bool, Error> {
    let Some(commit_lsn) = part.piece.commit_lsn() else {
        return Ok(true);
    };
    if inner.state().in_flight > 0 {
        return Ok(false);
    }
    let (seen, before) = match spilling.current {
        Some((c, seen, before)) if c == commit_lsn => (seen, before),
        _ => (0, SpillMark::load(inner, conn, commit_lsn).await?),
    };
    // Rows a reading before this one dealt with (published, or moved by a fallback): not again.
    let mut dealt_with = if guard.covers(commit_lsn) {
        guard.dealt_with(inner, conn, &part.row_ids).await?
    } else {
        HashSet::new()
    };
    // Table-less events the fallback before this reading took.
    dealt_with.extend(guard.taken_in(part));
    // Every event of the buffer not yet settled goes first, marked moving (claims skip them).
    let Some((mut rows, moving)) = unsettled_marked_moving(inner) else {
        return Ok(false);
    };
    // The items a reading before this one handed over already.
    let skip = usize::try_from(before.saturating_sub(seen))
        .unwrap_or(usize::MAX)
        .min(part.items.len());
    rows.extend(part_rows(part, skip, &dealt_with));
    let seen = seen + part.items.len() as u64;
    let mark = SpillMark {
        commit_lsn,
        handed: seen.max(before),
    };
    let inserted = insert_held(inner, conn, &rows, Some(mark)).await;
    // In the held table now, whatever the delete below does; or back as they were.
    moving.finish(&mut inner.state(), inserted.is_ok());
    inserted?;
    // After the part is in the held table (a crash in between leaves rows a replay skips).
    delete_published(inner, conn, &part.row_ids).await?;
    let mut st = inner.state();
    let last = matches!(part.piece, Piece::Last { .. });
    if last {
        st.txns.push_back(Txn {
            end_lsn: part.end_lsn,
            commit_time: part.commit_time,
            entries: Vec::new(),
            row_ids: Vec::new(),
        });
        spilling.current = None;
    } else {
        spilling.current = Some((commit_lsn, seen, before));
    }
    drop(st);
    debug!(
        events = rows.len(),
        skipped = skip,
        last,
        "a part of a large transaction moved to the held table"
    );
    held_changed(inner);
    Ok(true)
}

/// Every event of the buffer not yet settled, as held rows, each marked moving (claims skip
/// them); `None` while a batch holds events of the buffer.
fn unsettled_marked_moving(inner: &Inner) -> Option<(Vec<HeldRow>, Moving)> {
    let mut st = inner.state();
    if st.in_flight > 0 {
        return None;
    }
    let mut rows = Vec::new();
    let mut positions = Vec::new();
    for t in &st.txns {
        for (i, e) in t.entries.iter().enumerate() {
            match &e.state {
                EntryState::Done => continue,
                EntryState::Failed(a) => rows.push(HeldRow::failed(e.event.clone(), a)),
                _ => rows.push(HeldRow::waiting(e.event.clone())),
            }
            positions.push((t.end_lsn, i));
        }
    }
    let mut moving = Moving::default();
    for (end, i) in positions {
        moving.mark(&mut st, end, i);
    }
    Some((rows, moving))
}

/// The held rows of `part`'s items from `skip` on, leaving out those a reading before this one
/// dealt with.
fn part_rows(part: &WalTransaction, skip: usize, dealt_with: &HashSet<Uuid>) -> Vec<HeldRow> {
    let mut rows = Vec::new();
    for item in &part.items[skip..] {
        rows.push(match item {
            WalItem::Event(e) if dealt_with.contains(&e.id) => continue,
            WalItem::Undecodable { id, .. } if dealt_with.contains(id) => continue,
            item => HeldRow::of_item(item, part.commit_time),
        });
    }
    rows
}

/// The reader moved events to the held table: the relay's next claim looks there, now.
pub(super) fn held_changed(inner: &Inner) {
    inner
        .held_poll
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .dirty = true;
    inner.wake_relay();
}

/// Takes newly read transactions in: events of aggregates with events in the held table go there
/// (after them), so do changes that are not events (as dead letters); the rest wait in memory.
/// Returns whether some went to the held table.
pub(super) async fn take_in(
    inner: &Inner,
    conn: &mut PgConnection,
    new: Vec<WalTransaction>,
    check_held: bool,
    guard: &ReplayGuard,
) -> Result<bool, Error> {
    // Rows a reading before this one dealt with (published, or moved by a fallback): not again.
    let replayed: Vec<Uuid> = new
        .iter()
        .filter(|t| guard.covers(t.end_lsn))
        .flat_map(|t| t.row_ids.iter().copied())
        .collect();
    let mut skip = guard.dealt_with(inner, conn, &replayed).await?;
    skip.extend(new.iter().flat_map(|t| guard.taken_in(t)));
    let in_held = if check_held {
        InHeld::of(inner, conn, &new).await?
    } else {
        InHeld::default()
    };
    // Moved there before a restart: their fate is the held table's.
    skip.extend(&in_held.ids);
    let (txns, to_held) = sort_in(new, &in_held.aggregates, &skip);
    // Into the held table first: a transaction is confirmed only once it is in hand.
    insert_held(inner, conn, &to_held, None).await?;
    if !to_held.is_empty() {
        inner
            .held_poll
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .dirty = true;
    }
    let mut st = inner.state();
    let mut claimable = false;
    for t in txns {
        for e in &t.entries {
            st.unsettled += 1;
            st.unsettled_bytes += e.event.payload.len();
        }
        claimable |= !t.entries.is_empty();
        st.txns.push_back(t);
    }
    drop(st);
    if claimable || !to_held.is_empty() {
        inner.wake_relay();
    }
    Ok(!to_held.is_empty())
}

/// What the held table holds of some transactions: the aggregates with unpublished events there
/// (as `type \u{1f} id`), and the events already there.
#[derive(Debug, Default)]
struct InHeld {
    aggregates: HashSet<String>,
    ids: HashSet<Uuid>,
}

impl InHeld {
    /// Looks up the aggregates and the events of `new` in the held table, in one statement.
    async fn of(
        inner: &Inner,
        conn: &mut PgConnection,
        new: &[WalTransaction],
    ) -> Result<InHeld, Error> {
        let mut keys_t = Vec::new();
        let mut keys_i = Vec::new();
        let mut seen = HashSet::new();
        let mut ids = Vec::new();
        for item in new.iter().flat_map(|t| &t.items) {
            if let WalItem::Event(e) = item {
                ids.push(e.id);
                if seen.insert((e.aggregate_type.as_str(), e.aggregate_id.as_str())) {
                    keys_t.push(e.aggregate_type.clone());
                    keys_i.push(e.aggregate_id.clone());
                }
            }
        }
        if ids.is_empty() {
            return Ok(InHeld::default());
        }
        let held = inner.held.table().qualified();
        let found: Vec<(String, String)> = sqlx::query_as(&format!(
            "SELECT 'a', k.t || chr(31) || k.i FROM unnest($1::text[], $2::text[]) AS k(t, i)
             WHERE EXISTS (SELECT 1 FROM {held} h
                           WHERE h.aggregate_type = k.t AND h.aggregate_id = k.i AND h.processed_at IS NULL)
             UNION ALL
             SELECT 'i', h.id::text FROM {held} h WHERE h.id = ANY($3)"
        ))
        .bind(&keys_t)
        .bind(&keys_i)
        .bind(&ids)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal read", e))?;
        let mut in_held = InHeld::default();
        for (kind, value) in found {
            if kind == "a" {
                in_held.aggregates.insert(value);
            } else if let Ok(id) = value.parse() {
                in_held.ids.insert(id);
            }
        }
        Ok(in_held)
    }
}

/// Sorts the items of `new`: those in `skip` are left out; changes that are not events, and events
/// of aggregates in `held_aggregates`, go to the held table (in order); the rest become the
/// buffer's transactions.
fn sort_in(
    new: Vec<WalTransaction>,
    held_aggregates: &HashSet<String>,
    skip: &HashSet<Uuid>,
) -> (Vec<Txn>, Vec<HeldRow>) {
    let mut to_held = Vec::new();
    let mut txns = Vec::with_capacity(new.len());
    for t in new {
        let mut entries = Vec::with_capacity(t.items.len());
        for item in t.items {
            let event = match item {
                WalItem::Event(e) => e,
                WalItem::Undecodable {
                    id,
                    lsn,
                    error,
                    raw,
                } => {
                    if !skip.contains(&id) {
                        to_held.push(HeldRow::undecodable(id, lsn, error, raw, t.commit_time));
                    }
                    continue;
                }
            };
            if skip.contains(&event.id) {
                continue;
            }
            let agg = format!("{}\u{1f}{}", event.aggregate_type, event.aggregate_id);
            if held_aggregates.contains(&agg) {
                to_held.push(HeldRow::waiting(event));
                continue;
            }
            entries.push(Entry {
                key: aggregate_key(&event.aggregate_type, &event.aggregate_id),
                event,
                state: EntryState::Ready,
            });
        }
        txns.push(Txn {
            end_lsn: t.end_lsn,
            commit_time: t.commit_time,
            entries,
            row_ids: t.row_ids,
        });
    }
    (txns, to_held)
}

/// The dead letter of a change that is not an event.
fn undecodable_event(id: Uuid, lsn: u64, raw: String, commit_time: DateTime<Utc>) -> Event {
    Event {
        id,
        aggregate_type: UNDECODABLE_AGGREGATE_TYPE.into(),
        aggregate_id: format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF),
        event_type: UNDECODABLE_AGGREGATE_TYPE.into(),
        payload: raw.into_bytes(),
        content_type: "text/plain; charset=utf-8".into(),
        headers: Default::default(),
        destination: None,
        created_at: commit_time,
        attempts: 0,
    }
}

/// What the WAL source left in its held table `held`: events not yet published, and how many of
/// them are dead letters; `None` when the table does not exist or holds none (its marks aside).
///
/// A polling relay over the outbox table does not publish them, and the later events of their
/// aggregates would go out before them: a switch from the WAL source back to polling waits until
/// this is `None` ([`refuse_polling_over_held_events`]).
///
/// # Errors
/// A database error.
pub async fn held_events_left(
    pool: &sqlx::PgPool,
    held: &crate::table::OutboxTable,
) -> Result<Option<(i64, i64)>, Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(held.qualified())
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("held table check", e))?;
    if !exists {
        return Ok(None);
    }
    let (left, dead): (i64, i64) = sqlx::query_as(&format!(
        "SELECT count(*), count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) FROM {}
         WHERE processed_at IS NULL AND aggregate_type NOT LIKE '{}'",
        held.qualified(),
        crate::row::MARK_TYPES
    ))
    .fetch_one(pool)
    .await
    .map_err(|e| map_sqlx("held table check", e))?;
    Ok((left > 0).then_some((left, dead)))
}

/// Refuses a polling relay over a table whose WAL source left events in its held table `held`
/// ([`held_events_left`]), naming them and the way back. A role that may not read the held table
/// is let through with a warning.
///
/// # Errors
/// A configuration error while events wait there; a database error.
pub async fn refuse_polling_over_held_events(
    pool: &sqlx::PgPool,
    held: &crate::table::OutboxTable,
) -> Result<(), Error> {
    let left = match held_events_left(pool, held).await {
        Ok(left) => left,
        // A role that may not read the held table (it never ran the WAL source) cannot tell; the
        // relay says so rather than refuse a polling relay that may owe the table nothing.
        Err(e) if e.kind() == txoutbox_core::ErrorKind::PermissionDenied => {
            warn!(
                held = %held.qualified(),
                error = %e,
                "cannot read the WAL source's held table: if a WAL source left events there, publish them with database.source = \"wal\" before polling"
            );
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let Some((left, dead)) = left else {
        return Ok(());
    };
    Err(Error::config(format!(
        "the WAL source's held table {} still holds {left} unpublished events ({dead} of them dead \
         letters): a polling relay would not publish them, and later events of their aggregates \
         would go out before them. Run the relay with database.source = \"wal\" until `outbox \
         status` shows none there (retry or discard its dead letters with `outbox dead-letters`), \
         then switch to polling",
        held.qualified()
    )))
}
