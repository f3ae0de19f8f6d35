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

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::consumer::Consumer;
use super::unit::leases::LeaseBatch;
use super::unit::savepoints::SqlBatch;
use super::unit::Mode;
use crate::error::SourceError;
use crate::outcome::{Outcome, OutcomeKind, Summary};
use crate::source::{Delivery, Source};
use crate::store::{BatchStore, LeaseBatchStore, Store};

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

/// Stores a consumer can run in batch mode ([`Consumer::run_batched`]):
/// every [`BatchStore`] (a batch shares one transaction, as above) and the
/// Redis lease store (a batch's claims and its completions take one round
/// trip each; see [`LeaseBatchStore`]).
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

/// The Redis store runs batches through the lease unit.
#[cfg(feature = "redis")]
impl BatchMode for crate::store::redis::RedisStore {
    fn run_batch(
        consumer: &Consumer<Self>,
        deliveries: Vec<Delivery>,
    ) -> BoxFuture<'_, Vec<Outcome>> {
        Box::pin(consumer.process_lease_batch(deliveries))
    }
}

impl<S: BatchStore> Consumer<S> {
    /// Processes a batch of deliveries in one transaction (see the module
    /// docs) and settles each with its source; returns the outcomes in order.
    pub async fn process_batch(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        self.process_polled(&SqlBatch, deliveries).await
    }
}

impl<S: LeaseBatchStore> Consumer<S> {
    /// Processes a batch of deliveries over a lease store (see
    /// [`LeaseBatchStore`]: a lease per key, claimed and completed in one
    /// round trip each) and settles each with its source; returns the
    /// outcomes in order.
    pub async fn process_lease_batch(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        self.process_polled(&LeaseBatch, deliveries).await
    }
}

impl<S: Store> Consumer<S> {
    /// A polled batch as one unit of `mode`, each delivery identified here.
    async fn process_polled<M: Mode<S>>(
        &self,
        mode: &M,
        deliveries: Vec<Delivery>,
    ) -> Vec<Outcome> {
        let members = deliveries
            .into_iter()
            .map(|delivery| self.member_of(mode, delivery))
            .collect();
        self.process_unit(mode, members).await
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
