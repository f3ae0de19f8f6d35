//! Batch mode: a polled batch of messages shares one transaction.
//!
//! A batch is one unit of work of the store ([`UnitStore`]). Per batch, with
//! a SQL store:
//! 1. every message's key and fingerprint are derived (bad input is
//!    dead-lettered on its own, as in per-message mode);
//! 2. all keys are claimed in **one statement** in a new transaction;
//! 3. the new keys' handlers run in that transaction. If one fails, the
//!    transaction is rolled back and the batch runs again with each handler
//!    inside its own **savepoint**: a failing message is rolled back to it
//!    and gives up its claim, the rest stay (a batch without failures pays
//!    no savepoint round trips);
//! 4. results are stored and the batch **commits once**;
//! 5. only then are the deliveries settled: processed and duplicates acked,
//!    failures counted (outside the transaction) and nacked or dead-lettered.
//!
//! Copies of one key keep their order across batches: the run loop holds a
//! later copy in its key lane until the earlier one's outcome is decided,
//! so the later copy runs in a later batch and the inbox answers it (a
//! duplicate or a conflict), or it is deferred while the earlier copy waits
//! for its retry. Copies inside one batch handed to
//! [`Consumer::process_batch`] directly are claimed once: the first copy
//! leads, the later ones get its answer after the commit (retried later if
//! it did not commit). If the commit fails, nothing of the batch is acked:
//! every message is retried and the inbox sorts out what did commit. A
//! crash anywhere leaves the whole batch committed or none of it.
//!
//! Up to [`concurrency`](super::ConsumerBuilder::concurrency) batches are in
//! flight at once, each in its own transaction.
//!
//! Batching trades latency for throughput: one commit (one fsync) per batch
//! instead of per message. A partitioned source (Kafka) may hand out as
//! many records of a partition as the loop reads ahead
//! ([`Source::settle_out_of_order`]), so a batch fills from one partition
//! as well; SQS FIFO groups still hand out one message per group at a time.

use std::future::Future;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::consumer::{Consumer, Identity};
use super::pipeline::Member;
use super::run::{Direct, Runner, Units};
use super::unit::stored::Batch;
use crate::error::{InputError, SourceError};
use crate::message::DeliveryMeta;
use crate::outcome::{Outcome, Summary};
use crate::source::{Delivery, Source};
use crate::store::UnitStore;

/// How batches are formed in [`Consumer::run_batched`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchOptions {
    /// At most this many messages per batch (and per transaction).
    pub max_size: usize,
    /// After the first message of a batch arrived, wait at most this long for
    /// more before running the batch.
    pub max_wait: Duration,
}

impl BatchOptions {
    /// Batches of at most `max_size` messages, waiting at most `max_wait`
    /// for more after the first.
    pub fn new(max_size: usize, max_wait: Duration) -> Self {
        Self { max_size, max_wait }
    }
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

/// The run loop's view of batch mode: batches of a [`UnitStore`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Batched;

impl<S: UnitStore> Runner<S> for Batched {
    fn out_of_order(&self) -> bool {
        true
    }

    fn claim_identity(
        &self,
        _meta: &DeliveryMeta,
        identity: &Identity,
        _defect: Option<&InputError>,
    ) -> Identity {
        identity.clone()
    }

    fn process<'a>(
        &'a self,
        consumer: &'a Consumer<S>,
        members: Vec<(Member, Identity)>,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(consumer.process_unit(&Batch, members))
    }
}

impl<S: UnitStore> Consumer<S> {
    /// Processes a batch of deliveries as one unit of work of the store (see
    /// the module docs) and settles each with its source; returns the
    /// outcomes in order.
    pub async fn process_batch(&self, deliveries: Vec<Delivery>) -> Vec<Outcome> {
        let members = deliveries
            .into_iter()
            .map(|delivery| self.member_of(&Direct(Batch), delivery))
            .collect();
        self.process_unit(&Batch, members).await
    }

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
        source: impl Source,
        options: BatchOptions,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        let units = Units {
            max_size: options.max_size,
            max_wait: options.max_wait,
        };
        self.run_units(source, shutdown, Batched, units).await
    }
}
