//! The lease store itself ([`RedisStore`]): connecting, and the [`Store`]
//! side: claim, commit, rollback, failures and dead letters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redis::{Cmd, RedisError};

use super::heartbeat::Heartbeats;
use super::{
    done_value, encode_dead_letter, map_err, millis, parse_done, DropRelease, Keys,
    RedisConnection, RedisLease, RedisOptions, Scripts,
};
use crate::effect::EffectJournal;
use crate::error::{StoreError, StoreErrorKind};
use crate::store::{now_ms, Claim, ClaimRequest, DeadLetter, Store};

/// The Redis lease store (see the module docs). Cloning shares the connection.
#[derive(Debug, Clone)]
pub struct RedisStore {
    pub(super) conn: RedisConnection,
    pub(super) keys: Keys,
    pub(super) options: RedisOptions,
    pub(super) scripts: Arc<Scripts>,
    pub(super) tokens: Arc<Tokens>,
    /// The heartbeat of the per-message leases.
    pub(super) heartbeats: Arc<Heartbeats>,
    /// When each consumer's done index was last renewed and trimmed.
    maintained: Arc<Mutex<HashMap<String, Instant>>>,
    /// Whether claims try the plain `SET … NX GET` first (off on a Redis
    /// before 7.0).
    plain_claims: Arc<AtomicBool>,
}

/// How often a consumer's done index is renewed and trimmed (and the
/// consumer listed in the set of consumers), at most.
const INDEX_MAINTENANCE_EVERY: Duration = Duration::from_secs(1);

/// Lease tokens: a random base per store and a counter, unique across
/// processes without drawing a random number per claim.
#[derive(Debug)]
pub(super) struct Tokens {
    base: String,
    next: AtomicU64,
}

impl Tokens {
    fn new() -> Self {
        let mut base = uuid::Uuid::new_v4().simple().to_string();
        base.truncate(16);
        Self {
            base,
            next: AtomicU64::new(0),
        }
    }

