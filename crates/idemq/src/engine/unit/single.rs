//! The unit of one: a single key in its own transaction (SQL stores) or
//! lease (lease stores), for any [`Store`]. Per-message mode.

use std::time::Instant;

use async_trait::async_trait;

use super::{roll_back, Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::Consumer;
use crate::error::StoreError;
use crate::policy::InFlightPolicy;
use crate::store::{Claim, ClaimRequest, Store};

/// Per-message mode: every delivery is a unit of one.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PerMessage;

impl<S: Store> Mode<S> for PerMessage {
    type Unit = Single<S>;

    fn open(&self, consumer: &Consumer<S>, _careful: bool) -> Single<S> {
        Single {
            consumer: consumer.clone(),
            tx: None,
        }
    }
}

/// One claimed key and its transaction or lease.
pub(crate) struct Single<S: Store> {
    consumer: Consumer<S>,
    tx: Option<S::Tx>,
}

/// Claims the key; with [`InFlightPolicy::Wait`], polls while another
/// worker holds it, until it completes, its lease expires, or the wait ends.
async fn claim_waiting<S: Store>(
    consumer: &Consumer<S>,
    req: &ClaimRequest<'_>,
) -> Result<Claim<S::Tx>, StoreError> {
    let inner = &*consumer.inner;
    let claim = inner.store.claim(req).await?;
    let InFlightPolicy::Wait { poll, max_wait } = inner.in_flight else {
        return Ok(claim);
    };
    if !matches!(claim, Claim::InFlight) {
        return Ok(claim);
    }
    let deadline = Instant::now() + max_wait;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Ok(Claim::InFlight);
        }
        tokio::time::sleep(poll.min(deadline - now)).await;
        match inner.store.claim(req).await? {
            Claim::InFlight => continue,
            other => return Ok(other),
        }
    }
}

impl<S: Store> Single<S> {
    async fn rollback(&mut self) {
        roll_back(&self.consumer, &mut self.tx).await;
    }
}

#[async_trait]
impl<S: Store> Unit<S> for Single<S> {
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError> {
        let mut answers = Vec::with_capacity(claims.len());
        // A unit of one: more members would need a transaction each.
        for claim in claims.iter().take(1) {
            answers.push(match claim_waiting(&self.consumer, &claim.req).await? {
                Claim::New(tx) => {
                    self.tx = Some(tx);
                    Answer::New
                }
                Claim::Done(record) => Answer::Done(record),
                Claim::InFlight => Answer::Busy("in flight in another worker".into()),
            });
        }
        for _ in claims.iter().skip(1) {
            answers.push(Answer::Busy("a unit of one claims one key".into()));
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
        match (done.first(), claims.first(), self.tx.take()) {
            (Some((_, result)), Some(claim), Some(tx)) => {
                self.consumer
                    .inner
                    .store
                    .commit(tx, &claim.req, *result)
                    .await?;
                Ok(vec![true])
            }
            (_, _, tx) => {
                self.tx = tx;
                self.rollback().await;
                Ok(Vec::new())
            }
        }
    }

    async fn abort(mut self) {
        self.rollback().await;
    }
}
