//! Batch mode over a lease store ([`LeaseBatchStore`]: the Redis store).
//!
//! [`Consumer::run_batched`] drives it like the SQL batch mode, with a lease
//! per key instead of a shared transaction. Per batch:
//! 1. every message's key and fingerprint are derived (bad input is
//!    dead-lettered on its own); copies of one key inside the batch are
//!    claimed once (the first copy leads);
//! 2. all keys are claimed in **one round trip**: each new key gets its own
//!    lease (token and fencing number), a done key answers duplicate (or
//!    conflict), a key in flight elsewhere follows the
//!    [`InFlightPolicy`] (retry later, or poll — again one round trip for
//!    all the waiting keys — until it completes or its lease expires);
//! 3. the new keys' handlers run one after another, each with its own lease,
//!    while **one heartbeat** extends every lease of the batch;
//! 4. in **one round trip**, the processed keys are completed
//!    (compare-and-set on their tokens, result stored, retention TTL) and
//!    the failed ones released (compare-and-delete), so only they are
//!    retried;
//! 5. then the deliveries are settled: processed and duplicates acked,
//!    failures counted and nacked or dead-lettered.
//!
//! A lease lost while the batch ran (the heartbeat could not reach Redis for
//! a whole lease, and another worker took the key over) makes that key's
//! completion fail: it is retried and the redelivery finds the other
//! worker's result. A crash before the completion round trip leaves every
//! lease of the batch to be released (task aborted) or to expire (process
//! gone): the redeliveries run those handlers again, so, as in per-message
//! mode, a lease store needs effects that are idempotent or fenced
//! ([`RedisLease::fencing_token`](crate::store::redis::RedisLease::fencing_token))
//! — and batching widens that window from one handler to a batch.

use std::time::Instant;

use super::batch::{Batch, Item, Led};
use super::consumer::Consumer;
use crate::error::{HandlerError, StoreError};
use crate::outcome::Outcome;
use crate::policy::InFlightPolicy;
use crate::source::Delivery;
use crate::store::{Claim, ClaimRequest, LeaseBatchStore, LeaseCompletion};

/// The Redis store runs batches through the lease path.
#[cfg(feature = "redis")]
impl super::batch::BatchMode for crate::store::redis::RedisStore {
    fn run_batch(
        consumer: &Consumer<Self>,
        deliveries: Vec<Delivery>,
    ) -> futures_util::future::BoxFuture<'_, Vec<Outcome>> {
        Box::pin(consumer.process_lease_batch(deliveries))
    }
}

impl<S: LeaseBatchStore> Consumer<S> {
    /// Processes a batch of deliveries over a lease store (see the module
    /// docs) and settles each with its source; returns the outcomes in order.
    pub async fn process_lease_batch(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        let Batch {
            mut items,
            leaders,
            followers,
        } = self.split_batch(deliveries).await;

        let led = self.run_lease_leaders(&mut items, &leaders).await;
        self.finish_batch(items, &leaders, followers, &led).await
    }

    /// Claims the leaders' keys in one round trip, waits for keys in flight
    /// elsewhere if the policy says so, runs the new keys' handlers,
    /// completes and releases in one round trip, and sets the leaders' outcomes.
    async fn run_lease_leaders(
        &self,
        items: &mut [Item],
        leaders: &[(usize, String, String)],
    ) -> Vec<Led> {
        let inner = &*self.inner;
        let store = &*inner.store;
        let consumer = inner.name.as_str();
        let mut led: Vec<Led> = leaders.iter().map(|_| Led::Failed).collect();
        if leaders.is_empty() {
            return led;
        }
        let mut group = store.lease_group(inner.lease);
        let claims: Vec<(&str, &str)> = leaders
            .iter()
            .map(|(_, key, fp)| (key.as_str(), fp.as_str()))
            .collect();
        let mut answers = match store.claim_leases(&mut group, consumer, &claims).await {
            Ok(answers) => {
                crate::failpoint::failpoint!("after_claim");
                answers
            }
            Err(e) => {
                for (index, key, _) in leaders {
                    items[*index].outcome =
                        Some(self.busy(Some(key.clone()), format!("claim failed: {e}")));
                }
                return led;
            }
        };
        if let InFlightPolicy::Wait { poll, max_wait } = inner.in_flight {
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
                let again: Vec<(&str, &str)> = waiting.iter().map(|&n| claims[n]).collect();
                match store.claim_leases(&mut group, consumer, &again).await {
                    Ok(claimed) => {
                        for (n, claim) in waiting.into_iter().zip(claimed) {
                            answers[n] = claim;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(consumer, error = %e, "claiming keys in flight failed");
                        break;
                    }
                }
            }
        }

        // The handlers, one after another, each with its own lease.
        let mut pending: Vec<(usize, Option<serde_json::Value>)> = Vec::new();
        let mut held = Vec::new();
        let mut released = Vec::new();
        let mut failures: Vec<(usize, HandlerError)> = Vec::new();
        let mut limited: Vec<(usize, String)> = Vec::new();
        for (n, ((index, key, fingerprint), answer)) in leaders.iter().zip(answers).enumerate() {
            let item = &items[*index];
            let mut lease = match answer {
                Claim::New(lease) => lease,
                Claim::Done(record) => {
                    led[n] = Led::Done(record.clone());
                    let outcome = self.answer(record, fingerprint.clone(), item).await;
                    items[*index].outcome = Some(outcome);
                    continue;
                }
                Claim::InFlight => {
                    items[*index].outcome =
                        Some(self.busy(Some(key.clone()), "in flight in another worker".into()));
                    continue;
                }
            };
            if let Some(error) = self.over_delivery_limit(&item.meta) {
                released.push(lease);
                limited.push((n, error));
                continue;
            }
            let req = ClaimRequest {
                consumer,
                key,
                fingerprint,
                lease: inner.lease,
            };
            let result = self
                .call_handler(&mut lease, &req, &item.message, &item.meta)
                .await;
            crate::failpoint::failpoint!("after_handler");
            match result {
                Ok(value) => {
                    pending.push((n, value));
                    held.push(lease);
                }
                Err(error) => {
                    released.push(lease);
                    failures.push((n, error));
                }
            }
        }

        // One round trip: complete the processed keys, release the failed ones.
        let completions: Vec<LeaseCompletion<'_, S::Tx>> = held
            .into_iter()
            .zip(&pending)
            .map(|(lease, (n, value))| LeaseCompletion {
                lease,
                fingerprint: leaders[*n].2.as_str(),
                result: value.as_ref(),
            })
            .collect();
        crate::failpoint::failpoint!("before_commit");
        let completed = store.complete_leases(group, completions, released).await;
        match completed {
            Ok(flags) => {
                crate::failpoint::failpoint!("after_commit_before_ack");
                let flags = flags.into_iter().chain(std::iter::repeat(false));
                for ((n, value), ok) in pending.into_iter().zip(flags) {
                    let (index, key, _) = &leaders[n];
                    items[*index].outcome = Some(if ok {
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
            }
            Err(e) => {
                // The completion may or may not have happened; the
                // redeliveries find out.
                for (n, _) in pending {
                    let (index, key, _) = &leaders[n];
                    items[*index].outcome =
                        Some(self.busy(Some(key.clone()), format!("commit failed: {e}")));
                }
            }
        }
        self.settle_failed_leaders(items, leaders, limited, failures)
            .await;
        led
    }
}
