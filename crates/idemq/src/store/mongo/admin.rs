//! The admin side of the Mongo store ([`StoreAdmin`]): migrations, prune,
//! inspect, stats, dead letters, forced release.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};
use mongodb::options::IndexOptions;
use mongodb::{Collection, IndexModel};

use super::error::{code, map_err, MongoError};
use super::ids::{self, esc};
use super::records::{
    attempt_record, int, parse_dead_letter, text, At, KeyView, State, DONE, FREE, LEASE, PRUNED,
};
use super::MongoStore;
use crate::error::StoreError;
use crate::store::{ConsumerStats, DeadLetterRecord, KeyReport, StoreAdmin};

/// How long a pruning marker keeps claims of its key waiting; a pruner that
/// needed more than half of it to get to deleting the key's head gives up
/// (its marker then expires and the key lives on).
const PRUNE_LEASE: Duration = Duration::from_secs(60);

/// A prune batch reads up to this many times its size in candidate
/// documents, so that keys it must skip (live leases) do not hide the rest.
const PRUNE_SCAN_FACTOR: u64 = 16;

/// "Namespace exists": the collection was created already.
const NAMESPACE_EXISTS: i32 = 48;

/// "Index already exists" (same name and keys, older servers).
const INDEX_EXISTS: i32 = 68;

/// "Not implemented" (FerretDB, e.g. a TTL index).
const NOT_IMPLEMENTED: i32 = 238;

async fn collect(
    cursor: mongodb::error::Result<mongodb::Cursor<Document>>,
) -> Result<Vec<Document>, StoreError> {
    cursor
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)
}

/// The configuration error of an index kind the server does not have
/// (FerretDB: TTL indexes).
fn not_implemented(name: &str, e: &mongodb::error::Error) -> StoreError {
    MongoError::Config(format!(
        "this server cannot create the index {name} ({}); if it is the TTL index, leave MongoOptions::ttl unset and prune instead",
        e.kind
    ))
    .into()
}

fn index(keys: Document, name: &str, unique: bool) -> IndexModel {
    IndexModel::builder()
        .keys(keys)
        .options(
            IndexOptions::builder()
                .name(name.to_owned())
                .unique(unique)
                .build(),
        )
        .build()
}

impl MongoStore {
    async fn create_collection(&self, coll: &Collection<Document>) -> Result<(), StoreError> {
        match self.inner.db.create_collection(coll.name()).await {
            Ok(()) => Ok(()),
            Err(e) if code(&e) == Some(NAMESPACE_EXISTS) => Ok(()),
            Err(e) => Err(map_err(e)),
        }
    }

    /// Creates each index of `models` unless it exists, one command per
    /// index: FerretDB 1.x panics (and drops the connection) on a
    /// `createIndexes` of several indexes that all exist already. An index
    /// that a concurrent migration created meanwhile is not an error.
    async fn create_indexes(
        &self,
        coll: &Collection<Document>,
        models: Vec<IndexModel>,
    ) -> Result<(), StoreError> {
        let existing = coll.list_index_names().await.map_err(map_err)?;
        for model in models {
            let name = model
                .options
                .as_ref()
                .and_then(|o| o.name.clone())
                .unwrap_or_default();
            if existing.contains(&name) {
                continue;
            }
            match coll.create_index(model).await {
                Ok(_) => {}
                Err(e) if code(&e) == Some(INDEX_EXISTS) => {}
                Err(e) if code(&e) == Some(NOT_IMPLEMENTED) => {
                    return Err(not_implemented(&name, &e))
                }
                Err(e) => {
                    // Lost a race with another migration creating the same index?
                    let now = coll.list_index_names().await.map_err(map_err)?;
                    if !now.contains(&name) {
                        return Err(map_err(e));
                    }
                }
            }
        }
        Ok(())
    }

