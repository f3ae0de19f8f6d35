//! [`MongoUnit`]: the Mongo store's unit of work (batch mode) — many keys,
//! a lease each, claimed and completed in few round trips.
//!
//! Per unit:
//! 1. the keys' slots are read in **one query**, and every key that is free
//!    to take is claimed in **one unordered insert** (a lease each, its own
//!    token and fencing number); a key whose insert lost a race is claimed
//!    again on its own. A done key answers duplicate (or conflict); a key in
//!    flight elsewhere follows the [`InFlightPolicy`];
//! 2. the handlers run, each with its own lease, while **one heartbeat**
//!    extends every lease of the unit (one update, one query);
//! 3. in **one unordered insert**, the processed keys get their done
//!    records and the failed ones a `free` slot; a done record refused
//!    (the lease was taken over) makes that member's completion fail.
//!
//! As in per-message mode, a crash before step 3 leaves the unit's leases
//! to expire, and the redeliveries run those handlers again: a lease store
//! needs effects that are idempotent or fenced
//! ([`MongoLease::fencing_token`]), and batching widens that window from
//! one handler to a batch. The unit claims keys only: the Mongo store keeps
//! no offset watermarks.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use mongodb::bson::{doc, Bson, Document};

use super::error::map_err;
use super::ids::esc;
use super::lease::{release_in_background, spawn_heartbeat, Beating, LeaseCore};
use super::records::{text, Decision, KeyView};
use super::{MongoLease, MongoStore};
use crate::error::StoreError;
use crate::policy::InFlightPolicy;
use crate::store::lease_members::LeaseMembers;
use crate::store::unit::{
    Completion, MemberAnswer, MemberClaim, Undone, UnitOptions, UnitStore, WorkUnit,
};
use crate::store::Claim;
use crate::sync::lock;

/// A unit of work of the [`MongoStore`] (see the module docs). Dropped
/// while it holds leases (its task was aborted), it releases them in the
/// background.
pub struct MongoUnit {
    store: Arc<MongoStore>,
    lease: Duration,
    in_flight: InFlightPolicy,
    /// The leases the heartbeat extends.
    beating: Arc<Mutex<Vec<Beating>>>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// The members' leases.
    leases: LeaseMembers<MongoLease>,
}

impl std::fmt::Debug for MongoUnit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MongoUnit")
            .field("lease", &self.lease)
            .field("held", &self.leases.held_count())
            .finish_non_exhaustive()
    }
}

impl UnitStore for MongoStore {
    type Unit = MongoUnit;

    fn begin(self: &Arc<Self>, options: UnitOptions) -> MongoUnit {
        MongoUnit {
            store: Arc::clone(self),
            lease: options.lease,
            in_flight: options.in_flight,
            beating: Arc::default(),
            heartbeat: None,
            leases: LeaseMembers::default(),
        }
    }
}

impl MongoStore {
    /// Claims `keys` of `consumer` (distinct): one query for their slots,
    /// one unordered insert of the leases; a key whose insert lost a race
    /// is claimed on its own. Answers in the order given.
    pub(super) async fn claim_many(
        &self,
        consumer: &str,
        keys: &[&str],
        lease: Duration,
    ) -> Result<Vec<Claim<LeaseCore>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let wanted: Vec<Bson> = keys.iter().map(|k| Bson::String(esc(k))).collect();
        let docs: Vec<Document> = futures_util::TryStreamExt::try_collect(
            self.inner
                .inbox
                .find(doc! { "consumer": esc(consumer), "key": { "$in": wanted } })
                .await
                .map_err(map_err)?,
        )
        .await
        .map_err(map_err)?;
        let mut by_key: HashMap<String, Vec<Document>> = HashMap::new();
        for d in docs {
            if let Some(key) = text(&d, "key") {
                by_key.entry(key).or_default().push(d);
            }
        }
        let now = self.server_now().await;
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1);
        let expires = now.saturating_add(lease_ms);
        let batch_token = uuid::Uuid::new_v4().simple().to_string();
        let mut answers: Vec<Option<Claim<LeaseCore>>> = Vec::with_capacity(keys.len());
        let mut takes: Vec<(usize, LeaseCore)> = Vec::new();
        for (n, key) in keys.iter().enumerate() {
            let slots = by_key.remove(*key).unwrap_or_default();
            let view = KeyView::new(consumer, key, &slots)?;
            match view.decide(consumer, key, now) {
                Decision::Done(record) => answers.push(Some(Claim::Done(record))),
                Decision::Busy => answers.push(Some(Claim::InFlight)),
                Decision::Take {
                    epoch,
                    g,
                    first_seen,
                } => {
                    answers.push(None);
                    takes.push((
                        n,
                        LeaseCore {
                            consumer: consumer.to_owned(),
                            key: (*key).to_owned(),
                            epoch,
                            g,
                            token: format!("{batch_token}.{n}"),
                            first_seen,
                            lease,
                            renewed_until: expires,
                        },
                    ));
                }
            }
        }
        let inserts: Vec<Document> = takes
            .iter()
            .map(|(_, core)| core.at().lease(&core.token, expires))
            .collect();
        let inserted = self.insert_all_unique(inserts).await?;
        for ((n, core), ok) in takes.into_iter().zip(inserted) {
            answers[n] = Some(if ok {
                Claim::New(core)
            } else {
                self.claim_core(consumer, &core.key, lease).await?
            });
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or(Claim::InFlight))
            .collect())
    }
}

