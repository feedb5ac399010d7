//! The table fallback: while the slot cannot be read (missing, invalidated, its publication gone
//! or without the outbox table), the reader publishes from the outbox table itself. Its unpublished
//! rows are moved to the held table, in `seq` order, and the relay claims them from there with the
//! polling machinery; with `wal.auto_recreate` the reader makes the slot (and the publication)
//! again, moves every row written before the new slot's consistent point, and streams again.
//!
//! Why the rows are enough: a row event is a row of the outbox table until the WAL source deletes
//! it, which it does only once its event is published or in the held table. Table-less events
//! (logical decoding messages) have no row: those committed while no slot held the WAL are not read
//! by any, and the reader says so, with the WAL range they fell in.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use uuid::Uuid;

use txoutbox_core::Error;

use super::check::{check_slot, Identity, SlotProblem};
use super::confirm::{delete_published, refusal};
use super::decode::Origin;
use super::held::{held_changed, STATE_COLUMNS};
use super::mark::FallbackMark;
use super::progress::FallbackReason;
use super::shared::Inner;
use super::tableless::round;
use super::taken::Taken;
use crate::error::map_sqlx;
use crate::row::INSERT_COLUMNS;
use crate::table::OutboxTable;

/// Rows moved from the outbox table to the held table per statement.
const MOVE_CHUNK: i64 = 1_000;

/// How often the reader tries again to make the slot when making it failed.
const REPAIR_RETRY: Duration = Duration::from_secs(10);

/// How often the reader looks at the outbox table for new rows while it falls back (sooner when
/// a writer's NOTIFY wakes it).
const FALLBACK_POLL: Duration = Duration::from_millis(500);

/// Publishes from the outbox table while the slot cannot be streamed (see the module's
/// documentation), or finishes a fallback the [`FallbackMark`] says is unfinished. Returns the
/// publication's identity as it was when the fence was read once the slot can be streamed and every
/// row written before its consistent point is in the held table (the stream must find it unchanged);
/// `None` on `stop`. `left`: what a failed reading dealt with and did not confirm. With
/// `wal.delete_published = false` the table's published rows cannot be told
/// from the others: nothing is moved, and the reader only waits for the slot (and says which row
/// events it could not publish).
///
/// # Errors
/// A database error (the reader connects again and, the mark still there, goes on).
pub(super) async fn fall_back(
    inner: &Inner,
    conn: &mut PgConnection,
    problem: Option<SlotProblem>,
    mark: Option<FallbackMark>,
    origin: Origin,
    left: Taken,
    stop: &CancellationToken,
) -> Result<Option<(Identity, Taken)>, Error> {
    if problem.is_none() && !inner.settings.delete_published {
        // The table keeps published rows: rows before the slot cannot be told from the others.
        FallbackMark::clear(conn, inner.held.table()).await?;
        warn!(
            table = %inner.source.qualified(),
            "rows written before the slot was made are not moved to the held table: with wal.delete_published = false the table keeps published rows too; publish those you need yourself"
        );
        return Ok(Some((
            check_slot(inner, conn).await?.identity,
            Taken::default(),
        )));
    }
    announce(inner, problem);
    // With wal.delete_published = false the table keeps published rows: the reader cannot tell
    // which wait, publishes none of them, and only waits for the slot to be readable again.
    let from_table = inner.settings.delete_published;
    // Kept in the held table until every row before the fence is moved: a relay that takes over
    // from this one finishes the move before it streams.
    // A fence is kept only for the slot it was read after: a slot lost again needs a new one.
    let mut fence = if problem.is_some() {
        None
    } else {
        mark.as_ref().and_then(|m| m.fence)
    };
    // What an earlier reading took of the slot's table-less events (its slot still there).
    let mut taken = match (&mark, problem) {
        (Some(m), None | Some(SlotProblem::TableNotPublished)) => m.taken.clone(),
        _ => Taken::default(),
    };
    if matches!(problem, None | Some(SlotProblem::TableNotPublished)) {
        // The slot a failed reading left (a slot lost since starts again without them).
        taken.extend(left);
    }
    let mark_fence = mark.as_ref().and_then(|m| m.fence);
    if from_table && (mark.is_none() || (problem.is_some() && mark_fence.is_some())) {
        // A fence is valid only for the slot it was read after: one for a slot that is gone now
        // must not survive a relay that dies while making the next.
        FallbackMark {
            fence: None,
            taken: taken.clone(),
        }
        .save(conn, inner.held.table(), inner.reader.slot().slot())
        .await?;
    }
    let mut repair = Repair::new(inner, problem);
    let mut identity = None;
    loop {
        if fence.is_none() {
            if let Some((f, i)) = repair.step(inner, conn).await? {
                fence = Some(f);
                identity = Some(i);
                if from_table {
                    FallbackMark {
                        fence,
                        taken: taken.clone(),
                    }
                    .save(conn, inner.held.table(), inner.reader.slot().slot())
                    .await?;
                }
            }
        }
        let moved = if !from_table {
            0
        } else if repair.readable || fence.is_some() {
            // The slot can be read: its table-less events go to the held table among the rows.
            round(inner, conn, origin, fence, MOVE_CHUNK, &mut taken).await?
        } else {
            move_rows(inner, conn, fence).await?
        };
        if moved > 0 {
            held_changed(inner);
            if stop.is_cancelled() {
                return Ok(None);
            }
            continue;
        }
        if fence.is_some() {
            return leave(inner, conn, identity).await.map(|i| Some((i, taken)));
        }
        tokio::select! {
            _ = inner.reader_wake.notified() => {}
            _ = tokio::time::sleep(FALLBACK_POLL) => {}
            _ = stop.cancelled() => return Ok(None),
        }
    }
}

