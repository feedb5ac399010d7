//! The unordered claim: lock ready rows in seq order (`FOR UPDATE SKIP LOCKED`), cut the batch to
//! the byte budget, and lock again only the rows kept when the budget left some out.

use std::collections::HashSet;

use sqlx::{Postgres, Row, Transaction};
use uuid::Uuid;

use txoutbox_core::{Error, Event};

use super::CLAIM_LOCKS;
use crate::error::map_sqlx;
use crate::row::decode_event;
use crate::store::PostgresStore;

impl PostgresStore {
    /// An unordered claim: locks up to `limit` ready rows (`FOR UPDATE SKIP LOCKED`) and returns
    /// those within the byte budget; when the budget left some out, takes the locks again for the
    /// rows it keeps only (see [`CLAIM_LOCKS`]).
    pub(super) async fn claim_unordered(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        limit: i64,
        max_bytes: i64,
    ) -> Result<Vec<Event>, Error> {
        let rows = sqlx::query(&self.sql.claim_unordered)
            .bind(limit)
            .bind(max_bytes)
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        let mut locked = 0i64;
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            locked = row.try_get("locked").map_err(|e| map_sqlx("claim", e))?;
            events.push(decode_event(&row)?);
        }
        if (events.len() as i64) < locked {
            let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
            let kept: HashSet<Uuid> = self
                .relock(tx, sqlx::query_scalar(&self.sql.relock_rows).bind(&ids))
                .await?
                .into_iter()
                .collect();
            events.retain(|e| kept.contains(&e.id));
        }
        Ok(events)
    }

    /// Releases every lock the claim took (back to [`CLAIM_LOCKS`]) and takes again those of `query`
    /// (a relock statement); returns what it locked.
    async fn relock<T>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        query: sqlx::query::QueryScalar<'_, Postgres, T, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<T>, Error>
    where
        T: Send + Unpin + for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        sqlx::query(&format!("ROLLBACK TO SAVEPOINT {CLAIM_LOCKS}"))
            .execute(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))?;
        query
            .fetch_all(&mut **tx)
            .await
            .map_err(|e| map_sqlx("claim", e))
    }
}
