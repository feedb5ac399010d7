//! The benchmark's schema work: statements run as they are, emptying a table, the events'
//! payloads, and the pre-filled backlogs the drain and claim phases start from.

use sqlx::PgPool;

use txoutbox_core::Error;
use txoutbox_postgres::{map_sqlx, OutboxTable};

use super::options::BenchOptions;

pub(super) async fn exec(pool: &PgPool, sql: &str) -> Result<(), Error> {
    sqlx::query(sql)
        .execute(pool)
        .await
        .map_err(|e| map_sqlx("bench", e))?;
    Ok(())
}

pub(super) async fn truncate(pool: &PgPool, table: &OutboxTable) -> Result<(), Error> {
    exec(pool, &format!("TRUNCATE {}", table.qualified())).await
}

pub(super) fn payload(n: u64, pad: usize) -> serde_json::Value {
    serde_json::json!({ "order_id": n, "total": n % 1000, "pad": "x".repeat(pad) })
}

/// Inserts `count` events over `o.aggregates` aggregates in one statement per million rows (per
/// 2,000 rows over more than 2,000 aggregates), with time-ordered ids (as the writer's UUID v7),
/// then analyzes the table. `fill` keeps ids of different fills apart.
/// With `tx_rows`, that many rows per transaction instead (the WAL source reads a transaction
/// whole: a backlog written as writers write it, in small transactions).
pub(super) async fn prefill(
    pool: &PgPool,
    table: &OutboxTable,
    count: u64,
    o: &BenchOptions,
    processed: bool,
    fill: u32,
    tx_rows: Option<u64>,
) -> Result<(), Error> {
    let sql = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, processed_at)
         SELECT (lpad(to_hex($1::bigint), 8, '0') || '-0000-7000-8000-' || lpad(to_hex(g), 12, '0'))::uuid,
                'bench', 'a' || (g % $2), 'bench.event',
                jsonb_build_object('order_id', g, 'total', g % 1000, 'pad', repeat('x', $3)),
                CASE WHEN $4 THEN now() END
         FROM generate_series($5::bigint, $6::bigint) g",
        table.qualified()
    );
    // Each row takes its aggregate's transaction-scoped lock (the writer-order trigger): a
    // statement writing more distinct aggregates than the server's lock table holds fails with
    // "out of shared memory", so a fill over many aggregates goes a few thousand rows at a time.
    let chunk = match tx_rows {
        Some(rows) => rows.max(1),
        None if o.aggregates <= 2_000 => 1_000_000u64,
        None => 2_000,
    };
    let mut from = 1u64;
    while from <= count {
        let to = (from + chunk - 1).min(count);
        sqlx::query(&sql)
            .bind(i64::from(fill))
            .bind(o.aggregates as i64)
            .bind(o.payload_bytes as i32)
            .bind(processed)
            .bind(from as i64)
            .bind(to as i64)
            .execute(pool)
            .await
            .map_err(|e| map_sqlx("bench prefill", e))?;
        from = to + 1;
    }
    exec(pool, &format!("VACUUM ANALYZE {}", table.qualified())).await
}