    /// A token no other claim of any process holds (no `:` in it).
    pub(super) fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{}{n:x}", self.base)
    }
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
    /// [`RedisFilter`](crate::store::cache::RedisFilter)). `options.prefix` is
    /// used as given; an invalid prefix fails on first use of the bad keys
    /// only in that it breaks the Cluster slot layout, so prefer the
    /// `connect*` constructors, which validate it.
    pub fn with_connection(conn: RedisConnection, options: RedisOptions) -> Self {
        let scripts = Arc::new(Scripts::new());
        Self {
            heartbeats: Heartbeats::new(conn.clone(), Arc::clone(&scripts)),
            conn,
            keys: Keys::new(&options.prefix),
            options,
            scripts,
            tokens: Arc::new(Tokens::new()),
            maintained: Arc::default(),
            plain_claims: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Whether `consumer`'s done index is due for its TTL renewal and
    /// trimming (about once a second per consumer); marks it done if so.
    pub(super) fn index_maintenance_due(&self, consumer: &str) -> bool {
        let mut maintained = crate::sync::lock(&self.maintained);
        let now = Instant::now();
        match maintained.get_mut(consumer) {
            Some(last) if now.duration_since(*last) < INDEX_MAINTENANCE_EVERY => false,
            Some(last) => {
                *last = now;
                true
            }
            None => {
                maintained.insert(consumer.to_owned(), now);
                true
            }
        }
    }

    /// The TTL of a key's record while it is not done: the retention plus
    /// one lease, so the fencing counter outlives expiries and releases.
    pub(super) fn record_ttl(&self, lease: Duration) -> u64 {
        millis(self.options.retention + lease)
    }

    /// The connection (to share it).
    pub fn connection(&self) -> &RedisConnection {
        &self.conn
    }

    /// The options.
    pub fn options(&self) -> &RedisOptions {
        &self.options
    }

    pub(super) fn conn(&self) -> RedisConnection {
        self.conn.clone()
    }

    /// Best-effort update of an admin index; failures are logged.
    pub(super) async fn index(&self, what: &str, pipe: &redis::Pipeline) {
        let r: Result<(), RedisError> = pipe.query_async(&mut self.conn()).await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "updating the Redis {what} index failed");
        }
    }

    /// Updates the admin indexes of `consumer`'s newly completed `keys`
    /// (each with its first-seen time), best effort: the keys into the
    /// consumer's done index (its TTL renewed to `retention`, entries first
    /// seen before the retention window trimmed: their records are expired
    /// or about to), out of its failing set, and the consumer into the set
    /// of consumers. On one Redis that is one pipeline, one round trip beyond
    /// a batch's completion (a single completion writes them in its own
    /// script, `COMPLETE_INDEXED`); on a Redis Cluster the consumer's own
    /// keys (one slot) and the set of consumers (another) go at once.
    pub(super) async fn index_completed(
        &self,
        consumer: &str,
        keys: &[(i64, &str)],
        retention: Duration,
    ) {
        let done_index = self.keys.consumer(consumer, "done");
        let mut pipe = redis::pipe();
        let zadd = pipe.cmd("ZADD").arg(&done_index);
        for (first_seen_ms, key) in keys {
            zadd.arg(*first_seen_ms).arg(*key);
        }
        zadd.ignore();
        let maintain = self.index_maintenance_due(consumer);
        if maintain {
            pipe.cmd("PEXPIRE")
                .arg(&done_index)
                .arg(millis(retention))
                .ignore();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(&done_index)
                .arg("-inf")
                .arg(format!("({}", self.retention_horizon()))
                .ignore();
        }
        let srem = pipe
            .cmd("SREM")
            .arg(self.keys.consumer(consumer, "failing"));
        for (_, key) in keys {
            srem.arg(*key);
        }
        srem.ignore();
        if !maintain {
            self.index("done", &pipe).await;
        } else if !self.conn.is_single() {
            futures_util::future::join(self.index("done", &pipe), self.add_consumer(consumer))
                .await;
        } else {
            pipe.cmd("SADD")
                .arg(self.keys.consumers())
                .arg(consumer)
                .ignore();
            self.index("done", &pipe).await;
        }
    }

    /// `SADD`s `member` to `set` and renews the set's TTL to the retention.
    pub(super) async fn add_to_set(&self, what: &str, set: &str, member: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD").arg(set).arg(member).ignore();
        pipe.cmd("PEXPIRE")
            .arg(set)
            .arg(millis(self.options.retention))
            .ignore();
        self.index(what, &pipe).await;
    }

    /// Lists a consumer name (the set has no TTL: one member per consumer).
    pub(super) async fn add_consumer(&self, consumer: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SADD")
            .arg(self.keys.consumers())
            .arg(consumer)
            .ignore();
        self.index("consumers", &pipe).await;
    }

    pub(super) async fn remove_from_set(&self, what: &str, set: &str, member: &str) {
        let mut pipe = redis::pipe();
        pipe.cmd("SREM").arg(set).arg(member).ignore();
        self.index(what, &pipe).await;
    }

    pub(super) fn retention_horizon(&self) -> i64 {
        now_ms()
            .saturating_sub(i64::try_from(self.options.retention.as_millis()).unwrap_or(i64::MAX))
    }

    /// With [`RedisOptions::wait_for_replicas`], waits for the replicas of
    /// the master holding `consumer`/`key` (any key of the batch on a single
    /// Redis); without, answers at once.
    pub(super) async fn wait_for_replicas(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        match &self.options.replica_ack {
            Some(ack) => {
                let rec = self.keys.scoped(consumer, key, "rec");
                self.conn.wait_for_replicas(Some(&rec), ack).await
            }
            None => Ok(()),
        }
    }

    pub(super) async fn query<T: redis::FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        cmd.query_async(&mut self.conn()).await.map_err(map_err)
    }
}

