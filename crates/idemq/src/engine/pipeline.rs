//! The pipeline, written once for every mode:
//! identify → order → **claim → handle → complete** → settle → report.
//!
//! The run loops identify each delivery and order it in its key lane
//! (`super::run`, `super::batch`); [`Consumer::process_unit`] takes a unit
//! of members from there to their settled outcomes. What a unit is — one
//! key, a batch in one transaction, a batch of leases, one offset — is the
//! mode's ([`super::unit`]); the steps, the fail points and the outcome
//! rules are here:
//!
//! 1. a member whose identity failed (bad input) is dead-lettered without
//!    claiming; copies of one key inside a unit are claimed once: the first
//!    copy leads, the later ones follow its outcome;
//! 2. the leaders are **claimed** together (`after_claim`);
//! 3. each new leader's **handler** runs isolated in the unit
//!    (`after_handler`); one past its delivery limit is undone without
//!    running;
//! 4. the unit **completes** once (`before_commit`,
//!    `after_commit_before_ack`); if that fails, nothing of it is known to
//!    have committed, and every new leader is retried (its redelivery finds
//!    out what did commit);
//! 5. failed handlers are counted outside the unit and retried or
//!    dead-lettered; followers get their leader's answer;
//! 6. each delivery is **settled** with its source and **reported**; its
//!    lane is released with its outcome just before the settle, or just
//!    after the nack when it is retried after a delay.

use std::collections::HashMap;

use super::consumer::{Consumer, Identity};
use super::handler::Context;
use super::lanes::LaneRelease;
use super::run::{Direct, Runner};
use super::unit::{Answer, Claimant, Mode, Undone, Unit};
use crate::error::{HandlerError, StoreError};
use crate::message::{DeliveryMeta, Message};
use crate::outcome::{DeadLetterReason, Outcome};
use crate::source::{Acknowledger, Delivery};
use crate::store::{ClaimRequest, InboxRecord, Store};

/// One delivery on its way through the pipeline.
pub(crate) struct Member {
    pub(crate) message: Message,
    pub(crate) meta: DeliveryMeta,
    acker: Box<dyn Acknowledger>,
    lane: LaneRelease,
    outcome: Option<Outcome>,
}

/// The first copy of a key in a unit.
struct Leader {
    member: usize,
    key: String,
    fingerprint: String,
}

/// A later copy of a key in the same unit.
struct Follower {
    member: usize,
    leader: usize,
    fingerprint: String,
}

/// What happened to a leader, as its followers care.
enum Led {
    Processed(Option<serde_json::Value>),
    Done(InboxRecord),
    Failed,
}

/// The leaders' part of one unit: what happened to each, and their outcomes.
struct Ran {
    led: Vec<Led>,
    outcomes: Vec<Option<Outcome>>,
}

impl<S: Store> Consumer<S> {
    /// A delivery as a member of a unit of `mode`, identified already
    /// (`identity`: its business key and fingerprint), releasing `lane`
    /// once its outcome is decided.
    pub(crate) fn member<R: Runner<S>>(
        &self,
        mode: &R,
        delivery: Delivery,
        identity: &Identity,
        lane: LaneRelease,
    ) -> (Member, Identity) {
        let (message, meta, defect, acker) = delivery.into_parts();
        let claim = mode.claim_identity(&meta, identity, defect.as_ref());
        let member = Member {
            message,
            meta,
            acker,
            lane,
            outcome: None,
        };
        (member, claim)
    }

    /// A delivery identified here, outside any lane.
    pub(crate) fn member_of<R: Runner<S>>(
        &self,
        mode: &R,
        delivery: Delivery,
    ) -> (Member, Identity) {
        let identity = self.identify(&delivery.message, delivery.defect.as_ref());
        self.member(mode, delivery, &identity, LaneRelease::none())
    }

