//! Sources: where deliveries come from, and how they are settled.
//!
//! A [`Source`] yields [`Delivery`]s. Each delivery is settled exactly once
//! through its [`Acknowledger`]: ack after the inbox transaction committed,
//! nack with a delay for a retry, or dead-letter. The engine never acks
//! before the commit.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{InputError, SourceError, StoreError};
use crate::message::{DeliveryMeta, Message};
use crate::outcome::DeadLetterReason;

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod health;
pub mod idle;
pub mod jsonl;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod kit;
#[cfg(any(
    feature = "nats",
    feature = "redis-streams",
    feature = "amqp",
    feature = "sqs",
    feature = "rocketmq"
))]
pub(crate) mod lag;
pub mod loss;
#[cfg(feature = "mqtt")]
pub mod mqtt;
#[cfg(feature = "nats")]
pub mod nats;
pub mod queue;
#[cfg(feature = "redis-streams")]
pub mod redis_stream;
pub mod registry;
#[cfg(feature = "rocketmq")]
pub mod rocketmq;
#[cfg(feature = "sqs")]
pub mod sqs;
pub(crate) mod url;

/// Settles one delivery with its source.
#[async_trait]
pub trait Acknowledger: Send + Sync {
    /// The message is done (processed, duplicate or dead-lettered): do not deliver it again.
    async fn ack(self: Box<Self>) -> Result<(), SourceError>;

    /// Deliver the message again after `delay`.
    async fn nack(self: Box<Self>, delay: Duration) -> Result<(), SourceError>;

    /// The engine wrote the message to the store's dead-letter table
    /// ([`Store::dead_letter`](crate::store::Store::dead_letter)); forward it
    /// to the source's own dead-letter destination if it has one, then ack.
    async fn forward_dead_letter(
        self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let _ = reason;
        self.ack().await
    }

    /// For a record of a partitioned log: where the partition's contiguous
    /// position would stand if this delivery settled now (see
    /// [`Contiguity`]). Offset-watermark mode stores that position, so it
    /// never moves past a record still unsettled. The default,
    /// [`Contiguity::InOrder`], says the source hands out one unsettled
    /// record per partition, in offset order.
    fn contiguity(&self) -> Contiguity {
        Contiguity::InOrder
    }
}

/// How a delivery's partition stands, for offset-watermark mode
/// ([`Acknowledger::contiguity`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Contiguity {
    /// The source hands out one unsettled record per partition, in offset
    /// order: once this one settles, the partition's position is just past it.
    InOrder,
    /// The source tracks its partition's unsettled records and hands out
    /// several at once: the position (every record below it settled, or
    /// this one) if this one settled now; `None` when the partition is no
    /// longer this source's (revoked), so nothing may be said of it.
    Tracked(Option<i64>),
}

/// One delivery of a message: the message, where it came from, and the means to settle it.
pub struct Delivery {
    /// The message.
    pub message: Message,
    /// Delivery metadata.
    pub meta: DeliveryMeta,
    /// Set when the source could not decode the record; the engine dead-letters it
    /// with this reason and the raw bytes as the payload.
    pub defect: Option<InputError>,
    acker: Box<dyn Acknowledger>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("message", &self.message)
            .field("meta", &self.meta)
            .field("defect", &self.defect)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// A delivery settled through `acker`.
    pub fn new(message: Message, meta: DeliveryMeta, acker: Box<dyn Acknowledger>) -> Self {
        Self {
            message,
            meta,
            defect: None,
            acker,
        }
    }

    /// Marks the delivery as undecodable; the engine dead-letters it.
    pub fn with_defect(mut self, defect: InputError) -> Self {
        self.defect = Some(defect);
        self
    }

    /// Splits off the acknowledger so that message and metadata can be borrowed while settling.
    pub fn into_parts(
        self,
    ) -> (
        Message,
        DeliveryMeta,
        Option<InputError>,
        Box<dyn Acknowledger>,
    ) {
        (self.message, self.meta, self.defect, self.acker)
    }
}

/// Publishes messages to a broker: the producer side, used by `idemq produce`
/// and by tests. Each broker carries [`Message::id`], [`Message::key`] and the
/// headers in its own native places, documented on its publisher, so that its
/// source reads them back into the same [`Message`].
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publishes one message; returns when the broker has accepted it.
    async fn publish(&self, message: &Message) -> Result<(), SourceError>;

    /// Waits until everything published so far is stored by the broker.
    async fn flush(&self) -> Result<(), SourceError> {
        Ok(())
    }
}

/// Where a partitioned log resumes: the store's offset watermarks, which
/// offset-watermark mode hands to the source ([`Source::resume_from`]).
#[async_trait]
pub trait OffsetLookup: Send + Sync {
    /// The next offset to read of each of `partitions` of `topic` that has a
    /// stored position; partitions without one are left out.
    async fn next_offsets(
        &self,
        topic: &str,
        partitions: &[i32],
    ) -> Result<HashMap<i32, i64>, StoreError>;
}

/// A stream of deliveries.
#[async_trait]
pub trait Source: Send {
    /// The next delivery; `None` when the source is finished (a file read to
    /// its end with every delivery settled). Sources of endless streams never
    /// return `None`.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError>;

    /// Shuts the source down after a run, once every delivery was settled:
    /// sources whose client flushes acknowledgements or offsets on shutdown
    /// do it here, so that a process exiting right after the run loses no
    /// settlement. The engine's run loops call it; the default does nothing.
    async fn close(&mut self) {}

    /// Offset-watermark mode calls this once, before its run, with the
    /// store's watermarks. A source over a partitioned log (Kafka) then
    /// starts every partition it is assigned — at every assignment, and at
    /// once for partitions it already holds — at the stored position instead
    /// of the group's committed offset, so records already applied are not
    /// even fetched. The default ignores it: the engine's per-record check
    /// still answers such records as duplicates. Wrappers should forward it.
    async fn resume_from(&mut self, lookup: Arc<dyn OffsetLookup>) {
        let _ = lookup;
    }

    /// The engine's run loop calls this once, before its run (per-message
    /// and batch mode): it keeps the order of each business key itself (key
    /// lanes) and settles deliveries in any order. A source that hands out
    /// one unsettled delivery per partition to keep the partition's order
    /// (Kafka) may then hand out up to `per_partition` at once; it must
    /// still never commit past an unsettled delivery. The offset-watermark
    /// mode calls it too; a source that then hands out several records of
    /// a partition at once must say so in its ackers'
    /// [`Acknowledger::contiguity`] ([`Contiguity::Tracked`]), else the
    /// watermark would move past records still unsettled. The default
    /// ignores it; wrappers should forward it.
    fn settle_out_of_order(&mut self, per_partition: usize) {
        let _ = per_partition;
    }
}

#[async_trait]
impl<S: Source + ?Sized> Source for Box<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        (**self).next().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn OffsetLookup>) {
        (**self).resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        (**self).settle_out_of_order(per_partition)
    }

    async fn close(&mut self) {
        (**self).close().await
    }
}
