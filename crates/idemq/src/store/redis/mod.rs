//! The Redis lease store: claims as leases with fencing, on a single Redis or
//! a Redis Cluster (redis-rs with tokio).
//!
//! # Model
//!
//! Redis does not take part in the handler's transaction, so this is a
//! *lease* store like [`memory`](super::memory), but shared by every process
//! that points at the same Redis:
//!
//! Everything the exactly-once decision needs about a key lives in **one
//! record** (`P:{C/K}:rec`), so the common path — a new key claimed, then
//! completed — is one plain command and one short script on one key: the
//! claim of a key without a record is `SET rec in-flight:… NX GET PX` (Redis
//! 7.0+; it also answers a `done` record as the duplicate), every other
//! claim one script (`GET`, `TIME`, `SET`), the completion one script
//! (`GET`, `SET`); a batch's claims are one pipeline of those `SET`s (plus
//! one script for the keys that had another record) and its completions one
//! script. The protocol is the record
//! lease checked exhaustively by `crates/idemq-model`
//! (`StoreKind::LeaseRecord`, see `docs/proofs.md`):
//!
//! - **claim**: a `done:` record answers [`Claim::Done`]; a lease whose
//!   deadline (judged by the Redis server's clock, `TIME`) has not passed
//!   answers [`Claim::InFlight`]; otherwise — no record, a free one, or a
//!   lease past its deadline, which is taken over — the script writes
//!   `in-flight:<token>:<fence>:<deadline>:<first seen>` (the plain claim
//!   of a key without a record writes the deadline as `~<lease>/<TTL>`,
//!   "a lease from this write", which the scripts read with `PTTL`) and answers
//!   [`Claim::New`] with a [`RedisLease`] carrying the fencing number
//!   ([`RedisLease::fencing_token`]): the record's last number + 1, and at
//!   least the server's clock in milliseconds (so it still rises if the
//!   record was lost or pruned); a key without a record (no earlier holder
//!   to be above) gets the claiming client's clock in milliseconds. The record's own TTL is the retention plus
//!   one lease, so the counter outlives expiries and releases. A downstream
//!   system that remembers the highest number it has seen for a key can
//!   refuse a write from a stale holder.
//! - While the handler runs, a **heartbeat** task moves the deadline every
//!   `lease / 3`, compare-on-token. A lease past its deadline that nobody
//!   has taken over is still its holder's: the heartbeat renews it and the
//!   completion succeeds. It stops when the lease is committed, rolled back
//!   or dropped. A lease dropped while held (its task was aborted
//!   mid-handler) is released at once, like a rollback; a worker that dies
//!   outright leaves it until its deadline, and then another worker takes
//!   over. If the heartbeat finds the record taken by another token, or
//!   cannot reach Redis for a whole lease, it records that:
//!   [`RedisLease::lease_lost`].
//! - **commit** is a compare-and-set (Lua) from this token's lease to
//!   `done:{json}` holding the fingerprint, the optional result, the
//!   first-seen time and the completion time, with the retention TTL (`PX`);
//!   it also clears the key's failed attempts. If the token no longer holds
//!   the key, it is refused with [`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost).
//! - **rollback** turns this token's lease into `free:<fence>:<first seen>`
//!   (compare on the token), so the redelivery can claim the key at once,
//!   with a higher fencing number.
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
//! | `P:{C/K}:rec`           | string | `in-flight:<token>:<fence>:<deadline ms>:<first seen ms>` or `free:<fence>:<first seen ms>` (PX retention + lease), `done:{json}` (PX retention) |
//! | `P:{C/K}:att`           | hash   | failed attempts, last error, first/last failure (PX retention) |
//! | `P:{C/K}:fx`            | hash   | the effect journal: step → result JSON, first write wins (PX retention, renewed on each write) |
//! | `P:{c:C}:done`          | zset   | the consumer's done keys by first-seen time (for stats and prune; PX retention, renewed and trimmed past it about once a second per consumer and process) |
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
mod heartbeat;
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
