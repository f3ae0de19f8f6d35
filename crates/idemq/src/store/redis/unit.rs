//! [`RedisUnit`]: the Redis store's unit of work — many keys, a lease each,
//! claimed and completed in one round trip each.
//!
//! Per unit:
//! 1. all keys are claimed in **one round trip**: each new key gets its own
//!    lease (token and fencing number), a done key answers duplicate (or
//!    conflict), a key in flight elsewhere follows the [`InFlightPolicy`]
//!    (retry later, or poll — again one round trip for all the waiting
//!    keys — until it completes or its lease expires);
//! 2. the new keys' handlers run, each with its own lease, while **one
//!    heartbeat** extends every lease of the unit;
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
//! ([`RedisLease::fencing_token`]) — and batching widens that window from
//! one handler to a batch. The unit claims keys only: the Redis store keeps
//! no offset watermarks.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;

use super::batch::{LeaseCompletion, RedisLeaseGroup};
use super::{RedisLease, RedisStore};
use crate::error::StoreError;
use crate::policy::InFlightPolicy;
use crate::store::lease_members::LeaseMembers;
use crate::store::unit::{
    Completion, MemberAnswer, MemberClaim, Undone, UnitOptions, UnitStore, WorkUnit,
};
use crate::store::Claim;

/// A unit of work of the [`RedisStore`] (see the module docs).
pub struct RedisUnit {
    store: Arc<RedisStore>,
    group: Option<RedisLeaseGroup>,
    in_flight: InFlightPolicy,
    /// The members' leases.
    leases: LeaseMembers<RedisLease>,
}

impl std::fmt::Debug for RedisUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisUnit")
            .field("group", &self.group)
            .field("held", &self.leases.held_count())
            .finish_non_exhaustive()
    }
}

impl UnitStore for RedisStore {
    type Unit = RedisUnit;

    fn begin(self: &Arc<Self>, options: UnitOptions) -> RedisUnit {
        RedisUnit {
            group: Some(self.lease_group(options.lease)),
            store: Arc::clone(self),
            in_flight: options.in_flight,
            leases: LeaseMembers::default(),
        }
    }
}

impl RedisUnit {
    /// Claims the members `which` (indexes into `all`) into the group.
    async fn claim_some(
        &mut self,
        all: &[MemberClaim<'_>],
        which: &[usize],
    ) -> Result<Vec<Claim<RedisLease>>, StoreError> {
        let Some(group) = self.group.as_mut() else {
            return Err(StoreError::transient("the lease group is gone"));
        };
        let mut consumer = None;
        let mut pairs = Vec::with_capacity(which.len());
        for claim in which.iter().filter_map(|&n| all.get(n)) {
            let MemberClaim::Key(req) = claim else {
                return Err(StoreError::config(
                    "the Redis store claims keys only; it keeps no offset watermarks",
                ));
            };
            if *consumer.get_or_insert(req.consumer) != req.consumer {
                return Err(StoreError::config("a unit's keys belong to one consumer"));
            }
            pairs.push((req.key, req.fingerprint));
        }
        let consumer = consumer.unwrap_or_default();
        self.store.claim_leases(group, consumer, &pairs).await
    }

    /// With [`InFlightPolicy::Wait`], claims the members found in flight
    /// again (one round trip for all of them) until none is, or the wait ends.
    async fn wait_for_in_flight(
        &mut self,
        claims: &[MemberClaim<'_>],
        answers: &mut [Claim<RedisLease>],
    ) {
        let InFlightPolicy::Wait { poll, max_wait } = self.in_flight else {
            return;
        };
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
                return;
            }
            tokio::time::sleep(poll.min(deadline - now)).await;
            match self.claim_some(claims, &waiting).await {
                Ok(claimed) => {
                    for (n, claim) in waiting.into_iter().zip(claimed) {
                        answers[n] = claim;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "claiming keys in flight failed");
                    return;
                }
            }
        }
    }
}

#[async_trait]
impl WorkUnit for RedisUnit {
    type Tx = RedisLease;

    async fn claim(&mut self, claims: &[MemberClaim<'_>]) -> Result<Vec<MemberAnswer>, StoreError> {
        let all: Vec<usize> = (0..claims.len()).collect();
        let mut answers = self.claim_some(claims, &all).await?;
        self.wait_for_in_flight(claims, &mut answers).await;
        Ok(self.leases.hold(answers))
    }

    fn tx(&mut self, member: usize) -> Option<&mut RedisLease> {
        self.leases.get_mut(member)
    }

    async fn undo(
        &mut self,
        member: usize,
        _claim: &MemberClaim<'_>,
    ) -> Result<Undone, StoreError> {
        self.leases.set_aside(member);
        Ok(Undone::Member)
    }

    async fn complete(
        mut self,
        claims: &[MemberClaim<'_>],
        done: &[Completion<'_>],
    ) -> Result<Vec<bool>, StoreError> {
        let Some(group) = self.group.take() else {
            return Err(StoreError::transient("the lease group is gone"));
        };
        let mut completions = Vec::with_capacity(done.len());
        let mut answered = Vec::with_capacity(done.len());
        for (completion, taken) in done.iter().zip(self.leases.completing(claims, done)) {
            match taken {
                Some((lease, req)) => {
                    completions.push(LeaseCompletion {
                        lease,
                        fingerprint: req.fingerprint,
                        result: completion.result,
                    });
                    answered.push(true);
                }
                None => answered.push(false),
            }
        }
        // Leases still held by members that did not complete are released.
        let released = self.leases.take_releasable();
        let flags = self
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
        let released = self.leases.take_releasable();
        if let Err(e) = self
            .store
            .complete_leases(group, Vec::new(), released)
            .await
        {
            tracing::warn!(error = %e, "releasing the leases failed");
        }
    }
}
