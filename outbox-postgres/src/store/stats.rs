//! Statistics whose cost is bounded: each kind of row counted in chunks of `stats_max_rows`.

use std::collections::BTreeMap;

use sqlx::{Postgres, Row, Transaction};

use txoutbox_core::{Error, EventTypeStats, StoreStats};

use crate::error::map_sqlx;

use super::count::{CountPass, TypeCounts};
use super::sql::{DEAD, PENDING};
use super::PostgresStore;

impl PostgresStore {
    /// The statistics of [`Store::stats`](txoutbox_core::Store::stats): the next chunk of each kind,
    /// the figures of the last complete counts.
    pub(super) async fn chunked_stats(&self) -> Result<StoreStats, Error> {
        // One call at a time per store, so that chunks follow each other.
        let mut passes = self.stats_passes.lock().await;
        let mut tx = self.stats_transaction().await?;
        let (pending_pass, dead_pass) = &mut *passes;
        self.count_chunk(&mut tx, false, pending_pass).await?;
        self.count_chunk(&mut tx, true, dead_pass).await?;
        self.finish_stats(
            tx,
            pending_pass.report(),
            dead_pass.report(),
            self.stats_max_rows,
        )
        .await
    }

    /// The counts of [`Store::stats`](txoutbox_core::Store::stats), each kind counted to its end now:
    /// for a command that wants the whole count (`outbox status`), at the cost of reading every
    /// pending row and dead letter once, `stats_max_rows` at a time, and the held-back figures in
    /// one statement that reads every dead letter and every row held behind one.
    ///
    /// # Errors
    /// As [`Store::stats`](txoutbox_core::Store::stats).
    pub async fn stats_complete(&self) -> Result<StoreStats, Error> {
        let mut tx = self.stats_transaction().await?;
        let mut kinds = [CountPass::default(), CountPass::default()];
        for (dead, pass) in [false, true].into_iter().zip(kinds.iter_mut()) {
            loop {
                self.count_chunk(&mut tx, dead, pass).await?;
                if pass.cursor.is_none() {
                    break;
                }
            }
        }
        let [pending, dead] = kinds;
        let mut stats = self
            .finish_stats(tx, pending.report(), dead.report(), i64::MAX)
            .await?;
        stats.estimated = false;
        Ok(stats)
    }

