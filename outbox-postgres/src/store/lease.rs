//! The lease of a claimed batch: the claim's transaction, settled in one statement, or released.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use txoutbox_core::{Action, Error, ErrorKind, Lease, OrderingPolicy, Settlement};

use crate::error::map_sqlx;

use super::kept::{keep, Kept, KeptSets};
use super::sql::Sql;

/// The lease of an empty batch: nothing to settle or release.
pub(crate) struct EmptyLease;

#[async_trait]
impl Lease for EmptyLease {
    async fn settle(self: Box<Self>, _settlements: Vec<Settlement>) -> Result<(), Error> {
        Ok(())
    }
    async fn release(self: Box<Self>) -> Result<(), Error> {
        Ok(())
    }
}

/// A claimed batch: the claiming transaction holds its locks (the partitions of an ordered batch,
/// the rows of an unordered one) until it commits or rolls back (including when the connection
/// drops or the process dies).
pub(super) struct PgLease {
    pub(super) tx: Transaction<'static, Postgres>,
    pub(super) ids: Vec<Uuid>,
    pub(super) sql: Arc<Sql>,
    pub(super) pool: PgPool,
    /// How the batch was claimed: what owning a row means for a lost lease's settle.
    pub(super) ordering: OrderingPolicy,
    /// The batch's partitions, offered to later claims once the lease has been settled or
    /// released (not after an error: then they are simply chosen again).
    pub(super) keep: Option<(KeptSets, Kept)>,
}

/// The settlement statement's arguments.
#[derive(Default)]
pub(super) struct SettleArgs {
    published: Vec<Uuid>,
    r_ids: Vec<Uuid>,
    r_attempts: Vec<i32>,
    r_delay: Vec<i64>,
    r_err: Vec<String>,
    d_ids: Vec<Uuid>,
    d_attempts: Vec<i32>,
    d_err: Vec<String>,
}

