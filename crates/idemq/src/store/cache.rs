//! A fast path in front of any store: a bounded in-process cache of recently
//! completed keys and, optionally (feature `redis`), Redis as a filter shared
//! by every process.
//!
//! [`CachedStore`] wraps a store (typically a SQL inbox) and keeps its
//! transaction type, so handlers are unchanged:
//!
//! - **claim**: a hit in the local cache, then in the Redis filter, answers
//!   [`Claim::Done`] with the stored record (fingerprint, result) without
//!   touching the database: the engine reports a duplicate, or a conflict if
//!   the fingerprint differs. A miss goes to the inner store's claim, which
//!   stays the source of truth.
//! - **commit**: the inner commit first; only when it succeeded is the key
//!   put in the local cache and marked in Redis (with the retention TTL).
//!   If the commit fails, any local entry and Redis mark of the key are
//!   removed. So the cache can only ever say "duplicate" for a key whose
//!   transaction really committed; a rolled-back key is never cached.
//! - rollback, failure counting and dead letters pass straight through, as
//!   does [`StoreAdmin`].
//! - Any Redis error is logged and treated as a miss: an outage of the
//!   filter degrades to the inner store alone.
//!
//! The broker's redelivery model is unchanged: every delivery still ends in
//! the inner store's outcome; the cache only answers the duplicates sooner.
//! A cached record's `first_seen_ms` is the commit time seen by this process
//! (the inner store's row keeps the exact first-seen time). Entries outlive
//! pruning of the inner store (a pruned key did commit, so the answer
//! "duplicate" stays true); size the local cache with [`CachedStore::local`].
//!
//! ```no_run
//! # #[cfg(all(feature = "postgres", feature = "redis"))]
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use idemq::store::cache::{CachedStore, RedisFilter};
//! use idemq::store::redis::RedisOptions;
//! use idemq::store::sql::postgres::PostgresStore;
//!
//! let sql = PostgresStore::connect("postgres://postgres@127.0.0.1/test").await?;
//! let filter = RedisFilter::connect("redis://127.0.0.1:6379", RedisOptions::default().prefix("billing")).await?;
//! let store = CachedStore::new(sql).local(100_000).redis(filter);
//! # let _ = store;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use async_trait::async_trait;

use super::{
    now_ms, Claim, ClaimRequest, ConsumerStats, DeadLetter, DeadLetterRecord, InboxRecord,
    KeyReport, Store, StoreAdmin,
};
use crate::error::StoreError;

type LocalCache = quick_cache::sync::Cache<(String, String), InboxRecord>;

/// A store with a fast path for duplicates (see the module docs).
pub struct CachedStore<S> {
    inner: S,
    local: Option<Arc<LocalCache>>,
    #[cfg(feature = "redis")]
    redis: Option<RedisFilter>,
}

impl<S: Clone> Clone for CachedStore<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            local: self.local.clone(),
            #[cfg(feature = "redis")]
            redis: self.redis.clone(),
        }
    }
}

impl<S: std::fmt::Debug> std::fmt::Debug for CachedStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("CachedStore");
        d.field("inner", &self.inner)
            .field("local_capacity", &self.local.as_ref().map(|c| c.capacity()));
        #[cfg(feature = "redis")]
        d.field("redis", &self.redis);
        d.finish()
    }
}