/// The plain claim of `rec` for `token` at the client's `now_ms`: `SET rec
/// in-flight:<token>:<now>:~<lease>/<ttl>:<now> NX GET PX <ttl>` (see
/// [`RedisStore::claim`]'s plain path and the scripts' record layout).
pub(super) fn plain_claim(rec: &str, token: &str, now_ms: i64, lease_ms: u64, ttl_ms: u64) -> Cmd {
    let mut set = redis::cmd("SET");
    set.arg(rec)
        .arg(format!(
            "in-flight:{token}:{now_ms}:~{lease_ms}/{ttl_ms}:{now_ms}"
        ))
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(ttl_ms);
    set
}

impl RedisStore {
    /// The claim of a key without a record as one plain command, `SET rec
    /// in-flight:… NX GET PX <TTL>` (Redis 7.0+): no record → the lease is
    /// this token's, with a deadline relative to the write (see the
    /// scripts) and the client's clock in ms as its fencing number (a key
    /// without a record has no earlier holder to be above); a `done` record
    /// → the duplicate. `None`: the key has another record (a lease, a
    /// free one) and the claim script decides. A Redis that refuses the
    /// command (before 7.0) turns the plain claims off for this store.
    async fn claim_plain(
        &self,
        req: &ClaimRequest<'_>,
        rec: &str,
        token: &str,
    ) -> Result<Option<Claim<RedisLease>>, StoreError> {
        if !self.plain_claims.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let now = now_ms();
        let ttl = self.record_ttl(req.lease);
        let set = plain_claim(rec, token, now, millis(req.lease), ttl);
        let previous: Option<String> = match set.query_async(&mut self.conn()).await {
            Ok(previous) => previous,
            Err(e) if self.plain_claims_refused(&e) => return Ok(None),
            Err(e) => return Err(map_err(e)),
        };
        match previous {
            None => {
                let fencing = u64::try_from(now).unwrap_or(0);
                let lease = self
                    .new_lease(req, rec.to_owned(), token.to_owned(), fencing, now)
                    .await?;
                Ok(Some(lease))
            }
            Some(v) => match v.strip_prefix("done:") {
                Some(json) => self.done_claim(req, json).map(Some),
                None => Ok(None),
            },
        }
    }

    /// Whether claims try the plain `SET … NX GET` first.
    pub(super) fn plain_claims_on(&self) -> bool {
        self.plain_claims.load(Ordering::Relaxed)
    }

    /// Whether `e` is Redis refusing the plain claim (a server before 7.0:
    /// `SET` with both `NX` and `GET` is a syntax error there); if so, the
    /// plain claims are turned off for this store.
    pub(super) fn plain_claims_refused(&self, e: &RedisError) -> bool {
        let refused = e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError);
        if refused {
            tracing::info!(error = %e, "this Redis refuses SET … NX GET (before 7.0): claims use the script");
            self.plain_claims.store(false, Ordering::Relaxed);
        }
        refused
    }

    /// The answer to a claim that found the key's `done` record.
    fn done_claim(
        &self,
        req: &ClaimRequest<'_>,
        json: &str,
    ) -> Result<Claim<RedisLease>, StoreError> {
        parse_done(req.consumer, req.key, json)
            .map(Claim::Done)
            .ok_or_else(|| StoreError::corrupt(format!("unreadable done record: {json}")))
    }

    /// A lease just acquired on `rec` with `token`: its heartbeat started,
    /// released if dropped while held, and (with
    /// [`RedisOptions::wait_for_replicas`]) acknowledged by the replicas.
    async fn new_lease(
        &self,
        req: &ClaimRequest<'_>,
        rec: String,
        token: String,
        fencing: u64,
        first_seen_ms: i64,
    ) -> Result<Claim<RedisLease>, StoreError> {
        let lost = Arc::new(AtomicBool::new(false));
        let heartbeat = self.start_heartbeat(&rec, req.key, &token, req.lease, lost.clone());
        let lease = RedisLease {
            consumer: req.consumer.to_owned(),
            key: req.key.to_owned(),
            fencing,
            first_seen_ms,
            lease: req.lease,
            lost,
            heartbeat: Some(heartbeat),
            release_on_drop: Some(DropRelease {
                conn: self.conn(),
                scripts: Arc::clone(&self.scripts),
                rec,
                token: token.clone(),
                ttl_ms: self.record_ttl(req.lease),
            }),
            token,
        };
        // A lease the replicas did not get is released (on drop).
        self.wait_for_replicas(req.consumer, req.key).await?;
        Ok(Claim::New(lease))
    }
}

