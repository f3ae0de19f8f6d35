//! Units a store makes itself ([`UnitStore`]): batch mode's keys and
//! offset-watermark mode's records, driven through the engine's [`Unit`].
//!
//! The store decides what a unit is (one SQL transaction with savepoints,
//! Redis leases completed in one round trip); this adapter only says what
//! each member claims — its key, or its record's position — and, for a
//! record, where the partition's watermark may move.

use async_trait::async_trait;

use super::offsets::Records;
use super::{Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::Consumer;
use crate::error::StoreError;
use crate::store::unit::{Completion, MemberClaim, UnitOptions, UnitStore, WorkUnit};

/// Batch mode: a unit of many keys, made by the store.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Batch;

impl<S: UnitStore> Mode<S> for Batch {
    type Unit = Stored<S>;

    fn open(&self, consumer: &Consumer<S>, careful: bool) -> Stored<S> {
        Stored::open(consumer, careful, None)
    }
}

/// A store's unit, and how its members claim.
pub(crate) struct Stored<S: UnitStore> {
    unit: S::Unit,
    /// Offset-watermark mode: members claim their records.
    records: Option<Records>,
}

impl<S: UnitStore> Stored<S> {
    /// A new unit of the consumer's store; `careful`: isolate every member.
    pub(crate) fn open(consumer: &Consumer<S>, careful: bool, records: Option<Records>) -> Self {
        let inner = &*consumer.inner;
        let options = UnitOptions::new(careful, inner.lease, inner.in_flight);
        Self {
            unit: inner.store.begin(options),
            records,
        }
    }

    /// The position keys the members' record claims borrow (empty for keys).
    fn positions(&self, claims: &[Claimant<'_>]) -> Vec<String> {
        match &self.records {
            Some(records) => records.position_keys(claims),
            None => Vec::new(),
        }
    }

    /// What each member claims from the store.
    fn member_claims<'a>(
        &self,
        claims: &'a [Claimant<'a>],
        positions: &'a [String],
    ) -> Result<Vec<MemberClaim<'a>>, StoreError> {
        match &self.records {
            Some(records) => records.claims(claims, positions),
            None => Ok(claims.iter().map(|c| MemberClaim::Key(c.req)).collect()),
        }
    }
}

#[async_trait]
impl<S: UnitStore> Unit<S> for Stored<S> {
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError> {
        let positions = self.positions(claims);
        let members = self.member_claims(claims, &positions)?;
        self.unit.claim(&members).await
    }

    fn tx(&mut self, n: usize) -> Option<&mut S::Tx> {
        self.unit.tx(n)
    }

    fn shared(&mut self) -> Option<&mut S::Tx> {
        match self.records {
            Some(_) => None,
            None => self.unit.shared(),
        }
    }

    async fn isolate(&mut self, n: usize) -> Result<(), StoreError> {
        self.unit.isolate(n).await
    }

    async fn keep(&mut self, n: usize) -> Result<(), StoreError> {
        self.unit.keep(n).await
    }

    async fn undo(&mut self, n: usize, claim: &Claimant<'_>) -> Result<Undone, StoreError> {
        let one = std::slice::from_ref(claim);
        let positions = self.positions(one);
        let members = self.member_claims(one, &positions)?;
        match members.first() {
            Some(member) => self.unit.undo(n, member).await,
            None => Err(StoreError::transient("no claim to undo")),
        }
    }

    async fn complete(
        self,
        claims: &[Claimant<'_>],
        done: &[(usize, Option<&serde_json::Value>)],
    ) -> Result<Vec<bool>, StoreError> {
        let positions = self.positions(claims);
        let members = match self.member_claims(claims, &positions) {
            Ok(members) => members,
            Err(e) => {
                self.unit.abort().await;
                return Err(e);
            }
        };
        let completions: Vec<Completion<'_>> = done
            .iter()
            .map(|&(member, result)| Completion {
                member,
                result,
                watermark: match (&self.records, claims.get(member)) {
                    (Some(records), Some(claim)) => records.watermark_after(claim),
                    _ => None,
                },
            })
            .collect();
        self.unit.complete(&members, &completions).await
    }

    async fn abort(self) {
        self.unit.abort().await;
    }
}

/// Offset-watermark mode's unit: a [`Stored`] unit whose members claim records.
pub(crate) fn records<S: UnitStore>(consumer: &Consumer<S>, records: Records) -> Stored<S> {
    Stored::open(consumer, false, Some(records))
}
