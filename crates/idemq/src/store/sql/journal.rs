//! The effect journal of [`SqlStore`]: the table `{prefix}effects`, written
//! through a pool of its own (each statement commits by itself), pruned
//! with the inbox.

use super::database::{Bind, Column, SqlDatabase};
use super::partitions::Layout;
use super::{store_error, SqlStore};
use crate::effect::EffectJournal;
use crate::error::StoreError;
use crate::store::{now_ms, parse_result};

#[async_trait::async_trait]
impl<DB: SqlDatabase> EffectJournal for SqlStore<DB> {
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let pool = self.journal_pool().await?;
        let binds = [Bind::Text(consumer), Bind::Text(key), Bind::Text(step)];
        let rows = Self::fetch_on(pool, &self.queries.effect_get, &binds, &[Column::Text]).await?;
        match rows.first() {
            Some(row) => Ok(parse_result(Some(row.text(0).map_err(store_error)?))),
            None => Ok(None),
        }
    }

    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError> {
        let layout = self.prepare_journal().await?;
        let pool = self.journal_pool().await?;
        let text = result.to_string();
        let binds = [
            Bind::Text(consumer),
            Bind::Text(key),
            Bind::Text(step),
            Bind::Text(&text),
            Bind::Int(now_ms()),
        ];
        // A partitioned journal keeps the first result through its function
        // (see `partitions`); a plain one by its primary key.
        let put = match layout {
            Layout::Plain => &self.queries.effect_put,
            Layout::Partitioned => &self.parts.put,
        };
        let mut conn = pool.acquire().await.map_err(store_error)?;
        DB::execute(&mut conn, put, &binds)
            .await
            .map_err(|e| self.partitioned_error(layout, e))?;
        drop(conn);
        let stored = EffectJournal::get(self, consumer, key, step).await?;
        stored.ok_or_else(|| {
            StoreError::transient(format!(
                "effect {step:?} of key {key:?}: the journal row is not visible after writing it"
            ))
        })
    }

    async fn steps(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let pool = self.journal_pool().await?;
        let binds = [Bind::Text(consumer), Bind::Text(key)];
        let rows = Self::fetch_on(
            pool,
            &self.queries.effect_steps,
            &binds,
            &[Column::Text, Column::Text],
        )
        .await?;
        rows.iter()
            .map(|row| {
                let value = parse_result(Some(row.text(1)?)).unwrap_or(serde_json::Value::Null);
                Ok((row.text(0)?, value))
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(store_error)
    }
}