/// Counts the fallback for `problem` (`None`: rows written before the slot) and says why it
/// happens and what comes next, when the reader was not falling back already.
fn announce(inner: &Inner, problem: Option<SlotProblem>) {
    let reason = match problem {
        Some(p) => p.describe(inner),
        None => format!(
            "rows of {} written before the slot {} was made may not be in it (a fallback that did not finish, or a slot made by `outbox wal setup`)",
            inner.source.qualified(),
            inner.reader.slot().slot()
        ),
    };
    let fix = if problem.is_none() {
        "they are moved to the held table first"
    } else if inner.settings.auto_recreate {
        "the relay makes it again itself (wal.auto_recreate)"
    } else {
        "run `outbox wal setup` (wal.auto_recreate is off)"
    };
    let kind = problem.map_or(FallbackReason::RowsBeforeSlot, SlotProblem::reason);
    if !inner.fallbacks.enter(kind, &format!("{reason}: {fix}")) {
        return;
    }
    let slot = inner.reader.slot().slot();
    if !inner.settings.delete_published {
        error!(
            slot,
            reason = %reason,
            "the WAL source cannot read its slot, and with wal.delete_published = false it cannot publish from the outbox table either (the table keeps published rows too): row events written until the slot can be read again are not published, and table-less ones are not read; {fix}"
        );
    } else if problem.is_some() {
        error!(
            slot,
            reason = %reason,
            "the WAL source falls back to the outbox table: its unpublished rows go to the held table, in order, and are published from there; {fix}"
        );
    } else {
        // After `outbox wal setup` made the slot, or a fallback another relay did not finish.
        info!(
            slot,
            "moving the outbox table's rows written before the slot was made to the held table before streaming"
        );
    }
}

