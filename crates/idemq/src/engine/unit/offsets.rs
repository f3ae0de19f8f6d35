//! Offset-watermark mode ([`WatermarkStore`]): each member claims its
//! record — its offset (and, with key dedup, its business key) — in the
//! store's unit, which commits with the partition's watermark moved past it;
//! or, when records of its partition commit out of order
//! ([`Contiguity::Tracked`]), with its position claimed in the inbox and the
//! watermark moved only to the partition's contiguous position.

use async_trait::async_trait;

use super::stored::{self, Stored};
use super::{Answer, Claimant, Mode};
use crate::engine::consumer::{Consumer, Identity};
use crate::engine::watermark::WatermarkOptions;
use crate::error::{InputError, StoreError};
use crate::message::DeliveryMeta;
use crate::outcome::DeadLetterReason;
use crate::source::{Acknowledger, Contiguity};
use crate::store::unit::{
    Completion, MemberClaim, RecordClaim, RecordPosition, UnitOptions, WatermarkStore, WorkUnit,
};
use crate::store::ClaimRequest;

/// Where a delivery sits in its partitioned log.
pub(crate) struct Position<'a> {
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
}

impl<'a> Position<'a> {
    /// The record's identity in the inbox: `topic-partition@offset`.
    fn key(&self) -> String {
        format!("{}-{}@{}", self.topic, self.partition, self.offset)
    }

    /// The position as the store's record claim takes it.
    fn record(&self) -> RecordPosition<'a> {
        RecordPosition {
            topic: self.topic,
            partition: self.partition,
            offset: self.offset,
        }
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

impl Watermark {
    fn records(&self) -> Records {
        Records {
            dedup_keys: self.0.dedup_keys,
            concurrent_records: self.0.concurrent_records,
        }
    }
}

#[async_trait]
impl<S: WatermarkStore> Mode<S> for Watermark {
    type Unit = Stored<S>;

    /// With [`WatermarkOptions::concurrent_records`], records of a partition
    /// may commit out of offset order: the watermark moves only to the
    /// contiguous position the source reports ([`Contiguity::Tracked`]).
    fn out_of_order(&self) -> bool {
        self.0.concurrent_records
    }

    fn open(&self, consumer: &Consumer<S>, _careful: bool) -> Stored<S> {
        stored::records(consumer, self.records())
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
        let key = at.key();
        let identity = position_claim(&inner.name, &key, inner.lease);
        let concurrent = tracked(contiguity_of(self.0.concurrent_records, acker));
        let claim = MemberClaim::Record(RecordClaim {
            at: at.record(),
            identity,
            claim_key: false,
            position: concurrent.then_some(identity),
            skip_to: None,
        });
        let mut unit = inner
            .store
            .begin(UnitOptions::new(false, inner.lease, inner.in_flight));
        let answers = unit.claim(std::slice::from_ref(&claim)).await?;
        if !matches!(answers.first(), Some(Answer::New)) {
            unit.abort().await;
            return Ok(());
        }
        let watermark = if concurrent {
            next_watermark(&at, acker.contiguity())
        } else {
            Some(at.offset.saturating_add(1))
        };
        let done = [Completion {
            member: 0,
            result: None,
            watermark,
        }];
        unit.complete(&[claim], &done).await.map(|_| ())
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

/// How the members of a watermark unit claim their records.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Records {
    dedup_keys: bool,
    concurrent_records: bool,
}

impl Records {
    /// Each member's position key, `topic-partition@offset` (empty without
    /// a position).
    pub(super) fn position_keys(&self, claims: &[Claimant<'_>]) -> Vec<String> {
        claims
            .iter()
            .map(|c| position(c.meta).map(|at| at.key()).unwrap_or_default())
            .collect()
    }

    /// Each member's record claim; `positions` from [`position_keys`](Self::position_keys).
    pub(super) fn claims<'a>(
        &self,
        claims: &'a [Claimant<'a>],
        positions: &'a [String],
    ) -> Result<Vec<MemberClaim<'a>>, StoreError> {
        claims
            .iter()
            .zip(positions)
            .map(|(c, key)| {
                let at = position(c.meta).ok_or_else(|| {
                    StoreError::config(
                        "offset-watermark mode needs a topic, a partition and an offset",
                    )
                })?;
                let contiguity = contiguity_of(self.concurrent_records, c.acker);
                Ok(MemberClaim::Record(RecordClaim {
                    at: at.record(),
                    identity: c.req,
                    claim_key: self.dedup_keys,
                    position: tracked(contiguity)
                        .then(|| position_claim(c.req.consumer, key, c.req.lease)),
                    skip_to: next_watermark(&at, contiguity),
                }))
            })
            .collect()
    }

    /// Where the watermark moves when the member's record commits.
    pub(super) fn watermark_after(&self, claim: &Claimant<'_>) -> Option<i64> {
        let at = position(claim.meta)?;
        next_watermark(&at, contiguity_of(self.concurrent_records, claim.acker))
    }
}
