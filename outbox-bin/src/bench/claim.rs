//! The claim-cost phase: the time of a claim, of a statistics refresh and of an exact count in
//! three table states (pending rows only, with a large processed history, a large backlog).

use sqlx::PgPool;
use tokio::time::Instant;

use txoutbox_core::{Error, ErrorKind, OrderingPolicy, Store};
use txoutbox_postgres::{map_sqlx, migrate, OutboxTable, PostgresStore, Retention};

use super::fill::{prefill, truncate};
use super::options::BenchOptions;
use super::report::{percentile, ratio, ClaimFigures};
use crate::target::DiscardPublisher;

pub(super) async fn claim_phase(
    admin: &PgPool,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<Vec<ClaimFigures>, Error> {
    let table = OutboxTable::new(&o.schema, "outbox_claim")?;
    migrate(admin, &table).await?;
    let store = PostgresStore::with_retention(admin.clone(), table.clone(), Retention::Keep);
    let small = 10_000u64;
    let mut out: Vec<ClaimFigures> = Vec::new();
    let mut push = |state: &str,
                    pending,
                    processed,
                    (median, p95): (f64, f64),
                    (stats_ms, exact_count_ms): (f64, f64)| {
        let first = out.first().map_or(median, |f| f.median_ms);
        progress(&format!(
            "claim: {state}: median {median:.2} ms; statistics {stats_ms:.2} ms (exact count {exact_count_ms:.2} ms)"
        ));
        out.push(ClaimFigures {
            state: state.into(),
            pending_rows: pending,
            processed_rows: processed,
            median_ms: median,
            p95_ms: p95,
            vs_first: ratio(median, first).unwrap_or(1.0),
            stats_ms,
            exact_count_ms,
        });
    };
    progress(&format!("claim: {small} pending rows, no history"));
    prefill(admin, &table, small, o, false, 100, None).await?;
    push(
        "pending only",
        small,
        0,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    progress(&format!(
        "claim: adding {} processed rows (keep-processed mode); this takes a while",
        o.claim_processed_rows
    ));
    prefill(admin, &table, o.claim_processed_rows, o, true, 101, None).await?;
    push(
        "pending + processed history",
        small,
        o.claim_processed_rows,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    truncate(admin, &table).await?;
    progress(&format!("claim: {} pending rows", o.claim_pending_rows));
    prefill(admin, &table, o.claim_pending_rows, o, false, 102, None).await?;
    push(
        "large pending backlog",
        o.claim_pending_rows,
        0,
        time_claims(&store, o).await?,
        time_stats(admin, &store).await?,
    );
    Ok(out)
}

/// Times five statistics refreshes (after one for warm-up) and one exact count of the unpublished
/// rows; returns the median refresh and the count, in milliseconds.
async fn time_stats(admin: &PgPool, store: &PostgresStore) -> Result<(f64, f64), Error> {
    let mut ms = Vec::with_capacity(5);
    for i in 0..6 {
        let started = Instant::now();
        store.stats().await?;
        if i > 0 {
            ms.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    ms.sort_by(f64::total_cmp);
    let started = Instant::now();
    sqlx::query(&format!(
        "SELECT count(*) FROM {} WHERE processed_at IS NULL",
        store.table().qualified()
    ))
    .execute(admin)
    .await
    .map_err(|e| map_sqlx("bench exact count", e))?;
    Ok((
        percentile(&ms, 50.0),
        started.elapsed().as_secs_f64() * 1000.0,
    ))
}

/// Times `claim_samples` claims of a batch (each released again), after a few for warm-up; returns
/// the median and the 95th percentile in milliseconds.
async fn time_claims(store: &PostgresStore, o: &BenchOptions) -> Result<(f64, f64), Error> {
    let request = o.relay.claim_request(&DiscardPublisher);
    let mut ms = Vec::with_capacity(o.claim_samples);
    for i in 0..o.claim_samples + 5 {
        let started = Instant::now();
        let batch = store.claim(request).await?;
        let elapsed = started.elapsed();
        if batch.events.is_empty() && request.ordering == OrderingPolicy::PerAggregate {
            return Err(Error::new(
                ErrorKind::Unexpected,
                "the claim-cost phase claimed nothing from a filled table",
            ));
        }
        batch.lease.release().await?;
        if i >= 5 {
            ms.push(elapsed.as_secs_f64() * 1000.0);
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 50.0), percentile(&ms, 95.0)))
}
