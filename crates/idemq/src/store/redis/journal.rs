//! The effect journal of the Redis store.

use async_trait::async_trait;

use super::{map_err, millis, RedisStore};
use crate::effect::EffectJournal;
use crate::error::StoreError;
use crate::store::parse_result;

/// The journal of a key is the hash `P:{C/K}:fx` (step → result JSON), in
/// the key's slot, with the retention TTL renewed on every write.
#[async_trait]
impl EffectJournal for RedisStore {
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let text: Option<String> = self
            .query(
                redis::cmd("HGET")
                    .arg(self.keys.scoped(consumer, key, "fx"))
                    .arg(step),
            )
            .await?;
        Ok(parse_result(text))
    }

    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError> {
        let text: Option<String> = self
            .scripts
            .effect_put
            .key(self.keys.scoped(consumer, key, "fx"))
            .arg(step)
            .arg(result.to_string())
            .arg(millis(self.options.retention))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        parse_result(text).ok_or_else(|| {
            StoreError::transient(format!(
                "effect {step:?} of key {key:?}: the journal entry vanished after writing it"
            ))
        })
    }

    async fn steps(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let entries: Vec<(String, String)> = self
            .query(redis::cmd("HGETALL").arg(self.keys.scoped(consumer, key, "fx")))
            .await?;
        let mut steps: Vec<(String, serde_json::Value)> = entries
            .into_iter()
            .map(|(step, text)| (step, parse_result(Some(text)).unwrap_or_default()))
            .collect();
        steps.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(steps)
    }
}
