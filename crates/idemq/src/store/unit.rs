//! A store's unit of work: begin, claim many, isolate a failing member,
//! complete — the one store-side notion behind batch mode and
//! offset-watermark mode.
//!
//! A store that implements only [`Store`] runs per message: every claim is
//! its own transaction or lease. A store that also implements
//! [`UnitStore`] hands out [`WorkUnit`]s, which the engine's pipeline drives
//! the same way for every mode:
//!
//! 1. [`claim`](WorkUnit::claim) every member once (a business key, or a
//!    record's position in a partitioned log);
//! 2. for each member answered [`MemberAnswer::New`]:
//!    [`isolate`](WorkUnit::isolate), the handler writing through
//!    [`tx`](WorkUnit::tx), then [`keep`](WorkUnit::keep) — or
//!    [`undo`](WorkUnit::undo) if the handler failed;
//! 3. [`complete`](WorkUnit::complete) the unit once, or
//!    [`abort`](WorkUnit::abort) it if it broke.
//!
//! What a unit *is* stays the store's own: the SQL stores claim a batch in
//! one statement inside one transaction, isolate members with savepoints and
//! commit once, and keep offset watermarks in that transaction; the Redis
//! store gives each member its own lease, heartbeated together, claimed and
//! completed in one round trip each.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use idemq::store::sql::sqlite::SqliteStore;
//! use idemq::store::unit::{Completion, MemberAnswer, MemberClaim, UnitOptions, UnitStore, WorkUnit};
//! use idemq::store::{ClaimRequest, StoreAdmin};
//! use idemq::InFlightPolicy;
//!
//! let store = Arc::new(SqliteStore::connect("sqlite::memory:").await.unwrap());
//! store.migrate().await.unwrap();
//! let claim = |key| {
//!     MemberClaim::Key(ClaimRequest { consumer: "ledger", key, fingerprint: "fp", lease: Duration::from_secs(30) })
//! };
//! let options = UnitOptions::new(false, Duration::from_secs(30), InFlightPolicy::Reject);
//!
//! let claims = [claim("a"), claim("b")];
//! let mut unit = store.begin(options);
//! assert_eq!(unit.claim(&claims).await.unwrap(), [MemberAnswer::New, MemberAnswer::New]);
//! // The handlers write through `unit.tx(n)`; both complete in one commit.
//! let done = [0, 1].map(|member| Completion { member, result: None, watermark: None });
//! assert_eq!(unit.complete(&claims, &done).await.unwrap(), [true, true]);
//!
//! // A later unit finds both keys done.
//! let mut again = store.begin(options);
//! let answers = again.claim(&claims).await.unwrap();
//! assert!(answers.iter().all(|a| matches!(a, MemberAnswer::Done(_))));
//! again.abort().await;
//! # });
//! ```

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{ClaimRequest, InboxRecord, Store};
use crate::error::StoreError;
use crate::policy::InFlightPolicy;

/// Where a record sits in its partitioned log (a Kafka topic partition).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordPosition<'a> {
    /// The topic.
    pub topic: &'a str,
    /// The partition.
    pub partition: i32,
    /// The record's offset.
    pub offset: i64,
}

/// A record claimed in offset-watermark mode: it is new while its offset is
/// at or past the partition's watermark (and, with `position`, while its
/// position was not claimed before).
#[derive(Debug, Clone, Copy)]
pub struct RecordClaim<'a> {
    /// The record.
    pub at: RecordPosition<'a>,
    /// What the record is known as: its business key (and fingerprint) when
    /// the mode deduplicates keys too, else its position. Its `consumer`
    /// owns the watermark.
    pub identity: ClaimRequest<'a>,
    /// Claim `identity` as a key in the inbox as well (key dedup): a key
    /// found done makes the record [`MemberAnswer::Done`], and the watermark
    /// moves to `skip_to`.
    pub claim_key: bool,
    /// `None`: records of the partition apply one at a time, and the unit
    /// holds the partition's watermark until it ends. `Some`: records of the
    /// partition apply concurrently, and the record's position is claimed
    /// in the inbox under this request, so that a copy of it cannot apply
    /// twice while the watermark lags behind.
    pub position: Option<ClaimRequest<'a>>,
    /// Where the watermark moves if the record needs no effect because its
    /// key was done (`None`: it stays).
    pub skip_to: Option<i64>,
}

/// What one member of a unit claims.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum MemberClaim<'a> {
    /// A business key (per-message and batch modes).
    Key(ClaimRequest<'a>),
    /// A record of a partitioned log (offset-watermark mode).
    Record(RecordClaim<'a>),
}

impl<'a> MemberClaim<'a> {
    /// The consumer the claim is scoped by.
    pub fn consumer(&self) -> &'a str {
        match self {
            MemberClaim::Key(req) => req.consumer,
            MemberClaim::Record(record) => record.identity.consumer,
        }
    }

    /// The business key claimed, if any.
    pub fn key(&self) -> Option<&ClaimRequest<'a>> {
        match self {
            MemberClaim::Key(req) => Some(req),
            MemberClaim::Record(record) => record.claim_key.then_some(&record.identity),
        }
    }
}

