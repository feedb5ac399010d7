//! The claim. Ordered: take partitions of the aggregates (transaction-scoped advisory locks, held
//! by the batch's lease), then read the oldest ready events of those partitions, within a byte
//! budget; skip scans over the aggregates find heads beyond that read. Unordered: lock ready rows
//! (`FOR UPDATE SKIP LOCKED`).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use sqlx::postgres::PgRow;
use sqlx::{Connection, Postgres, Row, Transaction};
use uuid::Uuid;

use outbox_core::{Batch, ClaimRequest, Error, Event, OrderingPolicy};

use crate::error::map_sqlx;

use super::lease::{EmptyLease, PgLease};
use super::*;

/// Opens a claim's transaction (one round trip). Every statement of a claim and its settlement reads
/// the outbox through an index; without sequential scans the planner has no plan left whose cost
/// grows with the table. (A plan cached while the outbox was nearly empty, which is its usual state,
/// would otherwise scan the whole backlog once per candidate head when a backlog builds up: seconds
/// per claim, until the next ANALYZE of the table. Measured by `outbox bench`, latency phase.)
///
/// The claim transaction is the lease: it stays open, idle, while the batch is published. Its own
/// `idle_in_transaction_session_timeout` is the relay's hold time (`ClaimRequest::hold_for`), so a
/// shorter timeout of the role or database (which the operations guide recommends against forgotten
/// transactions) cannot end a lease in the middle of a publish.
///
/// It is READ COMMITTED whatever the role's or database's `default_transaction_isolation`: each
/// statement must see what other leases settled before it, in particular the owned read, which
/// follows the statement that took the partitions (a snapshot kept from before the locks would
/// show events another lease has just settled as pending, and they would be published again).
pub(super) fn claim_begin(hold_for: std::time::Duration) -> String {
    let ms = hold_for.as_millis().clamp(1_000, i32::MAX as u128);
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL enable_seqscan = off; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
         SAVEPOINT {CLAIM_LOCKS}"
    )
}

/// The savepoint taken before a claim locks anything: when the byte budget leaves locked rows out of
/// an unordered batch, the claim rolls back to it (releasing every lock) and locks again only the
/// rows it keeps, so that no row is held by a lease that will not publish it.
pub(super) const CLAIM_LOCKS: &str = "claim_locks";

/// Claims that read more payload bytes than this give their connection's grown buffers back.
pub(super) const SHRINK_BUFFERS_ABOVE: usize = 1024 * 1024;

/// Keeps, per aggregate, the rows from its head (found by a skip scan) on while they are ready.
/// `rows` hold every unprocessed row of the heads' aggregates (or a seq-ordered prefix of them), in
/// seq order. Each row is dropped once decoded, so a batch's payloads are held about once, not
/// twice.
pub(super) fn runs_from_heads(
    rows: Vec<PgRow>,
    head_seq: &HashMap<(String, String), i64>,
) -> Result<Vec<Event>, Error> {
    #[derive(PartialEq)]
    enum Run {
        Taking,
        Stopped,
    }
    let mut state: HashMap<(String, String), Run> = HashMap::new();
    let mut seen: HashSet<i64> = HashSet::new();
    let mut events = Vec::new();
    for row in rows {
        let get = |e: sqlx::Error| map_sqlx("claim", e);
        let key: (String, String) = (
            row.try_get("aggregate_type").map_err(get)?,
            row.try_get("aggregate_id").map_err(get)?,
        );
        let seq: i64 = row.try_get("seq").map_err(get)?;
        let ready: bool = row.try_get("ready").map_err(get)?;
        // A row read twice (its aggregate listed twice) is taken once.
        if !seen.insert(seq) {
            continue;
        }
        let take = match state.get(&key) {
            None => ready && head_seq.get(&key) == Some(&seq),
            Some(Run::Taking) => ready,
            Some(Run::Stopped) => false,
        };
        state.insert(key, if take { Run::Taking } else { Run::Stopped });
        if take {
            events.push(decode_event(&row)?);
        }
    }
    Ok(events)
}

/// The most rows read per aggregate in one claim: twice an even share of the batch, so that a batch
/// still fills when some runs are short, while a claim never reads more than about two batches of rows
/// however long the runs behind the heads are. Taking fewer rows of a run is always safe: the rest
/// stays for the next claim, behind the same head.
pub(super) fn run_cap(limit: i64, heads: usize) -> i64 {
    let heads = i64::try_from(heads.max(1)).unwrap_or(i64::MAX);
    let share = (limit + heads - 1) / heads;
    share.saturating_mul(2).clamp(1, limit.max(1))
}

