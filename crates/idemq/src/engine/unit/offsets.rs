//! The offset unit of the watermark mode ([`OffsetStore`]): one record's
//! offset (and, with key dedup, its business key) claimed in one
//! transaction, committed with the partition's watermark moved past it.

use async_trait::async_trait;

use super::{roll_back, Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::{Consumer, Identity};
use crate::engine::watermark::WatermarkOptions;
use crate::error::{InputError, StoreError};
use crate::message::DeliveryMeta;
use crate::outcome::DeadLetterReason;
use crate::store::{InboxRecord, OffsetClaim, OffsetStore};

/// Where a delivery sits in its partitioned log.
pub(crate) struct Position<'a> {
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

/// The position of a delivery that carries a topic, a partition and an offset.
pub(crate) fn position(meta: &DeliveryMeta) -> Option<Position<'_>> {
    Some(Position {
        topic: meta.topic.as_deref()?,
        partition: meta.partition?,
        offset: meta.offset?,
    })
}

/// Offset-watermark mode.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Watermark(pub(crate) WatermarkOptions);

#[async_trait]
impl<S: OffsetStore> Mode<S> for Watermark {
    type Unit = Offsets<S>;

    /// The watermark moves to the highest offset applied, so a partition's
    /// records must commit in offset order: one unsettled at a time.
    fn out_of_order(&self) -> bool {
        false
    }

    fn open(&self, consumer: &Consumer<S>, _careful: bool) -> Offsets<S> {
        Offsets {
            consumer: consumer.clone(),
            dedup_keys: self.0.dedup_keys,
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
            None => Ok((
                format!("{}-{}@{}", at.topic, at.partition, at.offset),
                String::new(),
            )),
        }
    }

    /// Moves the watermark past a dead-lettered record, so that a re-read
    /// does not dead-letter it again.
    async fn after_dead_letter(
        &self,
        consumer: &Consumer<S>,
        meta: &DeliveryMeta,
    ) -> Result<(), StoreError> {
        let Some(at) = position(meta) else {
            return Ok(());
        };
        let inner = &*consumer.inner;
        inner
            .store
            .advance_offset(&inner.name, at.topic, at.partition, at.offset)
            .await
    }
}

/// One record's offset claim and its transaction.
pub(crate) struct Offsets<S: OffsetStore> {
    consumer: Consumer<S>,
    dedup_keys: bool,
    tx: Option<S::Tx>,
}

impl<S: OffsetStore> Offsets<S> {
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
        let mut tx = match inner
            .store
            .claim_offset(consumer, at.topic, at.partition, at.offset)
            .await?
        {
            OffsetClaim::New(tx) => tx,
            OffsetClaim::Applied { .. } => {
                return Ok(Answer::Done(InboxRecord {
                    consumer: consumer.to_owned(),
                    key: claim.req.key.to_owned(),
                    fingerprint: claim.req.fingerprint.to_owned(),
                    result: None,
                    first_seen_ms: 0,
                }))
            }
        };
        if self.dedup_keys {
            match inner.store.claim_key_in(&mut tx, &claim.req).await {
                Ok(None) => {}
                Ok(Some(record)) => {
                    // A producer retry (or a conflict): nothing to apply,
                    // but the watermark moves past this record.
                    inner
                        .store
                        .commit_offset(tx, consumer, at.topic, at.partition, at.offset, None)
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
                inner
                    .store
                    .commit_offset(tx, &inner.name, at.topic, at.partition, at.offset, keyed)
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