    /// One delivery as a unit of one of `mode`, identified here, outside any
    /// lane; its settled outcome.
    pub(crate) async fn process_one<M: Mode<S> + Clone + 'static>(
        &self,
        mode: M,
        delivery: Delivery,
    ) -> Outcome {
        let member = self.member_of(&Direct(mode.clone()), delivery);
        let mut outcomes = self.process_unit(&mode, vec![member]).await;
        outcomes
            .pop()
            .unwrap_or_else(|| self.busy(None, "no outcome".into()))
    }

    /// Takes a unit of members through the pipeline (see the module docs)
    /// and settles each with its source; returns the outcomes in order.
    pub(crate) async fn process_unit<M: Mode<S>>(
        &self,
        mode: &M,
        members: Vec<(Member, Identity)>,
    ) -> Vec<Outcome> {
        let mut leaders: Vec<Leader> = Vec::new();
        let mut followers: Vec<Follower> = Vec::new();
        // Copies of a key can only meet in a unit of more than one.
        let several = members.len() > 1;
        let mut leader_of: HashMap<String, usize> = HashMap::new();
        let mut unit: Vec<Member> = Vec::with_capacity(members.len());
        for (index, (mut member, identity)) in members.into_iter().enumerate() {
            match identity {
                Err((key, reason)) => {
                    let outcome = self
                        .dead_letter(key.as_deref(), reason, &member.message, &member.meta, 0)
                        .await;
                    member.outcome = Some(outcome);
                }
                Ok((key, fingerprint)) => match leader_of.get(&key) {
                    Some(&leader) => followers.push(Follower {
                        member: index,
                        leader,
                        fingerprint,
                    }),
                    None => {
                        if several {
                            leader_of.insert(key.clone(), leaders.len());
                        }
                        leaders.push(Leader {
                            member: index,
                            key,
                            fingerprint,
                        });
                    }
                },
            }
            unit.push(member);
        }

        // A unit that rolls back as a whole on a failure runs once more
        // with every member isolated.
        let ran = match self.run_unit(mode, &unit, &leaders, false).await {
            Some(ran) => Some(ran),
            None => self.run_unit(mode, &unit, &leaders, true).await,
        };
        let Ran { led, outcomes } = ran.unwrap_or_else(|| Ran {
            led: leaders.iter().map(|_| Led::Failed).collect(),
            outcomes: leaders
                .iter()
                .map(|l| {
                    Some(self.busy(Some(l.key.clone()), "the unit was rolled back twice".into()))
                })
                .collect(),
        });
        for (leader, outcome) in leaders.iter().zip(outcomes) {
            unit[leader.member].outcome = outcome;
        }
        for follower in followers {
            let leader = &leaders[follower.leader];
            let member = &unit[follower.member];
            let outcome = match &led[follower.leader] {
                Led::Processed(result) => {
                    let record = InboxRecord {
                        consumer: self.inner.name.clone(),
                        key: leader.key.clone(),
                        fingerprint: leader.fingerprint.clone(),
                        result: result.clone(),
                        first_seen_ms: crate::store::now_ms(),
                    };
                    self.answer(record, follower.fingerprint, member).await
                }
                Led::Done(record) => {
                    self.answer(record.clone(), follower.fingerprint, member)
                        .await
                }
                Led::Failed => self.busy(
                    Some(leader.key.clone()),
                    "another copy of the key in the same unit did not complete".into(),
                ),
            };
            unit[follower.member].outcome = Some(outcome);
        }

        let mut outcomes = Vec::with_capacity(unit.len());
        for member in unit {
            let outcome = match member.outcome {
                Some(Outcome::DeadLettered { key, reason, error }) => {
                    match mode
                        .after_dead_letter(self, &member.meta, &*member.acker)
                        .await
                    {
                        Ok(()) => Outcome::DeadLettered { key, reason, error },
                        Err(e) => self.busy(key, format!("moving the watermark failed: {e}")),
                    }
                }
                Some(outcome) => outcome,
                // Every member gets an outcome above; keep the message if not.
                None => self.busy(None, "no outcome".into()),
            };
            // A retry with a delay is nacked before its lane learns of it:
            // the next copy of the key, deferred by the same delay, must
            // reach the source after it, or it comes back first and wins.
            // Without a delay the lane goes first, so that the redelivery of
            // this very message does not queue behind its own attempt.
            let delayed_retry =
                matches!(&outcome, Outcome::RetryLater { delay, .. } if !delay.is_zero());
            if delayed_retry {
                self.settle(&outcome, member.acker).await;
                member.lane.release(&outcome);
            } else {
                member.lane.release(&outcome);
                self.settle(&outcome, member.acker).await;
            }
            self.report(&outcome, &member.meta);
            outcomes.push(outcome);
        }
        outcomes
    }

    /// Claims the leaders, runs their handlers, completes the unit, and
    /// decides the leaders' outcomes. `None`: a failure rolled the whole
    /// unit back; run it again `careful`ly (every member isolated).
    async fn run_unit<M: Mode<S>>(
        &self,
        mode: &M,
        members: &[Member],
        leaders: &[Leader],
        careful: bool,
    ) -> Option<Ran> {
        let inner = &*self.inner;
        let mut led: Vec<Led> = leaders.iter().map(|_| Led::Failed).collect();
        let mut outcomes: Vec<Option<Outcome>> = leaders.iter().map(|_| None).collect();
        if leaders.is_empty() {
            return Some(Ran { led, outcomes });
        }
        // A member past its delivery limit is undone without running, which
        // needs it isolated.
        let careful = careful
            || leaders
                .iter()
                .any(|l| self.over_delivery_limit(&members[l.member].meta).is_some());
        let claims: Vec<Claimant<'_>> = leaders
            .iter()
            .map(|l| Claimant {
                req: ClaimRequest {
                    consumer: &inner.name,
                    key: &l.key,
                    fingerprint: &l.fingerprint,
                    lease: inner.lease,
                },
                meta: &members[l.member].meta,
                acker: &*members[l.member].acker,
            })
            .collect();
        let mut unit = mode.open(self, careful);
        let started = std::time::Instant::now();
        let claimed = unit.claim(&claims).await;
        metrics::histogram!("idemq_claim_seconds", "consumer" => inner.name.clone())
            .record(started.elapsed().as_secs_f64());
        let answers = match claimed {
            Ok(answers) => {
                // The named points mark the states of new work: a unit whose
                // members were all answered (duplicates) passes none of them.
                crate::failpoint::failpoint!(
                    "after_claim",
                    if answers.iter().any(|a| matches!(a, Answer::New))
                );
                answers
            }
            Err(e) => {
                for (outcome, l) in outcomes.iter_mut().zip(leaders) {
                    *outcome = Some(self.busy(Some(l.key.clone()), format!("claim failed: {e}")));
                }
                return Some(Ran { led, outcomes });
            }
        };

        let mut done: Vec<(usize, Option<serde_json::Value>)> = Vec::new();
        let mut failures: Vec<(usize, HandlerError)> = Vec::new();
        let mut limited: Vec<(usize, String)> = Vec::new();
        let mut broken: Option<String> = None;
        let mut answered: Vec<(usize, InboxRecord)> = Vec::new();
        let mut new: Vec<usize> = Vec::new();
        for (n, answer) in answers.into_iter().enumerate().take(leaders.len()) {
            match answer {
                Answer::New => new.push(n),
                Answer::Done(record) => {
                    // Answered once the unit let go of its transaction: a
                    // conflict writes a dead letter, which needs a
                    // connection of its own.
                    led[n] = Led::Done(record.clone());
                    answered.push((n, record));
                }
                Answer::Busy(why) => {
                    outcomes[n] = Some(self.busy(Some(leaders[n].key.clone()), why));
                }
            }
        }

        // A handler that handles batches gets the new members at once in
        // the unit's one transaction; if it fails, the unit runs again with
        // every member isolated and handled on its own.
        let batch_tx = if !careful && new.len() > 1 && inner.handler.handles_batches() {
            unit.shared()
        } else {
            None
        };
        if let Some(tx) = batch_tx {
            let handled = self.call_batch(tx, &claims, &new, members, leaders).await;
            crate::failpoint::failpoint!("after_handler");
            match handled {
                Ok(values) => done.extend(new.iter().copied().zip(values)),
                Err(error) => {
                    tracing::debug!(
                        consumer = %inner.name,
                        size = new.len(),
                        error = %error,
                        "the batch handler failed; the batch runs again one message at a time"
                    );
                    unit.abort().await;
                    return None;
                }
            }
        } else {
            for n in new {
                let member = &members[leaders[n].member];
                if broken.is_some() {
                    continue;
                }
                if let Err(e) = unit.isolate(n).await {
                    broken = Some(format!("savepoint failed: {e}"));
                    continue;
                }
                let result = match (self.over_delivery_limit(&member.meta), unit.tx(n)) {
                    (Some(error), _) => {
                        limited.push((n, error));
                        Err(None)
                    }
                    (None, Some(tx)) => self
                        .call_handler(tx, &claims[n].req, &member.message, &member.meta)
                        .await
                        .map_err(Some),
                    (None, None) => {
                        broken = Some("the unit holds no claim for this member".into());
                        continue;
                    }
                };
                crate::failpoint::failpoint!("after_handler");
                match result {
                    Ok(value) => match unit.keep(n).await {
                        Ok(()) => done.push((n, value)),
                        Err(e) => broken = Some(format!("releasing the savepoint failed: {e}")),
                    },
                    Err(error) => match unit.undo(n, &claims[n]).await {
                        Ok(Undone::Member) => failures.extend(error.map(|error| (n, error))),
                        Ok(Undone::Unit) => return None,
                        Err(e) => {
                            broken = Some(format!("rolling back to the savepoint failed: {e}"))
                        }
                    },
                }
            }
        }

        // One completion for the unit, unless it broke.
        let completed = match broken {
            Some(reason) => {
                unit.abort().await;
                Err(reason)
            }
            None => {
                let results: Vec<(usize, Option<&serde_json::Value>)> =
                    done.iter().map(|(n, value)| (*n, value.as_ref())).collect();
                crate::failpoint::failpoint!("before_commit", if !results.is_empty());
                let started = std::time::Instant::now();
                let completed = unit.complete(&claims, &results).await;
                metrics::histogram!("idemq_commit_seconds", "consumer" => inner.name.clone())
                    .record(started.elapsed().as_secs_f64());
                completed.map_err(|e| format!("commit failed: {e}"))
            }
        };
        for (n, record) in answered {
            let member = &members[leaders[n].member];
            outcomes[n] = Some(
                self.answer(record, leaders[n].fingerprint.clone(), member)
                    .await,
            );
        }
        let held = match completed {
            Ok(held) => held,
            Err(reason) => {
                // Nothing of the unit is known to be committed: retry every
                // new key (the redelivery finds out what did commit).
                for (outcome, l) in outcomes.iter_mut().zip(leaders) {
                    if outcome.is_none() {
                        *outcome = Some(self.busy(Some(l.key.clone()), reason.clone()));
                    }
                }
                return Some(Ran { led, outcomes });
            }
        };
        crate::failpoint::failpoint!("after_commit_before_ack", if !done.is_empty());
        let mut held = held.into_iter();
        for (n, value) in done {
            let key = &leaders[n].key;
            outcomes[n] = Some(if held.next().unwrap_or(false) {
                led[n] = Led::Processed(value.clone());
                Outcome::Processed {
                    key: key.clone(),
                    result: value,
                }
            } else {
                let lost = StoreError::lease_lost(key);
                self.busy(Some(key.clone()), format!("commit failed: {lost}"))
            });
        }
        for (n, error) in limited {
            let member = &members[leaders[n].member];
            outcomes[n] = Some(
                self.dead_letter_with(
                    Some(&leaders[n].key),
                    DeadLetterReason::DeliveryLimit,
                    &error,
                    &member.message,
                    &member.meta,
                    0,
                )
                .await,
            );
        }
        for (n, error) in failures {
            let member = &members[leaders[n].member];
            outcomes[n] = Some(
                self.failed(&leaders[n].key, error, &member.message, &member.meta)
                    .await,
            );
        }
        Some(Ran { led, outcomes })
    }

    /// Calls the handler's [`handle_batch`](crate::Handler::handle_batch)
    /// for the new leaders `new` in the unit's transaction `tx`; one result
    /// per leader, or the error that sends the unit back to run per member.
    async fn call_batch(
        &self,
        tx: &mut S::Tx,
        claims: &[Claimant<'_>],
        new: &[usize],
        members: &[Member],
        leaders: &[Leader],
    ) -> Result<Vec<Option<serde_json::Value>>, HandlerError> {
        let batch: Vec<Context<'_>> = new
            .iter()
            .map(|&n| {
                let member = &members[leaders[n].member];
                self.context(&claims[n].req, &member.message, &member.meta)
            })
            .collect();
        let results = self.inner.handler.handle_batch(&batch, tx).await?;
        if results.len() != batch.len() {
            return Err(HandlerError::retryable(format!(
                "the batch handler returned {} results for {} messages",
                results.len(),
                batch.len()
            )));
        }
        Ok(results)
    }

    /// A duplicate of a processed key, or a conflict if the payload differs.
    async fn answer(&self, record: InboxRecord, fingerprint: String, member: &Member) -> Outcome {
        if record.fingerprint == fingerprint {
            Outcome::Duplicate { record }
        } else {
            self.conflict(record, fingerprint, &member.message, &member.meta)
                .await
        }
    }
}