/// Ends a fallback whose rows before the fence are all in the held table: the mark goes, and the
/// reader streams with the publication's identity as the fence found it (`None`: a fence from a
/// mark, another relay's, which comes without it: the one now).
async fn leave(
    inner: &Inner,
    conn: &mut PgConnection,
    identity: Option<Identity>,
) -> Result<Identity, Error> {
    let identity = match identity {
        Some(i) => i,
        None => check_slot(inner, conn).await?.identity,
    };
    inner.fallbacks.leave();
    // Without wal.delete_published, a mark left by a stream that saw the publication change: the
    // table's rows cannot be told apart here, and one kept would make a relay that deletes
    // published rows move every row of the table.
    FallbackMark::clear(conn, inner.held.table()).await?;
    if inner.settings.delete_published {
        info!(
            slot = inner.reader.slot().slot(),
            "the slot can be read again and every row written before it is in the held table: streaming the slot again"
        );
    } else {
        warn!(
            slot = inner.reader.slot().slot(),
            table = %inner.source.qualified(),
            "the slot can be read again: streaming it. Row events written while it could not be read were not published (wal.delete_published = false): publish those you need yourself"
        );
    }
    Ok(identity)
}

/// The fallback's tries to make the slot readable again, spaced by [`FALLBACK_POLL`] (by
/// [`REPAIR_RETRY`] after a failure, which is logged once per message).
struct Repair {
    /// The slot's last confirmed position before it was lost: the start of the WAL whose
    /// table-less events no slot read.
    lost_from: Option<u64>,
    /// Whether the slot this relay streamed was lost (missing, invalidated, or dropped to be made
    /// again): the table-less events since its last confirmed position are then unread.
    slot_lost: bool,
    next: Instant,
    last_failure: Option<String>,
    running: Option<Running>,
    /// Whether the slot can be read (peeked) now, as the last look found it: there, not lost, its
    /// publication there (with or without the table).
    readable: bool,
}

impl Repair {
    fn new(inner: &Inner, problem: Option<SlotProblem>) -> Self {
        Repair {
            lost_from: match inner.fallbacks.slot_confirmed.load(Ordering::SeqCst) {
                0 => None,
                c => Some(c),
            },
            slot_lost: problem.is_some_and(SlotProblem::loses_messages),
            next: Instant::now(),
            last_failure: None,
            running: None,
            readable: matches!(problem, None | Some(SlotProblem::TableNotPublished)),
        }
    }

    /// Tries, when a try is due: the fence and the publication's identity once the slot is
    /// readable (a gap of table-less events reported when a slot was made again).
    async fn step(
        &mut self,
        inner: &Inner,
        conn: &mut PgConnection,
    ) -> Result<Option<(i64, Identity)>, Error> {
        if Instant::now() < self.next {
            return Ok(None);
        }
        match restore(inner, conn, self.slot_lost, &mut self.running).await {
            Ok(Restored::NotYet(p)) => {
                self.slot_lost |= p.loses_messages();
                self.readable = p == SlotProblem::TableNotPublished;
                self.next = Instant::now() + FALLBACK_POLL;
                Ok(None)
            }
            Ok(Restored::Waiting) => {
                self.readable = true;
                self.next = Instant::now() + FALLBACK_POLL;
                Ok(None)
            }
            Ok(Restored::Ready {
                fence,
                made_at,
                identity,
            }) => {
                if let Some(made_at) = made_at {
                    report_gap(inner, self.lost_from, made_at);
                }
                Ok(Some((fence, identity)))
            }
            Err(e) => {
                // What the slot is now is not known: the rows alone until a look tells.
                self.readable = false;
                let message = e.to_string();
                if self.last_failure.as_deref() != Some(message.as_str()) {
                    error!(error = %e, slot = inner.reader.slot().slot(), retry_s = REPAIR_RETRY.as_secs(), "the relay cannot make the slot again; it keeps publishing from the outbox table and tries again every retry_s");
                    self.last_failure = Some(message);
                }
                self.next = Instant::now() + REPAIR_RETRY;
                Ok(None)
            }
        }
    }
}

