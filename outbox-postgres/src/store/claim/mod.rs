//! The claim. Ordered: take partitions of the aggregates (transaction-scoped advisory locks, held
//! by the batch's lease), then read the oldest ready events of those partitions, within a byte
//! budget (`ordered`); skip scans over the aggregates find heads beyond that read (`skip`).
//! Unordered: lock ready rows (`FOR UPDATE SKIP LOCKED`, `unordered`).

mod ordered;
mod skip;
mod unordered;

use std::collections::HashSet;

use sqlx::Connection;

use txoutbox_core::{Batch, ClaimRequest, Error, OrderingPolicy};

use super::lease::{EmptyLease, PgLease};
use super::PostgresStore;
use crate::error::map_sqlx;
use crate::pool::KEEPALIVES_LOCAL;

/// Opens a claim's transaction (one round trip). Every statement of a claim and its settlement reads
/// the outbox through an index; without sequential scans the planner has no plan left whose cost
/// grows with the table. (A plan cached while the outbox was nearly empty, which is its usual state,
/// would otherwise scan the whole backlog once per candidate head when a backlog builds up, until
/// the next ANALYZE of the table.)
///
/// The claim transaction is the lease: it stays open, idle, while the batch is published. Its own
/// `idle_in_transaction_session_timeout` is the relay's hold time (`ClaimRequest::hold_for`), so a
/// shorter timeout of the role or database (which the operations guide recommends against forgotten
/// transactions) cannot end a lease in the middle of a publish.
///
/// It is READ COMMITTED whatever the role's or database's `default_transaction_isolation`: each
/// statement must see what other leases settled before it, in particular the owned read, which
/// follows the statement that took the partitions (a snapshot kept from before the locks would
/// show events another lease has just settled as pending, and they would be published again).
///
/// It sets the TCP keepalives and user timeout of its connection for its own length
/// ([`KEEPALIVES_LOCAL`]): the release of a vanished relay's lease does not depend on how the pool
/// was opened.
pub(super) fn claim_begin(hold_for: std::time::Duration) -> String {
    let ms = hold_for.as_millis().clamp(1_000, i32::MAX as u128);
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL enable_seqscan = off; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
         {KEEPALIVES_LOCAL}; SAVEPOINT {CLAIM_LOCKS}"
    )
}

/// The savepoint taken before a claim locks anything: when the byte budget leaves locked rows out of
/// an unordered batch, the claim rolls back to it (releasing every lock) and locks again only the
/// rows it keeps, so that no row is held by a lease that will not publish it.
pub(super) const CLAIM_LOCKS: &str = "claim_locks";

/// Claims that read more payload bytes than this give their connection's grown buffers back.
pub(super) const SHRINK_BUFFERS_ABOVE: usize = 1024 * 1024;

