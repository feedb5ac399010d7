//! The writer phase: business transactions per second without the outbox insert, with it, and
//! with the variants that price its parts (one more round trip, the ordering rule, a table-less
//! event), in alternating runs.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::time::Instant;

use txoutbox_core::{Error, ErrorKind, NewEvent};
use txoutbox_postgres::{connect, map_sqlx, OutboxTable, Writer};

use super::fill::{exec, payload};
use super::instruments::join;
use super::options::BenchOptions;
use super::report::{ratio, WriterFigures};

pub(super) async fn writer_phase(
    url: &str,
    admin: &PgPool,
    table: &OutboxTable,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<WriterFigures, Error> {
    let orders = format!("{}.bench_orders", o.schema);
    exec(
        admin,
        &format!(
            "CREATE TABLE {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             customer text NOT NULL, total bigint NOT NULL, body jsonb NOT NULL)"
        ),
    )
    .await?;
    let pool = connect(url, o.writers as u32).await?;
    let (mut without, mut with, mut noop, mut unordered, mut message, mut in_statement) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    let trigger = format!(
        "ALTER TABLE {} {{}} TRIGGER \"{}_writer_order\"",
        table.qualified(),
        table.table()
    );
    // Alternating runs, so that drift in the machine's state affects every variant alike.
    for round in 1..=2 {
        for extra in [
            Extra::None,
            Extra::Outbox,
            Extra::Noop,
            Extra::OutboxUnordered,
            Extra::Message,
            Extra::MessageInStatement,
        ] {
            exec(admin, &format!("TRUNCATE {orders}, {}", table.qualified())).await?;
            let unordered_run = matches!(extra, Extra::OutboxUnordered);
            if unordered_run {
                exec(admin, &trigger.replace("{}", "DISABLE")).await?;
            }
            let run = writer_run(&pool, &orders, table, o, extra).await;
            if unordered_run {
                exec(admin, &trigger.replace("{}", "ENABLE")).await?;
            }
            let tps = run?;
            progress(&format!(
                "writer: round {round}, {}: {tps:.0} tx/s",
                extra.label()
            ));
            match extra {
                Extra::None => without += tps / 2.0,
                Extra::Outbox => with += tps / 2.0,
                Extra::Noop => noop += tps / 2.0,
                Extra::OutboxUnordered => unordered += tps / 2.0,
                Extra::Message => message += tps / 2.0,
                Extra::MessageInStatement => in_statement += tps / 2.0,
            }
        }
    }
    pool.close().await;
    Ok(WriterFigures {
        writers: o.writers,
        without_outbox_tps: without,
        with_outbox_tps: with,
        overhead: ratio(with, without).map_or(0.0, |r| 1.0 - r),
        with_noop_statement_tps: noop,
        noop_statement_overhead: ratio(noop, without).map_or(0.0, |r| 1.0 - r),
        with_outbox_without_ordering_tps: unordered,
        ordering_rule_overhead: ratio(with, unordered).map_or(0.0, |r| 1.0 - r),
        with_message_tps: message,
        message_overhead: ratio(message, without).map_or(0.0, |r| 1.0 - r),
        with_message_in_statement_tps: in_statement,
        message_in_statement_overhead: ratio(in_statement, without).map_or(0.0, |r| 1.0 - r),
    })
}

/// What a writer run adds to each business transaction.
#[derive(Debug, Clone, Copy)]
enum Extra {
    None,
    Outbox,
    /// `SELECT 1`: the cost of one more statement round trip alone.
    Noop,
    /// The outbox insert with the writer-order trigger disabled.
    OutboxUnordered,
    /// A table-less event (a transactional logical decoding message) instead of the insert.
    Message,
    /// The table-less event written by the business statement itself.
    MessageInStatement,
}

impl Extra {
    fn label(self) -> &'static str {
        match self {
            Extra::None => "without outbox",
            Extra::Outbox => "with outbox",
            Extra::Noop => "with SELECT 1",
            Extra::OutboxUnordered => "with outbox, no ordering trigger",
            Extra::Message => "with a table-less event",
            Extra::MessageInStatement => "with a table-less event in the business statement",
        }
    }
}

async fn writer_run(
    pool: &PgPool,
    orders: &str,
    table: &OutboxTable,
    o: &BenchOptions,
    extra: Extra,
) -> Result<f64, Error> {
    let prefix = format!("{}-bench", o.schema);
    let insert = Arc::<str>::from(match extra {
        // What a plain-SQL writer of table-less events would write: the business row and its event
        // in one statement.
        Extra::MessageInStatement => format!(
            "WITH o AS (INSERT INTO {orders} (customer, total, body) VALUES ($1, $2, $3::jsonb) RETURNING id)
             SELECT o.id FROM o, LATERAL (SELECT pg_logical_emit_message(true, '{prefix}',
                 json_build_object('aggregate_type', 'order', 'aggregate_id', o.id::text,
                                   'event_type', 'order.created', 'payload', $3::jsonb)::text)) m"
        ),
        _ => format!(
            "INSERT INTO {orders} (customer, total, body) VALUES ($1, $2, $3::jsonb) RETURNING id"
        ),
    });
    let writer = Writer::new(table.clone());
    // A prefix of the benchmark's own: no outbox's reader takes these messages.
    let messages = txoutbox_postgres::wal::MessageWriter::new(prefix, table);
    let started = Instant::now();
    let deadline = started + o.writer_duration;
    let mut tasks = Vec::new();
    for w in 0..o.writers {
        let (pool, insert, writer, messages, pad) = (
            pool.clone(),
            insert.clone(),
            writer.clone(),
            messages.clone(),
            o.payload_bytes,
        );
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            while Instant::now() < deadline {
                let n = done * 64 + w as u64;
                let body = payload(n, pad);
                let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
                let id: i64 = sqlx::query_scalar(&insert)
                    .bind(format!("customer-{}", n % 1000))
                    .bind((n % 1000) as i64)
                    .bind(body.to_string())
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(|e| map_sqlx("bench", e))?;
                match extra {
                    Extra::None | Extra::MessageInStatement => {}
                    Extra::Outbox | Extra::OutboxUnordered => {
                        writer
                            .enqueue(
                                &mut tx,
                                NewEvent::new("order", id.to_string(), "order.created", body),
                            )
                            .await?;
                    }
                    Extra::Message => {
                        messages
                            .emit(
                                &mut tx,
                                NewEvent::new("order", id.to_string(), "order.created", body),
                            )
                            .await?;
                    }
                    Extra::Noop => {
                        sqlx::query("SELECT 1")
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| map_sqlx("bench", e))?;
                    }
                }
                tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
                done += 1;
            }
            Ok::<u64, Error>(done)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += join(t).await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Every committed business transaction left exactly one event (none for the other variants).
    let events: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
        .fetch_one(pool)
        .await
        .map_err(|e| map_sqlx("bench", e))?;
    let expected = match extra {
        Extra::Outbox | Extra::OutboxUnordered => total,
        Extra::None | Extra::Noop | Extra::Message | Extra::MessageInStatement => 0,
    };
    if u64::try_from(events).ok() != Some(expected) {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!(
                "writer run `{}` committed {total} business transactions but the outbox holds {events} events (expected {expected})",
                extra.label()
            ),
        ));
    }
    Ok(total as f64 / elapsed)
}
