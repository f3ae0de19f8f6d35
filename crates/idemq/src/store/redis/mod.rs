//! The Redis lease store: claims as leases with fencing, on a single Redis or
//! a Redis Cluster (redis-rs with tokio).
//!
//! # Model
//!
//! Redis does not take part in the handler's transaction, so this is a
//! *lease* store like [`memory`](super::memory), but shared by every process
//! that points at the same Redis:
//!
//! - **claim** runs one Lua script on the key's record: a `done` record
//!   answers [`Claim::Done`]; a live `in-flight:<token>` record answers
//!   [`Claim::InFlight`]; otherwise the script does
//!   `SET rec in-flight:<token> NX PX <lease>` with a fresh random token,
//!   `HINCRBY`s the key's fencing counter and answers [`Claim::New`] with a
//!   [`RedisLease`] carrying that number ([`RedisLease::fencing_token`]).
//!   The number rises with every acquisition of the key, so a downstream
//!   system that remembers the highest number it has seen for a key can
//!   refuse a write from a stale holder.
//! - While the handler runs, a **heartbeat** task extends the lease every
//!   `lease / 3` by compare-on-token (`PEXPIRE` only if the record still holds
//!   this token). It stops when the lease is committed, rolled back or
//!   dropped. A lease dropped while held (its task was aborted mid-handler)
//!   is released at once by compare-and-delete, like a rollback; a worker
//!   that dies outright leaves it to expire after at most one lease, and
//!   another worker takes over. If the heartbeat finds the
//!   record taken by another token, or cannot reach Redis for a whole lease,
//!   it records that: [`RedisLease::lease_lost`].
//! - **commit** is a compare-and-set (Lua) from this token's in-flight record
//!   to `done:{json}` holding the fingerprint, the optional result, the
//!   first-seen time and the completion time, with the retention TTL (`PX`);
//!   it also clears the key's failed attempts. If the token no longer holds
//!   the key, it is refused with [`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost).
//! - **rollback** is a compare-and-delete of this token's record, so the
//!   redelivery can claim the key at once.
//! - A waiting claimer (e.g. an engine policy that waits for an in-flight key
//!   instead of rejecting it) simply calls [`Store::claim`] again until it
//!   answers [`Claim::Done`] or [`Claim::New`]: a claim that finds a live
//!   lease changes nothing.
//!
//! Redis errors map to [`StoreErrorKind::Transient`](crate::StoreErrorKind::Transient) when a retry may help
//! (connection refused/dropped, I/O, timeouts, `LOADING`, `TRYAGAIN`,
//! `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`, `MOVED`/`ASK`) and to
//! [`StoreErrorKind::Other`](crate::StoreErrorKind::Other) otherwise. The engine retries transient failures
//! without counting an attempt.
//!
//! Durability is Redis's: without AOF (`appendonly yes`) a Redis restart
//! forgets the processed keys and their duplicates are applied again. Use a
//! SQL store when that matters, or put [`cache::CachedStore`](super::cache::CachedStore)
//! with a [`RedisFilter`](super::cache::RedisFilter) in front of one.
//!
//! # Key layout
//!
//! `P` is [`RedisOptions::prefix`] (default `idemq`, no `{`/`}`); `C` and `K`
//! are the consumer and key, *escaped*: `%`, `{`, `}` and `/` become `%25`,
//! `%7B`, `%7D`, `%2F`, so a `}` inside a key cannot end the hash tag early
//! and `C/K` is unambiguous. Everything about one key shares a hash tag, so
//! the scripts touch a single Cluster slot:
//!
//! | key                     | type   | what                                            |
//! |-------------------------|--------|-------------------------------------------------|
//! | `P:{C/K}:rec`           | string | `in-flight:<token>` (PX lease) or `done:{json}` (PX retention) |
//! | `P:{C/K}:fence`         | hash   | `n` (fencing counter), `first_seen` while not done (PX retention) |
//! | `P:{C/K}:att`           | hash   | failed attempts, last error, first/last failure (PX retention) |
//! | `P:{C/K}:fx`            | hash   | the effect journal: step → result JSON, first write wins (PX retention, renewed on each write) |
//! | `P:{c:C}:done`          | zset   | the consumer's done keys by first-seen time (for stats and prune; PX retention, trimmed past it on every commit) |
//! | `P:{c:C}:failing`       | set    | the consumer's keys with counted failures (PX retention) |
//! | `P:consumers`           | set    | consumer names seen (no TTL, one member per consumer) |
//! | `P:{dlq}:seq`           | string | dead-letter id counter (`INCR`)                 |
//! | `P:{dlq}:data`          | hash   | dead-letter id → JSON record                    |
//! | `P:{dlq}:ids`           | zset   | all dead-letter ids                             |
//! | `P:{dlq}:c:C`           | zset   | a consumer's dead-letter ids                    |
//! | `P:{dlq}:k:C/K`         | zset   | a key's dead-letter ids                         |
//!
//! Dead letters have no TTL: they stay until deleted (`idemq dlq`).
//!
//! The per-consumer indexes live in other slots than the key's record, so
//! they are updated right after the record's script, not atomically with it:
//! they serve the admin operations only (stats, prune), never the
//! exactly-once decision. Dead letters all live in the `{dlq}` slot.
//!
//! # Admin operations
//!
//! - `migrate` is a no-op success: Redis needs no schema.
//! - Processed records expire by themselves after the retention TTL.
//!   `prune_batch` additionally deletes done records first seen before the
//!   cutoff, with their effect journal, via the per-consumer index (it counts
//!   index entries handled). A journal whose key never completed expires by
//!   its TTL.
//! - `stats` costs O(consumers) plus, per consumer, a check of the index
//!   entries older than the retention window and of the failing keys (stale
//!   entries whose record expired are removed as found).
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use idemq::{Consumer, KeySpec};
//! use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = RedisStore::connect_with(
//!     "redis://127.0.0.1:6379",
//!     RedisOptions::default().prefix("billing").retention(Duration::from_secs(86_400)),
//! )
//! .await?;
//! let consumer = Consumer::builder("payments", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .lease(Duration::from_secs(10))
//!     .handler_fn(|ctx, lease: &mut RedisLease| Box::pin(async move {
//!         // Pass the fencing number to the downstream write, which refuses
//!         // numbers lower than the highest it has seen for this key.
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
//! [`Store::claim`]: super::Store::claim

mod admin;
mod batch;
mod connection;
mod journal;
mod lease;
mod options;
mod records;
mod scripts;
mod store;
mod unit;

pub use connection::RedisConnection;
pub use lease::RedisLease;
pub use options::{RedisOptions, ReplicaAck};
pub use store::RedisStore;
pub use unit::RedisUnit;

pub(crate) use connection::map_err;
pub(crate) use options::Keys;
pub(crate) use records::{parse_done, record_json};

// The sibling files (and the batch claims, `batch.rs`) reach these
// through `super::`.
use lease::DropRelease;
use records::{attempt_record, decode_dead_letter, done_value, encode_dead_letter};
use scripts::{millis, Scripts, RELEASE};
