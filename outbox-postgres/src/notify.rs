//! Optional LISTEN/NOTIFY wake-up.
//!
//! [`install_notify_trigger`] adds a statement-level trigger that calls `pg_notify(channel, '')` after
//! each INSERT into the outbox; PostgreSQL folds identical notifications of one transaction into one,
//! so writers send one payload-free notification per transaction. [`listen`] wakes the relay on each
//! notification and reconnects when the connection drops. Polling stays on as the fallback: a
//! notification lost during a reconnection delays events by one poll interval at most.
//!
//! Cost: `NOTIFY` takes a server-wide lock held through the commit, so notifying transactions commit
//! one at a time (BENCHMARKS-HISTORY.md, "Writers with NOTIFY"). Enable it only when the write rate is low
//! and latency matters.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{Executor, PgPool};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use txoutbox_core::{Error, ErrorKind, Wake};

use crate::error::map_sqlx;
use crate::table::OutboxTable;

/// The notification channel of `table`: `<schema>.<table>`.
///
/// # Errors
/// A config error when the name is longer than PostgreSQL's 63-byte identifier limit.
pub fn channel(table: &OutboxTable) -> Result<String, Error> {
    let c = format!("{}.{}", table.schema(), table.table());
    if c.len() > 63 {
        return Err(Error::new(
            ErrorKind::Config,
            format!("the notification channel {c:?} is longer than 63 bytes: use shorter database.schema / database.table names, or database.notify = false"),
        ));
    }
    Ok(c)
}

/// Installs (or replaces) the notify trigger on `table`.
///
/// # Errors
/// A database error, or a config error for an over-long channel name.
pub async fn install_notify_trigger(pool: &PgPool, table: &OutboxTable) -> Result<(), Error> {
    let channel = channel(table)?;
    let function = table.qualified_derived("notify");
    let trigger = format!("{}_notify", table.table());
    let sql = format!(
        "BEGIN; SET LOCAL client_min_messages = warning;
         CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $fn$
         BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $fn$;
         DROP TRIGGER IF EXISTS \"{trigger}\" ON {t};
         CREATE TRIGGER \"{trigger}\" AFTER INSERT ON {t} FOR EACH STATEMENT EXECUTE FUNCTION {function}();
         COMMIT;",
        t = table.qualified()
    );
    pool.execute(sqlx::raw_sql(&sql))
        .await
        .map_err(|e| map_sqlx("install notify trigger", e))?;
    Ok(())
}

/// Removes the notify trigger from `table`, if present.
///
/// # Errors
/// A database error.
pub async fn remove_notify_trigger(pool: &PgPool, table: &OutboxTable) -> Result<(), Error> {
    let function = table.qualified_derived("notify");
    let trigger = format!("{}_notify", table.table());
    let sql = format!(
        "BEGIN; SET LOCAL client_min_messages = warning;
         DROP TRIGGER IF EXISTS \"{trigger}\" ON {t}; DROP FUNCTION IF EXISTS {function}();
         COMMIT;",
        t = table.qualified()
    );
    pool.execute(sqlx::raw_sql(&sql))
        .await
        .map_err(|e| map_sqlx("remove notify trigger", e))?;
    Ok(())
}

/// Wakes `wake` on every notification of `table` until `shutdown`; reconnects (and wakes once, for
/// what may have been missed) when the connection drops.
///
/// # Errors
/// Only when the first connection cannot be made (later failures are retried).
pub async fn listen(
    pool: &PgPool,
    table: &OutboxTable,
    wake: Wake,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let channel = channel(table)?;
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(|e| map_sqlx("listen", e))?;
    listener
        .listen(&channel)
        .await
        .map_err(|e| map_sqlx("listen", e))?;
    info!(channel = %channel, "listening for outbox notifications");
    let mut backoff = Duration::from_millis(100);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            next = listener.try_recv() => match next {
                Ok(Some(_)) => {
                    backoff = Duration::from_millis(100);
                    wake.wake();
                }
                Ok(None) => {
                    // The connection dropped; the next call reconnects and listens again.
                    debug!("notification connection lost; reconnecting");
                    wake.wake();
                }
                Err(e) => {
                    warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "notification listener failed");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.cancelled() => return Ok(()),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }
}
