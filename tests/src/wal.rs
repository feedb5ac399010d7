//! The WAL source in tests: a slot and held table per test table, dropped at the end.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use txoutbox_core::{CancellationToken, Publisher, Relay, RelayConfig, RelaySummary, Wake};
use txoutbox_postgres::testing::pool;
use txoutbox_postgres::wal::{ReaderHandle, WalConfig, WalSlot, WalStore};
use txoutbox_postgres::{OutboxTable, PostgresStore};

use crate::harness::{committed_in_db, wait_until, Load, RelayProcess, Sink};
use crate::Verdict;

/// The slot, publication and held table of a test table; the slot and publication are dropped
/// when this is (failed test or not): a forgotten slot keeps WAL for ever.
pub struct WalSource {
    /// The slot.
    pub slot: WalSlot,
    /// The held table.
    pub held: OutboxTable,
    /// The settings the relays of the test use.
    pub config: WalConfig,
    pool: sqlx::PgPool,
}

impl WalSource {
    /// Sets up the WAL source of `table` (as `outbox wal setup` does), reading every 20 ms when idle.
    ///
    /// # Panics
    /// When `wal_level` is not `logical` (naming the fix) or the setup fails (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn setup(table: &OutboxTable) -> WalSource {
        let pool = pool(2).await;
        let level = txoutbox_postgres::wal::wal_level(&pool).await.unwrap();
        assert_eq!(
            level, "logical",
            "the WAL tests need wal_level = logical: run `bash scripts/test-env.sh` (it sets it and restarts the local server once)"
        );
        let config = WalConfig {
            message_prefix: table.schema().to_string(),
            ..WalConfig::default()
        };
        let slot = config.slot(table).unwrap();
        let held = txoutbox_postgres::wal::setup(&pool, table, &config)
            .await
            .unwrap()
            .held;
        WalSource {
            slot,
            held,
            config,
            pool,
        }
    }

    /// [`WalSource::setup`] when `wal`, for scenarios run on both sources.
    pub async fn setup_if(wal: bool, table: &OutboxTable) -> Option<WalSource> {
        if wal {
            Some(WalSource::setup(table).await)
        } else {
            None
        }
    }

    /// A WAL store with a pool of its own (as a relay process has), waking `wake`.
    ///
    /// # Panics
    /// When the test database's settings make no replication connection (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn store(&self, wake: Wake) -> WalStore {
        let pool = pool(6).await;
        WalStore::new(
            pool.clone(),
            self.slot.clone(),
            PostgresStore::new(pool, self.held.clone()),
            &self.config,
        )
        .unwrap()
        .with_wake(wake)
        .with_held_poll_interval(Duration::from_millis(50))
    }

    /// Starts a relay over a WAL store of its own; cancel the token to stop it (its reader stops
    /// after it).
    ///
    /// # Panics
    /// When the configuration is invalid (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn spawn_relay(
        &self,
        publisher: Arc<dyn Publisher>,
        config: RelayConfig,
        shutdown: CancellationToken,
    ) -> (WalStore, JoinHandle<RelaySummary>) {
        let wake = Wake::new();
        let store = self.store(wake.clone()).await;
        let relay = Relay::new(Arc::new(store.clone()), publisher, config)
            .unwrap()
            .with_wake(wake);
        let reader: ReaderHandle = store.start();
        let task = tokio::spawn(async move {
            let summary = relay.run(shutdown).await;
            reader.stop().await;
            summary
        });
        (store, task)
    }

    /// Rows ever inserted into the held table (it deletes what it published): its sequence, two
    /// values a row (the identity column's default, then the writer-order trigger's).
    ///
    /// # Panics
    /// When the database is unreachable (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn held_rows_in(&self) -> i64 {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence($1, 'seq')), 0) / 2",
        )
        .bind(self.held.qualified())
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Events in the held table not yet published (dead letters included).
    ///
    /// # Panics
    /// When the database is unreachable (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn held_unpublished(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE processed_at IS NULL",
            self.held.qualified()
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

impl Drop for WalSource {
    fn drop(&mut self) {
        let (slot, pool) = (self.slot.clone(), self.pool.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async move {
                    // A reader that is still stopping holds the slot for a moment.
                    for _ in 0..100 {
                        match slot.drop(&pool).await {
                            Ok(_) => return,
                            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                });
            }
        })
        .join();
    }
}

impl WalSource {
    /// The settings of an `outbox relay` process reading this source (`database.source = "wal"`,
    /// this test's message prefix), plus `extra`.
    pub fn relay_env(&self, extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut env = vec![
            ("OUTBOX_DATABASE__SOURCE".to_string(), "wal".to_string()),
            (
                "OUTBOX_WAL__MESSAGE_PREFIX".to_string(),
                self.config.message_prefix.clone(),
            ),
        ];
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        env
    }

