//! The WAL source in the benchmark: its slot, publication and held table over the bench's table
//! ([`WalBench`]), and a relay over it draining the backlog the slot holds.

use std::sync::Arc;

use sqlx::PgPool;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use txoutbox_core::{Error, Relay};
use txoutbox_postgres::wal::{check_wal_level, wal_level, WalConfig, WalSlot, WalStore};
use txoutbox_postgres::{connect, migrate, OutboxTable, PostgresStore};

use super::fill::truncate;
use super::instruments::{delayed, join, wait_for_settled, Counter};
use super::options::BenchOptions;
use super::report::DrainFigures;
use super::rss::RssSampler;
use crate::target::BenchTarget;

/// Rows per transaction of the WAL source's drain backlog.
pub(super) const WAL_FILL_TX_ROWS: u64 = 100;

/// Said in the report when the server cannot decode its WAL.
pub(super) const WAL_UNAVAILABLE: &str =
    "WAL source not measured: the server's wal_level is not logical (set it and restart PostgreSQL)";

/// The bench's slot, publication and held table over its outbox table.
pub(super) struct WalBench {
    slot: WalSlot,
    held: OutboxTable,
    config: WalConfig,
}

impl WalBench {
    /// A fresh slot (a leftover of an earlier run is dropped) and held table; `None` when the
    /// server's `wal_level` is not `logical`.
    pub(super) async fn prepare(
        admin: &PgPool,
        table: &OutboxTable,
        progress: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<Option<WalBench>, Error> {
        if check_wal_level(&wal_level(admin).await?).is_err() {
            progress(WAL_UNAVAILABLE);
            return Ok(None);
        }
        // Named after the bench's schema (slots are server-wide: two benches at once in two
        // schemas each have their own), as `outbox wal setup` names them.
        let config = WalConfig {
            message_prefix: table.schema().to_string(),
            ..WalConfig::default()
        };
        let slot = config.slot(table)?;
        let held = config.held_table(table)?;
        migrate(admin, &held).await?;
        let wal = WalBench { slot, held, config };
        wal.drop(admin).await;
        Ok(Some(wal))
    }

    /// Empties the tables and makes the slot anew, so that it holds what is written next only.
    pub(super) async fn reset(&self, admin: &PgPool) -> Result<(), Error> {
        self.drop(admin).await;
        truncate(admin, self.slot.table()).await?;
        truncate(admin, &self.held).await?;
        self.slot.setup(admin).await?;
        Ok(())
    }

    /// Drops the slot and publication (a slot left behind keeps WAL for ever).
    pub(super) async fn drop(&self, admin: &PgPool) {
        if let Err(e) = self.slot.drop(admin).await {
            tracing::warn!(error = %e, slot = self.slot.slot(), "cannot drop the bench's slot: drop it with `outbox wal drop`");
        }
    }

    pub(super) fn store(
        &self,
        pool: PgPool,
        wake: txoutbox_core::Wake,
        o: &BenchOptions,
    ) -> Result<WalStore, Error> {
        WalStore::new(
            pool.clone(),
            self.slot.clone(),
            PostgresStore::new(pool, self.held.clone()),
            &self.config,
        )
        .map(|store| {
            store
                .with_wake(wake)
                .with_held_poll_interval(o.relay.poll_interval)
        })
    }
}

/// One relay over the WAL source drains the backlog the slot holds to `target`.
pub(super) async fn wal_drain_run(
    url: &str,
    wal: &WalBench,
    target: &dyn BenchTarget,
    events: u64,
    o: &BenchOptions,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<DrainFigures, Error> {
    let counter = Arc::new(Counter::default());
    let shutdown = CancellationToken::new();
    let pool = connect(url, o.relay.max_in_flight as u32 + 1).await?;
    let wake = txoutbox_core::Wake::new();
    let store = wal.store(pool, wake.clone(), o)?;
    let publisher = delayed(target.publisher().await?, o.publish_delay);
    publisher.check().await?;
    let relay = Relay::new(Arc::new(store.clone()), publisher, o.relay.clone())?
        .with_observer(counter.clone())
        .with_wake(wake);
    progress(&format!(
        "drain (WAL source): 1 relay -> {}, {events} events",
        target.name()
    ));
    let rss = RssSampler::start();
    let started = Instant::now();
    let reader = store.start();
    let handle = {
        let s = shutdown.clone();
        tokio::spawn(async move { relay.run(s).await })
    };
    let outcome = wait_for_settled(&counter, events, progress).await;
    let seconds = started.elapsed().as_secs_f64();
    shutdown.cancel();
    join(handle).await?;
    reader.stop().await;
    outcome?;
    let rate = events as f64 / seconds;
    progress(&format!(
        "drain (WAL source): 1 relay -> {}: {rate:.0} events/s",
        target.name()
    ));
    Ok(DrainFigures {
        publisher: target.name().to_string(),
        relay: "wal".into(),
        relays: 1,
        events,
        seconds,
        events_per_second: rate,
        peak_rss_bytes: rss.peak(),
        stages: Some(counter.stages()),
    })
}
