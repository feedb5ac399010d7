//! The reader task: one per slot, holding the slot's reader lock (a session advisory lock; other
//! relays stand by and take over when its session ends), and, while it holds it, streaming the
//! slot into the buffer, moving failed events to the held table and confirming what is settled.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use txoutbox_core::Error;

use super::buffer::EntryState;
use super::check::{check_slot, warn_unreadable, Identity};
use super::confirm::{check_reader_privileges, confirm_settled, delete_published};
use super::decode::{Origin, Piece, WalItem, WalTransaction};
use super::fallback::{fall_back, mark_unfinished};
use super::held::{move_failed, spill, take_in, Spilling};
use super::mark::FallbackMark;
use super::replay::ReplayGuard;
use super::shared::Inner;
use super::stream::{open_stream, Stream, CONFIRM_EVERY};
use crate::error::map_sqlx;
use crate::pool::KEEPALIVES;

/// How often a standby tries to take the reader lock.
pub const STANDBY_RETRY: Duration = Duration::from_millis(500);

/// How often the reader runs a statement on its lock connection at least (a dead one ends the
/// reading spell, so that a reader that lost its lock stops).
const LOCK_PING: Duration = Duration::from_secs(10);

/// How often the reader looks whether the held table is empty again, while it may not be.
const HELD_EMPTY_CHECK: Duration = Duration::from_secs(1);

/// How often the reader looks whether the slot can still be streamed (its publication may have
/// lost the outbox table).
const SLOT_CHECK: Duration = Duration::from_secs(1);

/// How long the reader waits between two looks at what it holds while the relay does not claim.
const PAUSED_WAIT: Duration = Duration::from_secs(1);

/// How long the reader waits before connecting again after its connection failed.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// The reader: waits for the lock, reads while it holds it, reconnects after failures.
pub(super) async fn run_reader(inner: Arc<Inner>, stop: CancellationToken) {
    let slot = inner.reader.slot().slot().to_string();
    if let Err(e) = runtime_supported() {
        tracing::error!(error = %e, slot = %slot, "the WAL reader does not read");
        return;
    }
    let mut waiting_logged = false;
    let mut failures = RepeatedWarning::default();
    loop {
        if stop.is_cancelled() {
            return;
        }
        let conn = tokio::select! {
            c = connect(&inner) => c,
            _ = stop.cancelled() => return,
        };
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                if failures.should_log(&e.to_string()) {
                    warn!(error = %e, slot = %slot, repeat_logged_after_s = REPEAT_AFTER.as_secs(), "the WAL reader cannot connect; trying again (a failure that repeats is logged again after repeat_logged_after_s)");
                }
                if pause(&stop, RECONNECT_PAUSE).await {
                    return;
                }
                continue;
            }
        };
        let session = match stand_by(&mut conn, &slot, &stop, &mut waiting_logged).await {
            Standby::Locked(session) => session,
            Standby::Stopped => return,
            Standby::Lost(e) => {
                warn!(error = %e, slot = %slot, "the WAL reader lost its connection while standing by; reconnecting");
                if pause(&stop, RECONNECT_PAUSE).await {
                    return;
                }
                continue;
            }
        };
        waiting_logged = false;
        inner.state().start_reading(session);
        info!(slot = %slot, "reading the slot");
        let result = read_slot(&inner, &mut conn, &stop).await;
        // An unfinished fallback is the held table's mark's: whichever relay reads next goes on.
        inner.fallbacks.leave();
        inner.state().stop_reading();
        match result {
            Ok(()) => {
                let _ = conn.close().await;
                info!(slot = %slot, "stopped reading the slot");
                return;
            }
            Err(e) => {
                if failures.should_log(&e.to_string()) {
                    warn!(error = %e, slot = %slot, repeat_logged_after_s = REPEAT_AFTER.as_secs(), "the WAL reader stopped reading; what it held is read again once it holds the slot (a failure that repeats is logged again after repeat_logged_after_s)");
                }
                drop(conn);
                if pause(&stop, RECONNECT_PAUSE).await {
                    return;
                }
            }
        }
    }
}

/// How a standby for the slot's reader lock ended.
enum Standby {
    /// The lock is this session's (its backend pid).
    Locked(i32),
    /// The connection failed meanwhile.
    Lost(Error),
    /// The reader is stopping.
    Stopped,
}