impl SettleArgs {
    pub(super) fn new(settlements: Vec<Settlement>, mine: &HashSet<Uuid>) -> Self {
        let mut a = SettleArgs::default();
        for s in settlements {
            if !mine.contains(&s.id) {
                continue;
            }
            match s.action {
                Action::Published => a.published.push(s.id),
                Action::Retry {
                    attempts,
                    delay,
                    error,
                } => {
                    a.r_ids.push(s.id);
                    a.r_attempts
                        .push(i32::try_from(attempts).unwrap_or(i32::MAX));
                    a.r_delay
                        .push(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
                    a.r_err.push(error);
                }
                Action::DeadLetter { attempts, error } => {
                    a.d_ids.push(s.id);
                    a.d_attempts
                        .push(i32::try_from(attempts).unwrap_or(i32::MAX));
                    a.d_err.push(error);
                }
                Action::Release => {}
            }
        }
        a
    }

    pub(super) fn is_empty(&self) -> bool {
        self.published.is_empty() && self.r_ids.is_empty() && self.d_ids.is_empty()
    }

    pub(super) fn ids(&self) -> Vec<Uuid> {
        let mut all = self.published.clone();
        all.extend(&self.r_ids);
        all.extend(&self.d_ids);
        all
    }

    /// Keeps only the rows in `free`.
    pub(super) fn retain(&mut self, free: &HashSet<Uuid>) {
        let all = std::mem::take(self);
        self.published = all
            .published
            .into_iter()
            .filter(|id| free.contains(id))
            .collect();
        let retried = all
            .r_ids
            .into_iter()
            .zip(all.r_attempts)
            .zip(all.r_delay)
            .zip(all.r_err);
        for (((id, attempts), delay), error) in
            retried.filter(|(((id, _), _), _)| free.contains(id))
        {
            self.r_ids.push(id);
            self.r_attempts.push(attempts);
            self.r_delay.push(delay);
            self.r_err.push(error);
        }
        let dead = all.d_ids.into_iter().zip(all.d_attempts).zip(all.d_err);
        for ((id, attempts), error) in dead.filter(|((id, _), _)| free.contains(id)) {
            self.d_ids.push(id);
            self.d_attempts.push(attempts);
            self.d_err.push(error);
        }
    }

    pub(super) async fn apply(
        &self,
        sql: &Sql,
        conn: &mut sqlx::PgConnection,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(&sql.settle)
            .bind(&self.published)
            .bind(&self.r_ids)
            .bind(&self.r_attempts)
            .bind(&self.r_delay)
            .bind(&self.r_err)
            .bind(&self.d_ids)
            .bind(&self.d_attempts)
            .bind(&self.d_err)
            .execute(conn)
            .await
            .map(|_| ())
    }
}

/// Offers a lease's partitions to later claims (see [`keep`]).
fn offer(to_keep: Option<(KeptSets, Kept)>) {
    if let Some((kept, set)) = to_keep {
        keep(&kept, set);
    }
}

/// Settles a lost lease's outcomes outside it (the claiming session died: killed, timed out, or its
/// connection dropped, so its locks are gone), in a transaction of its own, for what it can own again
/// as a claim would: under per-aggregate ordering, its rows still unprocessed in the partitions of
/// aggregates no other lease holds (taken as a claim takes them); unordered, each of its rows no
/// other lease holds. What another
/// lease took since is left to it. Without this, an event whose every publish outlived its lease
/// would be retried for ever with its attempts never counted, and published events would all be sent
/// again. Returns how many rows were settled.
pub(super) async fn settle_lost_lease(
    pool: &PgPool,
    sql: &Sql,
    ordering: OrderingPolicy,
    mut args: SettleArgs,
) -> Result<usize, Error> {
    let map = |e| map_sqlx("settle", e);
    // READ COMMITTED whatever the default: the rows are read after the partitions are taken.
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(map)?;
    let ids = args.ids();
    let free = match ordering {
        OrderingPolicy::PerAggregate => {
            let parts: Vec<i32> = sqlx::query_scalar(&sql.lock_lost_partitions)
                .bind(&ids)
                .fetch_one(&mut *tx)
                .await
                .map_err(map)?;
            sqlx::query_scalar::<_, Uuid>(&sql.lock_free)
                .bind(&ids)
                .bind(&parts)
                .fetch_all(&mut *tx)
                .await
        }
        OrderingPolicy::Unordered => {
            sqlx::query_scalar::<_, Uuid>(&sql.lock_free_rows)
                .bind(&ids)
                .fetch_all(&mut *tx)
                .await
        }
    };
    let free: HashSet<Uuid> = free.map_err(map)?.into_iter().collect();
    args.retain(&free);
    if args.is_empty() {
        tx.rollback().await.map_err(map)?;
        return Ok(0);
    }
    args.apply(sql, &mut tx).await.map_err(map)?;
    tx.commit().await.map_err(map)?;
    Ok(free.len())
}

#[async_trait]
impl Lease for PgLease {
    async fn settle(self: Box<Self>, settlements: Vec<Settlement>) -> Result<(), Error> {
        let PgLease {
            mut tx,
            ids,
            sql,
            pool,
            ordering,
            keep,
        } = *self;
        let mine: HashSet<Uuid> = ids.into_iter().collect();
        let args = SettleArgs::new(settlements, &mine);
        if args.is_empty() {
            tx.rollback().await.map_err(|e| map_sqlx("settle", e))?;
            offer(keep);
            return Ok(());
        }
        let settled = match args.apply(&sql, &mut tx).await {
            Ok(()) => tx.commit().await,
            Err(e) => Err(e),
        };
        match settled.map_err(|e| map_sqlx("settle", e)) {
            Ok(()) => {
                offer(keep);
                Ok(())
            }
            Err(lost) if lost.kind() == ErrorKind::Connection => {
                let total = args.ids().len();
                match settle_lost_lease(&pool, &sql, ordering, args).await {
                    Ok(n) => {
                        tracing::warn!(
                            error = %lost,
                            settled = n,
                            of = total,
                            "the batch's lease was lost (its database session ended); settled the rows no other lease holds"
                        );
                        Ok(())
                    }
                    Err(e) => Err(lost.with_context("settle_outside_lease", e.to_string())),
                }
            }
            Err(e) => Err(e),
        }
    }

    async fn release(self: Box<Self>) -> Result<(), Error> {
        let PgLease { tx, keep, .. } = *self;
        tx.rollback().await.map_err(|e| map_sqlx("release", e))?;
        offer(keep);
        Ok(())
    }
}
