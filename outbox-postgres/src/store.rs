//! The relay's store: claim with `FOR UPDATE SKIP LOCKED`, settle a batch in one statement.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Connection, FromRow, PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use outbox_core::{
    Action, Batch, ClaimRequest, Error, ErrorKind, Event, EventTypeStats, Lease, OrderingPolicy,
    Settlement, Store, StoreStats,
};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// What happens to a row once its event is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Delete it in the settling statement (the default: cheapest, keeps the table small).
    #[default]
    Delete,
    /// Keep it with `processed_at` set; remove it later with [`PostgresStore::cleanup`].
    Keep,
}

struct Sql {
    claim_heads: String,
    claim_skip_first: String,
    claim_skip_after: String,
    claim_runs: String,
    claim_unordered: String,
    settle: String,
    /// Locks the heads of a lost lease's aggregates that no other lease holds, and returns the
    /// lease's rows of those aggregates (see `PgLease::settle`).
    lock_free: String,
    /// The same for unordered claims: locks the lost lease's rows no other lease holds.
    lock_free_rows: String,
    /// Locks again the heads a budget-cut batch keeps (see [`CLAIM_LOCKS`]).
    relock_heads: String,
    /// Locks again the rows a budget-cut unordered batch keeps.
    relock_rows: String,
}

/// The select list that [`decode_event`] reads: every column of an event, over the outbox table
/// aliased `e` (`SELECT {EVENT_COLUMNS} FROM <table> e WHERE ...`), the payload as bytes whatever
/// its column.
pub const EVENT_COLUMNS: &str = "e.id, e.aggregate_type, e.aggregate_id, e.event_type,
    CASE WHEN e.payload_bytes IS NOT NULL THEN e.payload_bytes ELSE convert_to(e.payload::text, 'UTF8') END AS payload,
    e.content_type, e.headers::text AS headers, e.destination, e.created_at, e.attempts";

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
fn claim_begin(hold_for: std::time::Duration) -> String {
    let ms = hold_for.as_millis().clamp(1_000, i32::MAX as u128);
    format!(
        "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
         SAVEPOINT {CLAIM_LOCKS}"
    )
}

/// A row's payload size in bytes, as the byte budget counts it: recorded at insert (migration
/// `20261205000001_payload_size.sql`), else (rows written before it) the payload's stored size, which
/// for a compressed JSON payload is smaller than the payload itself.
const PAYLOAD_SIZE: &str =
    "COALESCE(e.payload_size, octet_length(e.payload_bytes), pg_column_size(e.payload))::bigint";

/// The savepoint taken before a claim locks anything: when the byte budget leaves locked rows out of
/// the batch, the claim rolls back to it (releasing every lock) and locks again only the rows it keeps,
/// so that no row is held by a lease that will not publish it.
const CLAIM_LOCKS: &str = "claim_locks";

/// Claims that read more payload bytes than this give their connection's grown buffers back.
const SHRINK_BUFFERS_ABOVE: usize = 1024 * 1024;

/// Pending rows (the statistics' first kind), as the partial index `<table>_pending_idx` holds them.
const PENDING: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL";

/// Dead letters, as the partial index `<table>_dead_idx` holds them.
const DEAD: &str = "e.dead_lettered_at IS NOT NULL AND e.processed_at IS NULL";

const READY: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL
      AND (e.retry_after IS NULL OR e.retry_after <= clock_timestamp())";

