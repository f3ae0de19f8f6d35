//! The run loop: pull deliveries from a source, keep N in flight, count outcomes.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::consumer::{lane_key, Consumer, Identity};
use super::lanes::{KeyLanes, LaneEnd, LaneRelease};
use crate::error::SourceError;
use crate::outcome::{Outcome, OutcomeKind, Summary};
use crate::source::{Delivery, Source};
use crate::store::Store;

/// Deliveries read ahead of those running, as a multiple of `concurrency`:
/// room for other keys to run while copies of one key wait in its lane.
const READ_AHEAD: usize = 2;

impl<S: Store> Consumer<S> {
    /// Runs `source` until it ends, with up to
    /// [`concurrency`](super::ConsumerBuilder::concurrency) messages handled
    /// at once, and returns the outcome counts. Deliveries of one business
    /// key are handled one after the other, in the source's order; different
    /// keys run concurrently, also within one partition of a partitioned log
    /// ([`Source::settle_out_of_order`]). Every delivery is settled before it
    /// returns.
    pub async fn run(&self, source: impl Source) -> Result<Summary, SourceError> {
        self.run_until(source, std::future::pending::<()>()).await
    }

    /// Like [`run`](Self::run), but stops taking new deliveries when
    /// `shutdown` completes, finishes the ones in flight, and returns.
    pub async fn run_until(
        &self,
        mut source: impl Source,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        // The key lanes keep each key's order: a partitioned source may
        // hand out as many records of a partition as the loop reads ahead.
        source.settle_out_of_order(self.inner.concurrency.saturating_mul(READ_AHEAD));
        let consumer = self.clone();
        self.run_with(source, shutdown, move |delivery, identity, lane| {
            let consumer = consumer.clone();
            async move { consumer.process_in_lane(delivery, &identity, lane).await }
        })
        .await
    }

    /// The loop of every per-delivery mode: reads up to twice `concurrency`
    /// deliveries ahead, identifies each once (key and fingerprint), and
    /// runs up to `concurrency` of them at once through `process`, until the
    /// source ends or `shutdown` completes, then waits for those in flight.
    ///
    /// Deliveries with the same business key go through one key lane
    /// (`super::lanes`): each waits until the previous one of its key
    /// ended, so the first copy in the source's order is the first to claim
    /// the key. When the previous copy was nacked to be retried, the next
    /// one is nacked with the same delay without claiming (a later copy
    /// never overtakes an earlier one that waits for its retry). Deliveries
    /// without a key (bad input) run at once.
    pub(crate) async fn run_with<F, Fut>(
        &self,
        mut source: impl Source,
        shutdown: impl Future<Output = ()>,
        process: F,
    ) -> Result<Summary, SourceError>
    where
        F: Fn(Delivery, Identity, LaneRelease) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let concurrency = self.inner.concurrency;
        let admitted = Arc::new(Semaphore::new(concurrency.saturating_mul(READ_AHEAD)));
        let running = Arc::new(Semaphore::new(concurrency));
        let lanes = Arc::new(KeyLanes::default());
        let mut tasks: JoinSet<OutcomeKind> = JoinSet::new();
        let mut summary = Summary::default();
        let mut failure = None;
        tokio::pin!(shutdown);
        loop {
            while let Some(done) = tasks.try_join_next() {
                count(&mut summary, done);
            }
            let admission = tokio::select! {
                permit = Arc::clone(&admitted).acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = &mut shutdown => break,
            };
            let next = tokio::select! {
                next = source.next() => next,
                _ = &mut shutdown => break,
            };
            match next {
                Ok(Some(delivery)) => {
                    let identity = self.identify(&delivery.message, delivery.defect.as_ref());
                    let ticket = lane_key(&identity).map(|key| lanes.admit(key.to_owned()));
                    let consumer = self.clone();
                    let process = process.clone();
                    let running = Arc::clone(&running);
                    tasks.spawn(async move {
                        // The lane is released once the outcome is decided,
                        // before the settle (see `LaneRelease`).
                        let outcome = match ticket {
                            None => {
                                let _running = running.acquire_owned().await.ok();
                                process(delivery, identity, LaneRelease::none()).await
                            }
                            Some(mut ticket) => match ticket.wait().await {
                                Some(LaneEnd::RetryLater(delay)) => {
                                    ticket.finish(LaneEnd::RetryLater(delay));
                                    let key = lane_key(&identity).map(str::to_owned);
                                    consumer.defer(delivery, key, delay).await
                                }
                                _ => {
                                    let _running = running.acquire_owned().await.ok();
                                    process(delivery, identity, ticket.into()).await
                                }
                            },
                        };
                        drop(admission);
                        outcome.kind()
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(consumer = %self.inner.name, error = %e, "source failed");
                    failure = Some(e);
                    break;
                }
            }
        }
        while let Some(done) = tasks.join_next().await {
            count(&mut summary, done);
        }
        source.close().await;
        match failure {
            Some(e) => Err(e),
            None => Ok(summary),
        }
    }

    /// Nacks `delivery` (of `key`) with `delay` without claiming it: an
    /// earlier delivery of its key waits for a retry and must go first.
    async fn defer(&self, delivery: Delivery, key: Option<String>, delay: Duration) -> Outcome {
        let (_message, meta, _defect, acker) = delivery.into_parts();
        let outcome = Outcome::RetryLater {
            key,
            attempts: 0,
            delay,
            error: "an earlier delivery of this key waits for its retry".into(),
        };
        self.settle(&outcome, acker).await;
        self.report(&outcome, &meta);
        outcome
    }
}

fn count(summary: &mut Summary, done: Result<OutcomeKind, tokio::task::JoinError>) {
    match done {
        Ok(kind) => summary.record(kind),
        // The delivery was dropped unsettled: its source redelivers it.
        Err(e) => tracing::error!(error = %e, "a message task failed"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use crate::source::queue::MemoryQueue;
    use crate::store::memory::MemoryStore;
    use crate::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

    /// A delivery nacked without a delay comes straight back. Its lane is
    /// released before the nack, so the redelivery runs at once (one retry
    /// in all) instead of queueing behind its own earlier attempt and being
    /// deferred as "an earlier delivery of this key waits for its retry".
    #[tokio::test]
    async fn a_redelivery_without_delay_is_not_deferred_behind_itself() {
        for _ in 0..20 {
            let calls = Arc::new(AtomicU32::new(0));
            let consumer = Consumer::builder("lanes", MemoryStore::new())
                .key(KeySpec::json("/id"))
                .handler_fn({
                    let calls = Arc::clone(&calls);
                    move |_ctx, _lease| {
                        let calls = Arc::clone(&calls);
                        Box::pin(async move {
                            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                                Err(HandlerError::retryable("once")
                                    .with_retry_after(Duration::ZERO))
                            } else {
                                Ok(None)
                            }
                        })
                    }
                })
                .build()
                .unwrap();
            let queue = MemoryQueue::new("q");
            queue.push(Message::new(r#"{"id":1}"#));
            queue.close();
            let summary = consumer.run(queue.source()).await.unwrap();
            assert_eq!(summary.count(OutcomeKind::RetryLater), 1, "{summary}");
            assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    }
}
