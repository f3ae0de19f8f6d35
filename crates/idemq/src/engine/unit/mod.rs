//! Units of work: what one pass of the pipeline claims, runs and completes
//! together, and the modes that make them.
//!
//! The pipeline (`super::pipeline`) is written once over [`Unit`]; a mode
//! decides what a unit is:
//!
//! | mode | unit | claims |
//! |---|---|---|
//! | per message ([`single`]) | one key in its own transaction or lease, for any [`Store`] | the key |
//! | batch ([`stored::Batch`]) | the store's own [`WorkUnit`](crate::store::WorkUnit) ([`UnitStore`](crate::store::UnitStore)) | many keys |
//! | offset watermark ([`offsets::Watermark`]) | the store's own unit ([`WatermarkStore`](crate::store::WatermarkStore)) | one record's position (and key) |
//!
//! What a store's unit does with a failing member and how it completes is
//! the store's: one SQL transaction with savepoints, Redis leases completed
//! in one round trip (see [`crate::store::unit`]).

use async_trait::async_trait;

use super::consumer::{Consumer, Identity};
use crate::error::{InputError, StoreError};
use crate::message::DeliveryMeta;
use crate::source::Acknowledger;
use crate::store::{ClaimRequest, Store};

pub(crate) mod offsets;
pub(crate) mod single;
pub(crate) mod stored;

pub(crate) use crate::store::unit::{MemberAnswer as Answer, Undone};

/// One member of a unit as its store sees it: the claim and where the
/// delivery came from.
#[derive(Clone, Copy)]
pub(crate) struct Claimant<'a> {
    /// The key (or record) to claim.
    pub(crate) req: ClaimRequest<'a>,
    /// Where the delivery came from (the offset claim reads its position).
    pub(crate) meta: &'a DeliveryMeta,
    /// Its settlement: the offset claim asks it how the partition stands.
    pub(crate) acker: &'a dyn Acknowledger,
}

/// A unit of work over store `S`: claims its members, isolates a failing
/// one, and completes (commits) the rest together.
///
/// The pipeline calls, in order: [`claim`](Self::claim) once; for each new
/// member [`isolate`](Self::isolate), the handler with [`tx`](Self::tx),
/// then [`keep`](Self::keep) or [`undo`](Self::undo); finally
/// [`complete`](Self::complete), or [`abort`](Self::abort) if the unit
/// broke.
#[async_trait]
pub(crate) trait Unit<S: Store>: Send + Sized {
    /// Claims every member (distinct keys); answers in order. On an error
    /// the unit holds nothing.
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError>;

    /// The transaction or lease member `n`'s handler writes through.
    fn tx(&mut self, n: usize) -> Option<&mut S::Tx>;

    /// The one transaction every member writes through, if the unit has
    /// one (see [`WorkUnit::shared`](crate::store::WorkUnit::shared)).
    fn shared(&mut self) -> Option<&mut S::Tx> {
        None
    }

    /// Marks the point member `n`'s work can be undone to.
    async fn isolate(&mut self, _n: usize) -> Result<(), StoreError> {
        Ok(())
    }

    /// Keeps member `n`'s work.
    async fn keep(&mut self, _n: usize) -> Result<(), StoreError> {
        Ok(())
    }

    /// Undoes member `n`'s work and gives up its claim, so that its
    /// redelivery can claim the key again.
    async fn undo(&mut self, n: usize, claim: &Claimant<'_>) -> Result<Undone, StoreError>;

    /// Stores the results of the members in `done` (member, result) and
    /// commits the unit; answers, per member of `done` in order, whether its
    /// claim held (a lease taken over after expiring does not).
    async fn complete(
        self,
        claims: &[Claimant<'_>],
        done: &[(usize, Option<&serde_json::Value>)],
    ) -> Result<Vec<bool>, StoreError>;

    /// Gives the whole unit up (rollback, leases released).
    async fn abort(self);
}

/// Rolls back the transaction or lease a unit still `held`, if any; a
/// failure is logged (the database or the lease expiry undoes it anyway).
pub(crate) async fn roll_back<S: Store>(consumer: &Consumer<S>, held: &mut Option<S::Tx>) {
    if let Some(tx) = held.take() {
        if let Err(e) = consumer.inner.store.rollback(tx).await {
            tracing::warn!(consumer = %consumer.inner.name, error = %e, "rollback failed");
        }
    }
}

/// A mode of the pipeline: what a unit is, what a member claims, and what
/// happens after a dead letter.
#[async_trait]
pub(crate) trait Mode<S: Store>: Send + Sync {
    /// The unit this mode runs.
    type Unit: Unit<S>;

    /// Whether the run loop may ask a partitioned source for many unsettled
    /// records of a partition at once ([`Source::settle_out_of_order`](crate::source::Source::settle_out_of_order)):
    /// the key lanes keep each key's order. By default, yes.
    fn out_of_order(&self) -> bool {
        true
    }

    /// A new unit; `careful`: isolate every member from the start.
    fn open(&self, consumer: &Consumer<S>, careful: bool) -> Self::Unit;

    /// What a delivery claims, from its identity (business key and
    /// fingerprint) and its source's `defect`. By default, the identity.
    fn claim_identity(
        &self,
        _meta: &DeliveryMeta,
        identity: &Identity,
        _defect: Option<&InputError>,
    ) -> Identity {
        identity.clone()
    }

    /// Runs after a member was dead-lettered: the watermark mode moves past
    /// the record so that a re-read does not dead-letter it again. An error
    /// keeps the delivery to be retried.
    async fn after_dead_letter(
        &self,
        _consumer: &Consumer<S>,
        _meta: &DeliveryMeta,
        _acker: &dyn Acknowledger,
    ) -> Result<(), StoreError> {
        Ok(())
    }
}