/// Tries the slot's reader lock until it is this connection's (another relay reads meanwhile),
/// logging the standby once.
async fn stand_by(
    conn: &mut PgConnection,
    slot: &str,
    stop: &CancellationToken,
    waiting_logged: &mut bool,
) -> Standby {
    loop {
        match try_lock(conn, slot).await {
            Ok((true, session)) => return Standby::Locked(session),
            Ok((false, _)) => {
                if !*waiting_logged {
                    info!(slot = %slot, "another relay reads the slot; standing by to take over");
                    *waiting_logged = true;
                }
                if pause(stop, STANDBY_RETRY).await {
                    return Standby::Stopped;
                }
            }
            Err(e) => return Standby::Lost(e),
        }
    }
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
async fn settle_before_leaving(inner: &Inner, conn: &mut PgConnection) {
    // A reading that follows checks what it reads again: besides the rows deleted below, those of
    // transactions this reading confirmed may be read again, the server not having taken the last
    // confirm before the stream ended.
    inner.left_unconfirmed.store(true, Ordering::SeqCst);
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
        note_settled(inner);
        keep_in_mark(inner, conn).await?;
        delete_published(inner, conn, &ids).await
    };
    if let Err(e) = settled.await {
        debug!(error = %e, "the rows of events published before the reading failed are not deleted: they are read again");
    }
}

/// With a fallback mark (the reading ends on a change of the publication), what the reading dealt
/// with goes into it too: the relay that reads next may be another.
async fn keep_in_mark(inner: &Inner, conn: &mut PgConnection) -> Result<(), Error> {
    let Some(mut mark) = FallbackMark::load(conn, inner.held.table()).await? else {
        return Ok(());
    };
    let left = inner
        .left_taken
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    mark.taken.extend(left);
    mark.save(conn, inner.held.table(), inner.reader.slot().slot())
        .await
}

/// Table-less events have no row to tell that they are dealt with: the next reading is told which
/// transactions of the buffer were (published, or in the held table).
fn note_settled(inner: &Inner) {
    let st = inner.state();
    let settled: Vec<u64> = st
        .txns
        .iter()
        .filter(|t| t.settled())
        .map(|t| t.end_lsn)
        .collect();
    // Confirmed on the stream: the server may not have taken it before the stream ended.
    let confirmed = st.confirmed;
    drop(st);
    let mut left = inner.left_taken.lock().unwrap_or_else(|p| p.into_inner());
    left.add_through(confirmed);
    for end in settled {
        left.add_whole(end);
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

/// The WAL source reads on a multi-thread tokio runtime only (see
/// [`WalStore::start`](crate::wal::WalStore::start)).
pub(super) fn runtime_supported() -> Result<(), Error> {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => Ok(()),
        _ => Err(Error::config(
            "the WAL source needs a multi-thread tokio runtime (#[tokio::main] or \
             #[tokio::test(flavor = \"multi_thread\")])",
        )),
    }
}

/// How often a failure that repeats is logged again.
const REPEAT_AFTER: Duration = Duration::from_secs(60);

/// Logs a failure that repeats once per [`REPEAT_AFTER`] rather than at every retry.
#[derive(Default)]
struct RepeatedWarning {
    last: Option<(String, Instant)>,
}

impl RepeatedWarning {
    fn should_log(&mut self, message: &str) -> bool {
        match &self.last {
            Some((m, at)) if m == message && at.elapsed() < REPEAT_AFTER => false,
            _ => {
                self.last = Some((message.to_string(), Instant::now()));
                true
            }
        }
    }
}

/// Waits `d` or until `stop`; true when stopped.
async fn pause(stop: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.cancelled() => true,
    }
}

/// The reader's own connection (the pool's settings), with no statement or idle timeouts of the
/// role's: it waits on the slot and must outlive an idle spell.
async fn connect(inner: &Inner) -> Result<PgConnection, Error> {
    let options = inner.pool.connect_options();
    let mut conn = PgConnection::connect_with(&options)
        .await
        .map_err(|e| map_sqlx("wal reader connect", e))?;
    sqlx::query(
        "SELECT set_config('statement_timeout', '0', false), set_config('idle_session_timeout', '0', false)
         WHERE current_setting('server_version_num')::int >= 140000
         UNION ALL SELECT set_config('statement_timeout', '0', false), ''
         WHERE current_setting('server_version_num')::int < 140000",
    )
    .execute(&mut conn)
    .await
    .map_err(|e| map_sqlx("wal reader connect", e))?;
    // The pool's server-side TCP keepalives: a reader whose host vanished loses its session, and
    // the lock with it, within about 25 s instead of the kernel's two hours.
    {
        use sqlx::Executor;
        conn.execute(sqlx::raw_sql(KEEPALIVES))
            .await
            .map_err(|e| map_sqlx("wal reader connect", e))?;
    }
    Ok(conn)
}