    /// Prunes the life `epoch` of `consumer`/`key` if its top is done or
    /// abandoned (free, or a lease or marker that expired); whether it did.
    async fn prune_key(&self, consumer: &str, key: &str, epoch: &str) -> Result<bool, StoreError> {
        let view = self.view(consumer, key).await?;
        let (Some(head), Some(top)) = (&view.head, &view.top) else {
            return Ok(false);
        };
        let now = self.server_now().await;
        if head.epoch != epoch || top.is_live(now) {
            return Ok(false);
        }
        // The marker: once it is the top, no claim takes the key, and no
        // other pruner prunes this life.
        let marker = At {
            consumer,
            key,
            epoch,
            g: top.g + 1,
            first_seen: head.first_seen,
        };
        let lease_ms = i64::try_from(PRUNE_LEASE.as_millis()).unwrap_or(i64::MAX);
        let started = Instant::now();
        let marker_doc = marker.pruned(now.saturating_add(lease_ms));
        if !self.insert_unique(&self.inner.inbox, marker_doc).await? {
            return Ok(false);
        }
        if started.elapsed() >= PRUNE_LEASE / 2 {
            tracing::warn!(key, "pruning gave up: the marker is about to expire");
            return Ok(false);
        }
        // Only the marker's writer deletes this life's head: no other life
        // can have a head yet.
        self.inner
            .inbox
            .delete_one(doc! { "_id": ids::head(consumer, key) })
            .await
            .map_err(map_err)?;
        // The rest of the life; its ids hold the epoch, so they touch no
        // later life of the key.
        self.inner
            .inbox
            .delete_many(doc! { "consumer": esc(consumer), "key": esc(key), "epoch": epoch })
            .await
            .map_err(map_err)?;
        Ok(true)
    }

    /// Deletes leftovers of pruned lives (a pruner that stopped half way, a
    /// stray completion): slots first seen before `cutoff_ms` whose epoch is
    /// no longer the key's head's. At most `batch` candidates are looked at.
    async fn prune_leftovers(&self, cutoff_ms: i64, batch: u32) -> Result<(), StoreError> {
        let docs = collect(
            self.inner
                .inbox
                .find(doc! { "g": { "$gt": 1 }, "first_seen": { "$lt": cutoff_ms } })
                .projection(doc! { "consumer": 1, "key": 1, "epoch": 1 })
                .limit(i64::from(batch))
                .await,
        )
        .await?;
        let lives: BTreeSet<(String, String, String)> = docs
            .iter()
            .filter_map(|d| {
                Some((
                    text(d, "consumer")?,
                    text(d, "key")?,
                    d.get_str("epoch").ok()?.to_owned(),
                ))
            })
            .collect();
        for (consumer, key, epoch) in lives {
            let head = self
                .inner
                .inbox
                .find_one(doc! { "_id": ids::head(&consumer, &key) })
                .projection(doc! { "epoch": 1 })
                .await
                .map_err(map_err)?;
            let alive = head
                .as_ref()
                .and_then(|h| h.get_str("epoch").ok())
                .is_some_and(|e| e == epoch);
            if !alive {
                self.inner
                    .inbox
                    .delete_many(
                        doc! { "consumer": esc(&consumer), "key": esc(&key), "epoch": &epoch },
                    )
                    .await
                    .map_err(map_err)?;
            }
        }
        Ok(())
    }

    /// Deletes the attempts of keys whose last failure was before
    /// `cutoff_ms` (at most `batch` candidates looked at).
    async fn prune_attempts(&self, cutoff_ms: i64, batch: u32) -> Result<(), StoreError> {
        let docs = collect(
            self.inner
                .attempts
                .find(doc! { "at": { "$lt": cutoff_ms } })
                .projection(doc! { "consumer": 1, "key": 1 })
                .limit(i64::from(batch))
                .await,
        )
        .await?;
        let keys: BTreeSet<(String, String)> = docs
            .iter()
            .filter_map(|d| Some((text(d, "consumer")?, text(d, "key")?)))
            .collect();
        for (consumer, key) in keys {
            let all = self.attempt_docs(&consumer, &key).await?;
            if all.iter().filter_map(|d| int(d, "at")).max() < Some(cutoff_ms) {
                self.inner
                    .attempts
                    .delete_many(doc! { "consumer": esc(&consumer), "key": esc(&key) })
                    .await
                    .map_err(map_err)?;
            }
        }
        Ok(())
    }

    async fn attempt_docs(&self, consumer: &str, key: &str) -> Result<Vec<Document>, StoreError> {
        collect(
            self.inner
                .attempts
                .find(doc! { "consumer": esc(consumer), "key": esc(key) })
                .await,
        )
        .await
    }

    async fn read_dead_letters(
        &self,
        filter: Document,
        limit: Option<u32>,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let mut find = self.inner.dead_letters.find(filter).sort(doc! { "_id": 1 });
        if let Some(limit) = limit {
            find = find.limit(i64::from(limit));
        }
        collect(find.await)
            .await?
            .iter()
            .map(|d| parse_dead_letter(d).map_err(StoreError::from))
            .collect()
    }

