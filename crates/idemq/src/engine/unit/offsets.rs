//! The offset unit of the watermark mode ([`OffsetStore`]): one record's
//! offset (and, with key dedup, its business key) claimed in one
//! transaction, committed with the partition's watermark moved past it —
//! or, when records of its partition commit out of order
//! ([`Contiguity::Tracked`]), with its position claimed in the inbox and the
//! watermark moved only to the partition's contiguous position.

use async_trait::async_trait;

use super::{roll_back, Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::{Consumer, Identity};
use crate::engine::watermark::WatermarkOptions;
use crate::error::{InputError, StoreError};
use crate::message::DeliveryMeta;
use crate::outcome::DeadLetterReason;
use crate::source::{Acknowledger, Contiguity};
use crate::store::{ClaimRequest, InboxRecord, OffsetClaim, OffsetStore};

/// Where a delivery sits in its partitioned log.
pub(crate) struct Position<'a> {
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

impl Position<'_> {
    /// The record's identity in the inbox: `topic-partition@offset`.
    fn key(&self) -> String {
        format!("{}-{}@{}", self.topic, self.partition, self.offset)
    }
}

/// The position of a delivery that carries a topic, a partition and an offset.
pub(crate) fn position(meta: &DeliveryMeta) -> Option<Position<'_>> {
    Some(Position {
        topic: meta.topic.as_deref()?,
        partition: meta.partition?,
        offset: meta.offset?,
    })
}

/// Where the watermark moves when `at` commits: just past it when its
/// source hands out its partition in order; else to the partition's
/// contiguous position as the source tracks it (`None`: not at all, the
/// record's position row alone says it was applied).
fn next_watermark(at: &Position<'_>, contiguity: Contiguity) -> Option<i64> {
    match contiguity {
        Contiguity::Tracked(position) => position,
        _ => Some(at.offset.saturating_add(1)),
    }
}

/// How a delivery's partition stands: as its source says when records of a
/// partition run concurrently (`concurrent_records`), else in order.
fn contiguity_of(concurrent_records: bool, acker: &dyn Acknowledger) -> Contiguity {
    if concurrent_records {
        acker.contiguity()
    } else {
        Contiguity::InOrder
    }
}

/// Whether records of the delivery's partition may apply concurrently: then
/// each claims its position in the inbox, and the watermark moves only to
/// the contiguous position.
fn tracked(contiguity: Contiguity) -> bool {
    matches!(contiguity, Contiguity::Tracked(_))
}

/// Offset-watermark mode.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Watermark(pub(crate) WatermarkOptions);

#[async_trait]
impl<S: OffsetStore> Mode<S> for Watermark {
    type Unit = Offsets<S>;

    /// With [`WatermarkOptions::concurrent_records`], records of a partition
    /// may commit out of offset order: the watermark moves only to the
    /// contiguous position the source reports ([`Contiguity::Tracked`]).
    fn out_of_order(&self) -> bool {
        self.0.concurrent_records
    }

    fn open(&self, consumer: &Consumer<S>, _careful: bool) -> Offsets<S> {
        Offsets {
            consumer: consumer.clone(),
            dedup_keys: self.0.dedup_keys,
            concurrent_records: self.0.concurrent_records,
            tx: None,
        }
    }

    /// Without key dedup a record is identified by its position
    /// (`topic-partition@offset`, empty fingerprint); a delivery without a
    /// position cannot run in this mode and is dead-lettered.
    fn claim_identity(
        &self,
        meta: &DeliveryMeta,
        identity: &Identity,
        defect: Option<&InputError>,
    ) -> Identity {
        let Some(at) = position(meta) else {
            return Err((
                None,
                DeadLetterReason::InvalidInput(InputError::Malformed(
                    "offset-watermark mode needs a topic, a partition and an offset".into(),
                )),
            ));
        };
        if self.0.dedup_keys {
            return identity.clone();
        }
        match defect {
            Some(defect) => Err((None, DeadLetterReason::InvalidInput(defect.clone()))),
            None => Ok((at.key(), String::new())),
        }
    }

    /// Marks a dead-lettered record applied, so that a re-read does not
    /// dead-letter it again: the watermark moves past it, or, while records
    /// below it are unsettled, its position is claimed in the inbox.
    async fn after_dead_letter(
        &self,
        consumer: &Consumer<S>,
        meta: &DeliveryMeta,
        acker: &dyn Acknowledger,
    ) -> Result<(), StoreError> {
        let Some(at) = position(meta) else {
            return Ok(());
        };
        let inner = &*consumer.inner;
        let store = &inner.store;
        let name = inner.name.as_str();
        if !tracked(contiguity_of(self.0.concurrent_records, acker)) {
            return store
                .advance_offset(name, at.topic, at.partition, at.offset)
                .await;
        }
        let OffsetClaim::New(mut tx) = store
            .claim_offset(name, at.topic, at.partition, at.offset, false)
            .await?
        else {
            return Ok(());
        };
        let key = at.key();
        let req = position_claim(name, &key, inner.lease);
        if let Err(e) = store.claim_key_in(&mut tx, &req).await {
            if let Err(rollback) = store.rollback(tx).await {
                tracing::warn!(consumer = name, error = %rollback, "rollback failed");
            }
            return Err(e);
        }
        let next = next_watermark(&at, acker.contiguity());
        store
            .commit_offset(tx, name, at.topic, at.partition, next, None)
            .await
    }
}

