//! The reference relay: the classic design, for comparison. It claims the oldest 100 rows,
//! publishes them one at a time and marks each with an `UPDATE` of its own, in one transaction.

use std::time::Duration;

use tokio::time::Instant;

use txoutbox_core::{Error, ErrorKind};
use txoutbox_postgres::{connect, decode_event, map_sqlx, OutboxTable, EVENT_COLUMNS};

use super::options::BenchOptions;
use super::report::DrainFigures;
use super::rss::RssSampler;
use crate::target::BenchTarget;

pub(super) async fn reference_run(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    const BATCH: i64 = 100;
    const MAX_ATTEMPTS: i32 = 10;
    let pool = connect(url, 2).await?;
    let publisher = target.publisher().await?;
    publisher.check().await?;
    let t = table.qualified();
    let select = format!(
        "SELECT {EVENT_COLUMNS} FROM {t} e
         WHERE e.processed_at IS NULL AND e.attempts < $1
         ORDER BY e.created_at
         LIMIT $2
         FOR UPDATE SKIP LOCKED"
    );
    let done = format!("UPDATE {t} SET processed_at = now() WHERE id = $1");
    let failed = format!("UPDATE {t} SET attempts = attempts + 1 WHERE id = $1");
    progress(&format!(
        "reference: 1 classic relay -> {}, {} events",
        target.name(),
        o.reference_events
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let mut published = 0u64;
    let mut last_report = Instant::now();
    let mut last_error = None;
    loop {
        let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
        let rows = sqlx::query(&select)
            .bind(MAX_ATTEMPTS)
            .bind(BATCH)
            .fetch_all(&mut *tx)
            .await
            .map_err(|e| map_sqlx("bench", e))?;
        if rows.is_empty() {
            tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
            break;
        }
        for row in &rows {
            let event = decode_event(row)?;
            let outcome = publisher.publish(std::slice::from_ref(&event)).await;
            let sql = match outcome.into_iter().next() {
                Some(Ok(())) => {
                    published += 1;
                    &done
                }
                Some(Err(e)) => {
                    last_error = Some(e.to_string());
                    &failed
                }
                None => &failed,
            };
            sqlx::query(sql)
                .bind(event.id)
                .execute(&mut *tx)
                .await
                .map_err(|e| map_sqlx("bench", e))?;
        }
        tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
        if last_report.elapsed() >= Duration::from_secs(2) {
            progress(&format!("  {published} / {}", o.reference_events));
            last_report = Instant::now();
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if published < o.reference_events as u64 {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!(
                "the reference relay published {published} of {} events (last error: {})",
                o.reference_events,
                last_error.unwrap_or_else(|| "none".into())
            ),
        ));
    }
    let rate = published as f64 / seconds;
    progress(&format!("reference: {rate:.0} events/s"));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "reference".into(),
        relays: 1,
        events: published,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: None,
    })
}
