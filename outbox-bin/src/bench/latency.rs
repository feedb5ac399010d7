//! The latency phase: commit-to-acknowledgement latency at a steady offered rate, with the relay
//! woken by polling, by NOTIFY, or by the WAL source's stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use txoutbox_core::{Error, NewEvent, Publisher, Relay, Store};
use txoutbox_postgres::{connect, map_sqlx, notify, OutboxTable, PostgresStore, Writer};

use super::fill::payload;
use super::instruments::{join, wait_for_settled, Counter, Wrapped};
use super::options::BenchOptions;
use super::report::{percentile, LatencyFigures, StageFigures};
use super::wal::WalBench;
use crate::target::BenchTarget;

#[allow(clippy::too_many_arguments)]
pub(super) async fn latency_run(
    url: &str,
    admin: &PgPool,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    notify_on: bool,
    wal: Option<&WalBench>,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<LatencyFigures, Error> {
    let wakeup = match (wal, notify_on) {
        (Some(_), _) => "wal",
        (None, true) => "notify",
        (None, false) => "poll",
    };
    if notify_on {
        notify::install_notify_trigger(admin, table).await?;
    }
    let result = latency_inner(url, table, target, o, notify_on, wal, progress).await;
    if notify_on {
        notify::remove_notify_trigger(admin, table).await?;
    }
    let (committed, acks, seconds, stages) = result?;
    let warm_up = committed
        .iter()
        .map(|(_, t)| *t)
        .min()
        .map(|t| t + Duration::from_secs(1));
    let acked: HashMap<Uuid, Instant> = acks.into_iter().collect();
    let mut ms: Vec<f64> = committed
        .iter()
        .filter(|(_, t)| Some(*t) >= warm_up)
        .filter_map(|(id, t)| {
            acked
                .get(id)
                .map(|a| a.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    let figures = LatencyFigures {
        wakeup: wakeup.into(),
        offered_rate: o.rate,
        achieved_rate: committed.len() as f64 / seconds,
        events: ms.len(),
        p50_ms: percentile(&ms, 50.0),
        p95_ms: percentile(&ms, 95.0),
        p99_ms: percentile(&ms, 99.0),
        max_ms: ms.last().copied().unwrap_or(0.0),
        stages,
    };
    progress(&format!(
        "latency ({wakeup}): p50 {:.2} ms, p99 {:.2} ms at {:.0} events/s",
        figures.p50_ms, figures.p99_ms, figures.achieved_rate
    ));
    Ok(figures)
}

type Stamps = Vec<(Uuid, Instant)>;

async fn latency_inner(
    url: &str,
    table: &OutboxTable,
    target: &dyn BenchTarget,
    o: &BenchOptions,
    notify_on: bool,
    wal: Option<&WalBench>,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(Stamps, Stamps, f64, StageFigures), Error> {
    let relay_pool = connect(url, o.relay.max_in_flight as u32 + 2).await?;
    let clock = Arc::new(Wrapped {
        inner: target.publisher().await?,
        delay: Duration::ZERO,
        acks: Some(Mutex::new(Vec::new())),
    });
    clock.check().await?;
    let counter = Arc::new(Counter::default());
    let wake = txoutbox_core::Wake::new();
    let (store, reader): (Arc<dyn Store>, _) = match wal {
        Some(w) => {
            let store = w.store(relay_pool.clone(), wake.clone(), o)?;
            let reader = store.start();
            (Arc::new(store), Some(reader))
        }
        None => (
            Arc::new(PostgresStore::new(relay_pool.clone(), table.clone())),
            None,
        ),
    };
    let relay = Relay::new(store, clock.clone(), o.relay.clone())?
        .with_observer(counter.clone())
        .with_wake(wake);
    let shutdown = CancellationToken::new();
    if notify_on {
        let (pool, table, wake, s) = (
            relay_pool.clone(),
            table.clone(),
            relay.wake_handle(),
            shutdown.clone(),
        );
        tokio::spawn(async move { notify::listen(&pool, &table, wake, s).await });
    }
    let relay_task = {
        let s = shutdown.clone();
        tokio::spawn(async move { relay.run(s).await })
    };
    // The writers commit one event per transaction, spread over tasks so that commit flushes overlap;
    // they do not wake the relay (it stands for a relay in another process).
    let tasks_n = 8usize;
    let period = Duration::from_secs_f64(tasks_n as f64 / f64::from(o.rate));
    let writer_pool = connect(url, tasks_n as u32).await?;
    let writer = Writer::new(table.clone());
    progress(&format!(
        "latency ({}): {} events/s for {}",
        match (wal, notify_on) {
            (Some(_), _) => "wal",
            (None, true) => "notify",
            (None, false) => "poll",
        },
        o.rate,
        txoutbox_core::duration::format(o.latency_duration)
    ));
    let started = Instant::now();
    let deadline = started + o.latency_duration;
    let mut tasks = Vec::new();
    for w in 0..tasks_n {
        let (pool, writer, pad) = (writer_pool.clone(), writer.clone(), o.payload_bytes);
        let aggregates = o.aggregates as u64;
        tasks.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(
                started + period.mul_f64(w as f64 / tasks_n as f64),
                period,
            );
            let mut stamps = Vec::new();
            let mut n = 0u64;
            loop {
                ticks.tick().await;
                if Instant::now() >= deadline {
                    break;
                }
                let k = n * tasks_n as u64 + w as u64;
                let event = NewEvent::new(
                    "order",
                    format!("a{}", k % aggregates),
                    "order.created",
                    payload(k, pad),
                );
                let id = event.id;
                let mut tx = pool.begin().await.map_err(|e| map_sqlx("bench", e))?;
                writer.enqueue(&mut tx, event).await?;
                tx.commit().await.map_err(|e| map_sqlx("bench", e))?;
                stamps.push((id, Instant::now()));
                n += 1;
            }
            Ok::<Stamps, Error>(stamps)
        }));
    }
    let mut committed = Vec::new();
    for t in tasks {
        committed.extend(join(t).await??);
    }
    let seconds = started.elapsed().as_secs_f64();
    let settled = wait_for_settled(&counter, committed.len() as u64, progress).await;
    shutdown.cancel();
    join(relay_task).await?;
    if let Some(reader) = reader {
        reader.stop().await;
    }
    settled?;
    let acks = clock
        .acks
        .as_ref()
        .and_then(|a| a.lock().ok().map(|mut a| std::mem::take(&mut *a)))
        .unwrap_or_default();
    Ok((committed, acks, seconds, counter.stages()))
}
