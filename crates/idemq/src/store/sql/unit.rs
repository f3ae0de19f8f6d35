//! [`SqlUnit`]: the SQL stores' unit of work — one transaction.
//!
//! - **Keys** (batch mode): every key is claimed in one statement; the
//!   handlers write in the same transaction, and the unit commits once. A
//!   unit that does not isolate its members rolls back as a whole when one
//!   fails ([`Undone::Unit`]); isolating, each member runs inside a
//!   savepoint, so a failing one is rolled back to it and gives up its claim
//!   while the rest stay.
//! - **A record** (offset-watermark mode): its offset is checked against the
//!   partition's watermark (the row locked, unless records of the partition
//!   apply concurrently and claim their positions instead), its key claimed
//!   too when the mode deduplicates keys, and the watermark moved in the
//!   transaction that commits its effects. A unit claims one record.

use std::sync::Arc;

use async_trait::async_trait;

use super::batch::{BatchClaim, OffsetClaim, Tx};
use super::database::SqlDatabase;
use super::SqlStore;
use crate::error::StoreError;
use crate::store::unit::{
    Completion, MemberAnswer, MemberClaim, RecordClaim, Undone, UnitOptions, UnitStore, WorkUnit,
};
use crate::store::{InboxRecord, Store};

/// A unit of work of a [`SqlStore`]: one transaction (see the module docs).
pub struct SqlUnit<DB: SqlDatabase> {
    store: Arc<SqlStore<DB>>,
    tx: Option<Tx<DB>>,
    isolate: bool,
    /// Claimed records: their key's result is stored at completion.
    records: bool,
}

impl<DB: SqlDatabase> std::fmt::Debug for SqlUnit<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlUnit")
            .field("open", &self.tx.is_some())
            .field("isolate", &self.isolate)
            .field("records", &self.records)
            .finish()
    }
}

impl<DB: SqlDatabase> UnitStore for SqlStore<DB> {
    type Unit = SqlUnit<DB>;

    fn begin(self: &Arc<Self>, options: UnitOptions) -> SqlUnit<DB> {
        SqlUnit {
            store: Arc::clone(self),
            tx: None,
            isolate: options.isolate,
            records: false,
        }
    }
}

/// Why a claim is refused: a unit claims keys, or one record.
fn mixed() -> StoreError {
    StoreError::config("a SQL unit claims either keys or one record")
}

impl<DB: SqlDatabase> SqlUnit<DB> {
    fn tx_mut(&mut self) -> Result<&mut Tx<DB>, StoreError> {
        self.tx
            .as_mut()
            .ok_or_else(|| StoreError::transient("the unit's transaction is gone"))
    }

    async fn rollback(&mut self) {
        if let Some(tx) = self.tx.take() {
            if let Err(e) = self.store.rollback(tx).await {
                tracing::warn!(error = %e, "rollback failed");
            }
        }
    }

    async fn claim_keys(
        &mut self,
        claims: &[MemberClaim<'_>],
    ) -> Result<Vec<MemberAnswer>, StoreError> {
        let mut consumer = None;
        let mut pairs = Vec::with_capacity(claims.len());
        for claim in claims {
            let MemberClaim::Key(req) = claim else {
                return Err(mixed());
            };
            if *consumer.get_or_insert(req.consumer) != req.consumer {
                return Err(StoreError::config("a unit's keys belong to one consumer"));
            }
            pairs.push((req.key, req.fingerprint));
        }
        let (tx, answers) = self
            .store
            .claim_batch(consumer.unwrap_or_default(), &pairs)
            .await?;
        self.tx = Some(tx);
        Ok(answers
            .into_iter()
            .map(|answer| match answer {
                BatchClaim::New => MemberAnswer::New,
                BatchClaim::Done(record) => MemberAnswer::Done(record),
                BatchClaim::Busy => {
                    MemberAnswer::Busy("the key is being committed by another worker".into())
                }
            })
            .collect())
    }

    /// Claims the record's offset (and its position, and its key).
    async fn claim_record(&mut self, claim: &RecordClaim<'_>) -> Result<MemberAnswer, StoreError> {
        let store = Arc::clone(&self.store);
        let at = claim.at;
        let consumer = claim.identity.consumer;
        let applied = || {
            MemberAnswer::Done(InboxRecord {
                consumer: consumer.to_owned(),
                key: claim.identity.key.to_owned(),
                fingerprint: claim.identity.fingerprint.to_owned(),
                result: None,
                first_seen_ms: 0,
            })
        };
        let lock = claim.position.is_none();
        let mut tx = match store
            .claim_offset(consumer, at.topic, at.partition, at.offset, lock)
            .await?
        {
            OffsetClaim::New(tx) => tx,
            OffsetClaim::Applied => return Ok(applied()),
        };
        if let Some(position) = &claim.position {
            // Above the watermark, a record committed out of order left its
            // position row; a copy still in another transaction (a revoked
            // owner's) makes this claim wait for its outcome.
            let claimed = store.claim_key_in(&mut tx, position).await;
            if !matches!(claimed, Ok(None)) {
                self.tx = Some(tx);
                self.rollback().await;
                return claimed.map(|_| applied());
            }
        }
        if claim.claim_key {
            match store.claim_key_in(&mut tx, &claim.identity).await {
                Ok(None) => {}
                Ok(Some(record)) => {
                    // A producer retry (or a conflict): nothing to apply,
                    // but the watermark moves past this record.
                    store
                        .commit_offset(tx, consumer, at.topic, at.partition, claim.skip_to, None)
                        .await?;
                    return Ok(MemberAnswer::Done(record));
                }
                Err(e) => {
                    self.tx = Some(tx);
                    self.rollback().await;
                    return Err(e);
                }
            }
        }
        self.tx = Some(tx);
        Ok(MemberAnswer::New)
    }
}

#[async_trait]
impl<DB: SqlDatabase> WorkUnit for SqlUnit<DB> {
    type Tx = Tx<DB>;

