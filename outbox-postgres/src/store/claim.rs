//! The claim: lock the heads of ready aggregates (`FOR UPDATE SKIP LOCKED`), then read their runs,
//! within a byte budget.

use std::collections::{HashMap, HashSet};

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
pub(super) fn claim_begin(hold_for: std::time::Duration) -> String {
    let ms = hold_for.as_millis().clamp(1_000, i32::MAX as u128);
    format!(
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
         SAVEPOINT {CLAIM_LOCKS}"
    )
}

/// The savepoint taken before a claim locks anything: when the byte budget leaves locked rows out of
/// the batch, the claim rolls back to it (releasing every lock) and locks again only the rows it keeps,
/// so that no row is held by a lease that will not publish it.
pub(super) const CLAIM_LOCKS: &str = "claim_locks";

/// Claims that read more payload bytes than this give their connection's grown buffers back.
pub(super) const SHRINK_BUFFERS_ABOVE: usize = 1024 * 1024;

/// Keeps, per aggregate, the rows from its locked head on while they are ready. `rows` hold every
/// unprocessed row of the locked aggregates (or a seq-ordered prefix of them), in seq order. Each row
/// is dropped once decoded, so a batch's payloads are held about once, not twice.
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
    let mut events = Vec::new();
    for row in rows {
        let get = |e: sqlx::Error| map_sqlx("claim", e);
        let key: (String, String) = (
            row.try_get("aggregate_type").map_err(get)?,
            row.try_get("aggregate_id").map_err(get)?,
        );
        let seq: i64 = row.try_get("seq").map_err(get)?;
        let ready: bool = row.try_get("ready").map_err(get)?;
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

/// A head locked by a claim: the oldest unprocessed row of its aggregate.
pub(super) struct Head {
    pub(super) seq: i64,
    pub(super) key: (String, String),
}

/// How many ready rows (in seq order) the heads are looked for among: four batches, and at least
/// 256, so that a batch fills from the window whenever the backlog is spread over many aggregates.
pub(super) fn heads_window(limit: i64) -> i64 {
    limit.saturating_mul(4).max(256)
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
/// for the one row a heads statement returns when it locked nothing.
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
                let (heads, whole) = self.claim_heads(&mut tx, limit, max_bytes).await?;
                if heads.is_empty() {
                    Vec::new()
                } else if let Some(events) = whole.and_then(|rows| heads_as_batch(rows).transpose())
                {
                    events?
                } else {
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
                        .bind(max_bytes)
                        .fetch_all(&mut *tx)
                        .await
                        .map_err(|e| map_sqlx("claim", e))?;
                    let mut keyed = Vec::with_capacity(rows.len());
                    for row in rows.drain(..) {
                        let seq: i64 = row.try_get("seq").map_err(|e| map_sqlx("claim", e))?;
                        keyed.push((seq, row));
                    }
                    keyed.sort_by_key(|(seq, _)| *seq);
                    let rows: Vec<PgRow> = keyed.into_iter().map(|(_, row)| row).collect();
                    let mut events = runs_from_heads(rows, &head_seq)?;
                    let used: HashSet<(String, String)> = events
                        .iter()
                        .map(|e| (e.aggregate_type.clone(), e.aggregate_id.clone()))
                        .collect();
                    if used.len() < heads.len() {
                        let seqs: Vec<i64> = heads
                            .iter()
                            .filter(|h| used.contains(&h.key))
                            .map(|h| h.seq)
                            .collect();
                        let kept: HashSet<i64> = self
                            .relock(
                                &mut tx,
                                sqlx::query_scalar(&self.sql.relock_heads).bind(&seqs),
                            )
                            .await?
                            .into_iter()
                            .collect();
                        events.retain(|e| {
                            head_seq
                                .get(&(e.aggregate_type.clone(), e.aggregate_id.clone()))
                                .is_some_and(|seq| kept.contains(seq))
                        });
                    }
                    events
                }
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

    /// Step 1 of an ordered claim: locks up to `limit` ready heads, oldest first. The window over the
    /// first ready rows finds them in the common case; when it was full and yielded fewer than
    /// `limit` (other relays hold the heads in it, or it holds one aggregate's backlog behind a
    /// backing-off head), skip scans over the aggregates find the others.
    /// Also returns the window statement's rows when those heads alone fill the batch (`limit`
    /// heads locked there); their events come whole when they fit `max_bytes`.
    async fn claim_heads(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        max_bytes: i64,
    ) -> Result<(Vec<Head>, Option<Vec<PgRow>>), Error> {
        let window = heads_window(limit);
        let rows = sqlx::query(&self.sql.claim_heads)
            .bind(limit)
            .bind(window)
            .bind(max_bytes)
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        let mut window_rows = 0i64;
        let mut heads = Vec::new();
        for row in &rows {
            window_rows = row
                .try_get("window_rows")
                .map_err(|e| map_sqlx("claim", e))?;
            heads.extend(head_of(row)?);
        }
        if heads.len() as i64 >= limit {
            return Ok((heads, Some(rows)));
        }
        if window_rows < window {
            return Ok((heads, None));
        }
        let started = std::time::Instant::now();
        let resting = self
            .skip_rest_until
            .lock()
            .is_ok_and(|until| until.is_some_and(|t| started < t));
        if resting {
            return Ok((heads, None));
        }
        let found_before = heads.len();
        let mut walked_all = false;
        // Up to four skip scans per claim, each going on from where the previous one stopped; one
        // that started after a cursor and reached the last aggregate goes on from the first (once).
        let span = skip_span(limit);
        let (mut scans, mut wrapped) = (0, false);
        while (heads.len() as i64) < limit && scans < 4 {
            scans += 1;
            let cursor = self
                .skip_cursor
                .lock()
                .map_or(None, |cursor| cursor.clone());
            let held: Vec<i64> = heads.iter().map(|h| h.seq).collect();
            let query = match &cursor {
                None => sqlx::query(&self.sql.claim_skip_first),
                Some(_) => sqlx::query(&self.sql.claim_skip_after),
            }
            .bind(limit - heads.len() as i64)
            .bind(span)
            .bind(&held);
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
            for row in &rows {
                let get = |e: sqlx::Error| map_sqlx("claim", e);
                visited = row
                    .try_get::<Option<i32>, _>("visited")
                    .map_err(get)?
                    .map_or(0, i64::from);
                let last_type: Option<String> = row.try_get("last_type").map_err(get)?;
                let last_id: Option<String> = row.try_get("last_id").map_err(get)?;
                last = last_type.zip(last_id);
                heads.extend(head_of(row)?);
            }
            let reached_end = visited < span;
            if let Ok(mut guard) = self.skip_cursor.lock() {
                *guard = if reached_end { None } else { last };
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
            *until = (walked_all && heads.len() == found_before)
                .then(|| started + skip_rest(started.elapsed()));
        }
        heads.sort_by_key(|h| h.seq);
        Ok((heads, None))
    }
}

/// The batch when the locked heads fill it within the byte budget: their events in seq order, read
/// from the rows of the statement that locked them. `None` when the statement sent them by key only
/// (`fits` false: over the budget), for the runs statement to cut the batch to the budget.
fn heads_as_batch(rows: Vec<PgRow>) -> Result<Option<Vec<Event>>, Error> {
    let get = |e: sqlx::Error| map_sqlx("claim", e);
    let mut keyed = Vec::with_capacity(rows.len());
    for row in rows {
        let Some(seq) = row.try_get::<Option<i64>, _>("seq").map_err(get)? else {
            continue;
        };
        if !row
            .try_get::<Option<bool>, _>("fits")
            .map_err(get)?
            .unwrap_or(false)
        {
            return Ok(None);
        }
        keyed.push((seq, row));
    }
    keyed.sort_by_key(|(seq, _)| *seq);
    keyed
        .iter()
        .map(|(_, row)| decode_event(row))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_sql_locks_heads_and_honours_the_table() {
        let t = OutboxTable::new("s", "events").unwrap();
        let sql = Sql::new(&t, Retention::Delete);
        assert!(sql.claim_heads.contains("FOR UPDATE SKIP LOCKED"));
        assert!(sql.claim_heads.contains("\"s\".\"events\""));
        assert!(sql.claim_runs.contains("\"s\".\"events\""));
        for skip in [&sql.claim_skip_first, &sql.claim_skip_after] {
            assert!(skip.contains("FOR UPDATE SKIP LOCKED"));
            assert!(skip.contains("\"s\".\"events\""));
        }
        assert!(sql.claim_skip_after.contains("> ($4, $5)"));
        assert!(!sql.claim_skip_first.contains("$4"));
        assert!(!sql.claim_unordered.contains("NOT EXISTS"));
        assert!(sql.settle.contains("DELETE FROM \"s\".\"events\""));
        let keep = Sql::new(&t, Retention::Keep);
        assert!(keep.settle.contains("SET processed_at = now()"));
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
