//! The statements of a store, built once for its table and retention ([`Retention`] picks the
//! form of the settling statement).
//!
//! # Ordered claims
//! Ordered claims own partitions of the aggregates (see [`CLAIM_PARTITIONS`]): a claim first takes
//! partitions (`claim_partitions`), then reads the oldest ready events of the partitions it holds
//! (`claim_owned`, a new statement and so a fresh snapshot taken after the locks: a lease that held
//! one of them and has just committed is seen settled). Every ordered lease holds the partitions of
//! its events until it ends, so an event read under the lock is in no other lease, nor is any
//! earlier event of its aggregate: the claim needs no row lock and no per-event check that the
//! event is its aggregate's oldest, only that no earlier event of its aggregate is held back
//! (`held_back`).
//!
//! Which partitions `claim_partitions` takes: those of the aggregates of the first $2 ready events
//! in seq order (the window) that are not held back, in the order of their first event, each tried
//! with `pg_try_advisory_xact_lock` (one taken by another lease is passed over), until those taken
//! hold $1 aggregates of the window (a batch of one event of each: the fewest publisher calls) or
//! about $3 bytes (counting one event per aggregate); with $4 (a sharing claim, for a publisher
//! that takes an aggregate's run in one call), $1 events of the window and their bytes instead: a
//! batch from as few aggregates as fill it. A claim thus takes what fills a batch with the oldest
//! events it can have, and leaves the rest to other leases (a relay's next batch, other relays);
//! held-back aggregates count for nothing. The statement returns how many events the window held,
//! the partitions taken, the first partition with a claimable aggregate that another lease holds
//! (the one to wait for when none could be taken), and how many claimable aggregates the window
//! held.
//!
//! # The owned read
//! Among the first $3 ready events in seq order (a bound on the rows read, whatever the backlog;
//! the scan stops as soon as the batch is full), the owned read takes those of the claim's
//! partitions ($1) not held back, the first $2 of them, cut to the byte budget ($4) by their
//! recorded sizes before any payload is read (the first event always: an event larger than the
//! budget goes alone). Seq order keeps each aggregate's events a prefix of its run. The first
//! column tells, when the batch is not full, whether the scan reached its bound (so events may lie
//! beyond it: the skip scan's case).
//!
//! The wide form, for backlogs written in runs (several events of an aggregate one after another,
//! or one busy aggregate): it looks at twice as many events and cuts the batch by position in the
//! runs (every aggregate's first event, then every second one...), so a batch spreads over as many
//! aggregates as it can (a publisher that sends an aggregate's later events one call apart then
//! needs few calls); it also returns the longest run among the events it looked at, for the store
//! to choose the form of the next claim.
//!
//! # The runs behind the skip scans' heads
//! Each aggregate's run is read from its index in seq order and cut at $4 rows, so the cost of a
//! claim follows the batch size, not the length of the backlog behind each head. The batch is cut
//! at $3 rows by position in the run first (every head's first row, then every second row...), so
//! every aggregate found has its turn, and a batch spreads over as many aggregates as it can (a
//! publisher that sends an aggregate's later events one call apart then sends most batches in one
//! call). The store puts the rows back in seq order.
//!
//! The byte budget ($5) is applied before any payload is read: the rows are first chosen by their
//! recorded sizes (`PAYLOAD_SIZE`), then only the chosen ones are fetched by address. The cut keeps
//! the rows up to the last whose running total stays within the budget (the first row always when
//! $6: an event larger than the budget goes alone; not when the owned read already filled part of
//! the batch, whose budget this is the rest of), in the batch's order, so each aggregate keeps a
//! prefix of its run.

use crate::row::EVENT_COLUMNS;
use crate::table::OutboxTable;

/// What happens to a row once its event is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Retention {
    /// Delete it in the settling statement (the default: cheapest, keeps the table small).
    #[default]
    Delete,
    /// Keep it with `processed_at` set; remove it later with
    /// [`PostgresStore::cleanup`](crate::PostgresStore::cleanup).
    Keep,
}

