//! The ordered claim: take partitions of the aggregates (a kept set again, or those of the oldest
//! ready events of a window), waiting a while for one when other leases hold them all, then read
//! the oldest ready events of the partitions held (the owned read). The window widens and narrows
//! with contention; a sharing mode fills batches with whole runs while claims meet other leases.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use sqlx::{Postgres, Row, Transaction};

use txoutbox_core::{ClaimRequest, Error, Event};

use crate::error::map_sqlx;
use crate::row::decode_event;
use crate::store::kept::Kept;
use crate::store::PostgresStore;

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
/// batches: narrowing it after every one would make the next claims find a narrow window's
/// partitions held again and wait. A burst shorter than that leaves the window wide for the next
/// (at most [`WINDOW_FACTOR_MAX`] times the rows per choice; a kept set's claim does not choose).
pub(super) const CALM_CLAIMS: u32 = 64;

/// How many claims in a row fill their batch from as few aggregates as they can (whole runs, for a
/// publisher that keeps an aggregate's events in order within a call) once a claim met other
/// leases holding every partition it could have taken (it waited for one). One event of each of
/// many aggregates is the cheaper read (more of the oldest events are the claim's), but it leaves
/// little for other leases: over a backlog of 1,000 aggregates two batches of 500 hold them all,
/// and a third and fourth claim in flight (two relays) wait. Sharing the aggregates out lets them
/// all fill a batch; the claims go back to the cheaper read after this many without waiting.
pub(super) const SHARE_CLAIMS: u32 = 64;

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

impl PostgresStore {
    /// An ordered claim: takes again a kept set of partitions when it still fills a batch; else
    /// chooses partitions (`claim_partitions`), waiting a while for one when other leases hold
    /// every claimable one, reads the oldest ready events of those it holds (`claim_owned`), and,
    /// when that read or the window was full of events it could not take, looks for heads beyond
    /// with skip scans over the aggregates. Returns the events and the set to offer to later
    /// claims when the batch's lease ends.
    pub(super) async fn claim_owned(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        max_bytes: i64,
        request: &ClaimRequest,
    ) -> Result<(Vec<Event>, Option<Kept>), Error> {
        let whole_runs = request.whole_runs;
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
            // Whether the budget has room left: one more byte would still fit.
            let room = request.fits(events.len(), bytes as usize, 1);
            if (events.len() as i64) < limit && beyond && !contended && room {
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

    /// A kept set of partitions (see [`KEPT_SETS`](crate::store::kept::KEPT_SETS)) chosen the way
    /// this claim chooses (sharing or not), if any: the oldest of those kept (the sets go round,
    /// each serving in turn). Sets of the other way, offered by leases that began before the mode
    /// changed, are dropped.
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::claim::skip::skip_span;
    use crate::table::OutboxTable;

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
    fn the_heads_window_and_skip_span_follow_the_batch_within_bounds() {
        assert_eq!(heads_window(500), 2000);
        assert_eq!(heads_window(1), 256);
        assert_eq!(skip_span(500), 1000);
        assert_eq!(skip_span(1), 256);
        assert_eq!(skip_span(100_000), 20_000);
    }
}
