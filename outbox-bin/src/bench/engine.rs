//! The measurements behind `outbox bench`: the run that makes the benchmark's schema, runs the
//! phases in order (each in a file of its own beside this one: load generators for the writer and
//! the relay, a reference relay that works like the classic design) and gathers their figures, whose
//! types are re-exported here.
//!
//! Everything runs against a real PostgreSQL and whatever [`BenchTarget`] the caller provides (a
//! broker publisher, or [`DiscardTarget`] for the database-only ceiling). The benchmark owns its own
//! schema (dropped and created again at the start, dropped at the end), so it never touches a
//! service's outbox table.
//!
//! ```no_run
//! # async fn demo() -> Result<(), txoutbox_core::Error> {
//! use txoutbox::bench::engine::{self as bench, BenchOptions, DiscardTarget};
//! let options = BenchOptions { backlog: 20_000, ..BenchOptions::default() };
//! let report = bench::run("postgres://postgres@127.0.0.1:5432/test", &DiscardTarget, &options, &|line: &str| eprintln!("{line}")).await?;
//! println!("{}", report.table());
//! # Ok(()) }
//! ```

use sqlx::PgPool;

use txoutbox_core::Error;
use txoutbox_postgres::{connect, migrate, OutboxTable};

use super::claim::claim_phase;
use super::drain::{drain_run, publisher_run, yardstick_run};
use super::fill::{exec, prefill, truncate};
use super::latency::latency_run;
use super::reference::reference_run;
use super::transaction::transaction_phase;
use super::wal::{wal_drain_run, WalBench, WAL_FILL_TX_ROWS, WAL_UNAVAILABLE};
use super::writer::writer_phase;

pub use super::options::{BenchOptions, LargeTransaction, Phase, DEFAULT_LARGE_TRANSACTIONS};
pub use super::report::{
    BenchReport, ClaimFigures, DrainFigures, LatencyFigures, PublisherFigures, Ratios,
    StageFigures, TransactionFigures, WriterFigures,
};
pub use super::rss::rss_bytes;
pub use crate::target::{BenchTarget, DiscardTarget};

/// Runs the phases of `options` against the database at `url`, publishing to `target`; `progress`
/// receives a line at each step.
///
/// # Errors
/// A config error for invalid options; a database or publisher error that stops a phase (an event
/// the target dead-letters stops the drain with the row's error, since a benchmark of failures
/// measures nothing).
pub async fn run(
    url: &str,
    target: &dyn BenchTarget,
    options: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<BenchReport, Error> {
    options.validate()?;
    let admin = connect(url, 4).await?;
    let schema = options.schema.clone();
    exec(&admin, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await?;
    exec(&admin, &format!("CREATE SCHEMA {schema}")).await?;
    let mut report = BenchReport {
        target: target.name().to_string(),
        options: options.clone(),
        writer: None,
        drain: Vec::new(),
        latency: Vec::new(),
        claim: Vec::new(),
        transactions: Vec::new(),
        ratios: Ratios::default(),
        notes: Vec::new(),
        relay_peak_rss_bytes: None,
        publisher: None,
    };
    let result = run_phases(url, &admin, target, options, progress, &mut report).await;
    // The schema goes whatever happened.
    let dropped = exec(&admin, &format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await;
    result?;
    dropped?;
    report.compute_ratios();
    Ok(report)
}

async fn run_phases(
    url: &str,
    admin: &PgPool,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
    report: &mut BenchReport,
) -> Result<(), Error> {
    let table = OutboxTable::new(&o.schema, "outbox_events")?;
    migrate(admin, &table).await?;
    let has = |p| o.phases.contains(&p);
    if has(Phase::Writer) {
        report.writer = Some(writer_phase(url, admin, &table, o, progress).await?);
    }
    let mut fill = 1;
    if has(Phase::Drain) {
        truncate(admin, &table).await?;
        progress(&format!("drain: filling {} events", o.backlog));
        prefill(admin, &table, o.backlog as u64, o, false, 99, None).await?;
        report
            .drain
            .push(yardstick_run(url, &table, o.backlog as u64, o, progress).await?);
        for relays in dedup([1, o.relays]) {
            for t in [&DiscardTarget as &dyn BenchTarget, target] {
                truncate(admin, &table).await?;
                progress(&format!("drain: filling {} events", o.backlog));
                prefill(admin, &table, o.backlog as u64, o, false, fill, None).await?;
                fill += 1;
                t.reset().await?;
                let d = drain_run(url, &table, t, relays, o.backlog as u64, o, progress).await?;
                report.drain.push(d);
            }
        }
    }
    if has(Phase::Drain) {
        match WalBench::prepare(admin, &table, progress).await? {
            Some(wal) => {
                for t in [&DiscardTarget as &dyn BenchTarget, target] {
                    let result = async {
                        wal.reset(admin).await?;
                        progress(&format!(
                            "drain (WAL source): filling {} events in transactions of {WAL_FILL_TX_ROWS}",
                            o.backlog
                        ));
                        prefill(admin, &table, o.backlog as u64, o, false, fill, Some(WAL_FILL_TX_ROWS)).await?;
                        fill += 1;
                        t.reset().await?;
                        wal_drain_run(url, &wal, t, o.backlog as u64, o, progress).await
                    }
                    .await;
                    match result {
                        Ok(d) => report.drain.push(d),
                        Err(e) => {
                            wal.drop(admin).await;
                            return Err(e);
                        }
                    }
                }
                wal.drop(admin).await;
            }
            None => report.notes.push(WAL_UNAVAILABLE.into()),
        }
    }
    if has(Phase::Drain) && target.name() != DiscardTarget.name() {
        target.reset().await?;
        report.publisher = Some(publisher_run(target, o.backlog as u64, o, progress).await?);
        target.reset().await?;
    }
    if has(Phase::Reference) {
        let reference = OutboxTable::new(&o.schema, "outbox_reference")?;
        migrate(admin, &reference).await?;
        // The classic design's own index (the claim orders by created_at).
        exec(
            admin,
            &format!(
                "CREATE INDEX IF NOT EXISTS idx_outbox_unprocessed ON {} (created_at) WHERE processed_at IS NULL",
                reference.qualified()
            ),
        )
        .await?;
        progress(&format!("reference: filling {} events", o.reference_events));
        prefill(
            admin,
            &reference,
            o.reference_events as u64,
            o,
            false,
            90,
            None,
        )
        .await?;
        target.reset().await?;
        report
            .drain
            .push(reference_run(url, &reference, target, o, progress).await?);
    }
    if has(Phase::Latency) {
        for notify_on in [false, true] {
            truncate(admin, &table).await?;
            target.reset().await?;
            report
                .latency
                .push(latency_run(url, admin, &table, target, o, notify_on, None, progress).await?);
        }
        match WalBench::prepare(admin, &table, progress).await? {
            Some(wal) => {
                wal.reset(admin).await?;
                target.reset().await?;
                let run =
                    latency_run(url, admin, &table, target, o, false, Some(&wal), progress).await;
                wal.drop(admin).await;
                report.latency.push(run?);
            }
            None => report.notes.push(WAL_UNAVAILABLE.into()),
        }
    }
    if has(Phase::Claim) {
        report.claim = claim_phase(admin, o, progress).await?;
    }
    if has(Phase::Transaction) {
        transaction_phase(url, admin, &table, target, o, progress, report).await?;
    }
    Ok(())
}

fn dedup(v: [usize; 2]) -> Vec<usize> {
    if v[0] == v[1] {
        vec![v[0]]
    } else {
        v.to_vec()
    }
}