    async fn claim(&mut self, claims: &[MemberClaim<'_>]) -> Result<Vec<MemberAnswer>, StoreError> {
        let Some(MemberClaim::Record(first)) = claims.first() else {
            return self.claim_keys(claims).await;
        };
        self.records = true;
        let mut answers = vec![self.claim_record(first).await?];
        for claim in &claims[1..] {
            if !matches!(claim, MemberClaim::Record(_)) {
                self.rollback().await;
                return Err(mixed());
            }
            // One record per unit: more would need a transaction each.
            answers.push(MemberAnswer::Busy("a unit claims one record".into()));
        }
        Ok(answers)
    }

    fn tx(&mut self, _member: usize) -> Option<&mut Tx<DB>> {
        self.tx.as_mut()
    }

    fn shared(&mut self) -> Option<&mut Tx<DB>> {
        self.tx.as_mut()
    }

    async fn isolate(&mut self, _member: usize) -> Result<(), StoreError> {
        if !self.isolate || self.records {
            return Ok(());
        }
        let store = Arc::clone(&self.store);
        store.savepoint(self.tx_mut()?).await
    }

    async fn keep(&mut self, _member: usize) -> Result<(), StoreError> {
        if !self.isolate || self.records {
            return Ok(());
        }
        let store = Arc::clone(&self.store);
        store.release_savepoint(self.tx_mut()?).await
    }

    async fn undo(
        &mut self,
        _member: usize,
        claim: &MemberClaim<'_>,
    ) -> Result<Undone, StoreError> {
        match claim {
            MemberClaim::Key(req) if self.isolate => {
                let store = Arc::clone(&self.store);
                store
                    .rollback_message(self.tx_mut()?, req.consumer, req.key)
                    .await?;
                Ok(Undone::Member)
            }
            MemberClaim::Key(_) => {
                self.rollback().await;
                Ok(Undone::Unit)
            }
            // A record is the unit's only member.
            _ => {
                self.rollback().await;
                Ok(Undone::Member)
            }
        }
    }

    async fn complete(
        mut self,
        claims: &[MemberClaim<'_>],
        done: &[Completion<'_>],
    ) -> Result<Vec<bool>, StoreError> {
        let Some(tx) = self.tx.take() else {
            if done.is_empty() {
                return Ok(Vec::new());
            }
            return Err(StoreError::transient("the unit's transaction is gone"));
        };
        if let Some(MemberClaim::Record(record)) = claims.first() {
            let Some(completion) = done.first() else {
                self.tx = Some(tx);
                self.rollback().await;
                return Ok(Vec::new());
            };
            let keyed = record
                .claim_key
                .then_some((&record.identity, completion.result));
            let at = record.at;
            self.store
                .commit_offset(
                    tx,
                    record.identity.consumer,
                    at.topic,
                    at.partition,
                    completion.watermark,
                    keyed,
                )
                .await?;
            return Ok(vec![true]);
        }
        let consumer = claims
            .first()
            .map(MemberClaim::consumer)
            .unwrap_or_default();
        let results: Vec<(&str, Option<&serde_json::Value>)> = done
            .iter()
            .filter_map(|c| {
                claims
                    .get(c.member)
                    .and_then(|m| m.key())
                    .map(|k| (k.key, c.result))
            })
            .collect();
        self.store.commit_batch(tx, consumer, &results).await?;
        Ok(vec![true; done.len()])
    }

    async fn abort(mut self) {
        self.rollback().await;
    }
}