/// The inbox claim of a record's position (fingerprint empty).
fn position_claim<'a>(
    consumer: &'a str,
    key: &'a str,
    lease: std::time::Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer,
        key,
        fingerprint: "",
        lease,
    }
}

/// One record's offset claim and its transaction.
pub(crate) struct Offsets<S: OffsetStore> {
    consumer: Consumer<S>,
    dedup_keys: bool,
    concurrent_records: bool,
    tx: Option<S::Tx>,
}

impl<S: OffsetStore> Offsets<S> {
    /// How the delivery's partition stands: as its source says when records
    /// of a partition run concurrently, else in order.
    fn contiguity(&self, acker: &dyn Acknowledger) -> Contiguity {
        contiguity_of(self.concurrent_records, acker)
    }

    async fn rollback(&mut self) {
        roll_back(&self.consumer, &mut self.tx).await;
    }

    /// Claims the offset (and the key); the answer for one record.
    async fn claim_one(&mut self, claim: &Claimant<'_>) -> Result<Answer, StoreError> {
        let inner = &*self.consumer.inner;
        let consumer = inner.name.as_str();
        let Some(at) = position(claim.meta) else {
            return Err(StoreError::config(
                "offset-watermark mode needs a topic, a partition and an offset",
            ));
        };
        let contiguity = self.contiguity(claim.acker);
        let applied = || {
            Answer::Done(InboxRecord {
                consumer: consumer.to_owned(),
                key: claim.req.key.to_owned(),
                fingerprint: claim.req.fingerprint.to_owned(),
                result: None,
                first_seen_ms: 0,
            })
        };
        let mut tx = match inner
            .store
            .claim_offset(
                consumer,
                at.topic,
                at.partition,
                at.offset,
                !tracked(contiguity),
            )
            .await?
        {
            OffsetClaim::New(tx) => tx,
            OffsetClaim::Applied { .. } => return Ok(applied()),
        };
        if tracked(contiguity) {
            // Above the watermark, a record committed out of order left its
            // position row; a copy still in another transaction (a revoked
            // owner's) makes this claim wait for its outcome.
            let key = at.key();
            let req = position_claim(consumer, &key, inner.lease);
            let claimed = inner.store.claim_key_in(&mut tx, &req).await;
            if !matches!(claimed, Ok(None)) {
                if let Err(e) = inner.store.rollback(tx).await {
                    tracing::warn!(consumer, error = %e, "rollback failed");
                }
                return claimed.map(|_| applied());
            }
        }
        if self.dedup_keys {
            match inner.store.claim_key_in(&mut tx, &claim.req).await {
                Ok(None) => {}
                Ok(Some(record)) => {
                    // A producer retry (or a conflict): nothing to apply,
                    // but the watermark moves past this record.
                    let next = next_watermark(&at, self.contiguity(claim.acker));
                    inner
                        .store
                        .commit_offset(tx, consumer, at.topic, at.partition, next, None)
                        .await?;
                    return Ok(Answer::Done(record));
                }
                Err(e) => {
                    self.tx = Some(tx);
                    self.rollback().await;
                    return Err(e);
                }
            }
        }
        self.tx = Some(tx);
        Ok(Answer::New)
    }
}

#[async_trait]
impl<S: OffsetStore> Unit<S> for Offsets<S> {
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError> {
        let mut answers = Vec::with_capacity(claims.len());
        for (n, claim) in claims.iter().enumerate() {
            answers.push(if n == 0 {
                self.claim_one(claim).await?
            } else {
                // A unit of one: more records would need a transaction each.
                Answer::Busy("a unit of one claims one record".into())
            });
        }
        Ok(answers)
    }

    fn tx(&mut self, _n: usize) -> Option<&mut S::Tx> {
        self.tx.as_mut()
    }

    async fn undo(&mut self, _n: usize, _claim: &Claimant<'_>) -> Result<Undone, StoreError> {
        self.rollback().await;
        Ok(Undone::Member)
    }

    async fn complete(
        mut self,
        claims: &[Claimant<'_>],
        done: &[(usize, Option<&serde_json::Value>)],
    ) -> Result<Vec<bool>, StoreError> {
        let held = self.tx.take();
        let at = claims
            .first()
            .and_then(|claim| position(claim.meta).map(|at| (claim, at)));
        match (done.first(), at, held) {
            (Some(&(_, result)), Some((claim, at)), Some(tx)) => {
                let inner = &*self.consumer.inner;
                let keyed = self.dedup_keys.then_some((&claim.req, result));
                let next = next_watermark(&at, self.contiguity(claim.acker));
                inner
                    .store
                    .commit_offset(tx, &inner.name, at.topic, at.partition, next, keyed)
                    .await?;
                Ok(vec![true])
            }
            (_, _, held) => {
                self.tx = held;
                self.rollback().await;
                Ok(Vec::new())
            }
        }
    }

    async fn abort(mut self) {
        self.rollback().await;
    }
}
