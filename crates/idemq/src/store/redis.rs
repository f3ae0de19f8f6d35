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
//!   the key, it is refused with [`StoreError::LeaseLost`].
//! - **rollback** is a compare-and-delete of this token's record, so the
//!   redelivery can claim the key at once.
//! - A waiting claimer (e.g. an engine policy that waits for an in-flight key
//!   instead of rejecting it) simply calls [`Store::claim`] again until it
//!   answers [`Claim::Done`] or [`Claim::New`]: a claim that finds a live
//!   lease changes nothing.
//!
//! Redis errors map to [`StoreError::Transient`] when a retry may help
//! (connection refused/dropped, I/O, timeouts, `LOADING`, `TRYAGAIN`,
//! `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`, `MOVED`/`ASK`) and to
//! [`StoreError::Other`] otherwise. The engine retries transient failures
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

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, RedisError, RedisFuture, Script, ServerErrorKind, Value};

use crate::effect::EffectJournal;

use super::{
    dead_letter_message, now_ms, parse_result, AttemptRecord, Claim, ClaimRequest, ConsumerStats,
    DeadLetter, DeadLetterRecord, InboxRecord, KeyReport, Store, StoreAdmin,
};
use crate::error::StoreError;

#[path = "redis_batch.rs"]
mod batch;
pub use batch::RedisLeaseGroup;

/// Options of a [`RedisStore`] (and of a [`RedisFilter`](super::cache::RedisFilter)).
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// Prefix of every Redis key (default `idemq`; must not contain `{` or `}`).
    pub prefix: String,
    /// How long a done record (and attempt counters) live: the TTL set on
    /// completion. Keep it longer than duplicates can arrive. Default 7 days.
    pub retention: Duration,
    /// Timeout of one connection attempt (default 2 s).
    pub connection_timeout: Duration,
    /// Timeout of one command's response (default 2 s).
    pub response_timeout: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idemq".into(),
            retention: Duration::from_secs(7 * 24 * 3600),
            connection_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
        }
    }
}

impl RedisOptions {
    /// Sets the key prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets the retention TTL of done records.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the connection and response timeouts.
    pub fn timeouts(mut self, connection: Duration, response: Duration) -> Self {
        self.connection_timeout = connection;
        self.response_timeout = response;
        self
    }

    fn validate(&self) -> Result<(), StoreError> {
        if self.prefix.is_empty() || self.prefix.contains(['{', '}']) {
            return Err(StoreError::Config(format!(
                "invalid Redis key prefix {:?}: non-empty, without '{{' or '}}'",
                self.prefix
            )));
        }
        if self.retention.is_zero() {
            return Err(StoreError::Config("Redis retention must be > 0".into()));
        }
        Ok(())
    }
}