/// The outcome of a try to make the slot readable again.
enum Restored {
    /// Still not readable (waiting for an operator, with `wal.auto_recreate` off).
    NotYet(SlotProblem),
    /// Readable, but transactions that began before it became so still run: rows they wrote may
    /// be in neither the slot nor (until they commit) the table's visible rows, so the fence waits
    /// for them. The reader goes on moving rows meanwhile.
    Waiting,
    /// Readable: rows up to `fence` (in `seq`) may have committed before its consistent point, and
    /// go to the held table before the slot is streamed. `made_at` is the new slot's consistent
    /// point, when a slot was lost (the table-less events before it since the old slot's position
    /// are unread).
    Ready {
        fence: i64,
        made_at: Option<u64>,
        identity: Identity,
    },
}

/// Makes the slot readable again (with `wal.auto_recreate`: drops a lost slot, or one older than
/// its publication, then makes what is missing as `outbox wal setup` does), and returns the fence.
async fn restore(
    inner: &Inner,
    conn: &mut PgConnection,
    slot_lost: bool,
    running: &mut Option<Running>,
) -> Result<Restored, Error> {
    let slot = inner.reader.slot();
    let mut check = check_slot(inner, conn).await?;
    let mut slot_lost = slot_lost || check.problem.is_some_and(SlotProblem::loses_messages);
    if inner.settings.auto_recreate {
        if let Some(p) = check.problem {
            if matches!(p, SlotProblem::Lost | SlotProblem::NoPublication)
                && check.confirmed.is_some()
            {
                // A lost slot cannot be read; one older than its (new) publication cannot decode
                // what was written without it.
                slot.drop_slot(&mut *conn, false)
                    .await
                    .map_err(|e| map_sqlx("wal drop of the unreadable slot", e))?;
                slot_lost = true;
            }
            let made = slot.setup(&inner.pool).await?;
            slot_lost |= made.slot;
            if made.slot || made.publication {
                info!(
                    slot = slot.slot(),
                    publication = slot.publication(),
                    made_slot = made.slot,
                    made_publication = made.publication,
                    "made the slot readable again"
                );
            }
            check = check_slot(inner, conn).await?;
        }
    }
    if let Some(p) = check.problem {
        *running = None;
        return Ok(Restored::NotYet(p));
    }
    // A transaction of this database that wrote before the publication held the table (added
    // again, made again) and commits later is decoded as of its writes, without the table: its
    // rows come only from the table, so it must have ended before the fence is read, however long
    // it runs. (A new slot waited for those already.) With wal.delete_published = false nothing is
    // moved from the table, so there is nothing to wait for.
    if inner.settings.delete_published
        && !running_ended(inner, conn, running, check.identity).await?
    {
        return Ok(Restored::Waiting);
    }
    *running = None;
    // Read after the slot exists: a row committed before its consistent point is visible now, so
    // its seq is at most this.
    let fence: i64 = sqlx::query_scalar(&format!(
        "SELECT coalesce(max(seq), 0) FROM {}",
        inner.source.qualified()
    ))
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal fallback", e))?;
    let made_at = slot_lost.then_some(check.confirmed).flatten();
    if let Some(c) = made_at {
        // The new slot's position replaces the old one's.
        inner.fallbacks.slot_confirmed.store(c, Ordering::SeqCst);
    }
    Ok(Restored::Ready {
        fence,
        made_at,
        identity: check.identity,
    })
}

/// How long the transactions running when the publication became right may run before the reader
/// says which ones it waits for (and again each time as long again).
const RUNNING_WARN: Duration = Duration::from_secs(60);

/// The transactions the fence waits for: those of this database (and its prepared ones) that held
/// a transaction id when the slot became readable with the publication `identity` (a write gives a
/// transaction its id, so every transaction that wrote a row meanwhile is among them), and since
/// when. Told by their transaction ids' locks, which `pg_locks` shows to any role.
pub(super) struct Running {
    xids: Vec<String>,
    identity: Identity,
    since: Instant,
    warned: Instant,
}