    /// The distinct consumers of `coll` (documents matching `filter`).
    async fn consumers_of(
        &self,
        coll: &Collection<Document>,
        filter: Document,
    ) -> Result<Vec<String>, StoreError> {
        let values = coll.distinct("consumer", filter).await.map_err(map_err)?;
        Ok(values
            .into_iter()
            .filter_map(|v| match v {
                Bson::String(s) => Some(super::ids::unesc(&s)),
                _ => None,
            })
            .collect())
    }

    /// The first-seen time of the oldest (`order` 1) or newest (-1) done key.
    async fn done_edge(&self, consumer: &str, order: i32) -> Result<Option<i64>, StoreError> {
        let found = self
            .inner
            .inbox
            .find_one(doc! { "consumer": esc(consumer), "kind": DONE })
            .sort(doc! { "first_seen": order })
            .projection(doc! { "first_seen": 1 })
            .await
            .map_err(map_err)?;
        Ok(found.and_then(|d| int(&d, "first_seen")))
    }
}

#[async_trait]
impl StoreAdmin for MongoStore {
    async fn ping(&self) -> Result<(), StoreError> {
        self.ping_server().await
    }

    /// Creates the collections and their indexes (idempotent). With
    /// [`MongoOptions::ttl`](super::MongoOptions::ttl), also the TTL index,
    /// which a server without TTL indexes (FerretDB) refuses: a
    /// configuration error.
    async fn migrate(&self) -> Result<(), StoreError> {
        let i = &self.inner;
        for coll in [&i.inbox, &i.attempts, &i.dead_letters, &i.effects] {
            self.create_collection(coll).await?;
        }
        let mut inbox = vec![
            index(
                doc! { "consumer": 1, "key": 1, "epoch": 1, "g": 1 },
                "idemq_slot",
                true,
            ),
            index(doc! { "first_seen": 1 }, "idemq_first_seen", false),
        ];
        if i.options.ttl.is_some() {
            inbox.push(
                IndexModel::builder()
                    .keys(doc! { "expire_at": 1 })
                    .options(
                        IndexOptions::builder()
                            .name("idemq_expire_at".to_owned())
                            .expire_after(Duration::ZERO)
                            .build(),
                    )
                    .build(),
            );
        }
        self.create_indexes(&i.inbox, inbox).await?;
        self.create_indexes(
            &i.attempts,
            vec![index(
                doc! { "consumer": 1, "key": 1, "n": 1 },
                "idemq_attempt",
                true,
            )],
        )
        .await?;
        self.create_indexes(
            &i.dead_letters,
            vec![
                index(doc! { "letter": 1 }, "idemq_letter", true),
                index(
                    doc! { "consumer": 1, "key": 1 },
                    "idemq_consumer_key",
                    false,
                ),
            ],
        )
        .await?;
        self.create_indexes(
            &i.effects,
            vec![
                index(
                    doc! { "consumer": 1, "key": 1, "step": 1 },
                    "idemq_effect",
                    true,
                ),
                index(doc! { "written": 1 }, "idemq_written", false),
            ],
        )
        .await
    }