#[async_trait]
impl Store for RedisStore {
    type Tx = RedisLease;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<RedisLease>, StoreError> {
        let token = self.tokens.next();
        let rec = self.keys.scoped(req.consumer, req.key, "rec");
        if let Some(claim) = self.claim_plain(req, &rec, &token).await? {
            return Ok(claim);
        }
        let reply: Vec<String> = self
            .scripts
            .claim
            .key(&rec)
            .arg(&token)
            .arg(millis(req.lease))
            .arg(self.record_ttl(req.lease))
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        match reply.first().map(String::as_str) {
            Some("done") => {
                let json = reply.get(1).map(String::as_str).unwrap_or_default();
                self.done_claim(req, json)
            }
            Some("busy") => Ok(Claim::InFlight),
            Some("new") => {
                let (fencing, first_seen_ms) = super::batch::new_lease(&reply);
                self.new_lease(req, rec, token, fencing, first_seen_ms)
                    .await
            }
            _ => Err(StoreError::new(
                StoreErrorKind::Other,
                format!("unexpected claim reply {reply:?}"),
            )),
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
        let retention = millis(self.options.retention);
        let value = done_value(req.fingerprint, result, lease.first_seen_ms);
        // On one Redis the admin indexes go in the completion's own script
        // (one round trip); on a Cluster they live in other slots.
        let single = self.conn.is_single();
        let invocation = if single {
            let mut inv = self.scripts.complete_indexed.prepare_invoke();
            inv.key(self.keys.scoped(c, k, "rec"))
                .key(self.keys.scoped(c, k, "att"))
                .key(self.keys.consumer(c, "done"))
                .key(self.keys.consumer(c, "failing"))
                .key(self.keys.consumers())
                .arg(&lease.token)
                .arg(&value)
                .arg(retention)
                .arg(lease.first_seen_ms)
                .arg(k)
                .arg(self.retention_horizon())
                .arg(c)
                .arg(u8::from(self.index_maintenance_due(c)));
            inv
        } else {
            let mut inv = self.scripts.complete.prepare_invoke();
            inv.key(self.keys.scoped(c, k, "rec"))
                .key(self.keys.scoped(c, k, "att"))
                .arg(&lease.token)
                .arg(&value)
                .arg(retention);
            inv
        };
        let done: i64 = invocation
            .invoke_async(&mut self.conn())
            .await
            .map_err(map_err)?;
        if done == 0 {
            lease.lost.store(true, Ordering::SeqCst);
            return Err(StoreError::lease_lost(&lease.key));
        }
        self.wait_for_replicas(c, k).await?;
        if !single {
            self.index_completed(c, &[(lease.first_seen_ms, k)], self.options.retention)
                .await;
        }
        Ok(())
    }

    async fn rollback(&self, mut lease: RedisLease) -> Result<(), StoreError> {
        lease.stop_heartbeat();
        let _: i64 = self
            .scripts
            .release
            .key(self.keys.scoped(&lease.consumer, &lease.key, "rec"))
            .arg(&lease.token)
            .arg(self.record_ttl(lease.lease))
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