    /// The transaction the statistics read in: every statement must read through the partial
    /// indexes in seq order (a plan chosen on stale estimates, a bitmap scan and a sort of every dead
    /// letter, would read the whole backlog).
    async fn stats_transaction(&self) -> Result<Transaction<'static, Postgres>, Error> {
        self.pool
            .begin_with(
                "BEGIN READ ONLY; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off",
            )
            .await
            .map_err(|e| map_sqlx("stats", e))
    }

    /// Reads the oldest pending event's age now (the counts may come from earlier calls), ends the
    /// transaction, and puts the figures together.
    async fn finish_stats(
        &self,
        mut tx: Transaction<'static, Postgres>,
        (pending, pending_estimated): (TypeCounts, bool),
        (dead, dead_estimated): (TypeCounts, bool),
        held_cap: i64,
    ) -> Result<StoreStats, Error> {
        let t = self.table.qualified();
        let row = sqlx::query(&format!(
            "SELECT EXTRACT(EPOCH FROM now())::float8 AS now,
                    (SELECT EXTRACT(EPOCH FROM (now() - min(s.created_at)))::float8
                     FROM (SELECT e.created_at FROM {t} e WHERE {PENDING} ORDER BY e.seq LIMIT 100) s) AS oldest"
        ))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| map_sqlx("stats", e))?;
        // Held back: pending rows after a dead letter of their aggregate. Read through the dead
        // letters' index (at most `held_cap` of them) and, per aggregate with one, through its index
        // from its first dead letter on, at most an even share of `held_cap` rows each (a lateral
        // subquery with a limit: a bounded probe per aggregate, whatever the backlog behind it).
        // Beyond those bounds the figures are a lower bound, flagged as an estimate.
        let held = sqlx::query(&format!(
            "WITH dl AS MATERIALIZED (
                 SELECT e.aggregate_type, e.aggregate_id, e.seq FROM {t} e WHERE {DEAD}
                 ORDER BY e.seq LIMIT $1),
             d AS MATERIALIZED (
                 SELECT dl.aggregate_type, dl.aggregate_id, min(dl.seq) AS seq
                 FROM dl GROUP BY dl.aggregate_type, dl.aggregate_id),
             share AS (SELECT GREATEST(1, $1 / GREATEST(count(*), 1)) AS rows FROM d),
             c AS MATERIALIZED (
                 SELECT x.scanned, x.n FROM d CROSS JOIN LATERAL (
                     SELECT count(*) AS scanned, count(*) FILTER (WHERE q.dead_lettered_at IS NULL) AS n
                     FROM (SELECT p.dead_lettered_at FROM {t} p
                           WHERE p.aggregate_type = d.aggregate_type AND p.aggregate_id = d.aggregate_id
                             AND p.processed_at IS NULL AND p.seq > d.seq
                           ORDER BY p.seq LIMIT (SELECT rows FROM share)) q) x)
             SELECT COALESCE((SELECT sum(n) FROM c), 0)::bigint AS events,
                    (SELECT count(*) FROM c WHERE n > 0)::bigint AS aggregates,
                    ((SELECT count(*) FROM dl) >= $1
                     OR EXISTS (SELECT 1 FROM c WHERE scanned >= (SELECT rows FROM share))) AS capped"
        ))
        .bind(held_cap)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| map_sqlx("stats", e))?;
        tx.rollback().await.map_err(|e| map_sqlx("stats", e))?;
        let get = |e: sqlx::Error| map_sqlx("stats", e);
        let now: f64 = row.try_get("now").map_err(get)?;
        let oldest: Option<f64> = row.try_get("oldest").map_err(get)?;
        let mut by_type: BTreeMap<String, EventTypeStats> = BTreeMap::new();
        let held_events: i64 = held.try_get("events").map_err(get)?;
        let held_aggregates: i64 = held.try_get("aggregates").map_err(get)?;
        let held_capped: bool = held.try_get("capped").map_err(get)?;
        let mut stats = StoreStats {
            estimated: pending_estimated || dead_estimated || held_capped,
            held_back: u64::try_from(held_events).unwrap_or(0),
            held_back_aggregates: u64::try_from(held_aggregates).unwrap_or(0),
            oldest_pending_age_seconds: oldest.map(|o| o.max(0.0)),
            ..StoreStats::default()
        };
        for (event_type, (n, written)) in pending {
            stats.pending += n;
            let t = by_type
                .entry(event_type.clone())
                .or_insert_with(|| EventTypeStats::new(event_type));
            t.pending = n;
            t.oldest_pending_age_seconds = written.map(|w| (now - w).max(0.0));
        }
        for (event_type, (n, _)) in dead {
            stats.dead_letters += n;
            by_type
                .entry(event_type.clone())
                .or_insert_with(|| EventTypeStats::new(event_type))
                .dead_letters = n;
        }
        if stats.pending == 0 {
            stats.oldest_pending_age_seconds = None;
        }
        stats.by_event_type = by_type.into_values().collect();
        Ok(stats)
    }

    /// Counts the next chunk of pending rows (`dead = false`) or dead letters: at most
    /// `stats_max_rows` rows, in `seq` order after the pass's cursor, through the kind's partial
    /// index. The cost of a statistics call is thus bounded whatever the backlog.
    async fn count_chunk(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        dead: bool,
        pass: &mut CountPass,
    ) -> Result<(), Error> {
        let t = self.table.qualified();
        let kind = if dead { DEAD } else { PENDING };
        // The bound is written into the statement (not bound), so that a generic plan cannot
        // mistake it for an unknown share of the table and choose a scan of all of it.
        let cap = self.stats_max_rows;
        if pass.cursor.is_none() {
            pass.end = sqlx::query_scalar(&format!(
                "SELECT e.seq FROM {t} e WHERE {kind} ORDER BY e.seq DESC LIMIT 1"
            ))
            .fetch_optional(&mut **tx)
            .await
            .map_err(|e| map_sqlx("stats", e))?;
        }
        let chunk = format!(
            "SELECT s.event_type, count(*) AS n, max(s.seq) AS last_seq,
                    EXTRACT(EPOCH FROM min(s.created_at))::float8 AS oldest
             FROM (SELECT e.event_type, e.seq, e.created_at FROM {t} e
                   WHERE {kind} AND e.seq > $1 AND e.seq <= $2
                   ORDER BY e.seq LIMIT {cap}) s
             GROUP BY s.event_type"
        );
        let rows = sqlx::query(&chunk)
            .bind(pass.cursor.unwrap_or(i64::MIN))
            .bind(pass.end.unwrap_or(i64::MIN))
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("stats", e))?;
        let (mut counts, mut total, mut last_seq) = (TypeCounts::new(), 0u64, None);
        for r in rows {
            let get = |e: sqlx::Error| map_sqlx("stats", e);
            let n: i64 = r.try_get("n").map_err(get)?;
            let last: i64 = r.try_get("last_seq").map_err(get)?;
            let oldest: Option<f64> = r.try_get("oldest").map_err(get)?;
            total += n.max(0) as u64;
            last_seq = Some(last_seq.map_or(last, |l: i64| l.max(last)));
            counts.insert(
                r.try_get::<String, _>("event_type").map_err(get)?,
                (n.max(0) as u64, oldest),
            );
        }
        pass.add(counts, total, last_seq, cap as u64);
        Ok(())
    }
}
