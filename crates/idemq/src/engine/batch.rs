//! Batch mode: a polled batch of messages shares one transaction.
//!
//! Per batch, with a [`BatchStore`] (the SQL stores):
//! 1. every message's key and fingerprint are derived (bad input is
//!    dead-lettered on its own, as in per-message mode);
//! 2. all keys are claimed in **one statement** in a new transaction; copies
//!    of one key inside the batch are claimed once (the first copy leads);
//! 3. the new keys' handlers run in that transaction. If one fails, the
//!    transaction is rolled back and the batch runs again with each handler
//!    inside its own **savepoint**: a failing message is rolled back to it
//!    and gives up its claim, the rest stay (a batch without failures pays
//!    no savepoint round trips);
//! 4. results are stored and the batch **commits once**;
//! 5. only then are the deliveries settled: processed and duplicates acked,
//!    failures counted (outside the transaction) and nacked or dead-lettered.
//!
//! A copy of a key that another message in the same batch leads is answered
//! after the commit: a duplicate (or a conflict) when the leader was
//! processed, retried later otherwise. If the commit fails, nothing of the
//! batch is acked: every message is retried and the inbox sorts out what did
//! commit. A crash anywhere leaves the whole batch committed or none of it.
//!
//! Up to [`concurrency`](super::ConsumerBuilder::concurrency) batches are in
//! flight at once, each in its own transaction.
//!
//! Batching trades latency for throughput: one commit (one fsync) per batch
//! instead of per message. Sources that hold back a partition's next message
//! until the previous one is settled (Kafka, SQS FIFO groups) fill a batch
//! with at most one message per partition or group.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::consumer::Consumer;
use crate::error::{HandlerError, SourceError};
use crate::message::{DeliveryMeta, Message};
use crate::outcome::DeadLetterReason;
use crate::outcome::{Outcome, OutcomeKind, Summary};
use crate::source::{Acknowledger, Delivery, Source};
use crate::store::{BatchClaim, BatchStore, ClaimRequest, InboxRecord, Store};

/// How batches are formed in [`Consumer::run_batched`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// At most this many messages per batch (and per transaction).
    pub max_size: usize,
    /// After the first message of a batch arrived, wait at most this long for
    /// more before running the batch.
    pub max_wait: Duration,
}

impl Default for BatchOptions {
    /// 100 messages, 20 ms.
    fn default() -> Self {
        Self {
            max_size: 100,
            max_wait: Duration::from_millis(20),
        }
    }
}

fn count(summary: &mut Summary, done: Result<Vec<OutcomeKind>, tokio::task::JoinError>) {
    match done {
        Ok(kinds) => kinds.into_iter().for_each(|k| summary.record(k)),
        // The batch's deliveries were dropped unsettled: the source redelivers them.
        Err(e) => tracing::error!(error = %e, "a batch task failed"),
    }
}

/// One message of a batch while it is being processed.
pub(super) struct Item {
    pub(super) message: Message,
    pub(super) meta: DeliveryMeta,
    pub(super) acker: Box<dyn Acknowledger>,
    pub(super) outcome: Option<Outcome>,
}

/// What happened to a leader (the first copy of a key in the batch).
pub(super) enum Led {
    Processed(Option<serde_json::Value>),
    Done(InboxRecord),
    Failed,
}

/// Stores a consumer can run in batch mode ([`Consumer::run_batched`]):
/// every [`BatchStore`] (a batch shares one transaction, as above) and the
/// Redis lease store (a batch's claims and its completions take one round
/// trip each; see [`lease_batch`](super::lease_batch)).
pub trait BatchMode: Store + Sized {
    /// Processes one polled batch and settles each delivery; returns the
    /// outcomes in order.
    fn run_batch(
        consumer: &Consumer<Self>,
        deliveries: Vec<Delivery>,
    ) -> BoxFuture<'_, Vec<Outcome>>;
}