pub(super) struct Sql {
    /// Takes the claim's partitions (see [`CLAIM_PARTITIONS`]).
    pub(super) claim_partitions: String,
    /// Takes again those of a kept set of partitions that are free.
    pub(super) retake_partitions: String,
    /// Waits for a partition (see `PostgresStore::wait_for_partition`).
    pub(super) wait_partition: String,
    /// Reads the oldest ready events of the claim's partitions.
    pub(super) claim_owned: String,
    /// The same, spread over as many aggregates as it can (for backlogs written in runs).
    pub(super) claim_owned_wide: String,
    pub(super) claim_skip_first: String,
    pub(super) claim_skip_after: String,
    pub(super) claim_runs: String,
    pub(super) claim_unordered: String,
    pub(super) settle: String,
    /// Takes the partitions of a lost lease's rows that no other lease holds (see `PgLease::settle`).
    pub(super) lock_lost_partitions: String,
    /// Returns the lost lease's rows still unprocessed in the partitions taken.
    pub(super) lock_free: String,
    /// The same for unordered claims: locks the lost lease's rows no other lease holds.
    pub(super) lock_free_rows: String,
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

/// How many partitions the aggregates are hashed into for ordered claims. A claim owns the
/// partitions it takes (a transaction-scoped advisory lock each, held by the claim's transaction,
/// which is the batch's lease) and reads events only from them: no other lease can hold an
/// event of those aggregates meanwhile.
pub(super) const CLAIM_PARTITIONS: i32 = 256;

/// The partition of the aggregate of the row aliased `a`: a hash of its type and id, the same in
/// every relay (computed by the server: `hashtextextended` is stable across PostgreSQL versions).
pub(super) fn partition_of(a: &str) -> String {
    format!(
        "(hashtextextended({a}.aggregate_id, hashtextextended({a}.aggregate_type, 0)) & {})::int",
        CLAIM_PARTITIONS - 1
    )
}

/// The first key of the claim's partition locks for `table` (the partition is the second), so
/// that two outbox tables' relays never wait for each other. A 32-bit FNV-1a hash of the qualified
/// name: the same in every relay process and version. (The writer-order trigger's locks take one
/// 64-bit key, a space of their own.)
pub(super) fn partition_lock_key(table: &OutboxTable) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in format!("outbox.claim {}", table.qualified()).bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    i32::from_ne_bytes(h.to_ne_bytes())
}

/// The row aliased `a` is held back: an earlier unprocessed event of its aggregate is dead-lettered
/// or backing off (its `retry_after` not yet reached at the claim's start, `now()`). A point lookup
/// on the partial index `<table>_blocked_idx`, which holds only such rows (and those whose backoff
/// is over), so it stays small.
pub(super) fn held_back(t: &str, a: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM {t} b
                 WHERE b.aggregate_type = {a}.aggregate_type AND b.aggregate_id = {a}.aggregate_id
                   AND b.processed_at IS NULL AND (b.dead_lettered_at IS NOT NULL OR b.retry_after IS NOT NULL)
                   AND b.seq < {a}.seq
                   AND (b.dead_lettered_at IS NOT NULL OR b.retry_after > now()))"
    )
}

/// Ready, as of the claim's start (`now()`, the time [`held_back`] uses: one instant for both, so
/// that an event is never taken while an earlier one of its aggregate is judged not yet due).
pub(super) const READY_AT_START: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL
      AND (e.retry_after IS NULL OR e.retry_after <= now())";

pub(super) const READY: &str = "e.processed_at IS NULL AND e.dead_lettered_at IS NULL
      AND (e.retry_after IS NULL OR e.retry_after <= clock_timestamp())";

