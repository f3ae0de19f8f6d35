//! Stores: where claims, results, attempts and dead letters live.
//!
//! Two families implement [`Store`]:
//! - *transactional* stores ([`sql`]: PostgreSQL, MySQL/MariaDB, SQLite): the
//!   claim row is inserted in a database transaction that the handler writes
//!   through, so the claim and the effects commit or roll back together;
//! - *lease* stores ([`memory`]): the claim is an in-flight lease with an
//!   expiry, completed by compare-and-set; the handler's effects are its own.
//!
//! Stores that also implement [`UnitStore`] run units of many members
//! (batch mode) and, with [`WatermarkStore`], offset watermarks (see
//! [`unit`](mod@unit)). [`StoreAdmin`] holds the operations that are not on the hot path:
//! migrations, pruning, inspection and the dead-letter queue.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::effect::EffectJournal;
use crate::error::StoreError;
use crate::message::{DeliveryMeta, Message};
use crate::outcome::DeadLetterReason;

pub mod cache;
#[cfg(any(feature = "redis", feature = "mongodb"))]
pub(crate) mod lease_members;
pub mod memory;
#[cfg(feature = "mongodb")]
pub mod mongo;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod sql;
pub mod unit;

pub use unit::{UnitStore, WatermarkStore, WorkUnit};

/// What the engine asks a store to claim.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// The consumer name (the scope of the key).
    pub consumer: &'a str,
    /// The business key.
    pub key: &'a str,
    /// The payload fingerprint.
    pub fingerprint: &'a str,
    /// For lease stores: how long the claim stays valid without completion.
    pub lease: Duration,
}

/// The answer to a claim.
#[derive(Debug)]
pub enum Claim<Tx> {
    /// The key is new and now held: run the handler with this transaction or lease.
    New(Tx),
    /// The key was processed before; here is what was stored.
    Done(InboxRecord),
    /// The key is being processed by another worker right now (lease stores).
    InFlight,
}

/// A processed key as stored in the inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxRecord {
    /// The consumer name.
    pub consumer: String,
    /// The business key.
    pub key: String,
    /// The fingerprint of the payload that was processed.
    pub fingerprint: String,
    /// The result the handler stored, if any.
    pub result: Option<serde_json::Value>,
    /// When the key was first claimed, in milliseconds since the Unix epoch.
    pub first_seen_ms: i64,
}

/// Failed attempts counted for a key, outside the rolled-back transactions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptRecord {
    /// Failed attempts so far.
    pub attempts: u32,
    /// The last error text.
    pub last_error: String,
    /// First failure, ms since the epoch.
    pub first_failed_ms: i64,
    /// Last failure, ms since the epoch.
    pub last_failed_ms: i64,
}

/// A dead letter to write.
#[derive(Debug, Clone)]
pub struct DeadLetter<'a> {
    /// The consumer name.
    pub consumer: &'a str,
    /// The key, if one could be derived.
    pub key: Option<&'a str>,
    /// Why.
    pub reason: &'a DeadLetterReason,
    /// The error text.
    pub error: &'a str,
    /// The whole message.
    pub message: &'a Message,
    /// Where it came from.
    pub meta: &'a DeliveryMeta,
    /// Failed attempts counted.
    pub attempts: u32,
}

impl DeadLetter<'_> {
    /// Identifies the dead-lettered message: SHA-256 (hex) over the
    /// consumer, the key, the message id, the transport key, where it came
    /// from (source, topic, partition, offset) and the payload. A message
    /// that is dead-lettered again because it came back (the consumer died
    /// after writing the letter and before the ack) gets the same id, and
    /// every store keeps one letter per id.
    pub fn letter_id(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        let mut field = |bytes: Option<&[u8]>| match bytes {
            Some(b) => {
                hash.update((b.len() as u64).to_be_bytes());
                hash.update(b);
            }
            None => hash.update(u64::MAX.to_be_bytes()),
        };
        field(Some(self.consumer.as_bytes()));
        field(self.key.map(str::as_bytes));
        field(self.message.id.as_deref().map(str::as_bytes));
        field(self.message.key.as_deref().map(str::as_bytes));
        field(Some(self.meta.source.as_bytes()));
        field(self.meta.topic.as_deref().map(str::as_bytes));
        let partition = self.meta.partition.map(|p| i64::from(p).to_be_bytes());
        field(partition.as_ref().map(|b| &b[..]));
        let offset = self.meta.offset.map(i64::to_be_bytes);
        field(offset.as_ref().map(|b| &b[..]));
        field(Some(&Sha256::digest(&self.message.payload)[..]));
        hex::encode(hash.finalize())
    }
}

/// A dead letter as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterRecord {
    /// Row id.
    pub id: i64,
    /// The consumer name.
    pub consumer: String,
    /// The key, if one could be derived.
    pub key: Option<String>,
    /// The reason code ([`DeadLetterReason::code`]).
    pub reason: String,
    /// The error text.
    pub error: String,
    /// The message, as received.
    pub message: Message,
    /// Where it came from.
    pub meta: DeliveryMeta,
    /// Failed attempts counted.
    pub attempts: u32,
    /// When it was written, ms since the epoch.
    pub created_ms: i64,
}