impl<S: BatchStore> BatchMode for S {
    fn run_batch(
        consumer: &Consumer<Self>,
        deliveries: Vec<Delivery>,
    ) -> BoxFuture<'_, Vec<Outcome>> {
        Box::pin(consumer.process_batch(deliveries))
    }
}

impl<S: BatchMode> Consumer<S> {
    /// Runs `source` in batches until it ends, and returns the outcome counts.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")]
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use idemq::engine::BatchOptions;
    /// use idemq::source::queue::MemoryQueue;
    /// use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
    /// use idemq::{Consumer, KeySpec, Message, OutcomeKind};
    ///
    /// let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    /// store.migrate().await.unwrap();
    /// let consumer = Consumer::builder("batched", store)
    ///     .key(KeySpec::json("/id"))
    ///     .handler_fn(|_ctx, _tx| Box::pin(async { Ok(None) }))
    ///     .build()
    ///     .unwrap();
    /// let queue = MemoryQueue::new("q");
    /// for i in [1, 2, 1, 3] {
    ///     queue.push(Message::new(format!(r#"{{"id":{i}}}"#)));
    /// }
    /// queue.close();
    /// let summary = consumer.run_batched(queue.source(), BatchOptions::default()).await.unwrap();
    /// assert_eq!(summary.count(OutcomeKind::Processed), 3);
    /// assert_eq!(summary.count(OutcomeKind::Duplicate), 1);
    /// # });
    /// ```
    pub async fn run_batched(
        &self,
        source: impl Source,
        options: BatchOptions,
    ) -> Result<Summary, SourceError> {
        self.run_batched_until(source, options, std::future::pending::<()>())
            .await
    }

    /// Like [`run_batched`](Self::run_batched), but stops taking new
    /// deliveries when `shutdown` completes, runs the batch in hand, and returns.
    pub async fn run_batched_until(
        &self,
        mut source: impl Source,
        options: BatchOptions,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        let max_size = options.max_size.max(1);
        let mut summary = Summary::default();
        tokio::pin!(shutdown);
        let mut stopping = false;
        let mut failure = None;
        // Up to `concurrency` batches are in flight, each on its own connection.
        let permits = Arc::new(Semaphore::new(self.inner.concurrency));
        let mut running: JoinSet<Vec<OutcomeKind>> = JoinSet::new();
        while !stopping {
            while let Some(done) = running.try_join_next() {
                count(&mut summary, done);
            }
            let permit = tokio::select! {
                permit = Arc::clone(&permits).acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = &mut shutdown => break,
            };
            let mut batch = Vec::with_capacity(max_size);
            // The first message: wait as long as it takes.
            tokio::select! {
                next = source.next() => match next {
                    Ok(Some(d)) => batch.push(d),
                    Ok(None) => break,
                    Err(e) => { failure = Some(e); break; }
                },
                _ = &mut shutdown => break,
            }
            let deadline = tokio::time::Instant::now() + options.max_wait;
            while batch.len() < max_size {
                tokio::select! {
                    next = source.next() => match next {
                        Ok(Some(d)) => batch.push(d),
                        Ok(None) => { stopping = true; break; }
                        Err(e) => { failure = Some(e); stopping = true; break; }
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = &mut shutdown => { stopping = true; break; }
                }
            }
            let consumer = self.clone();
            running.spawn(async move {
                let outcomes = S::run_batch(&consumer, batch).await;
                drop(permit);
                outcomes.iter().map(Outcome::kind).collect()
            });
        }
        while let Some(done) = running.join_next().await {
            count(&mut summary, done);
        }
        source.close().await;
        if let Some(e) = failure {
            tracing::error!(consumer = %self.inner.name, error = %e, "source failed");
            return Err(e);
        }
        Ok(summary)
    }
}

/// A polled batch split into its messages, the first copy of each key
/// (leaders: index, key, fingerprint) and later copies (followers: index,
/// leader, fingerprint); undecodable messages are dead-lettered already.
pub(super) struct Batch {
    pub(super) items: Vec<Item>,
    pub(super) leaders: Vec<(usize, String, String)>,
    pub(super) followers: Vec<(usize, usize, String)>,
}

impl<S: Store> Consumer<S> {
    /// Identifies every message of a batch and groups copies of one key
    /// (the same for transactional and lease stores).
    pub(super) async fn split_batch(&self, deliveries: Vec<Delivery>) -> Batch {
        let mut items = Vec::with_capacity(deliveries.len());
        // Leaders (first copy of each key) and followers (later copies).
        let mut leaders: Vec<(usize, String, String)> = Vec::new();
        let mut followers: Vec<(usize, usize, String)> = Vec::new();
        let mut leader_of: HashMap<String, usize> = HashMap::new();
        for delivery in deliveries {
            let (message, meta, defect, acker) = delivery.into_parts();
            let index = items.len();
            let mut item = Item {
                message,
                meta,
                acker,
                outcome: None,
            };
            match self.identify(&item.message, defect.as_ref()) {
                Err((key, reason)) => {
                    let outcome = self
                        .dead_letter(key.as_deref(), reason, &item.message, &item.meta, 0)
                        .await;
                    item.outcome = Some(outcome);
                }
                Ok((key, fingerprint)) => match leader_of.get(&key) {
                    Some(&leader) => followers.push((index, leader, fingerprint)),
                    None => {
                        leader_of.insert(key.clone(), leaders.len());
                        leaders.push((index, key, fingerprint));
                    }
                },
            }
            items.push(item);
        }

        Batch {
            items,
            leaders,
            followers,
        }
    }

