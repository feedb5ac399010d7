//! The statements of a store, built once for its table and retention.

use crate::table::OutboxTable;

use super::{Retention, EVENT_COLUMNS};

pub(super) struct Sql {
    pub(super) claim_heads: String,
    pub(super) claim_skip_first: String,
    pub(super) claim_skip_after: String,
    pub(super) claim_runs: String,
    pub(super) claim_unordered: String,
    pub(super) settle: String,
    /// Locks the heads of a lost lease's aggregates that no other lease holds, and returns the
    /// lease's rows of those aggregates (see `PgLease::settle`).
    pub(super) lock_free: String,
    /// The same for unordered claims: locks the lost lease's rows no other lease holds.
    pub(super) lock_free_rows: String,
    /// Locks again the heads a budget-cut batch keeps (see [`CLAIM_LOCKS`]).
    pub(super) relock_heads: String,
    /// Locks again the rows a budget-cut unordered batch keeps.
    pub(super) relock_rows: String,
}

/// A row's payload size in bytes, as the byte budget counts it: recorded at insert (migration
/// `20261205000001_payload_size.sql`), else (rows written before it) the payload's stored size, which
/// for a compressed JSON payload is smaller than the payload itself.
pub(super) const PAYLOAD_SIZE: &str =
    "COALESCE(e.payload_size, octet_length(e.payload_bytes), pg_column_size(e.payload))::bigint";

/// Pending rows (the statistics' first kind), as the partial index `<table>_pending_idx` holds them.
pub(super) const PENDING: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL";

/// Dead letters, as the partial index `<table>_dead_idx` holds them.
pub(super) const DEAD: &str = "e.dead_lettered_at IS NOT NULL AND e.processed_at IS NULL";

pub(super) const READY: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL
      AND (e.retry_after IS NULL OR e.retry_after <= clock_timestamp())";

impl Sql {
    pub(super) fn new(table: &OutboxTable, retention: Retention) -> Self {
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
        // When the locked heads fill the batch ($1 of them) within the byte budget ($3, counted from
        // their recorded sizes), they are the batch (a batch cut by position in the runs takes every
        // head's first event before any second one): they come back whole (`fits`), and the runs
        // statement is not needed. Otherwise no payload or headers leave the server: the heads are
        // returned by key, and the runs statement reads what fits the budget.
        let claim_heads = format!(
            "WITH w AS MATERIALIZED (
                SELECT e.ctid AS tid, e.seq, e.aggregate_type, e.aggregate_id
                FROM {t} e WHERE {READY} ORDER BY e.seq LIMIT $2),
            firsts AS MATERIALIZED (
                SELECT DISTINCT ON (w.aggregate_type COLLATE \"C\", w.aggregate_id COLLATE \"C\") w.tid, w.seq
                FROM w ORDER BY w.aggregate_type COLLATE \"C\", w.aggregate_id COLLATE \"C\", w.seq)
            SELECT e.window_rows, e.seq, e.fits, {EVENT_COLUMNS}
            FROM (
              SELECT r.window_rows, r.seq, r.fits, r.id, r.aggregate_type, r.aggregate_id, r.event_type,
                     CASE WHEN r.fits THEN r.payload END AS payload,
                     CASE WHEN r.fits THEN r.payload_bytes END AS payload_bytes,
                     r.content_type,
                     CASE WHEN r.fits THEN r.headers END AS headers,
                     r.destination, r.created_at, r.attempts
              FROM (
                SELECT (SELECT count(*) FROM w) AS window_rows, h.*,
                       (count(h.seq) OVER () = $1 AND COALESCE(sum(h.size) OVER (), 0) <= $3) AS fits
                FROM (SELECT 1) one
                LEFT JOIN LATERAL (
                SELECT l.*
                FROM (SELECT f.tid, f.seq FROM firsts f ORDER BY f.seq) c
                CROSS JOIN LATERAL (
                    SELECT e.seq, {PAYLOAD_SIZE} AS size, e.id, e.aggregate_type, e.aggregate_id,
                           e.event_type, e.payload, e.payload_bytes, e.content_type, e.headers,
                           e.destination, e.created_at, e.attempts
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
                ) h ON true
              ) r
            ) e"
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