/// Whether every transaction of this database that held a transaction id when the slot became
/// readable (with `identity`; a new identity starts a new wait) has ended. Says once a minute which
/// sessions it still waits for.
async fn running_ended(
    inner: &Inner,
    conn: &mut PgConnection,
    running: &mut Option<Running>,
    identity: Identity,
) -> Result<bool, Error> {
    let map = |e| map_sqlx("wal fallback", e);
    if running.as_ref().is_none_or(|r| r.identity != identity) {
        let xids: Vec<String> = sqlx::query_scalar(
            "SELECT l.transactionid::text FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
               AND a.datname = current_database() AND l.pid <> pg_backend_pid()
             UNION
             SELECT transaction::text FROM pg_prepared_xacts WHERE database = current_database()",
        )
        .fetch_all(&mut *conn)
        .await
        .map_err(map)?;
        let now = Instant::now();
        *running = Some(Running {
            xids,
            identity,
            since: now,
            warned: now,
        });
    }
    let Some(r) = running.as_mut() else {
        return Ok(true);
    };
    if r.xids.is_empty() {
        return Ok(true);
    }
    // A transaction holds the lock on its id until it ends (a prepared one, until it is committed
    // or rolled back).
    let still: Vec<String> = sqlx::query_scalar(
        "SELECT coalesce(l.pid::text, 'prepared ' || p.gid, 'prepared') FROM pg_locks l
         LEFT JOIN pg_prepared_xacts p ON p.transaction::text = l.transactionid::text
         WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock'
           AND l.transactionid::text = ANY($1)",
    )
    .bind(&r.xids)
    .fetch_all(&mut *conn)
    .await
    .map_err(map)?;
    if still.is_empty() {
        return Ok(true);
    }
    if r.warned.elapsed() >= RUNNING_WARN {
        r.warned = Instant::now();
        warn!(
            slot = inner.reader.slot().slot(),
            waited_s = r.since.elapsed().as_secs(),
            sessions = %still.join(", "),
            "the slot can be read again, but transactions of this database that wrote before its publication held the outbox table still run: the relay keeps publishing from the table and streams once they end (their rows are then in the table); end them if they hang (the pids named; prepared transactions by their gid). The slot keeps WAL meanwhile"
        );
    }
    Ok(false)
}

/// Says which table-less events no slot read: those committed between the old slot's last
/// confirmed position (when this relay knew it) and the new slot's consistent point.
fn report_gap(inner: &Inner, from: Option<u64>, to: u64) {
    let slot = inner.reader.slot().slot();
    let lsn = |l: u64| format!("{:X}/{:X}", l >> 32, l & 0xFFFF_FFFF);
    match (from, to) {
        (Some(from), to) if to >= from => {
            inner.fallbacks.tableless_gaps.fetch_add(1, Ordering::SeqCst);
            inner
                .fallbacks
                .tableless_gap_bytes
                .fetch_add(to - from, Ordering::SeqCst);
            error!(
                slot,
                from = lsn(from),
                to = lsn(to),
                wal_bytes = to - from,
                "table-less events committed between these WAL positions were not read by any slot and are not published (row events are: they are rows of the outbox table)"
            );
        }
        // Not counted: this relay saw no slot before (a first start before `outbox wal setup`, or
        // a relay started while the slot was missing), so there may have been none.
        (_, to) => warn!(
            slot,
            to = lsn(to),
            "table-less events committed before the new slot's position, since the old slot's last confirmed one (not known to this relay: it saw no slot before), were not read by any slot and are not published (row events are: they are rows of the outbox table)"
        ),
    }
}

