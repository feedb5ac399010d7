//! Skip scans: when the owned read's scan or the window is full of events the claim cannot take
//! (held back, or of partitions other leases hold), walk the aggregates from a rotating cursor for
//! their heads, and read the runs behind the heads found.

use std::collections::{HashMap, HashSet};

use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use txoutbox_core::{Error, Event};

use crate::error::map_sqlx;
use crate::row::decode_event;
use crate::store::PostgresStore;

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
    /// The skip scans and the runs behind the heads they find, for up to `limit` more events within
    /// `max_bytes` (strictly when `taken`, the events already in the batch, is not empty).
    pub(super) async fn claim_beyond(
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
    fn runs_are_cut_at_twice_an_even_share_of_the_batch() {
        assert_eq!(run_cap(500, 500), 2);
        assert_eq!(run_cap(500, 1), 500);
        assert_eq!(run_cap(500, 3), 334);
        assert_eq!(run_cap(500, 0), 500);
        assert_eq!(run_cap(1, 7), 1);
    }
}
