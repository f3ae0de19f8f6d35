//! The lease batch unit ([`LeaseBatchStore`]: the Redis store): many keys,
//! a lease each, claimed and completed in one round trip each.
//!
//! Per unit:
//! 1. all keys are claimed in **one round trip**: each new key gets its own
//!    lease (token and fencing number), a done key answers duplicate (or
//!    conflict), a key in flight elsewhere follows the [`InFlightPolicy`]
//!    (retry later, or poll — again one round trip for all the waiting
//!    keys — until it completes or its lease expires);
//! 2. the new keys' handlers run one after another, each with its own
//!    lease, while **one heartbeat** extends every lease of the unit;
//! 3. in **one round trip**, the processed keys are completed
//!    (compare-and-set on their tokens, result stored, retention TTL) and
//!    the failed ones released (compare-and-delete), so only they are
//!    retried.
//!
//! A lease lost while the unit ran (the heartbeat could not reach Redis for
//! a whole lease, and another worker took the key over) makes that key's
//! completion fail: it is retried and the redelivery finds the other
//! worker's result. A crash before the completion round trip leaves every
//! lease of the unit to be released (task aborted) or to expire (process
//! gone): the redeliveries run those handlers again, so, as in per-message
//! mode, a lease store needs effects that are idempotent or fenced
//! ([`RedisLease::fencing_token`](crate::store::redis::RedisLease::fencing_token))
//! — and batching widens that window from one handler to a batch.

use std::time::Instant;

use async_trait::async_trait;

use super::{Answer, Claimant, Mode, Undone, Unit};
use crate::engine::consumer::Consumer;
use crate::error::StoreError;
use crate::policy::InFlightPolicy;
use crate::store::{Claim, LeaseBatchStore, LeaseCompletion};

/// Batch mode over a [`LeaseBatchStore`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LeaseBatch;

impl<S: LeaseBatchStore> Mode<S> for LeaseBatch {
    type Unit = Leases<S>;

    fn open(&self, consumer: &Consumer<S>, _careful: bool) -> Leases<S> {
        Leases {
            group: Some(consumer.inner.store.lease_group(consumer.inner.lease)),
            consumer: consumer.clone(),
            held: Vec::new(),
            released: Vec::new(),
        }
    }
}

/// The leases of one unit.
pub(crate) struct Leases<S: LeaseBatchStore> {
    consumer: Consumer<S>,
    group: Option<S::Leases>,
    /// Member `n`'s lease while it is held.
    held: Vec<Option<S::Tx>>,
    /// Leases of failed members, released at completion.
    released: Vec<S::Tx>,
}

impl<S: LeaseBatchStore> Leases<S> {
    /// Claims `claims` (by index into `all`) into the group.
    async fn claim_some(
        &mut self,
        all: &[Claimant<'_>],
        which: &[usize],
    ) -> Result<Vec<Claim<S::Tx>>, StoreError> {
        let inner = &*self.consumer.inner;
        let Some(group) = self.group.as_mut() else {
            return Err(StoreError::transient("the lease group is gone"));
        };
        let pairs: Vec<(&str, &str)> = which
            .iter()
            .filter_map(|&n| all.get(n).map(|c| (c.req.key, c.req.fingerprint)))
            .collect();
        inner.store.claim_leases(group, &inner.name, &pairs).await
    }
}

#[async_trait]
impl<S: LeaseBatchStore> Unit<S> for Leases<S> {
    async fn claim(&mut self, claims: &[Claimant<'_>]) -> Result<Vec<Answer>, StoreError> {
        let all: Vec<usize> = (0..claims.len()).collect();
        let mut answers = self.claim_some(claims, &all).await?;
        if let InFlightPolicy::Wait { poll, max_wait } = self.consumer.inner.in_flight {
            let deadline = Instant::now() + max_wait;
            loop {
                let waiting: Vec<usize> = answers
                    .iter()
                    .enumerate()
                    .filter(|(_, a)| matches!(a, Claim::InFlight))
                    .map(|(n, _)| n)
                    .collect();
                let now = Instant::now();
                if waiting.is_empty() || now >= deadline {
                    break;
                }
                tokio::time::sleep(poll.min(deadline - now)).await;
                match self.claim_some(claims, &waiting).await {
                    Ok(claimed) => {
                        for (n, claim) in waiting.into_iter().zip(claimed) {
                            answers[n] = claim;
                        }
                    }
                    Err(e) => {
                        let consumer = &self.consumer.inner.name;
                        tracing::warn!(%consumer, error = %e, "claiming keys in flight failed");
                        break;
                    }
                }
            }
        }
        self.held = (0..claims.len()).map(|_| None).collect();
        Ok(answers
            .into_iter()
            .enumerate()
            .map(|(n, answer)| match answer {
                Claim::New(lease) => {
                    self.held[n] = Some(lease);
                    Answer::New
                }
                Claim::Done(record) => Answer::Done(record),
                Claim::InFlight => Answer::Busy("in flight in another worker".into()),
            })
            .collect())
    }

    fn tx(&mut self, n: usize) -> Option<&mut S::Tx> {
        self.held.get_mut(n).and_then(Option::as_mut)
    }

    async fn undo(&mut self, n: usize, _claim: &Claimant<'_>) -> Result<Undone, StoreError> {
        if let Some(lease) = self.held.get_mut(n).and_then(Option::take) {
            self.released.push(lease);
        }
        Ok(Undone::Member)
    }

    async fn complete(
        mut self,
        claims: &[Claimant<'_>],
        done: &[(usize, Option<&serde_json::Value>)],
    ) -> Result<Vec<bool>, StoreError> {
        let Some(group) = self.group.take() else {
            return Err(StoreError::transient("the lease group is gone"));
        };
        let mut completions = Vec::with_capacity(done.len());
        let mut answered = Vec::with_capacity(done.len());
        for &(n, result) in done {
            match (self.held.get_mut(n).and_then(Option::take), claims.get(n)) {
                (Some(lease), Some(claim)) => {
                    completions.push(LeaseCompletion {
                        lease,
                        fingerprint: claim.req.fingerprint,
                        result,
                    });
                    answered.push(true);
                }
                _ => answered.push(false),
            }
        }
        // Leases still held by members that did not complete are released.
        let mut released = std::mem::take(&mut self.released);
        released.extend(self.held.iter_mut().filter_map(Option::take));
        let flags = self
            .consumer
            .inner
            .store
            .complete_leases(group, completions, released)
            .await?;
        let mut flags = flags.into_iter();
        Ok(answered
            .into_iter()
            .map(|present| present && flags.next().unwrap_or(false))
            .collect())
    }

    async fn abort(mut self) {
        let Some(group) = self.group.take() else {
            return;
        };
        let mut released = std::mem::take(&mut self.released);
        released.extend(self.held.iter_mut().filter_map(Option::take));
        let store = &self.consumer.inner.store;
        if let Err(e) = store.complete_leases(group, Vec::new(), released).await {
            tracing::warn!(consumer = %self.consumer.inner.name, error = %e, "releasing the leases failed");
        }
    }
}