/// Moves up to [`MOVE_CHUNK`] unpublished rows of the outbox table (with `seq` up to `fence`, when
/// set) to the held table, in `seq` order, and deletes them from the outbox table, in one
/// statement. Rows whose id is in the held table already are not moved twice. Returns how many
/// were moved.
///
/// A row keeps its delivery state: attempts, last error, next attempt time and dead-letter mark.
/// A dead letter of the polling source (a switch to WAL) moves too: in the held table it still
/// holds its aggregate back and shows in `outbox dead-letters`, and an event backing off still
/// waits for its time.
///
/// In `seq` order is in order per aggregate: a row a writer's transaction still holds has no later
/// row of its aggregate visible (the writer-order trigger).
async fn move_rows(
    inner: &Inner,
    conn: &mut PgConnection,
    fence: Option<i64>,
) -> Result<usize, Error> {
    let held = inner.held.table().qualified();
    let source = inner.source.qualified();
    let statement = |delete: bool| {
        format!(
            "WITH picked AS (
                 SELECT s.* FROM {source} s
                 WHERE s.processed_at IS NULL
                   AND ($1::bigint IS NULL OR s.seq <= $1)
                   AND NOT EXISTS (SELECT 1 FROM {held} h WHERE h.id = s.id)
                 ORDER BY s.seq
                 LIMIT $2
             ), moved AS (
                 INSERT INTO {held} ({INSERT_COLUMNS}, {STATE_COLUMNS})
                 SELECT {INSERT_COLUMNS}, {STATE_COLUMNS} FROM picked ORDER BY seq
                 ON CONFLICT (id) DO NOTHING
             ){}
             SELECT id FROM picked ORDER BY seq",
            if delete {
                format!(", gone AS (DELETE FROM {source} WHERE id IN (SELECT id FROM picked))")
            } else {
                String::new()
            }
        )
    };
    let ids = match run_move(conn, &statement(true), fence).await {
        Ok(ids) => ids,
        Err(e) if refusal(&e).is_some() => {
            // The database refuses to delete some of them (a foreign key into the outbox table,
            // a trigger): moved first, then deleted one at a time (the refused rows stay, logged;
            // `NOT EXISTS` keeps them from being moved again).
            let ids = run_move(conn, &statement(false), fence)
                .await
                .map_err(|e| map_sqlx("wal fallback: move rows to the held table", e))?;
            delete_published(inner, conn, &ids).await?;
            ids
        }
        Err(e) => return Err(map_sqlx("wal fallback: move rows to the held table", e)),
    };
    if !ids.is_empty() {
        inner
            .fallbacks
            .moved
            .fetch_add(ids.len() as u64, Ordering::SeqCst);
    }
    Ok(ids.len())
}

/// Runs one move statement in a transaction of its own, without the writer-order lock (this
/// reader is the held table's only writer: see `held::insert_held`).
async fn run_move(
    conn: &mut PgConnection,
    sql: &str,
    fence: Option<i64>,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    sqlx::query("SELECT set_config('outbox.writer_order', 'off', true)")
        .execute(&mut *tx)
        .await?;
    let ids = sqlx::query_scalar(sql)
        .bind(fence)
        .bind(MOVE_CHUNK)
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(ids)
}

/// Records a fallback to finish before the next stream (the publication changed under the running
/// one): the reader then moves the rows up to a new fence first.
pub(super) async fn mark_unfinished(inner: &Inner, conn: &mut PgConnection) -> Result<(), Error> {
    FallbackMark::default()
        .save(conn, inner.held.table(), inner.reader.slot().slot())
        .await
}

/// After `outbox wal setup` made `slot` (none existed): rows of `source` still unpublished that
/// committed before the slot's consistent point are not in it, so the relay moves every row up to
/// the table's largest `seq` now to the held table `held` before it streams (for example rows
/// written while no slot existed, or before a switch from the polling source). An empty table needs
/// no mark.
///
/// # Errors
/// A database error.
pub async fn mark_new_slot(
    pool: &sqlx::PgPool,
    source: &OutboxTable,
    held: &OutboxTable,
    slot: &str,
) -> Result<(), Error> {
    let mut conn = pool.acquire().await.map_err(|e| map_sqlx("wal setup", e))?;
    let fence: i64 = sqlx::query_scalar(&format!(
        "SELECT coalesce(max(seq), 0) FROM {}",
        source.qualified()
    ))
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal setup", e))?;
    if fence == 0 {
        // An empty table: nothing to move.
        return Ok(());
    }
    FallbackMark {
        fence: Some(fence),
        ..FallbackMark::default()
    }
    .save(&mut conn, held, slot)
    .await
}