    /// Prunes at most `batch` keys first seen before `cutoff_ms` whose
    /// record is done (or whose claim was abandoned), each behind a
    /// `pruned` marker (see the module docs); also leftovers of earlier
    /// prunes, attempts whose last failure was before the cutoff, and at
    /// most `batch` effect journal entries written before it. Returns the
    /// keys pruned, or the journal entries if more of those went.
    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let mut pruned: u64 = 0;
        // Done keys first; then, with what is left of the batch, keys whose
        // claims were abandoned (released, or a lease that ran out).
        let candidates = [
            doc! { "kind": DONE, "first_seen": { "$lt": cutoff_ms } },
            doc! { "kind": { "$in": [FREE, LEASE, PRUNED] }, "first_seen": { "$lt": cutoff_ms } },
        ];
        for filter in candidates {
            let left = u64::from(batch).saturating_sub(pruned);
            if left == 0 {
                break;
            }
            // Read past the batch: keys that cannot be pruned now (a live
            // lease, another pruner's marker) must not hide the ones behind
            // them, or a pruner would find nothing to do while old keys wait.
            let scan = left.saturating_mul(PRUNE_SCAN_FACTOR);
            let docs = collect(
                self.inner
                    .inbox
                    .find(filter)
                    .projection(doc! { "consumer": 1, "key": 1, "epoch": 1 })
                    .limit(i64::try_from(scan).unwrap_or(i64::MAX))
                    .await,
            )
            .await?;
            let lives: BTreeSet<(String, String, String)> = docs
                .iter()
                .filter_map(|d| {
                    Some((
                        text(d, "consumer")?,
                        text(d, "key")?,
                        d.get_str("epoch").ok()?.to_owned(),
                    ))
                })
                .collect();
            for (consumer, key, epoch) in lives {
                if pruned >= u64::from(batch) {
                    break;
                }
                if self.prune_key(&consumer, &key, &epoch).await? {
                    pruned += 1;
                }
            }
        }
        self.prune_leftovers(cutoff_ms, batch).await?;
        self.prune_attempts(cutoff_ms, batch).await?;
        let effects = self.prune_effects(cutoff_ms, batch).await?;
        Ok(pruned.max(effects))
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let view: KeyView = self.view(consumer, key).await?;
        let now = self.server_now().await;
        let in_flight = view
            .top
            .as_ref()
            .is_some_and(|t| matches!(t.state, State::Lease { .. }) && t.is_live(now));
        let attempts = attempt_record(&self.attempt_docs(consumer, key).await?);
        let dead_letters = self
            .read_dead_letters(doc! { "consumer": esc(consumer), "key": esc(key) }, None)
            .await?;
        Ok(KeyReport {
            inbox: view.record(consumer, key),
            in_flight,
            attempts,
            dead_letters,
        })
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        let i = &self.inner;
        let mut consumers: BTreeSet<String> = BTreeSet::new();
        consumers.extend(self.consumers_of(&i.inbox, doc! { "kind": DONE }).await?);
        consumers.extend(self.consumers_of(&i.dead_letters, doc! {}).await?);
        consumers.extend(self.consumers_of(&i.attempts, doc! {}).await?);
        let mut out: BTreeMap<String, ConsumerStats> = BTreeMap::new();
        for consumer in consumers {
            let c = esc(&consumer);
            let processed = i
                .inbox
                .count_documents(doc! { "consumer": &c, "kind": DONE })
                .await
                .map_err(map_err)?;
            let dead_letters = i
                .dead_letters
                .count_documents(doc! { "consumer": &c })
                .await
                .map_err(map_err)?;
            let failing = i
                .attempts
                .distinct("key", doc! { "consumer": &c })
                .await
                .map_err(map_err)?
                .len() as u64;
            if processed == 0 && dead_letters == 0 && failing == 0 {
                continue;
            }
            let (oldest_ms, newest_ms) = if processed > 0 {
                (
                    self.done_edge(&consumer, 1).await?,
                    self.done_edge(&consumer, -1).await?,
                )
            } else {
                (None, None)
            };
            out.insert(
                consumer.clone(),
                ConsumerStats {
                    consumer,
                    processed,
                    oldest_ms,
                    newest_ms,
                    dead_letters,
                    failing,
                },
            );
        }
        Ok(out.into_values().collect())
    }

    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let mut filter = doc! { "_id": { "$gt": after_id } };
        if let Some(consumer) = consumer {
            filter.insert("consumer", esc(consumer));
        }
        self.read_dead_letters(filter, Some(limit)).await
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let deleted = self
            .inner
            .dead_letters
            .delete_one(doc! { "_id": id })
            .await
            .map_err(map_err)?;
        Ok(deleted.deleted_count == 1)
    }

    /// Frees the key if a lease holds it (live or expired, whatever its
    /// token), so the next claim takes it at once; the old holder's
    /// completion is then refused ([`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost)) and its
    /// heartbeat reports the loss.
    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        for _ in 0..3 {
            let view = self.view(consumer, key).await?;
            let (Some(head), Some(top)) = (&view.head, &view.top) else {
                return Ok(false);
            };
            if !matches!(top.state, State::Lease { .. }) {
                return Ok(false);
            }
            let free = At {
                consumer,
                key,
                epoch: &head.epoch,
                g: top.g + 1,
                first_seen: head.first_seen,
            }
            .free();
            if self.insert_unique(&self.inner.inbox, free).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}