impl Sql {
    fn new(table: &OutboxTable, retention: Retention) -> Self {
        let t = table.qualified();
        // A head is the oldest unprocessed row of its aggregate (an earlier pending, backing-off,
        // claimed or dead-lettered row makes it not a head). Locking the heads with SKIP LOCKED gives
        // this relay the aggregates' runs for the life of its transaction; other relays skip the
        // locked heads and cannot see the runs' later rows as heads.
        // Step 1 locks the heads; step 2 (a new statement, so a fresh snapshot in which the heads are
        // ours) reads every unprocessed row of those aggregates, and the store keeps, per aggregate,
        // the ready rows from the head on, up to the first row that is not ready. An aggregate whose
        // oldest unprocessed row is not the locked head (it changed since step 1's snapshot) is left
        // out of this batch.
        // The heads are looked for among the first $2 ready rows in seq order (the window), never
        // the whole backlog: when other relays hold most heads, or one aggregate's long backlog
        // waits behind a backing-off head, a scan for heads would otherwise walk every pending row.
        // The first column tells how many rows the window held, so the store knows whether heads
        // may lie beyond it (the window was full) and the skip scan below is worth running.
        // The window's rows are located once (their row addresses); only the first of each aggregate
        // can be a head (a head has no earlier unprocessed row, so none earlier in the window). Those
        // candidates are taken in seq order, one at a time (a lateral subquery with its own lock,
        // so the walk stops at the $1-th locked head instead of checking every candidate): each is
        // fetched by address and is a head when no earlier unprocessed row of its aggregate exists
        // (a point lookup on the aggregate index, written as a scalar subquery so that it cannot
        // become a join). The grouping sorts by bytes (`COLLATE "C"`): it only needs equality, which
        // is byte equality under any deterministic collation, and a linguistic sort (ICU, glibc
        // en_US) of the window's keys costs more per claim (BENCHMARKS.md, third machine).
        // Every step is a row-address or index access whose cost follows the window, whatever the
        // planner believes of the table's size (see `CLAIM_BEGIN`): a plan cached while the outbox
        // was empty stays cheap once it is not.
        let claim_heads = format!(
            "WITH w AS MATERIALIZED (
                SELECT e.ctid AS tid, e.seq, e.aggregate_type, e.aggregate_id
                FROM {t} e WHERE {READY} ORDER BY e.seq LIMIT $2),
            firsts AS MATERIALIZED (
                SELECT DISTINCT ON (w.aggregate_type COLLATE \"C\", w.aggregate_id COLLATE \"C\") w.tid, w.seq
                FROM w ORDER BY w.aggregate_type COLLATE \"C\", w.aggregate_id COLLATE \"C\", w.seq)
            SELECT (SELECT count(*) FROM w) AS window_rows, h.seq, h.aggregate_type, h.aggregate_id
            FROM (SELECT 1) one
            LEFT JOIN LATERAL (
                SELECT l.seq, l.aggregate_type, l.aggregate_id
                FROM (SELECT f.tid, f.seq FROM firsts f ORDER BY f.seq) c
                CROSS JOIN LATERAL (
                    SELECT e.seq, e.aggregate_type, e.aggregate_id
                    FROM {t} e
                    WHERE e.ctid = c.tid
                      AND {READY}
                      AND (SELECT 1 FROM {t} p
                           WHERE p.aggregate_type = e.aggregate_type AND p.aggregate_id = e.aggregate_id
                             AND p.processed_at IS NULL AND p.seq < e.seq
                           LIMIT 1) IS NULL
                    FOR UPDATE SKIP LOCKED
                ) l
                ORDER BY c.seq
                LIMIT $1
            ) h ON true"
        );
        // The skip scan: walks up to $2 aggregates with unprocessed rows, in key order from a cursor
        // the store rotates, takes each one's oldest unprocessed row (its head) and locks the ready
        // heads not already held ($3). Its cost follows $2, not the number of pending rows. The first
        // columns tell how many aggregates were visited and the last one, for the next cursor.
        let skip = |start: &str| {
            format!(
                "WITH RECURSIVE aggs AS (
                    (SELECT a.aggregate_type, a.aggregate_id, 1 AS n FROM {t} a
                     WHERE a.processed_at IS NULL {start}
                     ORDER BY a.aggregate_type, a.aggregate_id LIMIT 1)
                    UNION ALL
                    SELECT nx.aggregate_type, nx.aggregate_id, aggs.n + 1
                    FROM aggs CROSS JOIN LATERAL (
                        SELECT a.aggregate_type, a.aggregate_id FROM {t} a
                        WHERE a.processed_at IS NULL
                          AND (a.aggregate_type, a.aggregate_id) > (aggs.aggregate_type, aggs.aggregate_id)
                        ORDER BY a.aggregate_type, a.aggregate_id LIMIT 1) nx
                    WHERE aggs.n < $2
                ),
                last AS (SELECT aggregate_type, aggregate_id, n FROM aggs ORDER BY n DESC LIMIT 1),
                heads AS (
                    SELECT hd.seq FROM aggs CROSS JOIN LATERAL (
                        SELECT a.seq FROM {t} a
                        WHERE a.aggregate_type = aggs.aggregate_type AND a.aggregate_id = aggs.aggregate_id
                          AND a.processed_at IS NULL
                        ORDER BY a.seq LIMIT 1) hd
                )
                SELECT last.n AS visited, last.aggregate_type AS last_type, last.aggregate_id AS last_id,
                       h.seq, h.aggregate_type, h.aggregate_id
                FROM (SELECT 1) one
                LEFT JOIN last ON true
                LEFT JOIN LATERAL (
                    SELECT e.seq, e.aggregate_type, e.aggregate_id
                    FROM {t} e
                    WHERE e.seq = ANY(ARRAY(SELECT seq FROM heads))
                      AND e.seq <> ALL($3::bigint[])
                      AND {READY}
                    ORDER BY e.seq
                    LIMIT $1
                    FOR UPDATE SKIP LOCKED
                ) h ON true"
            )
        };
        let claim_skip_first = skip("");
        let claim_skip_after = skip("AND (a.aggregate_type, a.aggregate_id) > ($4, $5)");
        // Each aggregate's run is read from its index in seq order and cut at $4 rows, so the cost
        // of a claim follows the batch size, not the length of the backlog behind each head. The
        // batch is cut at $3 rows by position in the run first (every locked head's first row, then
        // every second row...), so no locked aggregate is held without being published, and a batch
        // spreads over as many aggregates as it can (a publisher that sends an aggregate's later
        // events one call apart then sends most batches in one call). The store puts the rows back
        // in seq order.
        // The byte budget ($5) is applied before any payload is read: the rows are first chosen by
        // their recorded sizes (`PAYLOAD_SIZE`), then only the chosen ones are fetched by address.
        // The cut keeps the rows up to the last whose running total stays within the budget (the
        // first row always: an event larger than the budget goes alone), in the batch's order, so
        // each aggregate keeps a prefix of its run.
        let claim_runs = format!(
            "WITH m AS MATERIALIZED (
                SELECT r.tid, r.seq, r.ready, r.run_pos, r.size
                FROM UNNEST($1::text[], $2::text[]) AS h(aggregate_type, aggregate_id)
                CROSS JOIN LATERAL (
                    SELECT e.ctid AS tid, e.seq, {PAYLOAD_SIZE} AS size,
                        (e.dead_lettered_at IS NULL AND (e.retry_after IS NULL OR e.retry_after <= clock_timestamp())) AS ready,
                        row_number() OVER (ORDER BY e.seq) AS run_pos
                    FROM {t} e
                    WHERE e.aggregate_type = h.aggregate_type AND e.aggregate_id = h.aggregate_id
                      AND e.processed_at IS NULL
                    ORDER BY e.seq
                    LIMIT $4
                ) r
                ORDER BY r.run_pos, r.seq
                LIMIT $3),
            c AS (
                SELECT m.*, sum(m.size) OVER (ORDER BY m.run_pos, m.seq ROWS UNBOUNDED PRECEDING) AS upto,
                    row_number() OVER (ORDER BY m.run_pos, m.seq) AS n
                FROM m)
            SELECT {EVENT_COLUMNS}, c.seq, c.ready, c.run_pos
            FROM c CROSS JOIN LATERAL (SELECT * FROM {t} x WHERE x.ctid = c.tid) e
            WHERE c.n = 1 OR c.upto <= $5
            ORDER BY c.run_pos, c.seq"
        );
        // Unordered claims lock up to $1 ready rows and return those within the byte budget ($2),
        // with the number locked (the store then releases the rows it does not return).
        let claim_unordered = format!(
            "WITH m AS MATERIALIZED (
                SELECT e.ctid AS tid, e.seq, {PAYLOAD_SIZE} AS size
                FROM {t} e
                WHERE {READY}
                ORDER BY e.seq
                LIMIT $1
                FOR UPDATE SKIP LOCKED),
            c AS (
                SELECT m.*, sum(m.size) OVER (ORDER BY m.seq ROWS UNBOUNDED PRECEDING) AS upto,
                    row_number() OVER (ORDER BY m.seq) AS n
                FROM m)
            SELECT {EVENT_COLUMNS}, (SELECT count(*) FROM m) AS locked
            FROM c CROSS JOIN LATERAL (SELECT * FROM {t} x WHERE x.ctid = c.tid) e
            WHERE c.n = 1 OR c.upto <= $2
            ORDER BY c.seq"
        );
        let published = match retention {
            Retention::Delete => format!("DELETE FROM {t} WHERE id = ANY($1::uuid[])"),
            Retention::Keep => format!(
                "UPDATE {t} SET processed_at = now(), retry_after = NULL WHERE id = ANY($1::uuid[])"
            ),
        };
        let settle = format!(
            "WITH published AS ({published}),
            retried AS (
                UPDATE {t} o
                SET attempts = u.attempts,
                    retry_after = clock_timestamp() + u.delay_ms * interval '1 millisecond',
                    last_error = u.error
                FROM UNNEST($2::uuid[], $3::int[], $4::bigint[], $5::text[]) AS u(id, attempts, delay_ms, error)
                WHERE o.id = u.id
            ),
            dead AS (
                UPDATE {t} o
                SET attempts = u.attempts, last_error = u.error, dead_lettered_at = now(), retry_after = NULL
                FROM UNNEST($6::uuid[], $7::int[], $8::text[]) AS u(id, attempts, error)
                WHERE o.id = u.id
            )
            SELECT 1"
        );
        // A lost lease's rows may be settled only where this transaction owns the aggregate as a
        // claim would: by locking its head (its oldest unprocessed row), which must be one of the
        // lease's rows. Rows behind another lease's head are left to that lease.
        let lock_free = format!(
            "WITH heads AS (
                SELECT h.aggregate_type, h.aggregate_id FROM {t} h
                WHERE h.id = ANY($1::uuid[]) AND h.processed_at IS NULL
                  AND (SELECT 1 FROM {t} p
                       WHERE p.aggregate_type = h.aggregate_type AND p.aggregate_id = h.aggregate_id
                         AND p.processed_at IS NULL AND p.seq < h.seq
                       LIMIT 1) IS NULL
                FOR UPDATE OF h SKIP LOCKED)
            SELECT e.id FROM {t} e JOIN heads USING (aggregate_type, aggregate_id)
            WHERE e.id = ANY($1::uuid[]) AND e.processed_at IS NULL"
        );
        // After the byte budget left some locked rows out of a batch (and the claim rolled back to its
        // savepoint): lock again the heads (ordered) or rows (unordered) the batch keeps, if still
        // ready and free. One that is not (another relay took it in between) leaves the batch.
        let relock_heads = format!(
            "SELECT e.seq FROM {t} e WHERE e.seq = ANY($1::bigint[]) AND {READY} FOR UPDATE SKIP LOCKED"
        );
        let relock_rows = format!(
            "SELECT e.id FROM {t} e WHERE e.id = ANY($1::uuid[]) AND {READY} FOR UPDATE SKIP LOCKED"
        );
        // Under unordered claims a lease locks its rows themselves; so does the lost lease's settle.
        let lock_free_rows = format!(
            "SELECT id FROM {t} WHERE id = ANY($1::uuid[]) AND processed_at IS NULL FOR UPDATE SKIP LOCKED"
        );
        Sql {
            relock_heads,
            relock_rows,
            lock_free,
            lock_free_rows,
            claim_heads,
            claim_skip_first,
            claim_skip_after,
            claim_runs,
            claim_unordered,
            settle,
        }
    }
}