impl<S> CachedStore<S> {
    /// Wraps `inner` without any cache yet: add [`local`](Self::local)
    /// and/or `redis` (feature `redis`).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            local: None,
            #[cfg(feature = "redis")]
            redis: None,
        }
    }

    /// Adds a bounded in-process cache of up to `capacity` completed keys
    /// (`0` disables it).
    pub fn local(mut self, capacity: usize) -> Self {
        self.local = (capacity > 0).then(|| Arc::new(LocalCache::new(capacity)));
        self
    }

    /// Adds Redis as a filter shared by every process.
    #[cfg(feature = "redis")]
    pub fn redis(mut self, filter: RedisFilter) -> Self {
        self.redis = Some(filter);
        self
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Whether the local cache holds `key` of `consumer` (for tests and tools).
    pub fn cached_locally(&self, consumer: &str, key: &str) -> bool {
        self.local
            .as_ref()
            .is_some_and(|c| c.get(&(consumer.to_owned(), key.to_owned())).is_some())
    }

    fn local_get(&self, consumer: &str, key: &str) -> Option<InboxRecord> {
        self.local
            .as_ref()
            .and_then(|c| c.get(&(consumer.to_owned(), key.to_owned())))
    }

    fn local_put(&self, record: &InboxRecord) {
        if let Some(c) = &self.local {
            c.insert(
                (record.consumer.clone(), record.key.clone()),
                record.clone(),
            );
        }
    }

    fn local_remove(&self, consumer: &str, key: &str) {
        if let Some(c) = &self.local {
            c.remove(&(consumer.to_owned(), key.to_owned()));
        }
    }

    async fn filter_get(&self, _consumer: &str, _key: &str) -> Option<InboxRecord> {
        #[cfg(feature = "redis")]
        if let Some(filter) = &self.redis {
            match filter.get(_consumer, _key).await {
                Ok(hit) => return hit,
                Err(e) => {
                    tracing::warn!(error = %e, "Redis filter unavailable; asking the store")
                }
            }
        }
        None
    }

    async fn filter_mark(&self, _record: &InboxRecord) {
        #[cfg(feature = "redis")]
        if let Some(filter) = &self.redis {
            if let Err(e) = filter.mark(_record).await {
                tracing::warn!(error = %e, key = %_record.key, "marking the key in Redis failed");
            }
        }
    }

    async fn filter_unmark(&self, _consumer: &str, _key: &str) {
        #[cfg(feature = "redis")]
        if let Some(filter) = &self.redis {
            if let Err(e) = filter.unmark(_consumer, _key).await {
                tracing::warn!(error = %e, key = %_key, "removing the Redis mark failed");
            }
        }
    }
}

#[async_trait]
impl<S: Store> Store for CachedStore<S> {
    type Tx = S::Tx;

    fn journal(&self) -> Option<&dyn crate::effect::EffectJournal> {
        self.inner.journal()
    }

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<S::Tx>, StoreError> {
        if let Some(record) = self.local_get(req.consumer, req.key) {
            metrics::counter!("idemq_cache_hits_total", "layer" => "local").increment(1);
            return Ok(Claim::Done(record));
        }
        if let Some(record) = self.filter_get(req.consumer, req.key).await {
            metrics::counter!("idemq_cache_hits_total", "layer" => "redis").increment(1);
            self.local_put(&record);
            return Ok(Claim::Done(record));
        }
        let claim = self.inner.claim(req).await?;
        if let Claim::Done(record) = &claim {
            // The inner store says it committed: safe to remember.
            self.local_put(record);
            self.filter_mark(record).await;
        }
        Ok(claim)
    }

    async fn commit(
        &self,
        tx: S::Tx,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        match self.inner.commit(tx, req, result).await {
            Ok(()) => {
                let record = InboxRecord {
                    consumer: req.consumer.to_owned(),
                    key: req.key.to_owned(),
                    fingerprint: req.fingerprint.to_owned(),
                    result: result.cloned(),
                    first_seen_ms: now_ms(),
                };
                self.local_put(&record);
                self.filter_mark(&record).await;
                Ok(())
            }
            Err(e) => {
                self.local_remove(req.consumer, req.key);
                self.filter_unmark(req.consumer, req.key).await;
                Err(e)
            }
        }
    }

    async fn rollback(&self, tx: S::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }

    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError> {
        self.inner.record_failure(consumer, key, error).await
    }

    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError> {
        self.inner.dead_letter(letter).await
    }
}

