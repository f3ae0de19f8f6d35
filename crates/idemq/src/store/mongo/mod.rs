//! The MongoDB lease store: claims as leases with fencing, on MongoDB or a
//! MongoDB-wire server such as FerretDB (the official `mongodb` driver).
//!
//! # Model
//!
//! MongoDB does not take part in the handler's transaction (and FerretDB,
//! the server this store is tested against, has no multi-document
//! transactions), so this is a *lease* store like
//! the Redis store (`redis`) and [`memory`](super::memory): a claim is an
//! in-flight lease with a token, an expiry and a fencing number; a
//! heartbeat extends it while the handler runs; completion is a
//! compare-and-set from this lease to the done record; a rollback frees the
//! key; an expired lease is taken over by the next claim.
//!
//! # Why every decision is a unique insert
//!
//! A MongoDB-wire server is not necessarily atomic where MongoDB is.
//! FerretDB 1.x runs an `update`, `findAndModify` or `delete` with a filter
//! as *read the matching documents, then write them back by `_id`*, without
//! a transaction between the two: two compare-and-set updates on the same
//! token can both succeed. What every such server does arbitrate atomically
//! is a **unique index**: of two inserts of the same `_id`, exactly one
//! succeeds and the other gets duplicate-key error 11000 (on FerretDB, the
//! unique index of its PostgreSQL table). So this store never decides
//! anything by a conditional update or delete; every transition of a key is
//! the insert of an immutable *slot* document whose `_id` is unique per
//! (consumer, key, epoch, generation):
//!
//! - generation 1 is the key's **head**, `_id` `["consumer","key"]`, a
//!   lease; it carries a random **epoch** (one per life of the key, from
//!   its first claim until it is pruned) and the first-seen time;
//! - generation `g ≥ 2` has `_id` `["consumer","key","epoch",g]` and is one
//!   of: `lease` (token, expiry), `done` (fingerprint, result, first-seen,
//!   completion time), `free` (released) or `pruned` (being pruned);
//! - the key's state is its **top** slot, the highest generation of the
//!   head's epoch. Whoever wants to change it inserts generation `top + 1`;
//!   the unique `_id` lets exactly one of several racing writers do so.
//!
//! The operations:
//!
//! - **claim** reads the key's slots (one query): top `done` answers
//!   [`Claim::Done`]; a live `lease` (or `pruned`) answers
//!   [`Claim::InFlight`]; no head, a `free` top or an expired lease is
//!   claimed by inserting the next generation as a lease with a fresh random
//!   token ([`Claim::New`], fencing number = its generation). A claim that
//!   loses the insert race reads again.
//! - **heartbeat**: every `lease / 3` a task extends the lease's expiry
//!   (an update of its own slot; harmless even where updates are not
//!   atomic, since nothing else writes that slot) and checks whether the
//!   next generation exists, i.e. whether the key was taken over, or
//!   whether its own slot is gone, i.e. the key was pruned while the lease
//!   had lapsed ([`MongoLease::lease_lost`]). A lease dropped while held (its task was
//!   aborted) is released at once, like a rollback.
//! - **commit** inserts generation `g + 1` as the done record. If it
//!   exists already, a claim took the expired lease over (or an operator
//!   released it) first: [`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost). It then clears the
//!   key's failed attempts.
//! - **rollback** inserts generation `g + 1` as `free` (a no-op if another
//!   worker took the key over).
//!
//! Expiry is judged in the **server's time**: the store estimates the
//! server clock's offset from the `localTime` of a `hello` (every 30 s,
//! corrected by half the round trip), so workers whose clocks disagree still
//! agree on when a lease expired, to within a few milliseconds. A worker
//! whose clock steps between two estimates is off by that step until the
//! next one. First-seen and completion times, attempts and dead letters are
//! stamped with the worker's clock, like the other stores (pruning compares
//! them with a cutoff on the caller's clock).
//!
//! # Retention
//!
//! [`StoreAdmin::prune_batch`] removes the slots of keys first seen before
//! the cutoff whose top is `done` or was abandoned (`free`, an expired
//! lease): it inserts a `pruned` marker as the next generation (so no claim
//! can take the key meanwhile, and only one pruner prunes it), deletes the
//! head, then the rest of the epoch. The next claim of the key starts a new
//! epoch. A holder of an old epoch that wakes up after its key was pruned
//! (its lease long expired) finds its commit refused: a commit made after a
//! missed heartbeat checks that the head still carries its epoch.
//!
//! MongoDB can also expire completed keys by itself: with
//! [`MongoOptions::ttl`] the migration creates a TTL index on `expire_at`
//! and each completion stamps the key's slots with it. FerretDB has no TTL
//! indexes (the migration then fails with a configuration error); prune
//! works on both.
//!
//! # Collections
//!
//! In the URL's database (default `idemq`), names prefixed with
//! [`MongoOptions::prefix`] (default `idemq_`):
//!
//! | collection     | one document per                              | unique index |
//! |----------------|-----------------------------------------------|--------------|
//! | `inbox`        | slot: (consumer, key, epoch, generation)       | `_id`; (consumer, key, epoch, g) |
//! | `attempts`     | failed attempt: (consumer, key, n)             | `_id`; (consumer, key, n) |
//! | `dead_letters` | dead letter, `_id` a rising number             | `_id`; `letter` (one per message) |
//! | `effects`      | effect journal step: (consumer, key, step)     | `_id`; (consumer, key, step) |
//!
//! Counting a failed attempt inserts attempt `n + 1` (so concurrent
//! failures get distinct numbers); clearing deletes the key's attempts.
//! Dead letters get an id from the worker's clock (milliseconds × 1000 plus
//! a counter), unique by insert; a letter written again for the same message
//! ([`DeadLetter::letter_id`](super::DeadLetter::letter_id)) is found by its
//! unique `letter` and not written twice. A dead letter keeps at most
//! [`MAX_DEAD_LETTER_PAYLOAD`] bytes of the payload (a BSON document holds
//! 16 MiB), and says in its error text when it was cut.
//!
//! Strings are stored as they are, except that `%` and NUL become `%25` and
//! `%00` in the `consumer`, `key` and text fields (PostgreSQL, under
//! FerretDB, cannot store NUL), and read back decoded.
//!
//! # What was tested against what
//!
//! The store suite (`tests/integration/backends`) runs against FerretDB 1.24 over
//! PostgreSQL (`scripts/ferretdb.sh`). Nothing here needs a replica set;
//! on a real MongoDB replica set, put `w=majority` and
//! `readConcernLevel=majority` in the URL so that a failover cannot roll
//! back a claim or a completion. The TTL index path was not tested against
//! a real `mongod`.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use idemq::{Consumer, KeySpec};
//! use idemq::store::StoreAdmin;
//! use idemq::store::mongo::{MongoLease, MongoOptions, MongoStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MongoStore::connect_with(
//!     "mongodb://127.0.0.1:27017/billing",
//!     MongoOptions::default().prefix("payments_"),
//! )
//! .await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("payments", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .lease(Duration::from_secs(10))
//!     .handler_fn(|ctx, lease: &mut MongoLease| Box::pin(async move {
//!         // Pass the fencing number to the downstream write.
//!         println!("charging {} with fence {}", ctx.key, lease.fencing_token());
//!         Ok(None)
//!     }))
//!     .build()?;
//! # let _ = consumer;
//! # Ok(()) }
//! ```
//!
//! [`Claim::Done`]: super::Claim::Done
//! [`Claim::InFlight`]: super::Claim::InFlight
//! [`Claim::New`]: super::Claim::New
//! [`StoreAdmin::prune_batch`]: super::StoreAdmin::prune_batch

mod admin;
mod clock;
pub(crate) mod error;
mod ids;
mod journal;
mod lease;
mod options;
mod records;
mod store;
mod unit;

pub use error::MongoError;
pub use lease::MongoLease;
pub use options::MongoOptions;
pub use records::MAX_DEAD_LETTER_PAYLOAD;
pub use store::MongoStore;
pub use unit::MongoUnit;