    /// The `application_name` of the session that holds the slot's reader lock (the active relay),
    /// if any.
    ///
    /// # Panics
    /// When the database is unreachable (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn reader(&self, pg: &sqlx::PgPool) -> Option<String> {
        sqlx::query_scalar(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted
               AND l.classid::int4 = hashtext('outbox-wal-reader') AND l.objid::int4 = hashtext($1)",
        )
        .bind(self.slot.slot())
        .fetch_optional(pg)
        .await
        .unwrap()
    }
}

impl WalSource {
    /// The slot's confirmed position, as the server has it.
    ///
    /// # Panics
    /// When the database is unreachable or the slot is missing (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn confirmed(&self, pg: &sqlx::PgPool) -> u64 {
        let lsn: i64 = sqlx::query_scalar(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(self.slot.slot())
        .fetch_one(pg)
        .await
        .unwrap();
        lsn as u64
    }
}

/// A relay over `store` publishing to `publisher` (batches of 100, polling every 50 ms), until
/// `shutdown`; the store's reader starts with it and stops after it.
///
/// # Panics
/// When the configuration is invalid (this is test support).
#[allow(clippy::unwrap_used)]
pub fn run_store(
    store: WalStore,
    publisher: Arc<dyn Publisher>,
    shutdown: &CancellationToken,
) -> JoinHandle<()> {
    let relay = Relay::new(
        Arc::new(store.clone()),
        publisher,
        RelayConfig {
            batch_size: 100,
            poll_interval: Duration::from_millis(50),
            ..RelayConfig::default()
        },
    )
    .unwrap();
    let reader = store.start();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        relay.run(shutdown).await;
        reader.stop().await;
    })
}

impl WalSource {
    /// Ends a scenario of relay processes over this source: stops `load`, waits for every event it
    /// committed at `sink`, stops `relays` cleanly, waits for the held table to empty, and judges
    /// the delivery. Returns what committed and the verdict.
    ///
    /// # Panics
    /// When an event does not arrive, a relay does not stop cleanly or the held table does not
    /// empty (this is test support).
    pub async fn finish(
        &self,
        pg: &sqlx::PgPool,
        table: &OutboxTable,
        sink: &Sink,
        load: Load,
        relays: Vec<RelayProcess>,
    ) -> (Vec<(String, uuid::Uuid)>, Verdict) {
        let written = load.stop().await;
        let committed = committed_in_db(pg, table, &written).await;
        let verdict = self.finish_with(sink, &committed, relays).await;
        (committed, verdict)
    }

    /// As [`WalSource::finish`], for what a load of the scenario's own committed.
    ///
    /// # Panics
    /// As [`WalSource::finish`].
    pub async fn finish_with(
        &self,
        sink: &Sink,
        committed: &[(String, uuid::Uuid)],
        relays: Vec<RelayProcess>,
    ) -> Verdict {
        sink.wait_all(committed, Duration::from_secs(180)).await;
        for r in relays {
            assert_eq!(r.terminate(Duration::from_secs(60)), Some(0));
        }
        wait_until(Duration::from_secs(30), "the held table empty", || async {
            self.held_unpublished().await == 0
        })
        .await;
        sink.judge(committed).await
    }
}

impl WalSource {
    /// Takes `table` out of the source's publication (`ALTER PUBLICATION ... DROP TABLE`), as an
    /// operator might: its inserts are no longer decoded.
    ///
    /// # Panics
    /// When the statement fails (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn unpublish(&self, pg: &sqlx::PgPool, table: &OutboxTable) {
        sqlx::query(&format!(
            "ALTER PUBLICATION {} DROP TABLE {}",
            self.slot.publication(),
            table.qualified()
        ))
        .execute(pg)
        .await
        .unwrap();
    }

    /// Whether the slot's publication holds `table`.
    ///
    /// # Panics
    /// When the database is unreachable (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn published(&self, pg: &sqlx::PgPool, table: &OutboxTable) -> bool {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                            WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
        )
        .bind(self.slot.publication())
        .bind(table.schema())
        .bind(table.table())
        .fetch_one(pg)
        .await
        .unwrap()
    }

    /// Puts `table` back into the slot's publication (what `outbox wal setup` would do).
    ///
    /// # Panics
    /// When the statement fails (this is test support).
    #[allow(clippy::unwrap_used)]
    pub async fn republish(&self, pg: &sqlx::PgPool, table: &OutboxTable) {
        sqlx::query(&format!(
            "ALTER PUBLICATION {} ADD TABLE {}",
            self.slot.publication(),
            table.qualified()
        ))
        .execute(pg)
        .await
        .unwrap();
    }
}

/// `(key, value)` pairs borrowed, as `RelayProcess::start` takes them.
pub fn pairs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// The server's current WAL position: a transaction committed before it is confirmed once the
/// slot's confirmed position passes it.
#[allow(clippy::unwrap_used)]
pub async fn wal_position(pool: &sqlx::PgPool) -> u64 {
    sqlx::query_scalar::<_, i64>("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(pool)
        .await
        .unwrap() as u64
}