/// A head found by a skip scan: the oldest unprocessed row of its aggregate.
pub(super) struct Head {
    pub(super) seq: i64,
    pub(super) key: (String, String),
}

/// The longest a claim waits for another lease to end when every partition with events is held.
pub(super) const PARTITION_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Runs longer than this among a claim's events make the next claims use the wide form of the owned
/// read (see `claim_owned_wide`) until they are no longer.
pub(super) const WIDE_ABOVE: i64 = 2;

/// The longest run of one aggregate among `events`.
pub(super) fn longest_run(events: &[Event]) -> i64 {
    let mut runs: HashMap<(&str, &str), i64> = HashMap::new();
    let mut longest = 0;
    for e in events {
        let n = runs
            .entry((e.aggregate_type.as_str(), e.aggregate_id.as_str()))
            .or_insert(0);
        *n += 1;
        longest = longest.max(*n);
    }
    longest
}

/// How many ready rows (in seq order) a claim chooses its partitions from: four batches, and at
/// least 256. A claim takes the partitions that hold a batch's worth of them, so about four
/// claims at once (a relay's batches in flight, other relays) each find a full batch there.
pub(super) fn heads_window(limit: i64) -> i64 {
    limit.saturating_mul(4).max(256)
}

/// The fewest ready events (in seq order) the owned read looks at; it looks at twice the window
/// its partitions were chosen from, so that a claim holding the partitions of a batch's worth of
/// the window's aggregates finds them there.
pub(super) const OWNED_SCAN_MIN: i64 = 512;

/// The largest factor of the window (see `PostgresStore::window`): 8 x 4 batches. Claims choose
/// from a wider window while other leases hold every partition of theirs and the window holds
/// about one event per aggregate (many aggregates: a wider window holds more of them, so more
/// claims at once find a batch's worth), and narrow it again after a full batch chosen without
/// meeting another lease, or a step after [`CALM_CLAIMS`] full batches without widening.
pub(super) const WINDOW_FACTOR_MAX: i64 = 8;

/// How many full batches since the window last widened narrow it one step (a full batch whose
/// choice met no other lease narrows it at once; one taken from a kept set only counts). While
/// claims keep meeting other leases, the window stays as wide as it had to become for that many
/// batches: narrowing it after every one made the next claims find a narrow window's partitions
/// held again and wait. A burst shorter than that leaves the window wide for the next (at most
/// [`WINDOW_FACTOR_MAX`] times the rows per choice; a kept set's claim does not choose).
pub(super) const CALM_CLAIMS: u32 = 64;

/// How many sets of partitions a store keeps for later claims: one per batch in flight of the
/// default relay, and some.
pub(super) const KEPT_SETS: usize = 4;

/// How many times a kept set is taken again before its partitions are chosen afresh from the oldest
/// events (it serves that many batches after the one it was chosen for): partitions outside every
/// kept set wait for a choice at most about that many batches of each batch in flight.
pub(super) const KEPT_USES: u32 = 8;

/// How many claims in a row fill their batch from as few aggregates as they can (whole runs, for a
/// publisher that keeps an aggregate's events in order within a call) once a claim met other
/// leases holding every partition it could have taken (it waited for one). One event of each of
/// many aggregates is the cheaper read (more of the oldest events are the claim's), but it leaves
/// little for other leases: over a backlog of 1,000 aggregates two batches of 500 hold them all,
/// and a third and fourth claim in flight (two relays) wait. Sharing the aggregates out lets them
/// all fill a batch; the claims go back to the cheaper read after this many without waiting.
pub(super) const SHARE_CLAIMS: u32 = 64;

/// A set of partitions that filled a batch, kept for a later claim.
#[derive(Debug, Clone)]
pub(crate) struct Kept {
    parts: Vec<i32>,
    uses: u32,
    /// Chosen by a sharing claim (see [`SHARE_CLAIMS`]): taken again only by sharing claims, and a
    /// set chosen for one event per aggregate only by claims that are not.
    shared: bool,
}