/// A connection to a single Redis (auto-reconnecting `ConnectionManager`) or
/// to a Redis Cluster; cheap to clone, shared by the clones.
#[derive(Clone)]
pub struct RedisConnection(Conn);

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Conn::Single(_) => "RedisConnection::Single",
            Conn::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl RedisConnection {
    /// Connects to one Redis at `url` (`redis://[user:pass@]host:port[/db]`).
    /// The connection reconnects by itself after an outage.
    pub async fn connect(url: &str, options: &RedisOptions) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Config(format!("bad Redis URL {url:?}: {e}")))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.connection_timeout))
            .set_response_timeout(Some(options.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(map_err)?;
        Ok(Self(Conn::Single(manager)))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port`).
    pub async fn connect_cluster(
        nodes: &[&str],
        options: &RedisOptions,
    ) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClient::builder(nodes.iter().copied())
            .connection_timeout(options.connection_timeout)
            .response_timeout(options.response_timeout)
            .build()
            .map_err(|e| StoreError::Config(format!("bad Redis Cluster nodes: {e}")))?;
        let conn = client.get_async_connection().await.map_err(map_err)?;
        Ok(Self(Conn::Cluster(conn)))
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Maps a Redis error to a store error: transient when a retry may help.
pub(crate) fn map_err(e: RedisError) -> StoreError {
    let transient = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                )
        );
    if transient {
        StoreError::Transient(format!("redis: {e}"))
    } else {
        StoreError::Other(format!("redis: {e}"))
    }
}

/// Escapes a name for use inside a hash tag: `%`, `{`, `}`, `/` percent-encoded.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// Key names (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    prefix: String,
}

impl Keys {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
        }
    }

    /// `P:{C/K}:suffix`.
    pub(crate) fn scoped(&self, consumer: &str, key: &str, suffix: &str) -> String {
        format!(
            "{}:{{{}/{}}}:{suffix}",
            self.prefix,
            escape(consumer),
            escape(key)
        )
    }

    fn consumer(&self, consumer: &str, suffix: &str) -> String {
        format!("{}:{{c:{}}}:{suffix}", self.prefix, escape(consumer))
    }

    fn consumers(&self) -> String {
        format!("{}:consumers", self.prefix)
    }

    fn dlq(&self, suffix: &str) -> String {
        format!("{}:{{dlq}}:{suffix}", self.prefix)
    }

    fn dlq_consumer(&self, consumer: &str) -> String {
        self.dlq(&format!("c:{}", escape(consumer)))
    }

    fn dlq_key(&self, consumer: &str, key: &str) -> String {
        self.dlq(&format!("k:{}/{}", escape(consumer), escape(key)))
    }
}

const CLAIM: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then
  if string.sub(v, 1, 5) == 'done:' then return {'done', string.sub(v, 6)} end
  return {'busy'}
end
redis.call('SET', KEYS[1], 'in-flight:' .. ARGV[1], 'NX', 'PX', ARGV[2])
local n = redis.call('HINCRBY', KEYS[2], 'n', 1)
redis.call('HSETNX', KEYS[2], 'first_seen', ARGV[3])
local fs = redis.call('HGET', KEYS[2], 'first_seen')
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {'new', tostring(n), fs}
"#;

const EXTEND: &str = r#"
if redis.call('GET', KEYS[1]) == 'in-flight:' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"#;

const COMPLETE: &str = r#"
if redis.call('GET', KEYS[1]) ~= 'in-flight:' .. ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HDEL', KEYS[2], 'first_seen')
redis.call('DEL', KEYS[3])
return 1
"#;

const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == 'in-flight:' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

const FAIL: &str = r#"
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'last_error', ARGV[1], 'last_failed', ARGV[2])
redis.call('HSETNX', KEYS[1], 'first_failed', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return n
"#;

/// KEYS: seq, data, ids, consumer's ids, letters (letter id → id),
/// letter_of (id → letter id)[, key's ids]; ARGV: the letter's JSON, its
/// letter id. A letter id stored already returns the stored id and writes
/// nothing (one letter per dead-lettered message).
const DEAD_LETTER: &str = r#"
local seen = redis.call('HGET', KEYS[5], ARGV[2])
if seen then return tonumber(seen) end
local id = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], id, ARGV[1])
redis.call('ZADD', KEYS[3], id, id)
redis.call('ZADD', KEYS[4], id, id)
redis.call('HSET', KEYS[5], ARGV[2], id)
redis.call('HSET', KEYS[6], id, ARGV[2])
if KEYS[7] then redis.call('ZADD', KEYS[7], id, id) end
return id
"#;

/// KEYS: data, ids, consumer's ids, letters, letter_of[, key's ids]; ARGV: id.
const DELETE_DEAD_LETTER: &str = r#"
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local letter = redis.call('HGET', KEYS[5], ARGV[1])
if letter then
  redis.call('HDEL', KEYS[4], letter)
  redis.call('HDEL', KEYS[5], ARGV[1])
end
if KEYS[6] then redis.call('ZREM', KEYS[6], ARGV[1]) end
return 1
"#;

const FORCE_RELEASE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 10) == 'in-flight:' then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"#;

const PRUNE: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 5) == 'done:' then
  redis.call('DEL', KEYS[1])
  if KEYS[2] then redis.call('DEL', KEYS[2]) end
  return 1
end
return 0
"#;

const EFFECT_PUT: &str = r#"
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('HGET', KEYS[1], ARGV[1])
"#;

#[derive(Debug)]
struct Scripts {
    claim: Script,
    extend: Script,
    complete: Script,
    release: Script,
    fail: Script,
    dead_letter: Script,
    delete_dead_letter: Script,
    prune: Script,
    force_release: Script,
    effect_put: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(CLAIM),
            extend: Script::new(EXTEND),
            complete: Script::new(COMPLETE),
            release: Script::new(RELEASE),
            fail: Script::new(FAIL),
            dead_letter: Script::new(DEAD_LETTER),
            delete_dead_letter: Script::new(DELETE_DEAD_LETTER),
            prune: Script::new(PRUNE),
            force_release: Script::new(FORCE_RELEASE),
            effect_put: Script::new(EFFECT_PUT),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A held lease on a key: what a handler gets from the Redis store.
///
/// Dropping it stops its heartbeat (the lease then expires by itself unless
/// it was committed or rolled back).
#[derive(Debug)]
pub struct RedisLease {
    consumer: String,
    key: String,
    token: String,
    fencing: u64,
    first_seen_ms: i64,
    lost: Arc<AtomicBool>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    release_on_drop: Option<DropRelease>,
}

/// What a lease dropped without commit or rollback needs to release itself.
struct DropRelease {
    conn: RedisConnection,
    scripts: Arc<Scripts>,
    rec: String,
    token: String,
}

impl std::fmt::Debug for DropRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DropRelease")
            .field("rec", &self.rec)
            .finish()
    }
}

impl DropRelease {
    /// Releases the key in the background (compare-and-delete on the token).
    /// The future is polled once right here, so the command is queued on the
    /// connection before anything sent after the drop (e.g. the redelivery's
    /// claim); a spawned task finishes it.
    fn fire(self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the lease expires by itself
        };
        let mut fut = Box::pin(async move {
            let DropRelease {
                mut conn,
                scripts,
                rec,
                token,
            } = self;
            let r: Result<i64, RedisError> = scripts
                .release
                .key(&rec)
                .arg(&token)
                .invoke_async(&mut conn)
                .await;
            if let Err(e) = r {
                tracing::warn!(key = %rec, error = %e, "releasing a dropped lease failed; it will expire");
            }
        });
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        if fut.as_mut().poll(&mut cx).is_pending() {
            runtime.spawn(fut);
        }
    }
}

impl RedisLease {
    /// The key's fencing number: it rises with every acquisition of this key
    /// (per consumer), so a downstream system can refuse writes carrying a
    /// lower number than one it has already seen for the key.
    pub fn fencing_token(&self) -> u64 {
        self.fencing
    }

    /// Whether the heartbeat found the lease taken over (or could not renew
    /// it for a whole lease period): the completion will then be refused.
    pub fn lease_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The business key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stops the heartbeat and disarms the release on drop (commit and
    /// rollback take care of the record themselves).
    fn stop_heartbeat(&mut self) {
        self.release_on_drop = None;
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }
}

impl Drop for RedisLease {
    /// A lease dropped while held (its handler was cancelled, e.g. the task
    /// was aborted) stops its heartbeat and releases the key at once, like a
    /// rollback, so the redelivery need not wait for the lease to expire.
    fn drop(&mut self) {
        let release = self.release_on_drop.take();
        self.stop_heartbeat();
        if let Some(release) = release {
            release.fire();
        }
    }
}

/// The Redis lease store (see the module docs). Cloning shares the connection.
#[derive(Debug, Clone)]
pub struct RedisStore {
    conn: RedisConnection,
    keys: Keys,
    options: RedisOptions,
    scripts: Arc<Scripts>,
}

impl RedisStore {
    /// Connects to one Redis with default options.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, RedisOptions::default()).await
    }

    /// Connects to one Redis with `options`.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<Self, StoreError> {
        options.validate()?;
        let conn = RedisConnection::connect(url, &options).await?;
        Ok(Self::with_connection(conn, options))
    }

    /// Connects to a Redis Cluster through any of its `nodes`.
    pub async fn connect_cluster(
        nodes: &[&str],
        options: RedisOptions,
    ) -> Result<Self, StoreError> {
        options.validate()?;
        let conn = RedisConnection::connect_cluster(nodes, &options).await?;
        Ok(Self::with_connection(conn, options))
    }

    /// A store over an existing connection (e.g. shared with a
    /// [`RedisFilter`](super::cache::RedisFilter)). `options.prefix` is
    /// used as given; an invalid prefix fails on first use of the bad keys
    /// only in that it breaks the Cluster slot layout, so prefer the
    /// `connect*` constructors, which validate it.
    pub fn with_connection(conn: RedisConnection, options: RedisOptions) -> Self {
        Self {
            conn,
            keys: Keys::new(&options.prefix),
            options,
            scripts: Arc::new(Scripts::new()),
        }
    }

    /// The connection (to share it).
    pub fn connection(&self) -> &RedisConnection {
        &self.conn
    }

    /// The options.
    pub fn options(&self) -> &RedisOptions {
        &self.options
    }

    fn conn(&self) -> RedisConnection {
        self.conn.clone()
    }

    fn start_heartbeat(
        &self,
        consumer: &str,
        key: &str,
        token: &str,
        lease: Duration,
        lost: Arc<AtomicBool>,
    ) -> tokio::task::JoinHandle<()> {
        let mut conn = self.conn();
        let scripts = Arc::clone(&self.scripts);
        let rec = self.keys.scoped(consumer, key, "rec");
        let token = token.to_owned();
        let key = key.to_owned();
        let every = (lease / 3).max(Duration::from_millis(1));
        let lease_ms = millis(lease);
        tokio::spawn(async move {
            let mut last_ok = Instant::now();
            loop {
                tokio::time::sleep(every).await;
                let r: Result<i64, RedisError> = scripts
                    .extend
                    .key(&rec)
                    .arg(&token)
                    .arg(lease_ms)
                    .invoke_async(&mut conn)
                    .await;
                match r {
                    Ok(1) => last_ok = Instant::now(),
                    Ok(_) => {
                        tracing::warn!(key = %key, "lease lost: the key is held by another token");
                        lost.store(true, Ordering::SeqCst);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "lease heartbeat failed");
                        if last_ok.elapsed() >= lease {
                            lost.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            }
        })
    }

    /// Best-effort update of an admin index; failures are logged.
    async fn index(&self, what: &str, pipe: &redis::Pipeline) {
        let r: Result<(), RedisError> = pipe.query_async(&mut self.conn()).await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "updating the Redis {what} index failed");
        }
    }

    /// `SADD`s `member` to `set` and renews the set's TTL to the retention.
    async fn add_to_set(&self, what: &str, set: &str, member: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD").arg(set).arg(member).ignore();
        pipe.cmd("PEXPIRE")
            .arg(set)
            .arg(millis(self.options.retention))
            .ignore();
        self.index(what, &pipe).await;
    }

    /// Lists a consumer name (the set has no TTL: one member per consumer).
    async fn add_consumer(&self, consumer: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD")
            .arg(self.keys.consumers())
            .arg(consumer)
            .ignore();
        self.index("consumers", &pipe).await;
    }

    async fn remove_from_set(&self, what: &str, set: &str, member: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SREM").arg(set).arg(member).ignore();
        self.index(what, &pipe).await;
    }

    fn retention_horizon(&self) -> i64 {
        now_ms()
            .saturating_sub(i64::try_from(self.options.retention.as_millis()).unwrap_or(i64::MAX))
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        cmd.query_async(&mut self.conn()).await.map_err(map_err)
    }

    async fn read_dead_letters(&self, ids: &[i64]) -> Result<Vec<DeadLetterRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.keys.dlq("data")).arg(ids);
        let values: Vec<Option<String>> = self.query(&cmd).await?;
        Ok(ids
            .iter()
            .zip(values)
            .filter_map(|(id, v)| v.and_then(|v| decode_dead_letter(*id, &v)))
            .collect())
    }

    async fn dead_letter_ids(
        &self,
        zset: &str,
        after_id: i64,
        limit: Option<u32>,
    ) -> Result<Vec<i64>, StoreError> {
        let mut cmd = redis::cmd("ZRANGEBYSCORE");
        cmd.arg(zset).arg(format!("({after_id}")).arg("+inf");
        if let Some(limit) = limit {
            cmd.arg("LIMIT").arg(0).arg(limit);
        }
        self.query(&cmd).await
    }

    /// Removes index entries whose record is gone; returns the members kept.
    async fn drop_stale(
        &self,
        index: &str,
        members: Vec<String>,
        consumer: &str,
        suffix: &str,
        zset: bool,
    ) -> Result<usize, StoreError> {
        let mut kept = 0;
        for member in members {
            let mut exists = redis::cmd("EXISTS");
            exists.arg(self.keys.scoped(consumer, &member, suffix));
            let n: i64 = self.query(&exists).await?;
            if n > 0 {
                kept += 1;
            } else {
                let mut rm = redis::cmd(if zset { "ZREM" } else { "SREM" });
                rm.arg(index).arg(&member);
                let _: i64 = self.query(&rm).await?;
            }
        }
        Ok(kept)
    }
}

fn done_value(fingerprint: &str, result: Option<&serde_json::Value>, first_seen_ms: i64) -> String {
    let json = serde_json::json!({
        "fp": fingerprint,
        "result": result.map(serde_json::Value::to_string),
        "first_seen": first_seen_ms,
        "done_ms": now_ms(),
    });
    format!("done:{json}")
}

/// Parses the JSON of a `done:` record (also used by the cache's Redis filter).
pub(crate) fn parse_done(consumer: &str, key: &str, json: &str) -> Option<InboxRecord> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    Some(InboxRecord {
        consumer: consumer.to_owned(),
        key: key.to_owned(),
        fingerprint: v["fp"].as_str()?.to_owned(),
        result: parse_result(v["result"].as_str().map(str::to_owned)),
        first_seen_ms: v["first_seen"].as_i64().unwrap_or(0),
    })
}

/// The JSON of a `done:` record for `record` (also used by the cache's Redis filter).
pub(crate) fn record_json(record: &InboxRecord) -> String {
    serde_json::json!({
        "fp": record.fingerprint,
        "result": record.result.as_ref().map(serde_json::Value::to_string),
        "first_seen": record.first_seen_ms,
        "done_ms": now_ms(),
    })
    .to_string()
}

fn encode_dead_letter(letter: &DeadLetter<'_>) -> String {
    serde_json::json!({
        "consumer": letter.consumer,
        "key": letter.key,
        "reason": letter.reason.code(),
        "error": letter.error,
        "message_id": letter.message.id,
        "transport_key": letter.message.key,
        "headers": letter.message.headers.to_json().to_string(),
        "payload": hex::encode(&letter.message.payload),
        "source": letter.meta.source,
        "topic": letter.meta.topic,
        "partition": letter.meta.partition,
        "offset": letter.meta.offset,
        "delivery_count": letter.meta.delivery_count,
        "attempts": letter.attempts,
        "created_ms": now_ms(),
    })
    .to_string()
}

fn decode_dead_letter(id: i64, json: &str) -> Option<DeadLetterRecord> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let s = |name: &str| v[name].as_str().map(str::to_owned);
    let (message, meta) = dead_letter_message(
        s("message_id"),
        s("transport_key"),
        s("headers"),
        hex::decode(v["payload"].as_str().unwrap_or_default()).ok()?,
        s("source").unwrap_or_default(),
        s("topic"),
        v["partition"].as_i64().and_then(|p| i32::try_from(p).ok()),
        v["offset"].as_i64(),
        v["delivery_count"].as_i64().unwrap_or(1),
    );
    Some(DeadLetterRecord {
        id,
        consumer: s("consumer")?,
        key: s("key"),
        reason: s("reason").unwrap_or_default(),
        error: s("error").unwrap_or_default(),
        message,
        meta,
        attempts: v["attempts"]
            .as_u64()
            .and_then(|a| u32::try_from(a).ok())
            .unwrap_or(0),
        created_ms: v["created_ms"].as_i64().unwrap_or(0),
    })
}

fn attempt_record(map: &HashMap<String, String>) -> Option<AttemptRecord> {
    let num = |name: &str| map.get(name).and_then(|v| v.parse::<i64>().ok());
    Some(AttemptRecord {
        attempts: u32::try_from(num("attempts")?).unwrap_or(u32::MAX),
        last_error: map.get("last_error").cloned().unwrap_or_default(),
        first_failed_ms: num("first_failed").unwrap_or(0),
        last_failed_ms: num("last_failed").unwrap_or(0),
    })
}

#[async_trait]
impl Store for RedisStore {
    type Tx = RedisLease;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<RedisLease>, StoreError> {
        let token = uuid::Uuid::new_v4().simple().to_string();
        let reply: Vec<String> = self
            .scripts
            .claim
            .key(self.keys.scoped(req.consumer, req.key, "rec"))
            .key(self.keys.scoped(req.consumer, req.key, "fence"))
            .arg(&token)
            .arg(millis(req.lease))
            .arg(now_ms())
            .arg(millis(self.options.retention + req.lease))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        match reply.first().map(String::as_str) {
            Some("done") => {
                let json = reply.get(1).map(String::as_str).unwrap_or_default();
                parse_done(req.consumer, req.key, json)
                    .map(Claim::Done)
                    .ok_or_else(|| StoreError::Other(format!("unreadable done record: {json}")))
            }
            Some("busy") => Ok(Claim::InFlight),
            Some("new") => {
                let fencing = reply.get(1).and_then(|n| n.parse().ok()).unwrap_or(0);
                let first_seen_ms = reply
                    .get(2)
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(now_ms);
                let lost = Arc::new(AtomicBool::new(false));
                let heartbeat =
                    self.start_heartbeat(req.consumer, req.key, &token, req.lease, lost.clone());
                Ok(Claim::New(RedisLease {
                    consumer: req.consumer.to_owned(),
                    key: req.key.to_owned(),
                    fencing,
                    first_seen_ms,
                    lost,
                    heartbeat: Some(heartbeat),
                    release_on_drop: Some(DropRelease {
                        conn: self.conn(),
                        scripts: Arc::clone(&self.scripts),
                        rec: self.keys.scoped(req.consumer, req.key, "rec"),
                        token: token.clone(),
                    }),
                    token,
                }))
            }
            _ => Err(StoreError::Other(format!(
                "unexpected claim reply {reply:?}"
            ))),
        }
    }

    async fn commit(
        &self,
        mut lease: RedisLease,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        lease.stop_heartbeat();
        let (c, k) = (lease.consumer.as_str(), lease.key.as_str());
        let done: i64 = self
            .scripts
            .complete
            .key(self.keys.scoped(c, k, "rec"))
            .key(self.keys.scoped(c, k, "fence"))
            .key(self.keys.scoped(c, k, "att"))
            .arg(&lease.token)
            .arg(done_value(req.fingerprint, result, lease.first_seen_ms))
            .arg(millis(self.options.retention))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        if done != 1 {
            lease.lost.store(true, Ordering::SeqCst);
            return Err(StoreError::LeaseLost {
                key: lease.key.clone(),
            });
        }
        // The consumer's index: add the key, renew the TTL, trim entries
        // first seen before the retention window (their records are expired
        // or about to).
        let done_index = self.keys.consumer(c, "done");
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD")
            .arg(&done_index)
            .arg(lease.first_seen_ms)
            .arg(k)
            .ignore();
        pipe.cmd("PEXPIRE")
            .arg(&done_index)
            .arg(millis(self.options.retention))
            .ignore();
        pipe.cmd("ZREMRANGEBYSCORE")
            .arg(&done_index)
            .arg("-inf")
            .arg(format!("({}", self.retention_horizon()))
            .ignore();
        self.index("done", &pipe).await;
        self.remove_from_set("failing", &self.keys.consumer(c, "failing"), k)
            .await;
        self.add_consumer(c).await;
        Ok(())
    }

    async fn rollback(&self, mut lease: RedisLease) -> Result<(), StoreError> {
        lease.stop_heartbeat();
        let _: i64 = self
            .scripts
            .release
            .key(self.keys.scoped(&lease.consumer, &lease.key, "rec"))
            .arg(&lease.token)
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError> {
        let n: i64 = self
            .scripts
            .fail
            .key(self.keys.scoped(consumer, key, "att"))
            .arg(error)
            .arg(now_ms())
            .arg(millis(self.options.retention))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        self.add_to_set("failing", &self.keys.consumer(consumer, "failing"), key)
            .await;
        self.add_consumer(consumer).await;
        Ok(u32::try_from(n).unwrap_or(u32::MAX))
    }

    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError> {
        let json = encode_dead_letter(letter);
        let mut invocation = self.scripts.dead_letter.prepare_invoke();
        invocation
            .key(self.keys.dlq("seq"))
            .key(self.keys.dlq("data"))
            .key(self.keys.dlq("ids"))
            .key(self.keys.dlq_consumer(letter.consumer))
            .key(self.keys.dlq("letters"))
            .key(self.keys.dlq("letter_of"));
        if let Some(key) = letter.key {
            invocation.key(self.keys.dlq_key(letter.consumer, key));
        }
        let _id: i64 = invocation
            .arg(json)
            .arg(letter.letter_id())
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        self.add_consumer(letter.consumer).await;
        if let Some(key) = letter.key {
            let mut del = redis::cmd("DEL");
            del.arg(self.keys.scoped(letter.consumer, key, "att"));
            let _: i64 = self.query(&del).await?;
            self.remove_from_set(
                "failing",
                &self.keys.consumer(letter.consumer, "failing"),
                key,
            )
            .await;
        }
        Ok(())
    }

    fn journal(&self) -> Option<&dyn EffectJournal> {
        Some(self)
    }
}

/// The journal of a key is the hash `P:{C/K}:fx` (step → result JSON), in
/// the key's slot, with the retention TTL renewed on every write.
#[async_trait]
impl EffectJournal for RedisStore {
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let text: Option<String> = self
            .query(
                redis::cmd("HGET")
                    .arg(self.keys.scoped(consumer, key, "fx"))
                    .arg(step),
            )
            .await?;
        Ok(parse_result(text))
    }

    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError> {
        let text: Option<String> = self
            .scripts
            .effect_put
            .key(self.keys.scoped(consumer, key, "fx"))
            .arg(step)
            .arg(result.to_string())
            .arg(millis(self.options.retention))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        parse_result(text).ok_or_else(|| {
            StoreError::Transient(format!(
                "effect {step:?} of key {key:?}: the journal entry vanished after writing it"
            ))
        })
    }

    async fn steps(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let entries: Vec<(String, String)> = self
            .query(redis::cmd("HGETALL").arg(self.keys.scoped(consumer, key, "fx")))
            .await?;
        let mut steps: Vec<(String, serde_json::Value)> = entries
            .into_iter()
            .map(|(step, text)| (step, parse_result(Some(text)).unwrap_or_default()))
            .collect();
        steps.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(steps)
    }
}

#[async_trait]
impl StoreAdmin for RedisStore {
    /// Redis needs no schema: a no-op success.
    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Deletes done records first seen before `cutoff_ms`, found through the
    /// per-consumer index (records also expire by their retention TTL);
    /// returns how many index entries were handled, at most `batch`.
    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let mut consumers: Vec<String> = self
            .query(redis::cmd("SMEMBERS").arg(self.keys.consumers()))
            .await?;
        consumers.sort();
        let mut handled: u64 = 0;
        for consumer in consumers {
            let left = u64::from(batch).saturating_sub(handled);
            if left == 0 {
                break;
            }
            let index = self.keys.consumer(&consumer, "done");
            let members: Vec<String> = self
                .query(
                    redis::cmd("ZRANGEBYSCORE")
                        .arg(&index)
                        .arg("-inf")
                        .arg(format!("({cutoff_ms}"))
                        .arg("LIMIT")
                        .arg(0)
                        .arg(left),
                )
                .await?;
            for member in members {
                let _: i64 = self
                    .scripts
                    .prune
                    .key(self.keys.scoped(&consumer, &member, "rec"))
                    .key(self.keys.scoped(&consumer, &member, "fx"))
                    .invoke_async(&mut self.conn())
                    .await
                    .map_err(map_err)?;
                let _: i64 = self
                    .query(redis::cmd("ZREM").arg(&index).arg(&member))
                    .await?;
                handled += 1;
            }
        }
        Ok(handled)
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let rec: Option<String> = self
            .query(redis::cmd("GET").arg(self.keys.scoped(consumer, key, "rec")))
            .await?;
        let (inbox, in_flight) = match rec.as_deref() {
            Some(v) if v.starts_with("done:") => (parse_done(consumer, key, &v[5..]), false),
            Some(_) => (None, true),
            None => (None, false),
        };
        let att: HashMap<String, String> = self
            .query(redis::cmd("HGETALL").arg(self.keys.scoped(consumer, key, "att")))
            .await?;
        let ids = self
            .dead_letter_ids(&self.keys.dlq_key(consumer, key), 0, None)
            .await?;
        Ok(KeyReport {
            inbox,
            in_flight,
            attempts: attempt_record(&att),
            dead_letters: self.read_dead_letters(&ids).await?,
        })
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        let mut consumers: Vec<String> = self
            .query(redis::cmd("SMEMBERS").arg(self.keys.consumers()))
            .await?;
        consumers.sort();
        let horizon = now_ms()
            .saturating_sub(i64::try_from(self.options.retention.as_millis()).unwrap_or(i64::MAX));
        let mut out = Vec::new();
        for consumer in consumers {
            let done = self.keys.consumer(&consumer, "done");
            // Entries older than the retention window may have expired.
            let old: Vec<String> = self
                .query(
                    redis::cmd("ZRANGEBYSCORE")
                        .arg(&done)
                        .arg("-inf")
                        .arg(format!("({horizon}")),
                )
                .await?;
            self.drop_stale(&done, old, &consumer, "rec", true).await?;
            let processed: u64 = self.query(redis::cmd("ZCARD").arg(&done)).await?;
            let first: Vec<(String, f64)> = self
                .query(
                    redis::cmd("ZRANGE")
                        .arg(&done)
                        .arg(0)
                        .arg(0)
                        .arg("WITHSCORES"),
                )
                .await?;
            let last: Vec<(String, f64)> = self
                .query(
                    redis::cmd("ZRANGE")
                        .arg(&done)
                        .arg(-1)
                        .arg(-1)
                        .arg("WITHSCORES"),
                )
                .await?;
            let failing_key = self.keys.consumer(&consumer, "failing");
            let failing: Vec<String> = self.query(redis::cmd("SMEMBERS").arg(&failing_key)).await?;
            let failing = self
                .drop_stale(&failing_key, failing, &consumer, "att", false)
                .await? as u64;
            let dead_letters: u64 = self
                .query(redis::cmd("ZCARD").arg(self.keys.dlq_consumer(&consumer)))
                .await?;
            if processed == 0 && failing == 0 && dead_letters == 0 {
                continue;
            }
            out.push(ConsumerStats {
                consumer,
                processed,
                oldest_ms: first.first().map(|(_, s)| *s as i64),
                newest_ms: last.first().map(|(_, s)| *s as i64),
                dead_letters,
                failing,
            });
        }
        Ok(out)
    }

    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let zset = match consumer {
            Some(c) => self.keys.dlq_consumer(c),
            None => self.keys.dlq("ids"),
        };
        let ids = self.dead_letter_ids(&zset, after_id, Some(limit)).await?;
        self.read_dead_letters(&ids).await
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let Some(record) = self.read_dead_letters(&[id]).await?.pop() else {
            return Ok(false);
        };
        let mut invocation = self.scripts.delete_dead_letter.prepare_invoke();
        invocation
            .key(self.keys.dlq("data"))
            .key(self.keys.dlq("ids"))
            .key(self.keys.dlq_consumer(&record.consumer))
            .key(self.keys.dlq("letters"))
            .key(self.keys.dlq("letter_of"));
        if let Some(key) = &record.key {
            invocation.key(self.keys.dlq_key(&record.consumer, key));
        }
        let n: i64 = invocation
            .arg(id)
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(n == 1)
    }

    /// Deletes the key's record if it is in flight (whatever its token), so
    /// the next claim takes the key at once; the old holder's completion is
    /// then refused ([`StoreError::LeaseLost`]) and its heartbeat reports
    /// the loss.
    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .force_release
            .key(self.keys.scoped(consumer, key, "rec"))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_keeps_the_hash_tag_whole_and_is_reversible() {
        let keys = Keys::new("p");
        let k = keys.scoped("c", "a}b{c/d%7D", "rec");
        assert_eq!(k, "p:{c/a%7Db%7Bc%2Fd%257D}:rec");
        let tag = &k[k.find('{').unwrap() + 1..k.find('}').unwrap()];
        assert_eq!(tag, "c/a%7Db%7Bc%2Fd%257D");
        assert_ne!(
            keys.scoped("c/x", "y", "rec"),
            keys.scoped("c", "x/y", "rec")
        );
    }
}