impl PostgresStore {
    /// Claims a batch (see [`Store::claim`](txoutbox_core::Store::claim)).
    pub(super) async fn claim_batch(&self, request: ClaimRequest) -> Result<Batch, Error> {
        let limit = i64::try_from(request.limit).unwrap_or(i64::MAX);
        let max_bytes = i64::try_from(request.max_bytes).unwrap_or(i64::MAX);
        let mut tx = self
            .pool
            .begin_with(claim_begin(request.hold_for))
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        let mut to_keep = None;
        let events = match request.ordering {
            OrderingPolicy::Unordered => self.claim_unordered(&mut tx, limit, max_bytes).await?,
            OrderingPolicy::PerAggregate => {
                let (mut events, set) = self
                    .claim_owned(&mut tx, limit, max_bytes, &request)
                    .await?;
                to_keep = set;
                // Every event once: a batch that held one twice would publish it twice.
                let mut ids = HashSet::with_capacity(events.len());
                let before = events.len();
                events.retain(|e| ids.insert(e.id));
                if events.len() < before {
                    tracing::warn!(
                        dropped = before - events.len(),
                        "a claim read some events twice; each is in the batch once"
                    );
                }
                events
            }
        };
        // The connection's read buffer grew to the largest row it read and would keep that size for
        // the life of the connection (one per pool slot): a few large events would otherwise pin
        // the pool's buffers at their size for good, outside the byte budget.
        if events.iter().map(|e| e.payload.len()).sum::<usize>() > SHRINK_BUFFERS_ABOVE {
            tx.shrink_buffers();
        }
        if events.is_empty() {
            tx.rollback().await.map_err(|e| map_sqlx("claim", e))?;
            return Ok(Batch {
                events: Vec::new(),
                lease: Box::new(EmptyLease),
            });
        }
        let ids = events.iter().map(|e| e.id).collect();
        Ok(Batch {
            events,
            lease: Box::new(PgLease {
                tx,
                ids,
                sql: self.sql.clone(),
                pool: self.pool.clone(),
                ordering: request.ordering,
                keep: to_keep.map(|set| (self.kept.clone(), set)),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use crate::store::sql::{self, Sql};
    use crate::store::Retention;
    use crate::table::OutboxTable;

    #[test]
    fn claim_sql_takes_partitions_and_honours_the_table() {
        let t = OutboxTable::new("s", "events").unwrap();
        let sql = Sql::new(&t, Retention::Delete);
        let key = format!(
            "pg_try_advisory_xact_lock({}, ",
            sql::partition_lock_key(&t)
        );
        assert!(sql.claim_partitions.contains(&key));
        assert!(sql.claim_partitions.contains("\"s\".\"events\""));
        assert!(sql.claim_owned.contains("\"s\".\"events\""));
        assert!(!sql.claim_owned.contains("FOR UPDATE"));
        assert!(sql.claim_owned.contains("b.retry_after > now()"));
        assert!(sql.claim_runs.contains("\"s\".\"events\""));
        for skip in [&sql.claim_skip_first, &sql.claim_skip_after] {
            assert!(skip.contains(&key));
            assert!(skip.contains("\"s\".\"events\""));
        }
        assert!(sql.claim_skip_after.contains("> ($5, $6)"));
        assert!(!sql.claim_skip_first.contains("$5"));
        assert!(sql.lock_lost_partitions.contains(&key));
        assert!(sql.claim_unordered.contains("FOR UPDATE SKIP LOCKED"));
        assert!(!sql.claim_unordered.contains("NOT EXISTS"));
        assert!(sql.settle.contains("DELETE FROM \"s\".\"events\""));
        let keep = Sql::new(&t, Retention::Keep);
        assert!(keep.settle.contains("SET processed_at = now()"));
    }

    #[test]
    fn partition_lock_keys_are_stable_and_differ_by_table() {
        let a = OutboxTable::new("s", "events").unwrap();
        let b = OutboxTable::new("s", "events2").unwrap();
        assert_eq!(sql::partition_lock_key(&a), sql::partition_lock_key(&a));
        assert_ne!(sql::partition_lock_key(&a), sql::partition_lock_key(&b));
        // FNV-1a of `outbox.claim "s"."events"`: relays of every version must agree on it.
        assert_eq!(sql::partition_lock_key(&a), -2_051_167_190);
    }

    /// A pool opened without the keepalives of `txoutbox_postgres::connect` (a service's own): its
    /// claims carry them all the same, for the transaction only.
    #[tokio::test]
    async fn a_claim_sets_keepalives_on_its_connection_whatever_the_pool() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&crate::testing::database_url())
            .await
            .expect("the test database (DATABASE_URL, over TCP): run scripts/test-env.sh");
        async fn show(conn: &mut sqlx::PgConnection, name: &str) -> String {
            sqlx::query_scalar(&format!("SHOW {name}"))
                .fetch_one(conn)
                .await
                .unwrap()
        }
        let settings = [
            ("tcp_keepalives_idle", "10"),
            ("tcp_keepalives_interval", "5"),
            ("tcp_keepalives_count", "3"),
            ("tcp_user_timeout", "25000"),
        ];
        let mut before = Vec::new();
        {
            let mut conn = pool.acquire().await.unwrap();
            for (name, _) in settings {
                before.push(show(&mut conn, name).await);
            }
        }
        assert_ne!(
            before[0], "10",
            "the pool's connection has its own keepalives"
        );
        let mut tx = pool
            .begin_with(super::claim_begin(std::time::Duration::from_secs(30)))
            .await
            .unwrap();
        for (name, value) in settings {
            assert_eq!(show(&mut tx, name).await, value, "{name} in the claim");
        }
        tx.rollback().await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        for ((name, _), was) in settings.iter().zip(&before) {
            assert_eq!(&show(&mut conn, name).await, was, "{name} after a rollback");
        }
        drop(conn);
        let tx = pool
            .begin_with(super::claim_begin(std::time::Duration::from_secs(30)))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        for ((name, _), was) in settings.iter().zip(&before) {
            assert_eq!(&show(&mut conn, name).await, was, "{name} after a commit");
        }
    }
}