    /// Answers the followers from their leaders' outcomes, then settles
    /// every delivery in order and returns the outcomes.
    /// Gives the leaders that did not commit their outcomes: those over the
    /// delivery limit are dead-lettered, those whose handler failed are
    /// counted and retried or dead-lettered (both outside the transaction).
    pub(super) async fn settle_failed_leaders(
        &self,
        items: &mut [Item],
        leaders: &[(usize, String, String)],
        limited: Vec<(usize, String)>,
        failures: Vec<(usize, HandlerError)>,
    ) {
        for (n, error) in limited {
            let (index, key, _) = &leaders[n];
            let item = &items[*index];
            let outcome = self
                .dead_letter_with(
                    Some(key),
                    DeadLetterReason::DeliveryLimit,
                    &error,
                    &item.message,
                    &item.meta,
                    0,
                )
                .await;
            items[*index].outcome = Some(outcome);
        }
        for (n, error) in failures {
            let (index, key, _) = &leaders[n];
            let item = &items[*index];
            let outcome = self.failed(key, error, &item.message, &item.meta).await;
            items[*index].outcome = Some(outcome);
        }
    }

    pub(super) async fn finish_batch(
        &self,
        mut items: Vec<Item>,
        leaders: &[(usize, String, String)],
        followers: Vec<(usize, usize, String)>,
        led: &[Led],
    ) -> Vec<Outcome> {
        let inner = &*self.inner;
        let consumer = inner.name.as_str();
        for (index, leader, fingerprint) in followers {
            let key = leaders[leader].1.clone();
            let outcome = match &led[leader] {
                Led::Processed(result) => {
                    let record = InboxRecord {
                        consumer: consumer.to_owned(),
                        key,
                        fingerprint: leaders[leader].2.clone(),
                        result: result.clone(),
                        first_seen_ms: crate::store::now_ms(),
                    };
                    self.answer(record, fingerprint, &items[index]).await
                }
                Led::Done(record) => {
                    self.answer(record.clone(), fingerprint, &items[index])
                        .await
                }
                Led::Failed => self.busy(
                    Some(key),
                    "another copy of the key in the same batch did not complete".into(),
                ),
            };
            items[index].outcome = Some(outcome);
        }

        let mut outcomes = Vec::with_capacity(items.len());
        for item in items {
            let outcome = item.outcome.unwrap_or_else(|| {
                // Every item gets an outcome above; keep the message if not.
                Outcome::RetryLater {
                    key: None,
                    attempts: 0,
                    delay: inner.retry.busy_delay,
                    error: "no outcome".into(),
                }
            });
            self.settle(&outcome, item.acker).await;
            self.report(&outcome, &item.meta);
            outcomes.push(outcome);
        }
        outcomes
    }

