//! The leases a lease store's work unit holds, per member (shared by the
//! Redis and Mongo units): held while the member's handler runs, set aside
//! when it fails, and taken out together when the unit completes.

use super::unit::{Completion, MemberAnswer, MemberClaim};
use super::{Claim, ClaimRequest};

/// The leases of a unit's members: `held[n]` is member `n`'s lease while it
/// is held; `released` are the leases of failed members, released when the
/// unit completes.
#[derive(Debug)]
pub(crate) struct LeaseMembers<L> {
    held: Vec<Option<L>>,
    released: Vec<L>,
}

impl<L> Default for LeaseMembers<L> {
    fn default() -> Self {
        Self {
            held: Vec::new(),
            released: Vec::new(),
        }
    }
}

impl<L> LeaseMembers<L> {
    /// Takes the claims' answers in member order: the new leases are held,
    /// the engine gets the members' answers.
    pub(crate) fn hold(&mut self, answers: Vec<Claim<L>>) -> Vec<MemberAnswer> {
        self.held = (0..answers.len()).map(|_| None).collect();
        answers
            .into_iter()
            .enumerate()
            .map(|(n, answer)| match answer {
                Claim::New(lease) => {
                    self.held[n] = Some(lease);
                    MemberAnswer::New
                }
                Claim::Done(record) => MemberAnswer::Done(record),
                Claim::InFlight => MemberAnswer::Busy("in flight in another worker".into()),
            })
            .collect()
    }

    /// How many leases are held.
    pub(crate) fn held_count(&self) -> usize {
        self.held.iter().flatten().count()
    }

    /// Member `member`'s lease while it is held.
    pub(crate) fn get_mut(&mut self, member: usize) -> Option<&mut L> {
        self.held.get_mut(member).and_then(Option::as_mut)
    }

    /// Sets member `member`'s lease aside for release (its handler failed).
    pub(crate) fn set_aside(&mut self, member: usize) {
        if let Some(lease) = self.held.get_mut(member).and_then(Option::take) {
            self.released.push(lease);
        }
    }

    /// Takes out the lease of each completed member with its claim, in the
    /// order of `done`: `None` where the member holds no lease or has no
    /// key (such a lease is set aside for release).
    pub(crate) fn completing<'c, 'r>(
        &mut self,
        claims: &'c [MemberClaim<'r>],
        done: &[Completion<'_>],
    ) -> Vec<Option<(L, &'c ClaimRequest<'r>)>> {
        done.iter()
            .map(|completion| {
                let lease = self.held.get_mut(completion.member).and_then(Option::take);
                match (
                    lease,
                    claims.get(completion.member).and_then(MemberClaim::key),
                ) {
                    (Some(lease), Some(req)) => Some((lease, req)),
                    (lease, _) => {
                        self.released.extend(lease);
                        None
                    }
                }
            })
            .collect()
    }

    /// The leases set aside and those still held, taken out.
    pub(crate) fn take_releasable(&mut self) -> Vec<L> {
        let mut released = std::mem::take(&mut self.released);
        released.extend(self.held.iter_mut().filter_map(Option::take));
        released
    }
}