impl MongoUnit {
    /// Claims the members `which` (indexes into `all`).
    async fn claim_some(
        &mut self,
        all: &[MemberClaim<'_>],
        which: &[usize],
    ) -> Result<Vec<Claim<MongoLease>>, StoreError> {
        let mut consumer = None;
        let mut keys = Vec::with_capacity(which.len());
        for claim in which.iter().filter_map(|&n| all.get(n)) {
            let MemberClaim::Key(req) = claim else {
                return Err(StoreError::config(
                    "the Mongo store claims keys only; it keeps no offset watermarks",
                ));
            };
            if *consumer.get_or_insert(req.consumer) != req.consumer {
                return Err(StoreError::config("a unit's keys belong to one consumer"));
            }
            keys.push(req.key);
        }
        let consumer = consumer.unwrap_or_default();
        let claims = self.store.claim_many(consumer, &keys, self.lease).await?;
        let mut out = Vec::with_capacity(claims.len());
        let mut beating = Vec::new();
        for claim in claims {
            out.push(match claim {
                Claim::New(core) => {
                    let beat = Beating::of(&core);
                    let lease = MongoLease::grouped(core, &beat);
                    beating.push(beat);
                    Claim::New(lease)
                }
                Claim::Done(record) => Claim::Done(record),
                Claim::InFlight => Claim::InFlight,
            });
        }
        if !beating.is_empty() {
            lock(&self.beating).extend(beating);
            if self.heartbeat.is_none() {
                self.heartbeat = Some(spawn_heartbeat(
                    (*self.store).clone(),
                    Arc::clone(&self.beating),
                    self.lease,
                ));
            }
        }
        Ok(out)
    }

    /// With [`InFlightPolicy::Wait`], claims the members found in flight
    /// again (one round trip for all of them) until none is, or the wait ends.
    async fn wait_for_in_flight(
        &mut self,
        claims: &[MemberClaim<'_>],
        answers: &mut [Claim<MongoLease>],
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

    /// Stops the heartbeat; the cores of every lease still held or released.
    fn disarm(&mut self) -> Vec<LeaseCore> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        lock(&self.beating).clear();
        self.leases
            .take_releasable()
            .into_iter()
            .map(|mut l| l.settle())
            .collect()
    }
}

impl Drop for MongoUnit {
    fn drop(&mut self) {
        let cores = self.disarm();
        release_in_background((*self.store).clone(), cores);
    }
}

#[async_trait]
impl WorkUnit for MongoUnit {
    type Tx = MongoLease;

    async fn claim(&mut self, claims: &[MemberClaim<'_>]) -> Result<Vec<MemberAnswer>, StoreError> {
        let all: Vec<usize> = (0..claims.len()).collect();
        let mut answers = self.claim_some(claims, &all).await?;
        self.wait_for_in_flight(claims, &mut answers).await;
        Ok(self.leases.hold(answers))
    }

    fn tx(&mut self, member: usize) -> Option<&mut MongoLease> {
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
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        let store = Arc::clone(&self.store);
        let expire_at = store.expire_at();
        let mut completing: Vec<Option<LeaseCore>> = Vec::with_capacity(done.len());
        let mut docs = Vec::with_capacity(done.len());
        for (completion, taken) in done.iter().zip(self.leases.completing(claims, done)) {
            match taken {
                Some((mut lease, req)) => {
                    let core = lease.settle();
                    docs.push(
                        core.next()
                            .done(req.fingerprint, completion.result, expire_at),
                    );
                    completing.push(Some(core));
                }
                None => completing.push(None),
            }
        }
        // Everything else the unit holds is released in the same insert.
        let freed = self.disarm();
        docs.extend(freed.iter().map(|core| core.next().free()));
        let inserted = store.insert_all_unique(docs).await?;
        let mut flags = Vec::with_capacity(done.len());
        let mut completed_keys = Vec::new();
        let mut inserted = inserted.into_iter();
        for core in &completing {
            let Some(core) = core else {
                flags.push(false);
                continue;
            };
            let ok = inserted.next().unwrap_or(false) && store.confirm_completion(core).await?;
            if ok {
                completed_keys.push(core.key.as_str());
            }
            flags.push(ok);
        }
        if let Some(consumer) = completing
            .iter()
            .flatten()
            .next()
            .map(|c| c.consumer.as_str())
        {
            store.clear_attempts(consumer, &completed_keys).await;
        }
        Ok(flags)
    }

    async fn abort(mut self) {
        let cores = self.disarm();
        if let Err(e) = self.store.free_all(&cores).await {
            tracing::warn!(leases = cores.len(), error = %e, "releasing the leases failed; they will expire");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::mongo::records::At;

    #[test]
    fn a_completion_is_the_next_generation() {
        let core = LeaseCore {
            consumer: "c".into(),
            key: "k".into(),
            epoch: "e".into(),
            g: 1,
            token: "t".into(),
            first_seen: 1,
            lease: Duration::from_secs(3),
            renewed_until: 10_000,
        };
        let next: At<'_> = core.next();
        assert_eq!(next.g, 2);
        assert!(!core.may_have_lapsed(8_000));
        assert!(core.may_have_lapsed(9_100));
    }
}