/// The PostgreSQL implementation of [`Store`], plus the operator's tools (dead letters, cleanup).
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    table: OutboxTable,
    retention: Retention,
    sql: Arc<Sql>,
    /// Where the next skip scan starts: the last aggregate the previous one visited (`None`: from
    /// the first). Rotating it gives every aggregate its turn, however many there are.
    skip_cursor: Arc<Mutex<Option<(String, String)>>>,
    /// Until when skip scans rest: set when the last ones walked every aggregate and found no head
    /// to take (other relays hold them all), so that claims bound to find nothing beyond the window
    /// do not keep walking the aggregates (the window still runs on every claim).
    skip_rest_until: Arc<Mutex<Option<std::time::Instant>>>,
    /// The most rows of each kind one statistics call reads (see [`PostgresStore::with_stats_max_rows`]).
    stats_max_rows: i64,
    /// The counts in progress: pending rows, dead letters.
    stats_passes: Arc<tokio::sync::Mutex<(CountPass, CountPass)>>,
}

/// The default of [`PostgresStore::with_stats_max_rows`] (`database.stats_max_rows`): 100,000 rows
/// per kind and call.
pub const DEFAULT_STATS_MAX_ROWS: u64 = 100_000;

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.qualified())
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// An [`Event`] from a row selected with [`EVENT_COLUMNS`] (for tools that read the outbox
/// themselves, such as a benchmark's reference relay).
///
/// # Errors
/// A database error naming the column when the row lacks one or holds another type.
pub fn decode_event(row: &PgRow) -> Result<Event, Error> {
    let get = |e: sqlx::Error| map_sqlx("claim", e);
    let headers_text: String = row.try_get("headers").map_err(get)?;
    let headers = parse_headers(&headers_text);
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    Ok(Event {
        id: row.try_get("id").map_err(get)?,
        aggregate_type: row.try_get("aggregate_type").map_err(get)?,
        aggregate_id: row.try_get("aggregate_id").map_err(get)?,
        event_type: row.try_get("event_type").map_err(get)?,
        payload: row.try_get("payload").map_err(get)?,
        content_type: row.try_get("content_type").map_err(get)?,
        headers,
        destination: row.try_get("destination").map_err(get)?,
        created_at: row.try_get("created_at").map_err(get)?,
        attempts: u32::try_from(attempts).unwrap_or(0),
    })
}

