//! The drain phase's runs: the yardstick (the database's own drain rate), relays draining a
//! pre-filled backlog to a target, and the target's publisher alone with no database.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use txoutbox_core::{Error, ErrorKind, Event, Relay};
use txoutbox_postgres::{connect, map_sqlx, OutboxTable, PostgresStore, Retention};

use super::fill::payload;
use super::instruments::{delayed, join, wait_for_settled, Counter};
use super::options::BenchOptions;
use super::report::{percentile, DrainFigures, PublisherFigures};
use super::rss::RssSampler;
use crate::target::BenchTarget;

/// The yardstick of the drain: one statement, run back to back on one connection until the table
/// is empty, that deletes the oldest `batch_size` pending rows it can lock and returns them to the
/// client, as a relay that keeps no order and publishes nothing would. What the database can drain
/// from this table, with its indexes, when nothing else is asked of it.
pub(super) async fn yardstick_run(
    url: &str,
    table: &OutboxTable,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let pool = connect(url, 1).await?;
    let sql = format!(
        "WITH c AS (SELECT id FROM {t} WHERE processed_at IS NULL AND dead_lettered_at IS NULL \
                    ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
         DELETE FROM {t} o USING c WHERE o.id = c.id RETURNING o.*",
        t = table.qualified()
    );
    progress(&format!(
        "drain: yardstick (one DELETE ... RETURNING of {} rows after another), {events} events",
        o.relay.batch_size
    ));
    let started = Instant::now();
    let mut drained = 0u64;
    loop {
        let rows = sqlx::query(&sql)
            .bind(o.relay.batch_size as i64)
            .fetch_all(&pool)
            .await
            .map_err(|e| map_sqlx("bench yardstick", e))?;
        if rows.is_empty() {
            break;
        }
        drained += rows.len() as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    if drained != events {
        return Err(Error::new(
            ErrorKind::Unexpected,
            format!("the yardstick drained {drained} events of the {events} filled"),
        ));
    }
    let rate = events as f64 / seconds;
    progress(&format!("drain: yardstick: {rate:.0} events/s"));
    Ok(DrainFigures {
        publisher: "none".into(),
        relay: "yardstick".into(),
        relays: 1,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: None,
        stages: None,
    })
}

pub(super) async fn drain_run(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    relays: usize,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let counter = Arc::new(Counter::default());
    let shutdown = CancellationToken::new();
    let mut built = Vec::new();
    for _ in 0..relays {
        // One pool per relay, as separate processes have: a connection per batch in flight, one
        // for the claim.
        let pool = connect(url, o.relay.max_in_flight as u32 + 1).await?;
        let store = Arc::new(PostgresStore::with_retention(
            pool,
            table.clone(),
            Retention::Delete,
        ));
        let publisher = delayed(target.publisher().await?, o.publish_delay);
        publisher.check().await?;
        built.push(Relay::new(store, publisher, o.relay.clone())?.with_observer(counter.clone()));
    }
    progress(&format!(
        "drain: {} relay(s) -> {}, {events} events",
        relays,
        target.name()
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let handles: Vec<_> = built
        .into_iter()
        .map(|relay| {
            let s = shutdown.clone();
            tokio::spawn(async move { relay.run(s).await })
        })
        .collect();
    let outcome = wait_for_settled(&counter, events, progress).await;
    let seconds = started.elapsed().as_secs_f64();
    shutdown.cancel();
    for h in handles {
        join(h).await?;
    }
    outcome?;
    let rate = events as f64 / seconds;
    progress(&format!(
        "drain: {} relay(s) -> {}: {rate:.0} events/s",
        relays,
        target.name()
    ));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "relay".into(),
        relays,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: Some(counter.stages()),
    })
}

/// Publishes `events` events built in memory through the target's publisher, in calls of the
/// relay's batch size with its `max_in_flight` calls at once: what the broker takes from this
/// publisher when no database is involved.
pub(super) async fn publisher_run(
    target: &dyn BenchTarget,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<PublisherFigures, Error> {
    let publisher = delayed(target.publisher().await?, o.publish_delay);
    publisher.check().await?;
    let batch_size = o.relay.batch_size.max(1);
    let in_flight = o.relay.max_in_flight.max(1);
    progress(&format!(
        "publisher alone: {events} events -> {}, calls of {batch_size}, {in_flight} in flight",
        target.name()
    ));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..in_flight {
        let (publisher, next) = (publisher.clone(), next.clone());
        let (aggregates, pad) = (o.aggregates.max(1) as u64, o.payload_bytes);
        tasks.push(tokio::spawn(async move {
            let mut calls = Vec::new();
            loop {
                let from = next.fetch_add(batch_size as u64, Ordering::Relaxed);
                if from >= events {
                    break;
                }
                let to = (from + batch_size as u64).min(events);
                let batch: Vec<Event> = (from..to)
                    .map(|g| Event {
                        id: Uuid::now_v7(),
                        aggregate_type: "bench".into(),
                        aggregate_id: format!("a{}", g % aggregates),
                        event_type: "bench.event".into(),
                        payload: payload(g, pad).to_string().into_bytes(),
                        content_type: "application/json".into(),
                        headers: Default::default(),
                        destination: None,
                        created_at: chrono::Utc::now(),
                        attempts: 0,
                    })
                    .collect();
                let call = Instant::now();
                let outcomes = publisher.publish(&batch).await;
                calls.push(call.elapsed().as_secs_f64() * 1000.0);
                if let Some(Err(e)) = outcomes.into_iter().find(Result::is_err) {
                    return Err(e);
                }
            }
            Ok::<Vec<f64>, Error>(calls)
        }));
    }
    let mut calls = Vec::new();
    for t in tasks {
        calls.extend(join(t).await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    calls.sort_by(f64::total_cmp);
    let figures = PublisherFigures {
        events,
        batch_size,
        in_flight,
        seconds,
        events_per_second: events as f64 / seconds,
        batch_p50_ms: percentile(&calls, 50.0),
        batch_p99_ms: percentile(&calls, 99.0),
    };
    progress(&format!(
        "publisher alone -> {}: {:.0} events/s, call p99 {:.1} ms",
        target.name(),
        figures.events_per_second,
        figures.batch_p99_ms
    ));
    Ok(figures)
}