/// How one member's claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemberAnswer {
    /// New and held by the unit: run the handler.
    New,
    /// Processed before; here is what was stored.
    Done(InboxRecord),
    /// Held by another worker or not visible yet: retry later, for this reason.
    Busy(String),
}

/// What undoing one member's work undid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Undone {
    /// Only this member's work; the rest of the unit holds.
    Member,
    /// The whole unit (it was not isolating members): the engine runs it
    /// again with [`UnitOptions::isolate`] set.
    Unit,
}

/// One member to complete in [`WorkUnit::complete`].
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// The member's index in the claims.
    pub member: usize,
    /// The handler's result, stored with the key.
    pub result: Option<&'a serde_json::Value>,
    /// For a record: where the partition's watermark moves (`None`: it
    /// stays; it never moves back).
    pub watermark: Option<i64>,
}

/// How a unit runs.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct UnitOptions {
    /// Isolate every member from the start (SQL: a savepoint each), so that
    /// a failing member is undone alone. Without it a unit may undo as a
    /// whole ([`Undone::Unit`]), which saves round trips when nothing fails.
    pub isolate: bool,
    /// How long a lease lasts without a heartbeat (lease stores).
    pub lease: Duration,
    /// What a claim does when another worker holds the key (lease stores).
    pub in_flight: InFlightPolicy,
}

impl UnitOptions {
    /// Options for a unit: members isolated or not, leases of `lease`,
    /// keys in flight elsewhere handled by `in_flight`.
    pub fn new(isolate: bool, lease: Duration, in_flight: InFlightPolicy) -> Self {
        Self {
            isolate,
            lease,
            in_flight,
        }
    }
}

/// One unit of work of a [`UnitStore`] (see the module docs for the order
/// of calls). Dropping a unit without completing it gives up what it holds,
/// as [`abort`](Self::abort) does (at the latest when the database or the
/// lease expiry notices).
#[async_trait]
pub trait WorkUnit: Send + 'static {
    /// What a member's handler writes through: the open transaction, or the
    /// member's lease.
    type Tx: Send + 'static;

    /// Claims every member (their keys are distinct); answers in order. On
    /// an error the unit holds nothing.
    async fn claim(&mut self, claims: &[MemberClaim<'_>]) -> Result<Vec<MemberAnswer>, StoreError>;

    /// The transaction or lease member `member`'s handler writes through.
    fn tx(&mut self, member: usize) -> Option<&mut Self::Tx>;

    /// The one transaction every member of a claimed unit writes through,
    /// if the unit has one (a SQL batch); `None` if each member holds its
    /// own (leases). A handler that [handles batches](crate::Handler::handles_batches)
    /// gets it for the whole batch.
    fn shared(&mut self) -> Option<&mut Self::Tx> {
        None
    }

    /// Marks the point member `member`'s work can be undone to.
    async fn isolate(&mut self, member: usize) -> Result<(), StoreError> {
        let _ = member;
        Ok(())
    }

    /// Keeps member `member`'s work.
    async fn keep(&mut self, member: usize) -> Result<(), StoreError> {
        let _ = member;
        Ok(())
    }

    /// Undoes member `member`'s work and gives up its claim, so that its
    /// redelivery can claim it again.
    async fn undo(&mut self, member: usize, claim: &MemberClaim<'_>) -> Result<Undone, StoreError>;

    /// Stores the results of `done`, clears their failed attempts, gives up
    /// the other members' claims and commits the unit; answers, per entry of
    /// `done` in order, whether its claim held (a lease taken over after
    /// expiring does not). On an error nothing of the unit is known to have
    /// committed.
    async fn complete(
        self,
        claims: &[MemberClaim<'_>],
        done: &[Completion<'_>],
    ) -> Result<Vec<bool>, StoreError>;

    /// Gives the whole unit up: rolls back, releases its leases.
    async fn abort(self);
}

/// Stores that run units of many members: what batch mode needs
/// ([`Consumer::run_batched`](crate::Consumer::run_batched)).
pub trait UnitStore: Store {
    /// The store's unit of work.
    type Unit: WorkUnit<Tx = Self::Tx>;

    /// Begins a unit (it holds nothing until its first claim).
    fn begin(self: &Arc<Self>, options: UnitOptions) -> Self::Unit;
}

/// Stores whose units claim records ([`MemberClaim::Record`]) and keep a
/// watermark per (consumer, topic, partition) in the same transaction as the
/// effects: what offset-watermark mode needs
/// ([`Consumer::run_watermarked`](crate::Consumer::run_watermarked)).
#[async_trait]
pub trait WatermarkStore: UnitStore {
    /// The partition's watermark (the next offset to apply), if it has one.
    async fn watermark(
        &self,
        consumer: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError>;
}