/// Keeps, per aggregate, the rows from its locked head on while they are ready. `rows` hold every
/// unprocessed row of the locked aggregates (or a seq-ordered prefix of them), in seq order. Each row
/// is dropped once decoded, so a batch's payloads are held about once, not twice.
fn runs_from_heads(
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
fn run_cap(limit: i64, heads: usize) -> i64 {
    let heads = i64::try_from(heads.max(1)).unwrap_or(i64::MAX);
    let share = (limit + heads - 1) / heads;
    share.saturating_mul(2).clamp(1, limit.max(1))
}

/// Headers as stored: a JSON object. Non-string values (from plain-SQL writers) keep their JSON text;
/// anything that is not an object yields no headers rather than a failure.
fn parse_headers(text: &str) -> BTreeMap<String, String> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

impl PostgresStore {
    /// A store over `table` (migrate it first with [`crate::migrate`]). Published rows are deleted.
    pub fn new(pool: PgPool, table: OutboxTable) -> Self {
        Self::with_retention(pool, table, Retention::Delete)
    }

    /// A store with the given retention of published rows.
    pub fn with_retention(pool: PgPool, table: OutboxTable, retention: Retention) -> Self {
        let sql = Arc::new(Sql::new(&table, retention));
        PostgresStore {
            pool,
            table,
            retention,
            sql,
            skip_cursor: Arc::new(Mutex::new(None)),
            skip_rest_until: Arc::new(Mutex::new(None)),
            stats_max_rows: DEFAULT_STATS_MAX_ROWS as i64,
            stats_passes: Arc::default(),
        }
    }

    /// Reads at most `rows` rows of each kind (pending, dead letters) per [`Store::stats`] call
    /// (default [`DEFAULT_STATS_MAX_ROWS`]; at least 1,000): a kind with more is counted over
    /// several calls, each going on from where the last stopped, and reported from the last complete
    /// count ([`StoreStats::estimated`] is then true).
    pub fn with_stats_max_rows(mut self, rows: u64) -> Self {
        self.stats_max_rows = i64::try_from(rows).unwrap_or(i64::MAX).max(1_000);
        self
    }

    /// The counts of [`Store::stats`], each kind counted to its end now: for a command that wants
    /// the whole count (`outbox status`), at the cost of reading every pending row and dead letter
    /// once, `stats_max_rows` at a time.
    ///
    /// # Errors
    /// As [`Store::stats`].
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
            .finish_stats(tx, pending.report(), dead.report())
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
    ) -> Result<StoreStats, Error> {
        let row = sqlx::query(&format!(
            "SELECT EXTRACT(EPOCH FROM now())::float8 AS now,
                    (SELECT EXTRACT(EPOCH FROM (now() - min(s.created_at)))::float8
                     FROM (SELECT e.created_at FROM {} e WHERE {PENDING} ORDER BY e.seq LIMIT 100) s) AS oldest",
            self.table.qualified()
        ))
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| map_sqlx("stats", e))?;
        tx.rollback().await.map_err(|e| map_sqlx("stats", e))?;
        let get = |e: sqlx::Error| map_sqlx("stats", e);
        let now: f64 = row.try_get("now").map_err(get)?;
        let oldest: Option<f64> = row.try_get("oldest").map_err(get)?;
        let mut by_type: BTreeMap<String, EventTypeStats> = BTreeMap::new();
        let mut stats = StoreStats {
            estimated: pending_estimated || dead_estimated,
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

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &OutboxTable {
        &self.table
    }

    /// The retention in force.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// Applies the schema migrations to this store's table (see [`crate::migrate`]).
    ///
    /// # Errors
    /// As [`crate::migrate`].
    pub async fn migrate(&self) -> Result<Vec<i64>, Error> {
        crate::migrate::migrate(&self.pool, &self.table).await
    }
}

/// A head locked by a claim: the oldest unprocessed row of its aggregate.
struct Head {
    seq: i64,
    key: (String, String),
}

/// How many ready rows (in seq order) the heads are looked for among: four batches, and at least
/// 256, so that a batch fills from the window whenever the backlog is spread over many aggregates.
fn heads_window(limit: i64) -> i64 {
    limit.saturating_mul(4).max(256)
}

/// How long skip scans rest after a complete walk over the aggregates that took `walk` and found no
/// head to take.
fn skip_rest(walk: std::time::Duration) -> std::time::Duration {
    (walk * 10).clamp(
        std::time::Duration::from_millis(50),
        std::time::Duration::from_secs(2),
    )
}

/// How many aggregates one skip scan visits at most: two batches, at least 256, at most 20,000.
fn skip_span(limit: i64) -> i64 {
    limit.saturating_mul(2).clamp(256, 20_000)
}

/// Reads the optional head columns (`seq`, `aggregate_type`, `aggregate_id`) of a heads row: `None`
/// for the one row a heads statement returns when it locked nothing.
fn head_of(row: &PgRow) -> Result<Option<Head>, Error> {
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

/// Rows of one event type in a count: how many, and when the oldest was written (seconds since the
/// Unix epoch, by the database's clock).
type TypeCounts = BTreeMap<String, (u64, Option<f64>)>;

/// A count of one kind of rows (pending or dead letters) taken in chunks of `stats_max_rows` rows,
/// one chunk per statistics call, each going on in `seq` order from where the previous one stopped.
/// A kind with fewer rows than a chunk is counted whole, exactly, at every call; a larger one is
/// counted over several calls, and its figure is the last complete pass (or the pass in progress,
/// once that has counted more). A pass counts the rows up to the last `seq` there was when it started:
/// rows written meanwhile wait for the next pass, so a pass ends however fast rows arrive.
#[derive(Debug, Default)]
struct CountPass {
    /// Where the next chunk starts: after this `seq` (`None`: a new pass, from the oldest row).
    cursor: Option<i64>,
    /// The last `seq` of the kind when the pass in progress started.
    end: Option<i64>,
    /// The pass in progress.
    partial: TypeCounts,
    /// The last complete pass, and whether it took more than one chunk.
    last: Option<(TypeCounts, bool)>,
}

impl CountPass {
    /// Adds a chunk of `rows` rows (by type), the last at `last_seq`; a chunk smaller than `cap`
    /// ends the pass.
    fn add(&mut self, chunk: TypeCounts, rows: u64, last_seq: Option<i64>, cap: u64) {
        for (event_type, (n, oldest)) in chunk {
            let entry = self.partial.entry(event_type).or_insert((0, None));
            entry.0 += n;
            entry.1 = match (entry.1, oldest) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        match last_seq {
            Some(seq) if rows >= cap => self.cursor = Some(seq),
            _ => {
                let multi = self.cursor.is_some();
                self.last = Some((std::mem::take(&mut self.partial), multi));
                self.cursor = None;
                self.end = None;
            }
        }
    }

    /// The figure to report, and whether it is other than one exact count of this moment.
    fn report(&self) -> (TypeCounts, bool) {
        let total = |c: &TypeCounts| c.values().map(|(n, _)| n).sum::<u64>();
        match &self.last {
            Some((last, multi)) if self.cursor.is_none() || total(last) >= total(&self.partial) => {
                (last.clone(), *multi || self.cursor.is_some())
            }
            _ => (self.partial.clone(), true),
        }
    }
}

impl PostgresStore {
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

    /// Step 1 of an ordered claim: locks up to `limit` ready heads, oldest first. The window over the
    /// first ready rows finds them in the common case; when it was full and yielded fewer than
    /// `limit` (other relays hold the heads in it, or it holds one aggregate's backlog behind a
    /// backing-off head), skip scans over the aggregates find the others.
    async fn claim_heads(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
    ) -> Result<Vec<Head>, Error> {
        let window = heads_window(limit);
        let rows = sqlx::query(&self.sql.claim_heads)
            .bind(limit)
            .bind(window)
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
        if window_rows < window || heads.len() as i64 >= limit {
            return Ok(heads);
        }
        let started = std::time::Instant::now();
        let resting = self
            .skip_rest_until
            .lock()
            .is_ok_and(|until| until.is_some_and(|t| started < t));
        if resting {
            return Ok(heads);
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
        Ok(heads)
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Batch, Error> {
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
                let heads = self.claim_heads(&mut tx, limit).await?;
                if heads.is_empty() {
                    Vec::new()
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

    async fn stats(&self) -> Result<StoreStats, Error> {
        // One call at a time per store, so that chunks follow each other.
        let mut passes = self.stats_passes.lock().await;
        let mut tx = self.stats_transaction().await?;
        let (pending_pass, dead_pass) = &mut *passes;
        self.count_chunk(&mut tx, false, pending_pass).await?;
        self.count_chunk(&mut tx, true, dead_pass).await?;
        self.finish_stats(tx, pending_pass.report(), dead_pass.report())
            .await
    }

    async fn check(&self) -> Result<(), Error> {
        sqlx::query(&format!("SELECT 1 FROM {} LIMIT 0", self.table.qualified()))
            .execute(&self.pool)
            .await
            .map_err(|e| map_sqlx("check", e))?;
        Ok(())
    }
}

struct EmptyLease;

#[async_trait]
impl Lease for EmptyLease {
    async fn settle(self: Box<Self>, _settlements: Vec<Settlement>) -> Result<(), Error> {
        Ok(())
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

/// A claimed batch: the claiming transaction holds the row locks until it commits or rolls back
/// (including when the connection drops or the process dies).
struct PgLease {
    tx: Transaction<'static, Postgres>,
    ids: Vec<Uuid>,
    sql: Arc<Sql>,
    pool: PgPool,
    /// How the batch was claimed: what owning a row means for a lost lease's settle.
    ordering: OrderingPolicy,
}

/// The settlement statement's arguments.
#[derive(Default)]
struct SettleArgs {
    published: Vec<Uuid>,
    r_ids: Vec<Uuid>,
    r_attempts: Vec<i32>,
    r_delay: Vec<i64>,
    r_err: Vec<String>,
    d_ids: Vec<Uuid>,
    d_attempts: Vec<i32>,
    d_err: Vec<String>,
}

impl SettleArgs {
    fn new(settlements: Vec<Settlement>, mine: &HashSet<Uuid>) -> Self {
        let mut a = SettleArgs::default();
        for s in settlements {
            if !mine.contains(&s.id) {
                continue;
            }
            match s.action {
                Action::Published => a.published.push(s.id),
                Action::Retry {
                    attempts,
                    delay,
                    error,
                } => {
                    a.r_ids.push(s.id);
                    a.r_attempts
                        .push(i32::try_from(attempts).unwrap_or(i32::MAX));
                    a.r_delay
                        .push(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
                    a.r_err.push(error);
                }
                Action::DeadLetter { attempts, error } => {
                    a.d_ids.push(s.id);
                    a.d_attempts
                        .push(i32::try_from(attempts).unwrap_or(i32::MAX));
                    a.d_err.push(error);
                }
                Action::Release => {}
            }
        }
        a
    }

    fn is_empty(&self) -> bool {
        self.published.is_empty() && self.r_ids.is_empty() && self.d_ids.is_empty()
    }

    fn ids(&self) -> Vec<Uuid> {
        let mut all = self.published.clone();
        all.extend(&self.r_ids);
        all.extend(&self.d_ids);
        all
    }

    /// Keeps only the rows in `free`.
    fn retain(&mut self, free: &HashSet<Uuid>) {
        let all = std::mem::take(self);
        self.published = all
            .published
            .into_iter()
            .filter(|id| free.contains(id))
            .collect();
        let retried = all
            .r_ids
            .into_iter()
            .zip(all.r_attempts)
            .zip(all.r_delay)
            .zip(all.r_err);
        for (((id, attempts), delay), error) in
            retried.filter(|(((id, _), _), _)| free.contains(id))
        {
            self.r_ids.push(id);
            self.r_attempts.push(attempts);
            self.r_delay.push(delay);
            self.r_err.push(error);
        }
        let dead = all.d_ids.into_iter().zip(all.d_attempts).zip(all.d_err);
        for ((id, attempts), error) in dead.filter(|((id, _), _)| free.contains(id)) {
            self.d_ids.push(id);
            self.d_attempts.push(attempts);
            self.d_err.push(error);
        }
    }

    async fn apply(&self, sql: &Sql, conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(&sql.settle)
            .bind(&self.published)
            .bind(&self.r_ids)
            .bind(&self.r_attempts)
            .bind(&self.r_delay)
            .bind(&self.r_err)
            .bind(&self.d_ids)
            .bind(&self.d_attempts)
            .bind(&self.d_err)
            .execute(conn)
            .await
            .map(|_| ())
    }
}

/// Settles a lost lease's outcomes outside it (the claiming session died: killed, timed out, or its
/// connection dropped, so its locks are gone), in a transaction of its own, for what it can own again
/// as a claim would: under per-aggregate ordering, each of its aggregates whose head (oldest
/// unprocessed row) is one of its rows and no other lease holds (that head is locked, and the lease's
/// rows of the aggregate are settled); unordered, each of its rows no other lease holds. What another
/// lease took since is left to it. Without this, an event whose every publish outlived its lease
/// would be retried for ever with its attempts never counted, and published events would all be sent
/// again. Returns how many rows were settled.
async fn settle_lost_lease(
    pool: &PgPool,
    sql: &Sql,
    ordering: OrderingPolicy,
    mut args: SettleArgs,
) -> Result<usize, Error> {
    let map = |e| map_sqlx("settle", e);
    let mut tx = pool.begin().await.map_err(map)?;
    let lock = match ordering {
        OrderingPolicy::PerAggregate => &sql.lock_free,
        OrderingPolicy::Unordered => &sql.lock_free_rows,
    };
    let free: HashSet<Uuid> = sqlx::query_scalar::<_, Uuid>(lock)
        .bind(args.ids())
        .fetch_all(&mut *tx)
        .await
        .map_err(map)?
        .into_iter()
        .collect();
    args.retain(&free);
    if args.is_empty() {
        tx.rollback().await.map_err(map)?;
        return Ok(0);
    }
    args.apply(sql, &mut tx).await.map_err(map)?;
    tx.commit().await.map_err(map)?;
    Ok(free.len())
}

#[async_trait]
impl Lease for PgLease {
    async fn settle(self: Box<Self>, settlements: Vec<Settlement>) -> Result<(), Error> {
        let PgLease {
            mut tx,
            ids,
            sql,
            pool,
            ordering,
        } = *self;
        let mine: HashSet<Uuid> = ids.into_iter().collect();
        let args = SettleArgs::new(settlements, &mine);
        if args.is_empty() {
            return tx.rollback().await.map_err(|e| map_sqlx("settle", e));
        }
        let settled = match args.apply(&sql, &mut tx).await {
            Ok(()) => tx.commit().await,
            Err(e) => Err(e),
        };
        match settled.map_err(|e| map_sqlx("settle", e)) {
            Ok(()) => Ok(()),
            Err(lost) if lost.kind() == ErrorKind::Connection => {
                let total = args.ids().len();
                match settle_lost_lease(&pool, &sql, ordering, args).await {
                    Ok(n) => {
                        tracing::warn!(
                            error = %lost,
                            settled = n,
                            of = total,
                            "the batch's lease was lost (its database session ended); settled the rows no other lease holds"
                        );
                        Ok(())
                    }
                    Err(e) => Err(lost.with_context("settle_outside_lease", e.to_string())),
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        self.tx.rollback().await.map_err(|e| map_sqlx("release", e))
    }
}

/// Which dead letters an operation applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterFilter {
    /// These ids.
    Ids(Vec<Uuid>),
    /// Every dead letter of this event type.
    EventType(String),
    /// Every dead letter.
    All,
}

impl DeadLetterFilter {
    fn clause(&self) -> &'static str {
        match self {
            DeadLetterFilter::Ids(_) => "id = ANY($1::uuid[])",
            DeadLetterFilter::EventType(_) => "event_type = $1",
            DeadLetterFilter::All => "($1::text IS NULL)",
        }
    }

    fn bind<'q>(
        &'q self,
        q: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    ) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
        match self {
            DeadLetterFilter::Ids(ids) => q.bind(ids),
            DeadLetterFilter::EventType(t) => q.bind(t),
            DeadLetterFilter::All => q.bind(None::<String>),
        }
    }
}

/// A dead-lettered event, as listed for operators.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Event id.
    pub id: Uuid,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Event type.
    pub event_type: String,
    /// Attempts made.
    pub attempts: i32,
    /// The last error.
    pub last_error: Option<String>,
    /// When the event was written.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub dead_lettered_at: Option<DateTime<Utc>>,
}

impl PostgresStore {
    /// Lists dead letters, oldest first, at most `limit`.
    ///
    /// # Errors
    /// A database error.
    pub async fn dead_letters(
        &self,
        filter: &DeadLetterFilter,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, Error> {
        let sql = format!(
            "SELECT id, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, dead_lettered_at
             FROM {} WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL AND {}
             ORDER BY seq LIMIT $2",
            self.table.qualified(),
            filter.clause()
        );
        let rows = filter
            .bind(sqlx::query(&sql))
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| map_sqlx("dead_letters", e))?;
        rows.iter()
            .map(|r| DeadLetter::from_row(r).map_err(|e| map_sqlx("dead_letters", e)))
            .collect()
    }

    /// Makes matching dead letters pending again, with attempts reset (the last error is kept), and
    /// returns how many.
    ///
    /// # Errors
    /// A database error.
    pub async fn retry_dead_letters(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        let change = format!(
            "UPDATE {} SET dead_lettered_at = NULL, attempts = 0, retry_after = NULL",
            self.table.qualified()
        );
        self.change_dead_letters("retry_dead_letters", &change, filter)
            .await
    }

    /// Deletes matching dead letters for good and returns how many. Under per-aggregate ordering this
    /// lets the later events of their aggregates flow.
    ///
    /// # Errors
    /// A database error.
    pub async fn discard_dead_letters(&self, filter: &DeadLetterFilter) -> Result<u64, Error> {
        let change = format!("DELETE FROM {}", self.table.qualified());
        self.change_dead_letters("discard_dead_letters", &change, filter)
            .await
    }

    /// Runs `change` (an UPDATE or DELETE without WHERE) on the dead letters matching `filter`.
    async fn change_dead_letters(
        &self,
        operation: &'static str,
        change: &str,
        filter: &DeadLetterFilter,
    ) -> Result<u64, Error> {
        let sql = format!(
            "{change} WHERE dead_lettered_at IS NOT NULL AND processed_at IS NULL AND {}",
            filter.clause()
        );
        let done = filter
            .bind(sqlx::query(&sql))
            .execute(&self.pool)
            .await
            .map_err(|e| map_sqlx(operation, e))?;
        Ok(done.rows_affected())
    }

    /// Deletes processed rows older than `older_than`, `batch_size` rows per statement (each its own
    /// short transaction, so vacuum and writers are never held up), calling `progress` with the running
    /// total after each batch. Returns the total. Pending rows and dead letters are never touched.
    ///
    /// # Errors
    /// A database error, or [`ErrorKind::Config`] for a zero batch size.
    pub async fn cleanup(
        &self,
        older_than: std::time::Duration,
        batch_size: i64,
        mut progress: impl FnMut(u64) + Send,
    ) -> Result<u64, Error> {
        if batch_size <= 0 {
            return Err(Error::new(
                ErrorKind::Config,
                format!("cleanup batch size = {batch_size}: expected a positive number"),
            ));
        }
        let t = self.table.qualified();
        let sql = format!(
            "DELETE FROM {t} WHERE id IN (
                SELECT id FROM {t}
                WHERE processed_at IS NOT NULL AND processed_at < now() - $1 * interval '1 millisecond'
                ORDER BY processed_at LIMIT $2)"
        );
        let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0u64;
        loop {
            let n = sqlx::query(&sql)
                .bind(ms)
                .bind(batch_size)
                .execute(&self.pool)
                .await
                .map_err(|e| map_sqlx("cleanup", e))?
                .rows_affected();
            if n == 0 {
                break;
            }
            total += n;
            progress(total);
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_passes_report_the_last_complete_count_or_a_larger_partial_one() {
        let chunk = |n: u64| TypeCounts::from([("t".to_string(), (n, Some(1.0)))]);
        let total = |c: &TypeCounts| c.values().map(|(n, _)| n).sum::<u64>();
        let mut p = CountPass::default();
        p.add(chunk(5), 5, Some(9), 10);
        assert_eq!(p.report().0, chunk(5), "under a chunk: exact at once");
        assert!(!p.report().1);
        p.add(chunk(10), 10, Some(20), 10);
        assert_eq!(
            total(&p.report().0),
            10,
            "a larger partial pass shows at once"
        );
        assert!(p.report().1);
        p.add(chunk(10), 10, Some(30), 10);
        p.add(chunk(3), 3, Some(33), 10);
        let (c, estimated) = p.report();
        assert_eq!((total(&c), estimated), (23, true), "a pass of three chunks");
        p.add(chunk(10), 10, Some(10), 10);
        assert_eq!(
            total(&p.report().0),
            23,
            "the next pass, smaller so far, waits"
        );
        p.add(chunk(0), 0, None, 10);
        assert_eq!(total(&p.report().0), 10);
    }

    #[test]
    fn headers_parse_leniently() {
        assert_eq!(
            parse_headers(r#"{"a":"x","n":3}"#),
            BTreeMap::from([
                ("a".to_string(), "x".to_string()),
                ("n".to_string(), "3".to_string())
            ])
        );
        assert!(parse_headers("[1,2]").is_empty());
        assert!(parse_headers("not json").is_empty());
    }

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
