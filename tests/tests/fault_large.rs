//! Scenario: large payloads. A backlog of hundreds of events of several megabytes (hundreds of MB in
//! all), some larger than the relay's byte budget, some larger than the broker takes, for a relay on
//! its default settings: every event is published in order or dead-lettered with an error
//! naming the limit, the relay's peak memory stays within what its byte budget promises, and it never
//! restarts.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::Duration;

use txoutbox_core::{Uuid, DEFAULT_MAX_BATCH_BYTES};
use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_postgres::OutboxTable;
use txoutbox_tests::harness::{
    assert_clean_verdict, one_at_a_time, relay_log_dir, report_with, rng, wait_until, Broker,
    RelayProcess, Sink,
};
use txoutbox_tests::wal::{pairs, WalSource};

const MIB: usize = 1024 * 1024;

/// The largest message the relay may send in this scenario (`amqp.max_message_bytes`).
const BROKER_LIMIT: usize = 12 * MIB;

async fn pending(pg: &sqlx::PgPool, table: &txoutbox_postgres::OutboxTable) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {} WHERE processed_at IS NULL AND dead_lettered_at IS NULL",
        table.qualified()
    ))
    .fetch_one(pg)
    .await
    .unwrap()
}

/// Events not yet published nor dead-lettered: the outbox table's, and under the WAL source (which
/// empties it) the held table's.
async fn unsettled(pg: &sqlx::PgPool, table: &OutboxTable, wal: Option<&WalSource>) -> i64 {
    match wal {
        None => pending(pg, table).await,
        Some(w) => {
            let rows: i64 =
                sqlx::query_scalar(&format!("SELECT count(*) FROM {}", table.qualified()))
                    .fetch_one(pg)
                    .await
                    .unwrap();
            rows + pending(pg, &w.held).await
        }
    }
}

/// Starts a relay over `table` publishing to `sink` with `env`, waits until it has connected, and
/// pauses it (a backlog, as after an outage or a deployment: the relay stands still while it is
/// written). Returns it with its memory at start.
async fn paused_relay(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    sink: &Sink,
    env: &[(&str, &str)],
) -> (RelayProcess, u64) {
    let relay = RelayProcess::start(table, sink, env);
    let tag = relay.tag.clone();
    wait_until(Duration::from_secs(60), "the relay connects", || {
        let pg = pg.clone();
        let tag = tag.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            )
            .bind(tag)
            .fetch_one(&pg)
            .await
            .unwrap()
                > 0
        }
    })
    .await;
    let baseline = relay.peak_rss();
    relay.pause();
    (relay, baseline)
}

/// Writes an event of each `(aggregate, size)` by plain SQL, in transactions of ten, in that order
/// (which is their commit order), the payloads made by the server (a random 16-byte pattern
/// repeated: the client sends a few bytes per event, the relay reads megabytes). Returns their ids
/// in that order and the bytes written.
async fn write_large(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    sizes: &[(String, usize)],
    r: &mut fastrand::Rng,
) -> (Vec<Uuid>, usize) {
    let insert = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload, payload_bytes, content_type)
         VALUES ($1, 'doc', $2, 'doc.stored', 'null', decode(repeat(md5($3), $4), 'hex'), 'application/octet-stream')",
        table.qualified()
    );
    let (mut ids, mut total) = (Vec::with_capacity(sizes.len()), 0usize);
    for chunk in sizes.chunks(10) {
        let write = async {
            let mut tx = pg.begin().await.unwrap();
            for (aggregate, size) in chunk {
                let id = Uuid::now_v7();
                sqlx::query(&insert)
                    .bind(id)
                    .bind(aggregate)
                    .bind(format!("{}", r.u64(..)))
                    .bind((size / 16) as i32)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                total += size / 16 * 16;
                ids.push(id);
            }
            tx.commit().await.unwrap();
        };
        tokio::time::timeout(Duration::from_secs(120), write)
            .await
            .expect("writing ten events took over two minutes");
    }
    (ids, total)
}

/// Asserts that the dead letters of `table` are exactly `refused` (in seq order), each with an error
/// naming `limit` (the setting and its value).
async fn assert_dead_lettered(
    pg: &sqlx::PgPool,
    table: &OutboxTable,
    refused: &[Uuid],
    limit: &str,
) {
    let dead: Vec<(Uuid, String)> = sqlx::query_as(&format!(
        "SELECT id, last_error FROM {} WHERE dead_lettered_at IS NOT NULL ORDER BY seq",
        table.qualified()
    ))
    .fetch_all(pg)
    .await
    .unwrap();
    let dead_ids: Vec<Uuid> = dead.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        dead_ids, refused,
        "exactly the events over the broker's limit are dead-lettered"
    );
    for (id, error) in &dead {
        assert!(error.contains(limit), "{id}: {error}");
    }
}