/// Takes the slot's reader lock if it is free (a session lock: freed when the session ends);
/// whether it did, and the server session it holds it in.
async fn try_lock(conn: &mut PgConnection, slot: &str) -> Result<(bool, i32), Error> {
    sqlx::query_as(
        "SELECT pg_try_advisory_lock(hashtext('outbox-wal-reader'), hashtext($1)), pg_backend_pid()",
    )
    .bind(slot)
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal reader lock", e))
}

/// The reader's statements must run in the session that holds its lock. A pooler in transaction
/// mode that the start-up probe could not see (one instance per client behind a load balancer)
/// lends each statement a server session: the lock would stay in one that other clients are lent.
async fn same_session(inner: &Inner, conn: &mut PgConnection) -> Result<(), Error> {
    let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| map_sqlx("wal read", e))?;
    let locked = inner.state().session;
    if now == locked {
        return Ok(());
    }
    Err(Error::config(format!(
        "the WAL reader's connection went from server session {locked} to {now}: it goes through a connection pooler in \
         transaction mode, which would lend its reader lock to other clients. Set database.direct_url to the server itself \
         (or to a session-mode pool)"
    )))
}

/// The server's identity, for the ids of messages written without one.
async fn origin(conn: &mut PgConnection) -> Result<Origin, Error> {
    let (system, timeline): (i64, i32) = sqlx::query_as(
        "SELECT (SELECT system_identifier FROM pg_control_system()),
                (SELECT timeline_id FROM pg_control_checkpoint())",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| map_sqlx("wal read", e))?;
    Ok(Origin {
        system: system as u64,
        timeline: timeline as u32,
    })
}

/// A transaction taken from the stream. One in which a relation is described again makes the
/// reader look whether the publication changed first (see [`verify_publication`]).
async fn taken(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &Stream,
    t: Result<WalTransaction, Error>,
    identity: Identity,
) -> Result<WalTransaction, Error> {
    let t = stream.taken(t)?;
    if stream.described_again() {
        verify_publication(inner, conn, identity).await?;
    }
    Ok(t)
}

/// Fails, leaving a [`FallbackMark`], when the slot cannot be streamed any more or the publication
/// is not the one the stream started with: a slot dropped or invalidated ends the stream, but a
/// publication that lost the table (or lost it and got it back) does not, and rows written
/// meanwhile were not decoded. The next reading moves the outbox table's rows first.
async fn verify_publication(
    inner: &Inner,
    conn: &mut PgConnection,
    identity: Identity,
) -> Result<(), Error> {
    let check = check_slot(inner, conn).await?;
    if let Some(problem) = check.problem {
        mark_unfinished(inner, conn).await?;
        return Err(warn_unreadable(inner, problem));
    }
    if check.identity != identity {
        mark_unfinished(inner, conn).await?;
        let e = Error::new(
            txoutbox_core::ErrorKind::Connection,
            format!(
                "the publication {} or its outbox table was changed (made again, or the table removed and added again): rows written meanwhile may not be decoded; they are moved from the table first",
                inner.reader.slot().publication()
            ),
        );
        warn!(error = %e, "the slot's publication changed");
        return Err(e);
    }
    Ok(())
}

/// Reads, moves and confirms while the lock is held; returns on `stop` (after a last round) or
/// on a database or stream error.
async fn read_slot(
    inner: &Inner,
    conn: &mut PgConnection,
    stop: &CancellationToken,
) -> Result<(), Error> {
    // Without it every confirm (and every move from the table) would fail, and the reader read
    // the same events again, for ever.
    check_reader_privileges(inner, conn).await?;
    // A slot that cannot be streamed: publish from the outbox table until it can. A fallback not
    // finished (this relay's or another's that stopped) moves the rows before the fence first.
    let check = check_slot(inner, conn).await?;
    let mark = FallbackMark::load(conn, inner.held.table()).await?;
    let fell_back = check.problem.is_some() || mark.is_some();
    let origin = origin(conn).await?;
    // What a failed reading before this one dealt with and did not confirm.
    let left = std::mem::take(&mut *inner.left_taken.lock().unwrap_or_else(|p| p.into_inner()));
    let (identity, taken) = if fell_back {
        match fall_back(inner, conn, check.problem, mark, origin, left, stop).await? {
            Some(done) => done,
            None => return Ok(()),
        }
    } else {
        (check.identity, left)
    };
    // After every move of the fallback: what the stream hands over again is told by its row, or
    // (a table-less event) by the fallback's record of what it took.
    let guard = ReplayGuard::at_start(inner, conn, fell_back)
        .await?
        .with_taken(taken);
    let mut stream = open_stream(inner, origin).await?;
    // However this ends (a panic, the task dropped), readiness stops counting this stream.
    let _streaming = inner.replication_health.streaming();
    let result = read_stream(inner, conn, &mut stream, identity, &guard, stop).await;
    if result.is_err() {
        settle_before_leaving(inner, conn).await;
    }
    stream.close().await;
    result
}

/// Streams the slot into the buffer until `stop` (after a last confirm) or an error: moves failed
/// events to the held table, confirms what is settled, hands over parts of large transactions,
/// takes the periodic looks, and takes in what is decoded while there is room.
async fn read_stream(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &mut Stream,
    identity: Identity,
    guard: &ReplayGuard,
    stop: &CancellationToken,
) -> Result<(), Error> {
    let mut last_confirm = Instant::now();
    let mut looks = Looks::new();
    // A part of a transaction too large to hold whole, waiting to go to the held table.
    let mut part: Option<WalTransaction> = None;
    let mut spilling = Spilling::default();
    loop {
        if move_failed(inner, conn).await? {
            looks.held_may_have_rows = true;
        }
        let stopping = stop.is_cancelled();
        confirm_settled(inner, conn, stream, &mut last_confirm, stopping).await?;
        if stopping {
            return Ok(());
        }
        if let Some(p) = part.take() {
            if spill(inner, conn, &p, &mut spilling, guard).await? {
                looks.held_may_have_rows = true;
                continue;
            }
            // A batch holds events of the buffer: the part goes after them once it is settled.
            part = Some(p);
            pause_for_a_settle(inner, stop).await;
            continue;
        }
        looks.take(inner, conn, identity).await?;
        // Take in while fewer than `read_ahead` events wait to be claimed: a relay that does not
        // claim (its broker is down) stops the reading, and the server waits.
        let room = has_room(inner);
        let new = if room {
            take_ready(inner, conn, stream, identity, &mut part).await?
        } else {
            Vec::new()
        };
        if !new.is_empty() {
            if take_in(inner, conn, new, looks.held_may_have_rows, guard).await? {
                looks.held_may_have_rows = true;
            }
            continue;
        }
        if part.is_some() {
            continue;
        }
        // Nothing in hand: wait for a transaction, a settled batch, a confirm due, or the stop.
        let wait = idle_wait(inner, room, last_confirm);
        if !room {
            tokio::select! {
                _ = inner.reader_wake.notified() => {}
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => {}
            }
            continue;
        }
        tokio::select! {
            t = stream.rx.recv() => match t {
                Some(t) => {
                    let t = taken(inner, conn, stream, t, identity).await?;
                    if carries_tableless(&t) {
                        verify_publication(inner, conn, identity).await?;
                    }
                    if t.piece != Piece::Whole {
                        part = Some(t);
                    } else if take_in(inner, conn, vec![t], looks.held_may_have_rows, guard).await? {
                        looks.held_may_have_rows = true;
                    }
                }
                None => return Err(Error::new(txoutbox_core::ErrorKind::Connection, "the WAL stream ended")),
            },
            _ = inner.reader_wake.notified() => {}
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => {}
        }
    }
}

/// How long a reading with nothing in hand waits: until the next confirm is due while a settled
/// transaction waits for it (and there is room to read), else [`PAUSED_WAIT`].
fn idle_wait(inner: &Inner, room: bool, last_confirm: Instant) -> Duration {
    let settled_waiting = inner.state().txns.front().is_some_and(|t| t.settled());
    if room && settled_waiting {
        CONFIRM_EVERY
            .saturating_sub(last_confirm.elapsed())
            .max(Duration::from_millis(1))
    } else {
        PAUSED_WAIT
    }
}

/// Waits for a settled batch (or the stop) before a part goes to the held table.
async fn pause_for_a_settle(inner: &Inner, stop: &CancellationToken) {
    tokio::select! {
        _ = inner.reader_wake.notified() => {}
        _ = tokio::time::sleep(PAUSED_WAIT) => {}
        _ = stop.cancelled() => {}
    }
}

/// The reading's periodic looks: whether the held table may hold unpublished events, and whether
/// the slot and the publication are still what the stream started with.
struct Looks {
    /// Until the held table is seen empty, every event read is checked against it (its
    /// aggregate may wait there; a replayed event may be there). Only this reader adds to it.
    held_may_have_rows: bool,
    held_checked: Instant,
    slot_checked: Instant,
}

impl Looks {
    fn new() -> Self {
        Looks {
            held_may_have_rows: true,
            held_checked: Instant::now(),
            slot_checked: Instant::now(),
        }
    }

    /// Takes the looks that are due.
    async fn take(
        &mut self,
        inner: &Inner,
        conn: &mut PgConnection,
        identity: Identity,
    ) -> Result<(), Error> {
        if (self.held_may_have_rows && self.held_checked.elapsed() >= HELD_EMPTY_CHECK)
            || self.held_checked.elapsed() >= LOCK_PING
        {
            // Also proves the lock's session alive now and then (a reader of table-less events
            // only may run no other statement on it).
            self.held_checked = Instant::now();
            self.held_may_have_rows = sqlx::query_scalar(&format!(
                "SELECT EXISTS (SELECT 1 FROM {} WHERE processed_at IS NULL)",
                inner.held.table().qualified()
            ))
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| map_sqlx("wal read", e))?;
        }
        if self.slot_checked.elapsed() >= SLOT_CHECK {
            // A slot dropped or invalidated under the stream ends it; a publication that lost the
            // table does not: its rows are not decoded, and the reader publishes them from the
            // table instead.
            self.slot_checked = Instant::now();
            same_session(inner, conn).await?;
            verify_publication(inner, conn, identity).await?;
        }
        Ok(())
    }
}

