//! One transaction far larger than the WAL source's read-ahead, as a backfill writes it (`INSERT ...
//! SELECT generate_series`): 150,000 events of 4 KB over 100 aggregates (600 MB, 75 times the
//! read-ahead's spill mark; the relay SIGKILLed in the middle and started again), and events of 100
//! bytes over 1,000 aggregates in two sizes, 100,000 and 400,000 (5 and 20 times the spill mark of
//! 20,000 events). Each is published completely and in per-aggregate order, with the relay's peak
//! resident memory under 256 MiB (`peak_rss_mb`); the kill republishes no more than what was in
//! flight. That memory does not grow with a transaction's size is shown by the slope between the
//! two sizes: 300,000 more events may add at most 48 MiB, where a relay that held the transaction
//! whole took 448 MiB for 300,000 events of 200 bytes. (`outbox bench --phases transaction` drains
//! 2,000,000 events in one transaction on a release build.) Real binary and PostgreSQL
//! (`wal_level = logical`); the relay publishes to its standard output, read by the test (a broker
//! fixture would keep gigabytes of messages in memory).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use txoutbox_postgres::testing::{fresh_table, pool};
use txoutbox_tests::harness::{
    assert_clean_verdict, assert_crash_verdict, one_at_a_time, relay_log_dir, report_to,
    wait_until, RelayProcess,
};
use txoutbox_tests::wal::{pairs, WalSource};
use uuid::Uuid;

/// The bound on each relay's peak resident memory.
const RSS_BOUND_MIB: u64 = 256;
/// The most the peak may grow from the smaller transaction of 100-byte events to the larger one.
const SLOPE_BOUND_MIB: u64 = 48;

/// The relay's batch size: four times the default, which drains the held table faster and holds
/// more in memory (the stricter test of the bound).
const BATCH: usize = 2_000;
/// Batches in flight (the default), and one settling.
const IN_FLIGHT: usize = 3;

/// Writes and drains one transaction of `events`; returns the relay's peak resident memory in MiB.
async fn large_transaction(events: usize, bytes: usize, aggregates: usize, kill: bool) -> u64 {
    let scenario = format!("wal_transaction_of_{events}_events_of_{bytes}_bytes");
    let pg = pool(2).await;
    let table = fresh_table(&pg).await;
    let wal = WalSource::setup(&table).await;
    let batch = BATCH.to_string();
    let env = wal.relay_env(&[("OUTBOX_RELAY__BATCH_SIZE", batch.as_str())]);
    let received: Arc<Mutex<Vec<Uuid>>> = Arc::default();
    let start = || RelayProcess::start_to_stdout(&table, &pairs(&env), received.clone());
    let mut relay = start();

    // One transaction; its events in commit order are read back before it commits (the relay
    // deletes the rows as it hands them over).
    let started = Instant::now();
    let mut tx = pg.begin().await.unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'doc', 'agg-' || (g % $2), 'doc.loaded',
                jsonb_build_object('n', g, 'pad', repeat('x', $3))
         FROM generate_series(1, $1) g",
        table.qualified()
    ))
    .bind(events as i32)
    .bind(aggregates as i32)
    .bind(bytes.saturating_sub(20) as i32)
    .execute(&mut *tx)
    .await
    .unwrap();
    let committed: Vec<(String, Uuid)> = sqlx::query_as(&format!(
        "SELECT aggregate_id, id FROM {} ORDER BY seq",
        table.qualified()
    ))
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(committed.len(), events);
    let written = started.elapsed();

    let mut peak = relay.peak_rss();
    let mut kills = 0;
    if kill {
        // Killed once a fifth of the transaction is in the held table.
        let held_in = || wal.held_rows_in();
        wait_until(
            Duration::from_secs(600),
            "a fifth of the transaction in the held table",
            || async { held_in().await >= (events / 5) as i64 },
        )
        .await;
        peak = peak.max(relay.peak_rss());
        relay.kill9();
        kills = 1;
        relay = start();
    }
    // Sampled while it runs: a relay that held the transaction whole would pass the bound.
    let drain = Instant::now();
    loop {
        peak = peak.max(relay.peak_rss());
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT (SELECT count(*) FROM {}) + (SELECT count(*) FROM {} WHERE processed_at IS NULL)",
            table.qualified(),
            wal.held.qualified()
        ))
        .fetch_one(&pg)
        .await
        .unwrap();
        if left == 0 && received.lock().unwrap().len() >= events {
            break;
        }
        assert!(
            relay.alive(),
            "the relay must not crash (see {})",
            relay_log_dir(&table).display()
        );
        assert!(
            drain.elapsed() < Duration::from_secs(1200),
            "{left} events left after 20 minutes"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained = drain.elapsed();
    peak = peak.max(relay.peak_rss());
    assert_eq!(relay.terminate(Duration::from_secs(60)), Some(0));
    let verdict = txoutbox_tests::check(&committed, &received.lock().unwrap());
    report_to(
        &scenario,
        "stdout",
        &verdict,
        &format!(
            " source=wal aggregates={aggregates} kills={kills} written_s={} drained_s={} peak_rss_mb={} rss_bound_mb={RSS_BOUND_MIB}",
            written.as_secs(),
            drained.as_secs(),
            peak >> 20
        ),
    );
    if kill {
        assert_crash_verdict(&verdict, kills, BATCH, IN_FLIGHT);
    } else {
        assert_clean_verdict(&verdict);
    }
    assert!(
        peak >> 20 < RSS_BOUND_MIB,
        "the relay's peak resident memory was {} MiB, over {RSS_BOUND_MIB} MiB",
        peak >> 20
    );
    let _ = std::fs::remove_dir_all(relay_log_dir(&table));
    peak >> 20
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_of_150k_events_of_4kb_with_a_kill_in_the_middle() {
    let _serial = one_at_a_time().await;
    large_transaction(150_000, 4_096, 100, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_does_not_grow_with_a_transactions_size() {
    let _serial = one_at_a_time().await;
    let small = large_transaction(100_000, 100, 1_000, false).await;
    let large = large_transaction(400_000, 100, 1_000, false).await;
    println!("peak resident memory: {small} MiB for 100,000 events, {large} MiB for 400,000");
    assert!(
        large < small + SLOPE_BOUND_MIB,
        "the relay's peak grew from {small} MiB (100,000 events) to {large} MiB (400,000 events): \
         over {SLOPE_BOUND_MIB} MiB more for 300,000 more events, so memory follows the transaction's size"
    );
}