/// The byte budget's promise for a backlog of `sizes` under a budget of `budget` bytes: payloads
/// held about three times per batch in flight (rows, events, the client's frames), two batches in
/// flight, a batch at most the budget or one larger event; plus the process's memory at start
/// (`baseline`) and a fixed allowance for buffers that grow with use (allocator, runtime).
fn budget_bound(baseline: u64, sizes: &[(String, usize)], budget: usize) -> u64 {
    let largest = sizes.iter().map(|(_, s)| *s).max().unwrap_or(0).max(budget) as u64;
    baseline + 3 * 2 * largest + 32 * MIB as u64
}

/// Asserts that the relay's peak memory stayed within the budget's `bound`.
fn assert_within(peak: u64, bound: u64, baseline: u64) {
    assert!(
        peak <= bound,
        "peak RSS {} MiB exceeds the byte budget's bound {} MiB (start {} MiB)",
        peak / MIB as u64,
        bound / MIB as u64,
        baseline / MIB as u64
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_megabytes_of_large_events_stay_within_the_byte_budget() {
    large_events(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_megabytes_of_large_events_on_the_wal_source() {
    large_events(true).await;
}

async fn large_events(wal: bool) {
    let _serial = one_at_a_time().await;
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let source = WalSource::setup_if(wal, &table).await;
    let sink = Sink::new(Broker::Amqp).await;
    let limit = BROKER_LIMIT.to_string();
    let settings = [
        // The defaults a user runs (the harness lowers the batch size for other scenarios).
        ("OUTBOX_RELAY__BATCH_SIZE", "500"),
        ("OUTBOX_AMQP__MAX_MESSAGE_BYTES", limit.as_str()),
    ];
    let env: Vec<(String, String)> = match &source {
        Some(w) => w.relay_env(&settings),
        None => settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    let (mut relay, baseline) = paused_relay(&pg, &table, &sink, &pairs(&env)).await;

    // 200 events of 0.5 to 2.5 MiB over 20 aggregates, three of 10 MiB (over the 8 MiB budget: each
    // goes alone) and two of 13 MiB (over the broker's limit: dead-lettered), written in transactions
    // of ten.
    let mut r = rng("large payloads");
    let mut sizes: Vec<(String, usize)> = (0..200)
        .map(|i| (format!("doc-{}", i % 20), r.usize(MIB / 2..=5 * MIB / 2)))
        .collect();
    for i in 0..3 {
        sizes.insert(r.usize(..sizes.len()), (format!("huge-{i}"), 10 * MIB));
    }
    for i in 0..2 {
        sizes.insert(r.usize(..sizes.len()), (format!("refused-{i}"), 13 * MIB));
    }
    let (ids, total) = write_large(&pg, &table, &sizes, &mut r).await;
    let (mut deliverable, mut refused) = (Vec::new(), Vec::new());
    for ((aggregate, size), id) in sizes.iter().zip(ids) {
        if *size > BROKER_LIMIT {
            refused.push(id);
        } else {
            deliverable.push((aggregate.clone(), id));
        }
    }
    relay.resume();

    wait_until(
        Duration::from_secs(300),
        "every large event is published or dead-lettered",
        || {
            let pg = pg.clone();
            let table = table.clone();
            let source = source.as_ref();
            async move { unsettled(&pg, &table, source).await == 0 }
        },
    )
    .await;
    assert!(
        relay.alive(),
        "the relay must not crash (see {})",
        relay_log_dir(&table).display()
    );
    let peak = relay.peak_rss();

    // Under the WAL source the dead letters are in the held table.
    let kept = source.as_ref().map_or(&table, |w| &w.held);
    assert_dead_lettered(
        &pg,
        kept,
        &refused,
        &format!("amqp.max_message_bytes is {BROKER_LIMIT}"),
    )
    .await;
    assert_eq!(
        relay.terminate(Duration::from_secs(60)),
        Some(0),
        "a clean exit on SIGTERM"
    );
    let v = sink.judge(&deliverable).await;
    // The WAL source holds besides what it read ahead (wal.read_ahead_bytes, 16 MiB, in its buffer
    // and again in its channel, each passed by at most one transaction) and a transaction it
    // receives whole: its frames (bytea as hex text, twice its bytes) and the events decoded from
    // them. Measured 172-202 MiB.
    let largest_transaction = sizes
        .chunks(10)
        .map(|c| c.iter().map(|(_, s)| *s as u64).sum::<u64>())
        .max()
        .unwrap();
    let wal_extra = if wal {
        2 * 16 * MIB as u64 + 3 * largest_transaction
    } else {
        0
    };
    let bound = budget_bound(baseline, &sizes, DEFAULT_MAX_BATCH_BYTES) + wal_extra;
    report_with(
        if wal { "large_payloads_wal" } else { "large_payloads" },
        Broker::Amqp,
        &v,
        &format!(
            " events={} total_mb={} dead_lettered={} start_rss_mb={} peak_rss_mb={} rss_bound_mb={}",
            sizes.len(),
            total / MIB,
            refused.len(),
            baseline / MIB as u64,
            peak / MIB as u64,
            bound / MIB as u64
        ),
    );
    assert_clean_verdict(&v);
    assert_within(peak, bound, baseline);
}

/// The largest record the Kafka publisher sends on its defaults (`kafka.max_message_bytes`).
const KAFKA_LIMIT: usize = 1_000_000;

/// The relay's byte budget in the Kafka scenario: a quarter of the default, so that the backlog is
/// several times what the budget lets the relay hold and the memory bound can tell.
const KAFKA_SCENARIO_BUDGET: usize = 2 * MIB;

/// Large events to Kafka, which takes an aggregate's whole run in one call: a backlog of records of
/// 100-800 KiB (about 150 MB in all) in runs over a dozen aggregates, and three of 1.5 MiB (over the producer's
/// `message.max.bytes`) in the middle of three aggregates' runs, each followed at once by another
/// event of its aggregate. The oversized ones are dead-lettered with an error naming the limit; the
/// rest of their aggregates stays in the outbox and is not written to the topic before the dead
/// letters are discarded; every other event is published in order, once; discarding the dead
/// letters releases the held-back events, in order; the relay's memory stays within its byte
/// budget's bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_records_in_whole_runs_to_kafka_hold_back_only_the_aggregates_of_refused_ones() {
    let _serial = one_at_a_time().await;
    let pg = pool(4).await;
    let table = fresh_table(&pg).await;
    let sink = Sink::new(Broker::Kafka).await;
    let budget = KAFKA_SCENARIO_BUDGET.to_string();
    let (mut relay, baseline) = paused_relay(
        &pg,
        &table,
        &sink,
        &[
            ("OUTBOX_RELAY__BATCH_SIZE", "500"),
            ("OUTBOX_RELAY__MAX_BATCH_BYTES", budget.as_str()),
            // The default: the harness shortens it for the outage scenarios.
            ("OUTBOX_KAFKA__DELIVERY_TIMEOUT", "30s"),
        ],
    )
    .await;

    // 320 events of 100-800 KiB over 12 aggregates (runs of several events of an aggregate form in
    // the backlog), and three of 1.5 MiB in the middle of the backlog, each followed by another event
    // of its aggregate.
    let mut r = rng("large kafka records");
    let mut sizes: Vec<(String, usize)> = (0..320)
        .map(|_| {
            (
                format!("doc-{}", r.usize(..12)),
                r.usize(100 * 1024..=800 * 1024),
            )
        })
        .collect();
    for i in 0..3 {
        let at = r.usize(20..sizes.len() - 20);
        let aggregate = format!("doc-{}", i * 4);
        sizes.insert(at, (aggregate.clone(), 3 * MIB / 2));
        sizes.insert(at + 1, (aggregate, r.usize(100 * 1024..=800 * 1024)));
    }
    let (ids, total) = write_large(&pg, &table, &sizes, &mut r).await;
    // Commit order is the order of `sizes`: an aggregate's events after its refused one are held back.
    let (mut deliverable, mut held, mut refused) = (Vec::new(), Vec::new(), Vec::new());
    let mut blocked = std::collections::HashSet::new();
    for ((aggregate, size), id) in sizes.iter().zip(ids) {
        if *size > KAFKA_LIMIT {
            refused.push(id);
            blocked.insert(aggregate.clone());
        } else if blocked.contains(aggregate) {
            held.push((aggregate.clone(), id));
        } else {
            deliverable.push((aggregate.clone(), id));
        }
    }
    assert_eq!((refused.len(), blocked.len()), (3, 3));
    assert!(
        total as u64 > 2 * budget_bound(0, &sizes, KAFKA_SCENARIO_BUDGET),
        "the backlog is over twice what the budget lets the relay hold"
    );
    // Each aggregate's deliverable events come before its held-back ones: in commit order per aggregate.
    let all_in_order: Vec<(String, Uuid)> = deliverable.iter().chain(&held).cloned().collect();
    let held_ids: std::collections::BTreeSet<Uuid> = held.iter().map(|(_, id)| *id).collect();
    let pending_ids = || {
        let (pg, table) = (pg.clone(), table.clone());
        async move {
            sqlx::query_scalar::<_, Uuid>(&format!(
                "SELECT id FROM {} WHERE processed_at IS NULL AND dead_lettered_at IS NULL",
                table.qualified()
            ))
            .fetch_all(&pg)
            .await
            .unwrap()
            .into_iter()
            .collect::<std::collections::BTreeSet<Uuid>>()
        }
    };
    relay.resume();

    let store = txoutbox_postgres::PostgresStore::new(pg.clone(), table.clone());
    let expect_held = held.len() as i64;
    wait_until(
        Duration::from_secs(300),
        "every event is published, dead-lettered or held back behind a dead letter",
        || {
            let pg = pg.clone();
            let table = table.clone();
            async move {
                let dead: i64 = sqlx::query_scalar(&format!(
                    "SELECT count(*) FROM {} WHERE dead_lettered_at IS NOT NULL",
                    table.qualified()
                ))
                .fetch_one(&pg)
                .await
                .unwrap();
                dead == 3 && pending(&pg, &table).await <= expect_held
            }
        },
    )
    .await;
    assert_eq!(
        pending_ids().await,
        held_ids,
        "exactly the events behind a dead letter are left in the outbox"
    );
    assert_dead_lettered(
        &pg,
        &table,
        &refused,
        &format!("kafka.max_message_bytes is {KAFKA_LIMIT}"),
    )
    .await;
    // Everything written to the topic so far, read to its end: no held-back event among it. Each
    // partition's end is noted: a held-back event may be written only after the discard below,
    // beyond it. (A held-back event wrongly sent before the discard is found here, or below a
    // partition's end, or settled before the check of the outbox that follows, or sent again: a
    // duplicate; only one still unacknowledged at that check escapes, and a relay that sent held-back
    // events would have sent them as soon as its aggregate's event was dead-lettered.)
    let Sink::Kafka(fx) = &sink else {
        unreachable!("a Kafka sink")
    };
    sink.drained(Duration::from_secs(120)).await;
    let so_far = sink.received(usize::MAX, Duration::ZERO).await;
    let early: Vec<&(String, Uuid)> = held.iter().filter(|(_, id)| so_far.contains(id)).collect();
    assert!(
        early.is_empty(),
        "{} events reached Kafka past their aggregate's refused event: {early:?}",
        early.len()
    );
    // Each partition's end now: an end mark written after every event so far.
    let ends = fx.mark_ends().await;
    assert_eq!(
        pending_ids().await,
        held_ids,
        "the events behind a dead letter are still in the outbox"
    );

    // Discarding the dead letters releases the rest of their aggregates.
    let discarded = store
        .discard_dead_letters(&txoutbox_postgres::DeadLetterFilter::All)
        .await
        .unwrap();
    assert_eq!(discarded, 3);
    wait_until(
        Duration::from_secs(300),
        "the held-back events are published",
        || {
            let pg = pg.clone();
            let table = table.clone();
            async move { pending(&pg, &table).await == 0 }
        },
    )
    .await;
    assert!(
        relay.alive(),
        "the relay must not crash (see {})",
        relay_log_dir(&table).display()
    );
    let peak = relay.peak_rss();
    assert_eq!(
        relay.terminate(Duration::from_secs(60)),
        Some(0),
        "a clean exit on SIGTERM"
    );
    let v = sink.judge(&all_in_order).await;
    let delivered = fx.got.lock().unwrap().clone();
    for (aggregate, id) in &held {
        let first = delivered
            .iter()
            .filter(|d| d.received.event_id == Some(*id))
            .min_by_key(|d| d.offset)
            .unwrap_or_else(|| panic!("{aggregate} {id} was not received"));
        assert!(
            first.offset > ends[first.partition as usize],
            "{aggregate} {id} was written at offset {} of partition {}, before the dead letters were discarded (the partition's end mark then went to offset {})",
            first.offset,
            first.partition,
            ends[first.partition as usize]
        );
    }
    let bound = budget_bound(baseline, &sizes, KAFKA_SCENARIO_BUDGET);
    report_with(
        "large_records_kafka",
        Broker::Kafka,
        &v,
        &format!(
            " events={} total_mb={} dead_lettered={} held_back={} start_rss_mb={} peak_rss_mb={} rss_bound_mb={}",
            sizes.len(),
            total / MIB,
            refused.len(),
            held.len(),
            baseline / MIB as u64,
            peak / MIB as u64,
            bound / MIB as u64
        ),
    );
    assert_clean_verdict(&v);
    assert_within(peak, bound, baseline);
}