/// Whether the relay claims (a relay whose broker is down does not) and fewer than the read-ahead
/// events and bytes wait to be claimed.
fn has_room(inner: &Inner) -> bool {
    let claiming = inner
        .last_claim
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .elapsed()
        < inner.settings.claims_paused_after();
    let st = inner.state();
    claiming
        && st.unsettled - st.in_flight < inner.settings.read_ahead
        && st.unsettled_bytes < inner.settings.read_ahead_bytes
}

/// The whole transactions decoded already, without waiting, within the read-ahead; a part of one
/// too large to hold whole ends the taking and goes to `part`.
async fn take_ready(
    inner: &Inner,
    conn: &mut PgConnection,
    stream: &mut Stream,
    identity: Identity,
    part: &mut Option<WalTransaction>,
) -> Result<Vec<WalTransaction>, Error> {
    let mut new = Vec::new();
    let (mut events, mut bytes) = {
        let st = inner.state();
        (st.unsettled - st.in_flight, st.unsettled_bytes)
    };
    while events < inner.settings.read_ahead && bytes < inner.settings.read_ahead_bytes {
        let Ok(t) = stream.rx.try_recv() else {
            break;
        };
        let t = taken(inner, conn, stream, t, identity).await?;
        if t.piece != Piece::Whole {
            *part = Some(t);
            break;
        }
        for item in &t.items {
            if let WalItem::Event(e) = item {
                events += 1;
                bytes += e.payload.len();
            }
        }
        new.push(t);
    }
    if new.iter().chain(part.iter()).any(carries_tableless) {
        verify_publication(inner, conn, identity).await?;
    }
    Ok(new)
}

/// Whether `t` carries table-less events. Before they are handed over the reader looks whether
/// the publication still holds the table, unchanged: a row written after the table left it is not
/// decoded, and a later table-less event of its aggregate would go out before it. The look fails
/// the reading instead, and the fallback that follows reads both from where they are, in order.
fn carries_tableless(t: &WalTransaction) -> bool {
    // `row_ids` holds the ids of exactly its events that are rows.
    let events = t
        .items
        .iter()
        .filter(|item| matches!(item, WalItem::Event(_)))
        .count();
    events > t.row_ids.len()
}