/// Offers `set` to later claims once its batch's lease has ended (its partitions are free again),
/// unless it has served [`KEPT_USES`] claims.
pub(super) fn keep(kept: &Mutex<Vec<Kept>>, set: Kept) {
    if set.uses >= KEPT_USES || set.parts.is_empty() {
        return;
    }
    if let Ok(mut kept) = kept.lock() {
        kept.insert(0, set);
        kept.truncate(KEPT_SETS);
    }
}

/// What `claim_partitions` chose.
pub(super) struct Chosen {
    /// How many ready events its window held.
    pub(super) window_rows: i64,
    /// The partitions taken.
    pub(super) parts: Vec<i32>,
    /// The first partition with claimable events that another lease holds.
    pub(super) busy: Option<i32>,
    /// How many claimable aggregates the window held.
    pub(super) aggregates: i64,
}

/// How long skip scans rest after a complete walk over the aggregates that took `walk` and found no
/// head to take.
pub(super) fn skip_rest(walk: std::time::Duration) -> std::time::Duration {
    (walk * 10).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(2),
    )
}

/// How many aggregates one skip scan visits at most: two batches, at least 256, at most 20,000.
pub(super) fn skip_span(limit: i64) -> i64 {
    limit.saturating_mul(2).clamp(256, 20_000)
}

/// Reads the optional head columns (`seq`, `aggregate_type`, `aggregate_id`) of a heads row: `None`
/// for the one row a skip scan returns when it found nothing.
pub(super) fn head_of(row: &PgRow) -> Result<Option<Head>, Error> {
    let get = |e: sqlx::Error| map_sqlx("claim", e);
    let seq: Option<i64> = row.try_get("seq").map_err(get)?;
    let Some(seq) = seq else { return Ok(None) };
    Ok(Some(Head {
        seq,
        key: (
            row.try_get("aggregate_type").map_err(get)?,
            row.try_get("aggregate_id").map_err(get)?,
        ),
    }))
}

