//! The transaction phase: one transaction far larger than the WAL source's read-ahead (a backfill
//! written with `INSERT ... SELECT`), drained by one polling relay and by one relay over the WAL
//! source, each with its drain time and the bench process's peak memory.

use sqlx::PgPool;

use txoutbox_core::Error;
use txoutbox_postgres::OutboxTable;

use super::drain::drain_run;
use super::fill::{prefill, truncate};
use super::options::BenchOptions;
use super::report::{BenchReport, TransactionFigures};
use super::wal::{wal_drain_run, WalBench, WAL_UNAVAILABLE};
use crate::target::BenchTarget;

/// The JSON around the padding of a filled event's payload (`prefill`), in bytes.
const PAYLOAD_FRAME: usize = 48;

/// Fills a distinct id space for the phase's transactions (see `prefill`).
const FIRST_FILL: u32 = 200;

pub(super) async fn transaction_phase(
    url: &str,
    admin: &PgPool,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
    report: &mut BenchReport,
) -> Result<(), Error> {
    let mut fill = FIRST_FILL;
    let wal = WalBench::prepare(admin, table, progress).await?;
    if wal.is_none() {
        report.notes.push(WAL_UNAVAILABLE.into());
    }
    for t in &o.transactions {
        let shaped = BenchOptions {
            payload_bytes: t.payload_bytes.saturating_sub(PAYLOAD_FRAME),
            aggregates: t.aggregates,
            ..o.clone()
        };
        let what = format!(
            "transaction: one of {} events of {} bytes over {} aggregates",
            t.events, t.payload_bytes, t.aggregates
        );
        let mut figures = TransactionFigures {
            transaction: *t,
            drains: Vec::new(),
        };
        truncate(admin, table).await?;
        progress(&format!("{what}, polling"));
        prefill(admin, table, t.events, &shaped, false, fill, Some(t.events)).await?;
        fill += 1;
        target.reset().await?;
        figures
            .drains
            .push(drain_run(url, table, target, 1, t.events, &shaped, progress).await?);
        if let Some(wal) = &wal {
            let result = async {
                wal.reset(admin).await?;
                progress(&format!("{what}, WAL source"));
                prefill(admin, table, t.events, &shaped, false, fill, Some(t.events)).await?;
                target.reset().await?;
                wal_drain_run(url, wal, target, t.events, &shaped, progress).await
            }
            .await;
            fill += 1;
            match result {
                Ok(d) => figures.drains.push(d),
                Err(e) => {
                    wal.drop(admin).await;
                    return Err(e);
                }
            }
        }
        report.transactions.push(figures);
    }
    if let Some(wal) = wal {
        wal.drop(admin).await;
    }
    Ok(())
}