impl Sql {
    pub(super) fn new(table: &OutboxTable, retention: Retention) -> Self {
        let t = table.qualified();
        let key = partition_lock_key(table);
        let part_e = partition_of("e");
        let part_w = partition_of("w");
        // Takes the claim's partitions: those of the window's oldest claimable events, until they
        // fill a batch (see the module's documentation, "Ordered claims").
        let claim_partitions = format!(
            "WITH RECURSIVE w AS MATERIALIZED (
                SELECT e.seq, e.aggregate_type, e.aggregate_id, {part_e} AS part, {PAYLOAD_SIZE} AS size
                FROM {t} e WHERE {READY_AT_START} ORDER BY e.seq LIMIT $2),
            ord AS MATERIALIZED (
                SELECT array_agg(p.part ORDER BY p.first) AS parts, array_agg(p.n ORDER BY p.first) AS ns,
                       array_agg(p.fill ORDER BY p.first) AS fills, array_agg(p.bytes ORDER BY p.first) AS bytes
                FROM (SELECT a.part, min(a.first) AS first, count(*) AS n,
                             CASE WHEN $4 THEN sum(a.rows)::bigint ELSE count(*) END AS fill,
                             sum(CASE WHEN $4 THEN a.all_bytes ELSE a.bytes END) AS bytes
                      FROM (SELECT w.part, min(w.seq) AS first, count(*) AS rows, min(w.size) AS bytes,
                                   sum(w.size) AS all_bytes
                            FROM w WHERE NOT {held_w}
                            GROUP BY w.part, w.aggregate_type, w.aggregate_id) a
                      GROUP BY a.part) p),
            walk(i, events, bytes, part, taken) AS (
                SELECT 0, 0::bigint, 0::numeric, NULL::int, false
                UNION ALL
                SELECT walk.i + 1,
                       walk.events + CASE WHEN l.taken THEN ord.fills[walk.i + 1] ELSE 0 END,
                       walk.bytes + CASE WHEN l.taken THEN ord.bytes[walk.i + 1] ELSE 0 END,
                       ord.parts[walk.i + 1], l.taken
                FROM walk CROSS JOIN ord
                CROSS JOIN LATERAL (
                    SELECT pg_try_advisory_xact_lock({key}, ord.parts[walk.i + 1]) AS taken) l
                WHERE walk.events < $1 AND walk.bytes < $3 AND walk.i < cardinality(ord.parts))
            SELECT (SELECT count(*) FROM w) AS window_rows,
                   ARRAY(SELECT walk.part FROM walk WHERE walk.taken) AS parts,
                   (SELECT walk.part FROM walk WHERE NOT walk.taken AND walk.i > 0 ORDER BY walk.i LIMIT 1) AS busy,
                   (SELECT COALESCE(sum(n), 0)::bigint FROM ord, unnest(ord.ns) n) AS aggregates",
            held_w = held_back(&t, "w"),
        );
        // The owned read, narrow or wide (see the module's documentation, "The owned read"); the
        // first column tells whether its scan reached its bound (events may lie beyond it).
        let owned = |wide: bool| {
            let (take, pos, order, longest) = if wide {
                (
                    "$2 * 2",
                    ", row_number() OVER (PARTITION BY w.aggregate_type COLLATE \"C\", w.aggregate_id COLLATE \"C\" ORDER BY w.seq) AS pos",
                    "c.pos, c.seq",
                    "(SELECT COALESCE(max(c.pos), 0) FROM c)",
                )
            } else {
                ("$2", ", 1 AS pos", "c.seq", "1::bigint")
            };
            format!(
                "WITH c AS MATERIALIZED (
                    SELECT w.tid, w.seq, w.size {pos}
                    FROM (SELECT e.ctid AS tid, e.seq, e.aggregate_type, e.aggregate_id, {PAYLOAD_SIZE} AS size
                          FROM {t} e WHERE {READY_AT_START} ORDER BY e.seq LIMIT $3) w
                    WHERE {part_w} = ANY($1::int[]) AND NOT {held_w}
                    ORDER BY w.seq LIMIT {take}),
                b AS {b},
                k AS (
                    SELECT b.*, sum(b.size) OVER (ORDER BY {order_b} ROWS UNBOUNDED PRECEDING) AS upto,
                           row_number() OVER (ORDER BY {order_b}) AS n
                    FROM b)
                SELECT s.full, s.longest, k.seq, {EVENT_COLUMNS}
                FROM (SELECT (SELECT count(*) FROM b) < $2 AND EXISTS (
                          SELECT 1 FROM {t} e WHERE {READY_AT_START} ORDER BY e.seq OFFSET $3 - 1 LIMIT 1) AS full,
                             {longest} AS longest) s
                LEFT JOIN (k CROSS JOIN LATERAL (SELECT * FROM {t} x WHERE x.ctid = k.tid) e)
                  ON k.n = 1 OR k.upto <= $4
                ORDER BY k.seq",
                held_w = held_back(&t, "w"),
                order_b = order.replace("c.", "b."),
                b = if wide {
                    "MATERIALIZED (SELECT c.* FROM c ORDER BY c.pos, c.seq LIMIT $2)"
                } else {
                    "(SELECT c.* FROM c)"
                },
            )
        };
        let claim_owned = owned(false);
        let wait_partition = format!("SELECT pg_advisory_xact_lock({key}, $1)");
        let retake_partitions = format!(
            "SELECT ARRAY(SELECT p FROM unnest($1::int[]) p WHERE pg_try_advisory_xact_lock({key}, p))"
        );
        let claim_owned_wide = owned(true);
        // The skip scan, for when the owned read's scan is full of events it cannot take (held
        // back behind a failing event, or of partitions other leases hold): walks up to $2
        // aggregates with unprocessed rows, in key order from a cursor the store rotates, takes
        // each one's oldest unprocessed row (its head), and keeps the ready heads not already in
        // the batch ($3) whose partition the claim holds ($4) or can take. Its cost follows $2,
        // not the number of pending rows. Heads are taken in key order (the walk's), so that when
        // $1 cuts them the next cursor goes on after the last one taken. A head is judged in this
        // statement's snapshot, taken before some of the partitions were: the runs statement (a
        // fresh snapshot) keeps an aggregate only when its head is still its oldest unprocessed
        // event. The first columns tell how many aggregates were visited and the last one, for
        // the next cursor.
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
                    SELECT c.seq, c.aggregate_type, c.aggregate_id
                    FROM (
                        SELECT e.seq, e.aggregate_type, e.aggregate_id, {part_e} AS part
                        FROM {t} e
                        WHERE e.seq = ANY(ARRAY(SELECT seq FROM heads))
                          AND e.seq <> ALL($3::bigint[])
                          AND {READY}
                        ORDER BY e.aggregate_type, e.aggregate_id
                        OFFSET 0) c
                    WHERE c.part = ANY($4::int[]) OR pg_try_advisory_xact_lock({key}, c.part)
                    LIMIT $1
                ) h ON true
                ORDER BY h.aggregate_type, h.aggregate_id"
            )
        };
        let claim_skip_first = skip("");
        let claim_skip_after = skip("AND (a.aggregate_type, a.aggregate_id) > ($5, $6)");
        // The runs behind the skip scans' heads, cut to the batch by position in the runs and to
        // the byte budget by recorded sizes (see the module's documentation).
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
            WHERE (c.n = 1 AND $6) OR c.upto <= $5
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
        // An outcome never takes an event's attempts back: a lost lease's late outcome (settled
        // outside it, see `PgLease::settle`) leaves alone an event another lease has claimed,
        // failed and settled since, with a higher count.
        let settle = format!(
            "WITH published AS ({published}),
            retried AS (
                UPDATE {t} o
                SET attempts = u.attempts,
                    retry_after = clock_timestamp() + u.delay_ms * interval '1 millisecond',
                    last_error = u.error
                FROM UNNEST($2::uuid[], $3::int[], $4::bigint[], $5::text[]) AS u(id, attempts, delay_ms, error)
                WHERE o.id = u.id AND o.attempts <= u.attempts
            ),
            dead AS (
                UPDATE {t} o
                SET attempts = u.attempts, last_error = u.error, dead_lettered_at = now(), retry_after = NULL
                FROM UNNEST($6::uuid[], $7::int[], $8::text[]) AS u(id, attempts, error)
                WHERE o.id = u.id AND o.attempts <= u.attempts
            )
            SELECT 1"
        );
        // A lost lease's rows may be settled only where this transaction owns them as a claim
        // would: by taking their partitions (those another lease holds are left to it), then, in a
        // fresh snapshot, reading which of them are still unprocessed.
        let lock_lost_partitions = format!(
            "SELECT ARRAY(
                SELECT d.part FROM (
                    SELECT DISTINCT {part_e} AS part FROM {t} e
                    WHERE e.id = ANY($1::uuid[]) AND e.processed_at IS NULL) d
                WHERE pg_try_advisory_xact_lock({key}, d.part))"
        );
        let lock_free = format!(
            "SELECT e.id FROM {t} e
             WHERE e.id = ANY($1::uuid[]) AND e.processed_at IS NULL AND {part_e} = ANY($2::int[])"
        );
        // After the byte budget left some locked rows out of an unordered batch (and the claim rolled
        // back to its savepoint): lock again the rows the batch keeps, if still ready and free. One
        // that is not (another relay took it in between) leaves the batch.
        let relock_rows = format!(
            "SELECT e.id FROM {t} e WHERE e.id = ANY($1::uuid[]) AND {READY} FOR UPDATE SKIP LOCKED"
        );
        // Under unordered claims a lease locks its rows themselves; so does the lost lease's settle.
        let lock_free_rows = format!(
            "SELECT id FROM {t} WHERE id = ANY($1::uuid[]) AND processed_at IS NULL FOR UPDATE SKIP LOCKED"
        );
        Sql {
            relock_rows,
            lock_lost_partitions,
            lock_free,
            lock_free_rows,
            claim_partitions,
            claim_owned,
            claim_owned_wide,
            wait_partition,
            retake_partitions,
            claim_skip_first,
            claim_skip_after,
            claim_runs,
            claim_unordered,
            settle,
        }
    }
}