impl PostgresStore {
    /// Claims a batch (see [`Store::claim`]).
    pub(super) async fn claim_batch(&self, request: ClaimRequest) -> Result<Batch, Error> {
        let limit = i64::try_from(request.limit).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(request.max_bytes).unwrap_or(i64::MAX);
        let mut tx = self
            .pool
            .begin_with(claim_begin(request.hold_for))
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        let mut to_keep = None;
        let events = match request.ordering {
            OrderingPolicy::Unordered => {
                let rows = sqlx::query(&self.sql.claim_unordered)
                    .bind(limit)
                    .bind(max_bytes)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx("claim", e))?;
                let mut locked = 0i64;
                let mut events = Vec::with_capacity(rows.len());
                for row in rows {
                    locked = row.try_get("locked").map_err(|e| map_sqlx("claim", e))?;
                    events.push(decode_event(&row)?);
                }
                if (events.len() as i64) < locked {
                    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
                    let kept: HashSet<Uuid> = self
                        .relock(
                            &mut tx,
                            sqlx::query_scalar(&self.sql.relock_rows).bind(&ids),
                        )
                        .await?
                        .into_iter()
                        .collect();
                    events.retain(|e| kept.contains(&e.id));
                }
                events
            }
            OrderingPolicy::PerAggregate => {
                let (mut events, set) = self
                    .claim_owned(&mut tx, limit, max_bytes, request.whole_runs)
                    .await?;
                to_keep = set;
                // Every event once: a batch that held one twice would publish it twice.
                let mut ids = HashSet::with_capacity(events.len());
                let before = events.len();
                events.retain(|e| ids.insert(e.id));
                if events.len() < before {
                    tracing::warn!(
                        dropped = before - events.len(),
                        "a claim read some events twice; each is in the batch once"
                    );
                }
                events
            }
        };
        // The connection's read buffer grew to the largest row it read and would keep that size for
        // the life of the connection (one per pool slot): a few large events would otherwise pin
        // the pool's buffers at their size for good, outside the byte budget.
        if events.iter().map(|e| e.payload.len()).sum::<usize>() > SHRINK_BUFFERS_ABOVE {
            tx.shrink_buffers();
        }
        if events.is_empty() {
            tx.rollback().await.map_err(|e| map_sqlx("claim", e))?;
            return Ok(Batch {
                events: Vec::new(),
                lease: Box::new(EmptyLease),
            });
        }
        let ids = events.iter().map(|e| e.id).collect();
        Ok(Batch {
            events,
            lease: Box::new(PgLease {
                tx,
                ids,
                sql: self.sql.clone(),
                pool: self.pool.clone(),
                ordering: request.ordering,
                keep: to_keep.map(|set| (self.kept.clone(), set)),
            }),
        })
    }

    /// Releases every lock the claim took (back to [`CLAIM_LOCKS`]) and takes again those of `query`
    /// (a relock statement); returns what it locked.
    async fn relock<T>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        query: sqlx::query::QueryScalar<'_, Postgres, T, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<T>, Error>
    where
        T: Send + Unpin + for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        sqlx::query(&format!("ROLLBACK TO SAVEPOINT {CLAIM_LOCKS}"))
            .execute(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        query
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))
    }

    /// An ordered claim: takes again a kept set of partitions when it still fills a batch; else
    /// chooses partitions (`claim_partitions`), waiting a while for one when other leases hold
    /// every claimable one, reads the oldest ready events of those it holds (`claim_owned`), and,
    /// when that read or the window was full of events it could not take, looks for heads beyond
    /// with skip scans over the aggregates. Returns the events and the set to offer to later
    /// claims when the batch's lease ends.
    async fn claim_owned(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        max_bytes: i64,
        whole_runs: bool,
    ) -> Result<(Vec<Event>, Option<Kept>), Error> {
        let share = whole_runs && self.share_claims.load(Ordering::Relaxed) > 0;
        // A set of partitions that filled a recent batch is taken again as it is, when most of
        // it is free and it still fills a batch: no window to read and no walk.
        let mut retaken: Vec<i32> = Vec::new();
        if let Some(kept) = self.take_kept(share) {
            let held: Vec<i32> = sqlx::query_scalar(&self.sql.retake_partitions)
                .bind(&kept.parts)
                .fetch_one(&mut **tx)
                .await
                .map_err(|e| map_sqlx("claim", e))?;
            if held.len() * 2 >= kept.parts.len() {
                let scan = 2 * self.window(limit);
                let (events, _, _) = self
                    .read_owned(tx, &held, limit, scan, max_bytes, whole_runs)
                    .await?;
                if events.len() as i64 >= limit {
                    self.calm_claim();
                    let again = Kept {
                        parts: held,
                        uses: kept.uses + 1,
                        shared: kept.shared,
                    };
                    return Ok((events, Some(again)));
                }
            }
            // Short of a batch: choose as usual, and read again. The partitions taken stay the
            // claim's (a lock cannot be given back before the transaction ends), so the read
            // covers them too rather than holding them unread.
            retaken = held;
        }
        let mut waited = false;
        let mut wait_ran_out = false;
        loop {
            let window = self.window(limit);
            let chosen = self
                .take_partitions(tx, limit, window, max_bytes, share)
                .await?;
            let mut parts = chosen.parts;
            for p in &retaken {
                if !parts.contains(p) {
                    parts.push(*p);
                }
            }
            if let (true, Some(busy), false) = (parts.is_empty(), chosen.busy, waited) {
                // Other leases hold every partition with claimable events. Where the window holds
                // about as many aggregates as events, a larger one would find more of them: the
                // next claims choose from twice the window (see `PostgresStore::window`). Then wait
                // (a while, once) for the lease with the oldest events to end, rather than come back
                // empty and have the relay pause, and choose again.
                if chosen.aggregates.saturating_mul(2) > chosen.window_rows {
                    self.widen_window();
                    self.calm_claims.store(0, Ordering::Relaxed);
                }
                waited = true;
                if self.wait_for_partition(tx, busy).await? {
                    continue;
                }
                wait_ran_out = true;
            }
            let (mut events, seqs, scan_full) = if parts.is_empty() {
                (Vec::new(), Vec::new(), false)
            } else {
                self.read_owned(tx, &parts, limit, 2 * window, max_bytes, whole_runs)
                    .await?
            };
            // A full batch chosen without passing over partitions other leases hold: the usual
            // window will do for the next claims. Where other leases held some, the window
            // stays as wide as it has had to become (narrowing it at once makes the next claims
            // find every partition held again, and wait) until claims stop waiting.
            if events.len() as i64 >= limit {
                if chosen.busy.is_none() {
                    self.narrow_window();
                } else {
                    self.calm_claim();
                }
            }
            let to_keep = (events.len() as i64 >= limit).then(|| Kept {
                parts: parts.clone(),
                uses: 0,
                shared: share,
            });
            // Events may lie beyond what was read: the window or the owned read's scan was full
            // of events this claim could not take (held back, or of partitions other leases hold).
            // Skip scans look for them, unless the claim fell short because other leases hold
            // a batch's worth of the window's claimable aggregates (their partitions are where the
            // events are; walking the aggregates would find them held too), and it did not wait
            // in vain. A window with fewer claimable aggregates than that is mostly held back:
            // what lies beyond it is the skip scans' to find.
            if whole_runs {
                self.note_sharing(waited);
            }
            let beyond = chosen.window_rows >= window || scan_full;
            let contended = chosen.busy.is_some() && chosen.aggregates >= limit && !wait_ran_out;
            let bytes: i64 = events.iter().map(|e| e.payload.len() as i64).sum();
            if (events.len() as i64) < limit
                && beyond
                && !contended
                && (events.is_empty() || bytes < max_bytes)
            {
                // Aggregates already in the batch are not looked for again.
                let keys: HashSet<(String, String)> = events
                    .iter()
                    .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
                    .collect();
                let more = self
                    .claim_beyond(
                        tx,
                        limit - events.len() as i64,
                        max_bytes - bytes,
                        &seqs,
                        &keys,
                        &parts,
                    )
                    .await?;
                events.extend(more);
            }
            return Ok((events, to_keep));
        }
    }

    /// The owned read over `parts` (its narrow or wide form, see `claim_owned_wide`): the events,
    /// their seqs, and whether its scan reached its bound. Chooses the next claim's form. A
    /// publisher that takes whole runs needs no spreading: always the narrow form.
    async fn read_owned(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        parts: &[i32],
        limit: i64,
        scan: i64,
        max_bytes: i64,
        whole_runs: bool,
    ) -> Result<(Vec<Event>, Vec<i64>, bool), Error> {
        let get = |e: sqlx::Error| map_sqlx("claim", e);
        let wide = !whole_runs && self.wide.load(Ordering::Relaxed);
        let statement = if wide {
            &self.sql.claim_owned_wide
        } else {
            &self.sql.claim_owned
        };
        let rows = sqlx::query(statement)
            .bind(parts)
            .bind(limit)
            .bind(scan.max(OWNED_SCAN_MIN))
            .bind(max_bytes)
            .fetch_all(&mut **tx)
            .await
            .map_err(get)?;
        let (mut events, mut seqs, mut full, mut longest) = (Vec::new(), Vec::new(), false, 0i64);
        for row in &rows {
            full = row.try_get("full").map_err(get)?;
            longest = row.try_get("longest").map_err(get)?;
            if let Some(seq) = row.try_get::<Option<i64>, _>("seq").map_err(get)? {
                seqs.push(seq);
                events.push(decode_event(row)?);
            }
        }
        // The next claim's form: wide while the events looked at come in runs longer than two,
        // narrow (cheaper) otherwise.
        if wide {
            if longest <= WIDE_ABOVE {
                self.wide.store(false, Ordering::Relaxed);
            }
        } else if !whole_runs && events.len() as i64 >= limit && longest_run(&events) > WIDE_ABOVE {
            self.wide.store(true, Ordering::Relaxed);
        }
        Ok((events, seqs, full))
    }

    /// Counts down the claims left in the sharing mode (see [`SHARE_CLAIMS`]), or starts it again
    /// when this claim had to wait for a partition (`met_others`). Entering it drops the kept sets: they were chosen to hold
    /// as many aggregates as a batch has events, which is what sharing gives up (those offered
    /// later by leases that began before are passed over: see `take_kept`).
    fn note_sharing(&self, met_others: bool) {
        let before = self
            .share_claims
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(if met_others {
                    SHARE_CLAIMS
                } else {
                    n.saturating_sub(1)
                })
            })
            .unwrap_or(0);
        if met_others && before == 0 {
            if let Ok(mut kept) = self.kept.lock() {
                kept.clear();
            }
        }
    }

    /// Runs `claim_partitions` over a window of `window` ready events, filling `limit` with one
    /// event per aggregate, or (`share`: see [`SHARE_CLAIMS`]) with every event of the window.
    async fn take_partitions(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        window: i64,
        max_bytes: i64,
        share: bool,
    ) -> Result<Chosen, Error> {
        let get = |e: sqlx::Error| map_sqlx("claim", e);
        let row = sqlx::query(&self.sql.claim_partitions)
            .bind(limit)
            .bind(window)
            .bind(max_bytes)
            .bind(share)
            .fetch_one(&mut **tx)
            .await
            .map_err(get)?;
        Ok(Chosen {
            window_rows: row.try_get("window_rows").map_err(get)?,
            parts: row.try_get("parts").map_err(get)?,
            busy: row.try_get("busy").map_err(get)?,
            aggregates: row.try_get("aggregates").map_err(get)?,
        })
    }

    /// A kept set of partitions (see [`KEPT_SETS`]) chosen the way this claim chooses (sharing
    /// or not), if any: the oldest of those kept (the sets go round, each serving in turn). Sets
    /// of the other way, offered by leases that began before the mode changed, are dropped.
    fn take_kept(&self, share: bool) -> Option<Kept> {
        let mut kept = self.kept.lock().ok()?;
        while let Some(set) = kept.pop() {
            if set.shared == share {
                return Some(set);
            }
        }
        None
    }

    /// How many ready events a claim chooses its partitions from: [`heads_window`] times the
    /// store's current factor (1 to [`WINDOW_FACTOR_MAX`]).
    fn window(&self, limit: i64) -> i64 {
        heads_window(limit).saturating_mul(self.window_factor.load(Ordering::Relaxed).max(1))
    }

    fn widen_window(&self) {
        let _ = self
            .window_factor
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| {
                Some((f * 2).clamp(1, WINDOW_FACTOR_MAX))
            });
    }

    /// Counts a full batch; every [`CALM_CLAIMS`] of them since the window last widened, it
    /// narrows one step.
    fn calm_claim(&self) {
        let before = self
            .calm_claims
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some((n + 1) % CALM_CLAIMS)
            })
            .unwrap_or(0);
        if before + 1 >= CALM_CLAIMS {
            self.narrow_window();
        }
    }

    fn narrow_window(&self) {
        let _ = self
            .window_factor
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| {
                Some((f / 2).max(1))
            });
    }

    /// Waits up to [`PARTITION_WAIT`] for the lease holding partition `part` to end, and takes the
    /// partition. False when the wait ran out (the claim's transaction is left as it was). The
    /// wait is bounded by a `lock_timeout` of its own, set in a savepoint and put back after.
    async fn wait_for_partition(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        part: i32,
    ) -> Result<bool, Error> {
        let get = |e: sqlx::Error| map_sqlx("claim", e);
        let before: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
            .fetch_one(&mut **tx)
            .await
            .map_err(get)?;
        let arm = format!(
            "SAVEPOINT claim_wait; SET LOCAL lock_timeout = {}",
            PARTITION_WAIT.as_millis()
        );
        sqlx::Executor::execute(&mut **tx, arm.as_str())
            .await
            .map_err(get)?;
        let waited = sqlx::query(&self.sql.wait_partition)
            .bind(part)
            .execute(&mut **tx)
            .await;
        match waited {
            Ok(_) => {
                // Released, the savepoint keeps the lock (a rollback to it would release it).
                sqlx::Executor::execute(&mut **tx, "RELEASE SAVEPOINT claim_wait")
                    .await
                    .map_err(get)?;
                sqlx::query("SELECT set_config('lock_timeout', $1, true)")
                    .bind(&before)
                    .execute(&mut **tx)
                    .await
                    .map_err(get)?;
                Ok(true)
            }
            // The wait ran out (`lock_timeout`), or a shorter `statement_timeout` of the role
            // ended it first: the claim comes back empty.
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("55P03") | Some("57014")) =>
            {
                sqlx::Executor::execute(&mut **tx, "ROLLBACK TO SAVEPOINT claim_wait")
                    .await
                    .map_err(get)?;
                Ok(false)
            }
            Err(e) => Err(get(e)),
        }
    }

    /// The skip scans and the runs behind the heads they find, for up to `limit` more events within
    /// `max_bytes` (strictly when `taken`, the events already in the batch, is not empty).
    async fn claim_beyond(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        max_bytes: i64,
        taken: &[i64],
        taken_keys: &HashSet<(String, String)>,
        parts: &[i32],
    ) -> Result<Vec<Event>, Error> {
        let heads = self.skip_heads(tx, limit, taken, taken_keys, parts).await?;
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let mut head_seq: HashMap<(String, String), i64> = HashMap::new();
        let (mut types, mut ids) = (Vec::new(), Vec::new());
        for head in &heads {
            types.push(head.key.0.clone());
            ids.push(head.key.1.clone());
            head_seq.insert(head.key.clone(), head.seq);
        }
        let mut rows = sqlx::query(&self.sql.claim_runs)
            .bind(&types)
            .bind(&ids)
            .bind(limit)
            .bind(run_cap(limit, heads.len()))
            .bind(max_bytes.max(0))
            .bind(taken.is_empty())
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        let mut keyed = Vec::with_capacity(rows.len());
        for row in rows.drain(..) {
            let seq: i64 = row.try_get("seq").map_err(|e| map_sqlx("claim", e))?;
            keyed.push((seq, row));
        }
        keyed.sort_by_key(|(seq, _)| *seq);
        runs_from_heads(keyed.into_iter().map(|(_, row)| row).collect(), &head_seq)
    }

    /// Up to four skip scans, each going on from where the previous one stopped (one that started
    /// after a cursor and reached the last aggregate goes on from the first, once), for up to
    /// `limit` ready heads of aggregates not in `taken_keys` (their seqs in `taken`), of
    /// partitions the claim holds (`parts`) or takes. A complete walk that found nothing rests the
    /// skip scans (see [`skip_rest`]).
    async fn skip_heads(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        taken: &[i64],
        taken_keys: &HashSet<(String, String)>,
        parts: &[i32],
    ) -> Result<Vec<Head>, Error> {
        let started = std::time::Instant::now();
        let resting = self
            .skip_rest_until
            .lock()
            .is_ok_and(|until| until.is_some_and(|t| started < t));
        if resting {
            return Ok(Vec::new());
        }
        let mut heads: Vec<Head> = Vec::new();
        let mut known: HashSet<(String, String)> = taken_keys.clone();
        let mut walked_all = false;
        let span = skip_span(limit);
        let (mut scans, mut wrapped) = (0, false);
        while (heads.len() as i64) < limit && scans < 4 {
            scans += 1;
            let cursor = self
                .skip_cursor
                .lock()
                .map_or(None, |cursor| cursor.clone());
            let mut held: Vec<i64> = taken.to_vec();
            held.extend(heads.iter().map(|h| h.seq));
            let query = match &cursor {
                None => sqlx::query(&self.sql.claim_skip_first),
                Some(_) => sqlx::query(&self.sql.claim_skip_after),
            }
            .bind(limit - heads.len() as i64)
            .bind(span)
            .bind(&held)
            .bind(parts);
            let query = match &cursor {
                None => query,
                Some((aggregate_type, aggregate_id)) => {
                    query.bind(aggregate_type).bind(aggregate_id)
                }
            };
            let rows = query
                .fetch_all(&mut **tx)
                .await
                .map_err(|e| map_sqlx("claim", e))?;
            let (mut visited, mut last) = (0i64, None);
            let wanted = limit - heads.len() as i64;
            let mut found = Vec::new();
            for row in &rows {
                let get = |e: sqlx::Error| map_sqlx("claim", e);
                visited = row
                    .try_get::<Option<i32>, _>("visited")
                    .map_err(get)?
                    .map_or(0, i64::from);
                let last_type: Option<String> = row.try_get("last_type").map_err(get)?;
                let last_id: Option<String> = row.try_get("last_id").map_err(get)?;
                last = last_type.zip(last_id);
                found.extend(head_of(row)?);
            }
            // Cut by the batch: the next scan goes on after the last head taken (in key order),
            // so the aggregates visited beyond it have their turn next.
            let cut = found.len() as i64 >= wanted;
            let reached_end = visited < span && !cut;
            if let Ok(mut guard) = self.skip_cursor.lock() {
                *guard = match found.last() {
                    Some(head) if cut => Some(head.key.clone()),
                    _ if reached_end => None,
                    _ => last,
                };
            }
            // One head per aggregate: a later scan may see an aggregate again with another head
            // (the first scan judged it in a snapshot from before another lease settled its
            // events); the first head found stands, and the runs statement drops it if stale.
            for head in found {
                if known.insert(head.key.clone()) {
                    heads.push(head);
                }
            }
            if reached_end {
                if cursor.is_none() || wrapped {
                    walked_all = true;
                    break;
                }
                wrapped = true;
            }
        }
        // A futile complete walk rests the skip scans ten times as long as it took (at least 50 ms):
        // their share of the database stays under a tenth while every head is taken.
        if let Ok(mut until) = self.skip_rest_until.lock() {
            *until =
                (walked_all && heads.is_empty()).then(|| started + skip_rest(started.elapsed()));
        }
        heads.sort_by_key(|h| h.seq);
        Ok(heads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_widened_window_narrows_a_step_after_calm_claims_full_batches() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://127.0.0.1:1/never")
            .unwrap();
        let store = PostgresStore::new(pool, OutboxTable::new("s", "events").unwrap());
        let base = heads_window(500);
        for _ in 0..8 {
            store.widen_window();
        }
        assert_eq!(store.window(500), base * WINDOW_FACTOR_MAX);
        for _ in 1..CALM_CLAIMS {
            store.calm_claim();
        }
        assert_eq!(store.window(500), base * WINDOW_FACTOR_MAX);
        store.calm_claim();
        assert_eq!(store.window(500), base * WINDOW_FACTOR_MAX / 2);
        for _ in 0..3 * CALM_CLAIMS {
            store.calm_claim();
        }
        assert_eq!(
            store.window(500),
            base,
            "never narrower than the usual window"
        );
    }

    #[test]
    fn claim_sql_takes_partitions_and_honours_the_table() {
        let t = OutboxTable::new("s", "events").unwrap();
        let sql = Sql::new(&t, Retention::Delete);
        let key = format!(
            "pg_try_advisory_xact_lock({}, ",
            sql::partition_lock_key(&t)
        );
        assert!(sql.claim_partitions.contains(&key));
        assert!(sql.claim_partitions.contains("\"s\".\"events\""));
        assert!(sql.claim_owned.contains("\"s\".\"events\""));
        assert!(!sql.claim_owned.contains("FOR UPDATE"));
        assert!(sql.claim_owned.contains("b.retry_after > now()"));
        assert!(sql.claim_runs.contains("\"s\".\"events\""));
        for skip in [&sql.claim_skip_first, &sql.claim_skip_after] {
            assert!(skip.contains(&key));
            assert!(skip.contains("\"s\".\"events\""));
        }
        assert!(sql.claim_skip_after.contains("> ($5, $6)"));
        assert!(!sql.claim_skip_first.contains("$5"));
        assert!(sql.lock_lost_partitions.contains(&key));
        assert!(sql.claim_unordered.contains("FOR UPDATE SKIP LOCKED"));
        assert!(!sql.claim_unordered.contains("NOT EXISTS"));
        assert!(sql.settle.contains("DELETE FROM \"s\".\"events\""));
        let keep = Sql::new(&t, Retention::Keep);
        assert!(keep.settle.contains("SET processed_at = now()"));
    }

    #[test]
    fn partition_lock_keys_are_stable_and_differ_by_table() {
        let a = OutboxTable::new("s", "events").unwrap();
        let b = OutboxTable::new("s", "events2").unwrap();
        assert_eq!(sql::partition_lock_key(&a), sql::partition_lock_key(&a));
        assert_ne!(sql::partition_lock_key(&a), sql::partition_lock_key(&b));
        // FNV-1a of `outbox.claim "s"."events"`: relays of every version must agree on it.
        assert_eq!(sql::partition_lock_key(&a), -2_051_167_190);
    }

    #[test]
    fn skip_scans_rest_ten_times_a_futile_walk_within_bounds() {
        use std::time::Duration;
        assert_eq!(
            skip_rest(Duration::from_millis(1)),
            Duration::from_millis(50)
        );
        assert_eq!(
            skip_rest(Duration::from_millis(30)),
            Duration::from_millis(300)
        );
        assert_eq!(skip_rest(Duration::from_secs(1)), Duration::from_secs(2));
    }

    #[test]
    fn the_heads_window_and_skip_span_follow_the_batch_within_bounds() {
        assert_eq!(heads_window(500), 2000);
        assert_eq!(heads_window(1), 256);
        assert_eq!(skip_span(500), 1000);
        assert_eq!(skip_span(1), 256);
        assert_eq!(skip_span(100_000), 20_000);
    }

    #[test]
    fn runs_are_cut_at_twice_an_even_share_of_the_batch() {
        assert_eq!(run_cap(500, 500), 2);
        assert_eq!(run_cap(500, 1), 500);
        assert_eq!(run_cap(500, 3), 334);
        assert_eq!(run_cap(500, 0), 500);
        assert_eq!(run_cap(1, 7), 1);
    }
}
