//! The effect journal of the Mongo store: one document per (consumer, key,
//! step); the first insert wins, by its unique `_id`.

use async_trait::async_trait;
use futures_util::TryStreamExt;
use mongodb::bson::{doc, Document};

use super::error::map_err;
use super::ids::{self, esc};
use super::records::{int, parse_result, text};
use super::MongoStore;
use crate::effect::EffectJournal;
use crate::error::StoreError;
use crate::store::now_ms;

#[async_trait]
impl EffectJournal for MongoStore {
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let found = self
            .inner
            .effects
            .find_one(doc! { "_id": ids::effect(consumer, key, step) })
            .await
            .map_err(map_err)?;
        Ok(found.and_then(|d| parse_result(text(&d, "result"))))
    }

    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError> {
        let entry = doc! {
            "_id": ids::effect(consumer, key, step),
            "consumer": esc(consumer),
            "key": esc(key),
            "step": esc(step),
            "result": esc(&result.to_string()),
            "written": now_ms(),
        };
        if self.insert_unique(&self.inner.effects, entry).await? {
            return Ok(result.clone());
        }
        self.get(consumer, key, step).await?.ok_or_else(|| {
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
        let docs: Vec<Document> = self
            .inner
            .effects
            .find(doc! { "consumer": esc(consumer), "key": esc(key) })
            .await
            .map_err(map_err)?
            .try_collect()
            .await
            .map_err(map_err)?;
        let mut steps: Vec<(String, serde_json::Value)> = docs
            .iter()
            .filter_map(|d| {
                let step = text(d, "step")?;
                Some((step, parse_result(text(d, "result")).unwrap_or_default()))
            })
            .collect();
        steps.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(steps)
    }
}

impl MongoStore {
    /// Deletes at most `batch` journal entries written before `cutoff_ms`;
    /// returns how many went.
    pub(super) async fn prune_effects(
        &self,
        cutoff_ms: i64,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let old: Vec<Document> = self
            .inner
            .effects
            .find(doc! { "written": { "$lt": cutoff_ms } })
            .projection(doc! { "_id": 1, "written": 1 })
            .limit(i64::from(batch))
            .await
            .map_err(map_err)?
            .try_collect()
            .await
            .map_err(map_err)?;
        let ids: Vec<_> = old
            .iter()
            .filter(|d| int(d, "written").is_some_and(|w| w < cutoff_ms))
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let deleted = self
            .inner
            .effects
            .delete_many(doc! { "_id": { "$in": ids } })
            .await
            .map_err(map_err)?;
        Ok(deleted.deleted_count)
    }
}