/// Per-consumer numbers for `idemq stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// The consumer name.
    pub consumer: String,
    /// Processed keys in the inbox.
    pub processed: u64,
    /// Oldest inbox row, ms since the epoch.
    pub oldest_ms: Option<i64>,
    /// Newest inbox row, ms since the epoch.
    pub newest_ms: Option<i64>,
    /// Dead letters.
    pub dead_letters: u64,
    /// Keys with failed attempts and no completion yet.
    pub failing: u64,
}

/// What a store knows about one key, for `idemq inspect`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyReport {
    /// The inbox record, if the key was processed.
    pub inbox: Option<InboxRecord>,
    /// Whether a lease on the key is held right now (lease stores).
    pub in_flight: bool,
    /// Failed attempts, if any were counted.
    pub attempts: Option<AttemptRecord>,
    /// Dead letters written for the key.
    pub dead_letters: Vec<DeadLetterRecord>,
}

/// The hot path of a store: claim a key, complete or abandon the claim,
/// count failures, write dead letters.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// What the handler gets while it holds a claim: the open database
    /// transaction for SQL stores, a lease for lease stores.
    type Tx: Send + 'static;

    /// Claims `req.key` for `req.consumer`: insert first, never
    /// check-then-insert. A concurrent claim of the same key by another
    /// worker either waits for it (SQL) or answers [`Claim::InFlight`] (leases).
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<Self::Tx>, StoreError>;

    /// Stores the optional result, clears the key's failed attempts and
    /// commits (SQL) or completes the lease (compare-and-set on its token).
    async fn commit(
        &self,
        tx: Self::Tx,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError>;

    /// Abandons the claim: rolls back (SQL) or releases the lease if still held.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Counts a failed attempt for the key *outside* any business
    /// transaction, so the count survives the rollback; returns the new count.
    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError>;

    /// Writes a dead letter and clears the key's failed attempts.
    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError>;

    /// The store's effect journal, if it keeps one: handed to handlers
    /// through [`Context::effect`](crate::Context::effect). `None` by default.
    fn journal(&self) -> Option<&dyn EffectJournal> {
        None
    }
}

/// Operations off the hot path: schema, retention, inspection, dead letters.
#[async_trait]
pub trait StoreAdmin: Send + Sync {
    /// One cheap round trip to the store (`SELECT 1`, `PING`): whether it
    /// answers now, for readiness checks. Bound it with a timeout: a store
    /// that does not answer may keep it waiting.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Creates or upgrades the store's tables (idempotent).
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Deletes at most `batch` inbox rows (and stale attempt rows) first seen
    /// before `cutoff_ms`, and at most `batch` effect-journal rows written
    /// before it; returns how many inbox rows went, or how many journal rows
    /// if more of those went (so that calling it until it returns less than
    /// `batch` drains both).
    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError>;

    /// Everything known about one key.
    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError>;

    /// Numbers per consumer.
    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError>;

    /// Dead letters with id greater than `after_id`, oldest first, optionally of one consumer.
    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError>;

    /// Deletes one dead letter (after a successful replay); whether it existed.
    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError>;

    /// Frees the in-flight lease on `key` of `consumer` (lease stores), so
    /// that the next delivery claims it at once instead of waiting for the
    /// lease to expire; whether a lease was held. The holder, if it is still
    /// alive, then fails to complete (its token no longer holds the key).
    ///
    /// SQL stores hold no leases: a dead worker's transaction is rolled back
    /// by the database, which releases the row. They return `false`.
    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        let _ = (consumer, key);
        Ok(false)
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    system_time_ms(SystemTime::now())
}

/// Milliseconds since the Unix epoch of `t` (0 before the epoch).
pub fn system_time_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Parses a stored result column.
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
pub(crate) fn parse_result(text: Option<String>) -> Option<serde_json::Value> {
    text.map(|t| serde_json::from_str(&t).unwrap_or(serde_json::Value::String(t)))
}

/// Rebuilds a message and its metadata from dead-letter columns.
#[cfg(any(
    feature = "postgres",
    feature = "mysql",
    feature = "sqlite",
    feature = "redis"
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dead_letter_message(
    message_id: Option<String>,
    transport_key: Option<String>,
    headers_json: Option<String>,
    payload: Vec<u8>,
    source: String,
    topic: Option<String>,
    partition: Option<i32>,
    offset: Option<i64>,
    delivery_count: i64,
) -> (Message, DeliveryMeta) {
    let headers = headers_json
        .and_then(|h| serde_json::from_str::<serde_json::Value>(&h).ok())
        .map(|v| crate::message::Headers::from_json(&v))
        .unwrap_or_default();
    let message = Message {
        id: message_id,
        key: transport_key,
        headers,
        payload,
    };
    let meta = DeliveryMeta {
        source,
        topic,
        partition,
        offset,
        delivery_count: u32::try_from(delivery_count).unwrap_or(u32::MAX),
    };
    (message, meta)
}