#[async_trait]
impl<S: StoreAdmin> StoreAdmin for CachedStore<S> {
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        self.inner.migrate().await
    }

    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        self.inner.prune_batch(cutoff_ms, batch).await
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        self.inner.inspect(consumer, key).await
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        self.inner.stats().await
    }

    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        self.inner.dead_letters(consumer, after_id, limit).await
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        self.inner.delete_dead_letter(id).await
    }

    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        self.inner.release(consumer, key).await
    }
}

#[cfg(feature = "redis")]
pub use filter::RedisFilter;

#[cfg(feature = "redis")]
mod filter {
    use std::time::Duration;

    use super::super::redis::{
        map_err, parse_done, record_json, Keys, RedisConnection, RedisOptions,
    };
    use super::InboxRecord;
    use crate::error::StoreError;

    /// Redis as a shared filter of completed keys: `P:{C/K}:mark` holds the
    /// record's JSON (fingerprint, result, first seen) with the retention TTL
    /// of [`RedisOptions`] (same escaping and hash tags as the
    /// [Redis store](crate::store::redis)).
    #[derive(Debug, Clone)]
    pub struct RedisFilter {
        conn: RedisConnection,
        keys: Keys,
        ttl: Duration,
    }

    impl RedisFilter {
        /// Connects to one Redis; `options.prefix` scopes the marks and
        /// `options.retention` is their TTL.
        pub async fn connect(url: &str, options: RedisOptions) -> Result<Self, StoreError> {
            let conn = RedisConnection::connect(url, &options).await?;
            Ok(Self::new(conn, &options))
        }

        /// A filter over an existing connection (single or Cluster).
        pub fn new(conn: RedisConnection, options: &RedisOptions) -> Self {
            Self {
                conn,
                keys: Keys::new(&options.prefix),
                ttl: options.retention,
            }
        }

        fn mark_key(&self, consumer: &str, key: &str) -> String {
            self.keys.scoped(consumer, key, "mark")
        }

        /// The marked record of a key, if any.
        pub async fn get(
            &self,
            consumer: &str,
            key: &str,
        ) -> Result<Option<InboxRecord>, StoreError> {
            let v: Option<String> = redis::cmd("GET")
                .arg(self.mark_key(consumer, key))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(map_err)?;
            Ok(v.and_then(|json| parse_done(consumer, key, &json)))
        }

        /// Marks a committed key.
        pub async fn mark(&self, record: &InboxRecord) -> Result<(), StoreError> {
            let ttl = u64::try_from(self.ttl.as_millis())
                .unwrap_or(u64::MAX)
                .max(1);
            let _: () = redis::cmd("SET")
                .arg(self.mark_key(&record.consumer, &record.key))
                .arg(record_json(record))
                .arg("PX")
                .arg(ttl)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(map_err)?;
            Ok(())
        }

        /// Removes a key's mark.
        pub async fn unmark(&self, consumer: &str, key: &str) -> Result<(), StoreError> {
            let _: i64 = redis::cmd("DEL")
                .arg(self.mark_key(consumer, key))
                .query_async(&mut self.conn.clone())
                .await
                .map_err(map_err)?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use std::time::Duration;

    fn req(fp: &str) -> ClaimRequest<'_> {
        ClaimRequest {
            consumer: "c",
            key: "k",
            fingerprint: fp,
            lease: Duration::from_secs(30),
        }
    }

    #[tokio::test]
    async fn only_committed_keys_are_cached() {
        let store = CachedStore::new(MemoryStore::new()).local(16);
        let Claim::New(lease) = store.claim(&req("f")).await.unwrap() else {
            panic!("new")
        };
        store.rollback(lease).await.unwrap();
        assert!(!store.cached_locally("c", "k"), "rolled back: not cached");
        let Claim::New(lease) = store.claim(&req("f")).await.unwrap() else {
            panic!("claimable again")
        };
        store
            .commit(lease, &req("f"), Some(&serde_json::json!(1)))
            .await
            .unwrap();
        assert!(store.cached_locally("c", "k"));
        let Claim::Done(record) = store.claim(&req("f")).await.unwrap() else {
            panic!("done")
        };
        assert_eq!(record.result, Some(serde_json::json!(1)));
    }
}
