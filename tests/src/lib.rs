#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]
//! End-to-end and fault tests of the outbox toolkit against real servers; see `tests/*.rs`.
//!
//! This library holds the checker shared by the scenarios.

pub mod harness;
pub mod net;
pub mod wal;

use std::collections::HashMap;
use std::sync::Arc;

use tokio::task::JoinHandle;
use txoutbox_core::testkit::sample_event;
use txoutbox_core::{CancellationToken, Publisher, Relay, RelayConfig, RelaySummary};
use txoutbox_postgres::testing::pool;
use txoutbox_postgres::{OutboxTable, PostgresStore, Writer};
use uuid::Uuid;

/// Commits `rounds` transactions, each with one event for every one of `aggregates` aggregates
/// (`agg-0`, `agg-1`...), and returns `(aggregate, id)` in `seq` order, read back from the database
/// inside each transaction (so that a relay already running cannot take rows away first).
///
/// # Panics
/// When the database is unreachable or a write fails (this is test support).
#[allow(clippy::unwrap_used)]
pub async fn write_rounds(
    table: &OutboxTable,
    aggregates: usize,
    rounds: usize,
) -> Vec<(String, Uuid)> {
    let pg = pool(2).await;
    let writer = Writer::new(table.clone());
    let read_back = format!(
        "SELECT aggregate_id, id FROM {} WHERE id = ANY($1) ORDER BY seq",
        table.qualified()
    );
    let mut committed = Vec::with_capacity(aggregates * rounds);
    for n in 0..rounds {
        let mut tx = pg.begin().await.unwrap();
        let events: Vec<_> = (0..aggregates)
            .map(|a| sample_event(&format!("agg-{a}"), n))
            .collect();
        let ids = writer.enqueue_many(&mut tx, events).await.unwrap();
        let rows: Vec<(String, Uuid)> = sqlx::query_as(&read_back)
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .unwrap();
        assert_eq!(rows.len(), aggregates);
        writer.commit(tx).await.unwrap();
        committed.extend(rows);
    }
    committed
}

/// Starts `relays` relays over `table`, each with a pool of its own (as separate processes would
/// have), publishing through `publisher`; cancel the token to stop them.
///
/// # Panics
/// When the configuration is invalid or the database unreachable (this is test support).
#[allow(clippy::unwrap_used)]
pub async fn spawn_relays(
    table: &OutboxTable,
    relays: usize,
    publisher: Arc<dyn Publisher>,
    config: RelayConfig,
) -> (Vec<JoinHandle<RelaySummary>>, CancellationToken) {
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();
    for _ in 0..relays {
        let store = PostgresStore::new(pool(4).await, table.clone());
        let relay = Relay::new(Arc::new(store), publisher.clone(), config.clone()).unwrap();
        let s = shutdown.clone();
        tasks.push(tokio::spawn(async move { relay.run(s).await }));
    }
    (tasks, shutdown)
}

/// What a checker found when comparing what was committed with what the broker received.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Events committed to the outbox.
    pub committed: usize,
    /// Distinct committed events received.
    pub delivered: usize,
    /// Extra receptions of an event already received.
    pub duplicates: usize,
    /// Receptions where an aggregate's event arrived after a later event of that aggregate had
    /// arrived for the first time.
    pub order_violations: usize,
    /// Committed events never received.
    pub lost: usize,
    /// Distinct ids received that are not among the committed events expected: rolled back, never
    /// written, dead-lettered, or held back behind a dead letter.
    pub unexpected: usize,
    /// What the consumer's own reads failed with (shown, so that it is not mistaken for loss).
    pub consumer_errors: Vec<String>,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "committed={} delivered={} duplicates={} order_violations={} lost={} unexpected={}",
            self.committed,
            self.delivered,
            self.duplicates,
            self.order_violations,
            self.lost,
            self.unexpected
        )?;
        if !self.consumer_errors.is_empty() {
            write!(f, " consumer_errors={}", self.consumer_errors.len())?;
        }
        Ok(())
    }
}

/// Compares the committed events (`(aggregate, id)` in commit order per aggregate) with the ids
/// received, in reception order.
///
/// Order is checked on first receptions: the first time each event of an aggregate arrives must follow
/// the aggregate's commit order. A re-delivery (duplicate) is counted, not judged. An id received that
/// is not in `committed` counts as `unexpected` (once, however often it arrived).
pub fn check(committed: &[(String, Uuid)], received: &[Uuid]) -> Verdict {
    let mut position: HashMap<Uuid, (&str, usize)> = HashMap::new();
    let mut per_aggregate: HashMap<&str, usize> = HashMap::new();
    for (agg, id) in committed {
        let n = per_aggregate.entry(agg.as_str()).or_insert(0);
        position.insert(*id, (agg.as_str(), *n));
        *n += 1;
    }
    let mut seen: HashMap<Uuid, usize> = HashMap::new();
    let mut high_water: HashMap<&str, usize> = HashMap::new();
    let mut v = Verdict {
        committed: committed.len(),
        ..Verdict::default()
    };
    for id in received {
        let count = seen.entry(*id).or_insert(0);
        *count += 1;
        if *count > 1 {
            v.duplicates += 1;
            continue;
        }
        let Some((agg, n)) = position.get(id) else {
            v.unexpected += 1;
            continue;
        };
        let high = high_water.entry(agg).or_insert(0);
        if *n < *high {
            v.order_violations += 1;
        }
        *high = (*high).max(n + 1);
    }
    v.delivered = position.keys().filter(|id| seen.contains_key(id)).count();
    v.lost = v.committed - v.delivered;
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checker_counts_loss_duplicates_and_order() {
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::now_v7()).collect();
        let committed: Vec<(String, Uuid)> = vec![
            ("a".into(), ids[0]),
            ("a".into(), ids[1]),
            ("b".into(), ids[2]),
            ("a".into(), ids[3]),
        ];
        let ok = check(&committed, &[ids[2], ids[0], ids[1], ids[1], ids[3]]);
        assert_eq!(
            (ok.delivered, ok.duplicates, ok.order_violations, ok.lost),
            (4, 1, 0, 0)
        );
        let bad = check(&committed, &[ids[1], ids[0], ids[2]]);
        assert_eq!((bad.order_violations, bad.lost), (1, 1));
        let stranger = Uuid::now_v7();
        let odd = check(
            &committed[..2],
            &[ids[0], stranger, ids[1], stranger, ids[2]],
        );
        assert_eq!(
            (odd.delivered, odd.duplicates, odd.unexpected, odd.lost),
            (2, 1, 2, 0),
            "two strangers (one received twice: a duplicate too), nothing lost"
        );
    }
}