    /// A duplicate of a processed key, or a conflict if the payload differs.
    pub(super) async fn answer(
        &self,
        record: InboxRecord,
        fingerprint: String,
        item: &Item,
    ) -> Outcome {
        if record.fingerprint == fingerprint {
            Outcome::Duplicate { record }
        } else {
            self.conflict(record, fingerprint, &item.message, &item.meta)
                .await
        }
    }
}

impl<S: BatchStore> Consumer<S> {
    /// Processes a batch of deliveries in one transaction (see the module
    /// docs) and settles each with its source; returns the outcomes in order.
    pub async fn process_batch(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        let Batch {
            mut items,
            leaders,
            followers,
        } = self.split_batch(deliveries).await;

        // First without savepoints (two round trips fewer per message); if a
        // handler fails, the whole transaction is rolled back and the batch
        // runs again with a savepoint per message.
        let led = match self.run_leaders(&mut items, &leaders, false).await {
            Some(led) => led,
            None => self
                .run_leaders(&mut items, &leaders, true)
                .await
                .unwrap_or_else(|| leaders.iter().map(|_| Led::Failed).collect()),
        };

        self.finish_batch(items, &leaders, followers, &led).await
    }

    /// Claims the leaders in one statement, runs their handlers (each in a
    /// savepoint when `careful`), commits, and sets the leaders' outcomes.
    /// Without `careful`, the first failing handler rolls the whole batch
    /// back and `None` asks for a careful run.
    async fn run_leaders(
        &self,
        items: &mut [Item],
        leaders: &[(usize, String, String)],
        careful: bool,
    ) -> Option<Vec<Led>> {
        let inner = &*self.inner;
        let consumer = inner.name.as_str();
        let mut led: Vec<Led> = leaders.iter().map(|_| Led::Failed).collect();
        if leaders.is_empty() {
            return Some(led);
        }
        // A message past its delivery limit is skipped inside the batch,
        // which needs its savepoint.
        let careful = careful
            || leaders
                .iter()
                .any(|(index, _, _)| self.over_delivery_limit(&items[*index].meta).is_some());
        let claims: Vec<(&str, &str)> = leaders
            .iter()
            .map(|(_, key, fp)| (key.as_str(), fp.as_str()))
            .collect();
        let (mut tx, answers) = match inner.store.claim_batch(consumer, &claims).await {
            Ok(claimed) => {
                crate::failpoint::failpoint!("after_claim");
                claimed
            }
            Err(e) => {
                for (index, key, _) in leaders {
                    items[*index].outcome =
                        Some(self.busy(Some(key.clone()), format!("claim failed: {e}")));
                }
                return Some(led);
            }
        };

        // Handlers, each in its own savepoint.
        let mut failures: Vec<(usize, HandlerError)> = Vec::new();
        let mut limited: Vec<(usize, String)> = Vec::new();
        let mut processed: Vec<usize> = Vec::new();
        let mut broken: Option<String> = None;
        for (n, ((index, key, fingerprint), answer)) in leaders.iter().zip(answers).enumerate() {
            let item = &items[*index];
            match answer {
                BatchClaim::Done(record) => {
                    led[n] = Led::Done(record.clone());
                    let outcome = self.answer(record, fingerprint.clone(), item).await;
                    items[*index].outcome = Some(outcome);
                    continue;
                }
                BatchClaim::Busy => {
                    items[*index].outcome = Some(self.busy(
                        Some(key.clone()),
                        "the key is being committed by another worker".into(),
                    ));
                    continue;
                }
                BatchClaim::New => {}
            }
            if broken.is_some() {
                continue;
            }
            let req = ClaimRequest {
                consumer,
                key,
                fingerprint,
                lease: inner.lease,
            };
            if careful {
                if let Err(e) = inner.store.savepoint(&mut tx).await {
                    broken = Some(format!("savepoint failed: {e}"));
                    continue;
                }
            }
            let result = match self.over_delivery_limit(&item.meta) {
                Some(error) => {
                    limited.push((n, error));
                    Err(None)
                }
                None => self
                    .call_handler(&mut tx, &req, &item.message, &item.meta)
                    .await
                    .map_err(Some),
            };
            crate::failpoint::failpoint!("after_handler");
            match result {
                Ok(value) if !careful => {
                    led[n] = Led::Processed(value);
                    processed.push(n);
                }
                Ok(value) => match inner.store.release_savepoint(&mut tx).await {
                    Ok(()) => {
                        led[n] = Led::Processed(value);
                        processed.push(n);
                    }
                    Err(e) => broken = Some(format!("releasing the savepoint failed: {e}")),
                },
                Err(_) if !careful => {
                    if let Err(e) = inner.store.rollback(tx).await {
                        tracing::warn!(consumer, error = %e, "rollback failed");
                    }
                    return None;
                }
                Err(error) => {
                    if let Err(e) = inner.store.rollback_message(&mut tx, consumer, key).await {
                        broken = Some(format!("rolling back to the savepoint failed: {e}"));
                    }
                    if let Some(error) = error {
                        failures.push((n, error));
                    }
                }
            }
        }

        // One commit for the batch, unless the transaction broke.
        let committed = match broken {
            Some(reason) => {
                if let Err(e) = inner.store.rollback(tx).await {
                    tracing::warn!(consumer, error = %e, "rollback failed");
                }
                Err(reason)
            }
            None => {
                let results: Vec<(&str, Option<&serde_json::Value>)> = processed
                    .iter()
                    .map(|&n| {
                        let value = match &led[n] {
                            Led::Processed(v) => v.as_ref(),
                            _ => None,
                        };
                        (leaders[n].1.as_str(), value)
                    })
                    .collect();
                crate::failpoint::failpoint!("before_commit");
                inner
                    .store
                    .commit_batch(tx, consumer, &results)
                    .await
                    .map_err(|e| format!("commit failed: {e}"))
            }
        };
        if let Err(reason) = committed {
            // Nothing of the batch is known to be committed: retry every new
            // key (the redelivery finds out what did commit).
            for n in processed
                .iter()
                .copied()
                .chain(failures.iter().map(|(n, _)| *n))
            {
                led[n] = Led::Failed;
            }
            for (n, (index, key, _)) in leaders.iter().enumerate() {
                if items[*index].outcome.is_none() && !matches!(led[n], Led::Done(_)) {
                    items[*index].outcome = Some(self.busy(Some(key.clone()), reason.clone()));
                }
            }
            return Some(led);
        }
        crate::failpoint::failpoint!("after_commit_before_ack");
        for &n in &processed {
            let (index, key, _) = &leaders[n];
            let result = match &led[n] {
                Led::Processed(v) => v.clone(),
                _ => None,
            };
            items[*index].outcome = Some(Outcome::Processed {
                key: key.clone(),
                result,
            });
        }
        self.settle_failed_leaders(items, leaders, limited, failures)
            .await;
        // Leaders that never ran because the transaction broke before them.
        for (index, key, _) in leaders {
            if items[*index].outcome.is_none() {
                items[*index].outcome = Some(self.busy(
                    Some(key.clone()),
                    "the batch transaction broke before this message ran".into(),
                ));
            }
        }
        Some(led)
    }
}
