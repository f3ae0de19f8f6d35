//! Batch claims of the Redis lease store (behind its [`RedisUnit`](super::RedisUnit)): the same
//! lease protocol as the per-key scripts, a whole batch per round trip.
//!
//! - **claim**: one Lua script over every key of the batch does, per key,
//!   what the per-key claim script does on the key's one record (a `done`
//!   record answers [`Claim::Done`], a lease before its deadline
//!   [`Claim::InFlight`], otherwise a new lease with the record's next
//!   fencing number; `GET` and `SET` per key, one `TIME` per batch). Every
//!   key gets its own token (`<batch token>.<n>`) and fencing number.
//! - **heartbeat**: one task per batch, every `lease / 3`, moves the
//!   deadline of every lease the batch still holds in one script
//!   (compare-on-token); a lease found taken over is marked lost
//!   ([`RedisLease::lease_lost`]), and if Redis cannot be reached for a whole
//!   lease, all of them are.
//! - **complete**: one script completes the processed keys (compare-and-set
//!   from this token's lease to the `done:` record with the retention TTL,
//!   clearing failed attempts), releases the failed ones (to free records
//!   keeping their counters), and adds the completed keys to the consumer's
//!   done index in the same round trip (its TTL and trimming, and the set of
//!   consumers, about once a second).
//! - A batch dropped while it holds leases (its task was aborted) releases
//!   them at once, in one script, like a rollback.
//!
//! On a single Redis (or a Sentinel-managed primary) those scripts span the
//! keys of many hash slots, which a single node allows. A Redis Cluster
//! cannot run a script across slots: there every key's own script is sent
//! at once on the multiplexed connections (still no round trip waits for
//! another), and the consumer's index is updated in a pipeline after them.

use std::future::Future as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::{RedisError, Script};

use super::scripts::{lua_now, lua_record};
use super::{done_value, map_err, millis, RedisConnection, RedisLease, RedisStore, Scripts};
use crate::error::StoreErrorKind;
use crate::store::{now_ms, Claim, StoreError};
use crate::sync::lock;

/// One held lease to complete in [`RedisStore::complete_leases`].
#[derive(Debug)]
pub(super) struct LeaseCompletion<'a> {
    /// The lease, as [`RedisStore::claim_leases`] handed it out.
    pub(super) lease: RedisLease,
    /// The payload fingerprint stored with the key.
    pub(super) fingerprint: &'a str,
    /// The handler's result, stored with the key.
    pub(super) result: Option<&'a serde_json::Value>,
}

/// KEYS: rec per key. ARGV: token prefix, lease ms, record TTL ms. Per
/// key, what the per-key claim script does, with token `<prefix><n>`.
const BATCH_CLAIM: &str = concat!(
    lua_now!(),
    lua_record!(),
    r#"
local out = {}
for i = 1, #KEYS do
  out[i] = claim(KEYS[i], redis.call('GET', KEYS[i]), ARGV[1] .. i, now, tonumber(ARGV[2]), ARGV[3])
end
return out
"#
);

/// KEYS: rec per key. ARGV: lease ms, record TTL ms, then the token per key.
const BATCH_EXTEND: &str = concat!(
    lua_now!(),
    lua_record!(),
    r#"
local out = {}
for i = 1, #KEYS do
  out[i] = extend(KEYS[i], redis.call('GET', KEYS[i]), ARGV[i + 2], now, tonumber(ARGV[1]), ARGV[2])
end
return out
"#
);

/// KEYS: rec per key. ARGV: record TTL ms, then the token per key.
const BATCH_RELEASE: &str = concat!(
    lua_record!(),
    r#"
local n = 0
for i = 1, #KEYS do
  n = n + release(KEYS[i], redis.call('GET', KEYS[i]), ARGV[i + 1], ARGV[1])
end
return n
"#
);

/// KEYS: done index, failing set, consumer set; rec, att per completion;
/// rec per release. ARGV: retention ms, horizon ms, consumer, completions,
/// `1` when the index maintenance is due, record TTL ms; token, done value,
/// first seen, key per completion; token per release.
const BATCH_COMPLETE: &str = concat!(
    lua_record!(),
    r#"
local n = tonumber(ARGV[4])
local out = {}
local done = 0
for i = 1, n do
  local k = 3 + 2 * (i - 1)
  local a = 6 + 4 * (i - 1)
  if holds(redis.call('GET', KEYS[k + 1]), ARGV[a + 1]) then
    redis.call('SET', KEYS[k + 1], ARGV[a + 2], 'PX', ARGV[1])
    if redis.call('DEL', KEYS[k + 2]) == 1 then
      redis.call('SREM', KEYS[2], ARGV[a + 4])
    end
    redis.call('ZADD', KEYS[1], ARGV[a + 3], ARGV[a + 4])
    out[i] = 1
    done = done + 1
  else
    out[i] = 0
  end
end
local rk = 3 + 2 * n
local ra = 6 + 4 * n
for j = 1, #KEYS - rk do
  release(KEYS[rk + j], redis.call('GET', KEYS[rk + j]), ARGV[ra + j], ARGV[6])
end
if done > 0 and ARGV[5] == '1' then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[3])
end
return out
"#
);

struct BatchScripts {
    claim: Script,
    extend: Script,
    release: Script,
    complete: Script,
}

fn batch_scripts() -> &'static BatchScripts {
    static SCRIPTS: OnceLock<BatchScripts> = OnceLock::new();
    SCRIPTS.get_or_init(|| BatchScripts {
        claim: Script::new(BATCH_CLAIM),
        extend: Script::new(BATCH_EXTEND),
        release: Script::new(BATCH_RELEASE),
        complete: Script::new(BATCH_COMPLETE),
    })
}

/// One held lease: its record key, token and lost flag.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub(super) rec: String,
    pub(super) token: String,
    pub(super) lost: Arc<AtomicBool>,
}

/// The leases held by one batch of the Redis store (see the module docs):
/// one heartbeat task for all of them; dropped while still holding leases
/// (the batch was cancelled), it releases them at once.
pub(super) struct RedisLeaseGroup {
    conn: RedisConnection,
    scripts: Arc<Scripts>,
    lease: Duration,
    /// The TTL of the records of the group's keys while not done.
    ttl_ms: u64,
    held: Arc<Mutex<Vec<Held>>>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for RedisLeaseGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeaseGroup")
            .field("lease", &self.lease)
            .field("held", &lock(&self.held).len())
            .finish_non_exhaustive()
    }
}

/// Extends every lease in `held` once; returns per lease whether it still held.
pub(super) async fn extend(
    conn: &mut RedisConnection,
    scripts: &Scripts,
    held: &[Held],
    lease_ms: u64,
    ttl_ms: u64,
) -> Result<Vec<bool>, RedisError> {
    if conn.is_single() {
        let mut invocation = batch_scripts().extend.prepare_invoke();
        invocation.arg(lease_ms).arg(ttl_ms);
        for h in held {
            invocation.key(&h.rec).arg(&h.token);
        }
        let flags: Vec<i64> = invocation.invoke_async(conn).await?;
        return Ok(flags.into_iter().map(|f| f == 1).collect());
    }
    let calls = held.iter().map(|h| {
        let mut conn = conn.clone();
        async move {
            let r: Result<i64, RedisError> = scripts
                .extend
                .key(&h.rec)
                .arg(&h.token)
                .arg(lease_ms)
                .arg(ttl_ms)
                .invoke_async(&mut conn)
                .await;
            r
        }
    });
    join_all(calls)
        .await
        .into_iter()
        .map(|r| r.map(|f| f == 1))
        .collect()
}

/// Compare-and-deletes every lease in `held`.
async fn release(
    conn: &mut RedisConnection,
    scripts: &Scripts,
    held: &[Held],
    ttl_ms: u64,
) -> Result<(), RedisError> {
    if held.is_empty() {
        return Ok(());
    }
    if conn.is_single() {
        let mut invocation = batch_scripts().release.prepare_invoke();
        invocation.arg(ttl_ms);
        for h in held {
            invocation.key(&h.rec).arg(&h.token);
        }
        let _: i64 = invocation.invoke_async(conn).await?;
        return Ok(());
    }
    let calls = held.iter().map(|h| {
        let mut conn = conn.clone();
        async move {
            let r: Result<i64, RedisError> = scripts
                .release
                .key(&h.rec)
                .arg(&h.token)
                .arg(ttl_ms)
                .invoke_async(&mut conn)
                .await;
            r
        }
    });
    for r in join_all(calls).await {
        r?;
    }
    Ok(())
}

/// Compare-and-deletes every lease in `held` with `EVAL` (not `EVALSHA`):
/// the release of a dropped batch is queued on the connection at once, even
/// if Redis has not cached the script, before anything sent after the drop.
async fn release_now(
    conn: &mut RedisConnection,
    held: &[Held],
    ttl_ms: u64,
) -> Result<(), RedisError> {
    if conn.is_single() {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(BATCH_RELEASE).arg(held.len());
        for h in held {
            cmd.arg(&h.rec);
        }
        cmd.arg(ttl_ms);
        for h in held {
            cmd.arg(&h.token);
        }
        let _: i64 = cmd.query_async(conn).await?;
        return Ok(());
    }
    let calls = held.iter().map(|h| {
        let mut conn = conn.clone();
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(super::RELEASE)
            .arg(1)
            .arg(&h.rec)
            .arg(&h.token)
            .arg(ttl_ms);
        async move {
            let r: Result<i64, RedisError> = cmd.query_async(&mut conn).await;
            r
        }
    });
    for r in join_all(calls).await {
        r?;
    }
    Ok(())
}

impl RedisLeaseGroup {
    fn start_heartbeat(&mut self) {
        if self.heartbeat.is_some() {
            return;
        }
        let mut conn = self.conn.clone();
        let scripts = Arc::clone(&self.scripts);
        let held = Arc::clone(&self.held);
        let lease = self.lease;
        let every = (lease / 3).max(Duration::from_millis(1));
        let lease_ms = millis(lease);
        let ttl_ms = self.ttl_ms;
        self.heartbeat = Some(tokio::spawn(async move {
            let mut last_ok = Instant::now();
            loop {
                tokio::time::sleep(every).await;
                let snapshot: Vec<Held> = lock(&held).clone();
                if snapshot.is_empty() {
                    continue;
                }
                match extend(&mut conn, &scripts, &snapshot, lease_ms, ttl_ms).await {
                    Ok(flags) => {
                        last_ok = Instant::now();
                        let lost: Vec<&Held> = snapshot
                            .iter()
                            .zip(flags.iter().chain(std::iter::repeat(&false)))
                            .filter(|(_, ok)| !**ok)
                            .map(|(h, _)| h)
                            .collect();
                        if lost.is_empty() {
                            continue;
                        }
                        for h in &lost {
                            tracing::warn!(key = %h.rec, "lease lost: the key is held by another token");
                            h.lost.store(true, Ordering::SeqCst);
                        }
                        // Stop extending them.
                        lock(&held).retain(|h| !h.lost.load(Ordering::SeqCst));
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, leases = snapshot.len(), "batch lease heartbeat failed");
                        if last_ok.elapsed() >= lease {
                            for h in &snapshot {
                                h.lost.store(true, Ordering::SeqCst);
                            }
                            return;
                        }
                    }
                }
            }
        }));
    }

    /// Stops the heartbeat and hands over the leases still held (so that
    /// dropping the group releases nothing).
    fn disarm(&mut self) -> Vec<Held> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        std::mem::take(&mut *lock(&self.held))
    }
}

impl Drop for RedisLeaseGroup {
    /// A batch dropped while it holds leases (its task was aborted, the
    /// process is shutting down) releases them at once by compare-and-delete.
    /// The release is polled once right here, so it is queued on the
    /// connection before anything sent after the drop; a spawned task
    /// finishes it. Without a runtime the leases expire by themselves.
    fn drop(&mut self) {
        let held = self.disarm();
        if held.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut conn = self.conn.clone();
        let ttl_ms = self.ttl_ms;
        let mut fut = Box::pin(async move {
            if let Err(e) = release_now(&mut conn, &held, ttl_ms).await {
                tracing::warn!(leases = held.len(), error = %e, "releasing a dropped batch's leases failed; they will expire");
            }
        });
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        if fut.as_mut().poll(&mut cx).is_pending() {
            runtime.spawn(fut);
        }
    }
}

/// A `new` answer: the fencing number and the first-seen time.
pub(super) fn new_lease(reply: &[String]) -> (u64, i64) {
    let fencing = reply.get(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    let first_seen = reply
        .get(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(now_ms);
    (fencing, first_seen)
}

impl RedisStore {
    /// An empty group whose leases last `lease` without a heartbeat.
    pub(super) fn lease_group(&self, lease: Duration) -> RedisLeaseGroup {
        RedisLeaseGroup {
            conn: self.conn(),
            scripts: Arc::clone(&self.scripts),
            lease,
            ttl_ms: self.record_ttl(lease),
            held: Arc::default(),
            heartbeat: None,
        }
    }

    /// Claims every `(key, fingerprint)` of `consumer` in one round trip;
    /// new leases join `group`. Answers in the order given; the keys must be
    /// distinct.
    pub(super) async fn claim_leases(
        &self,
        group: &mut RedisLeaseGroup,
        consumer: &str,
        claims: &[(&str, &str)],
    ) -> Result<Vec<Claim<RedisLease>>, StoreError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let prefix = format!("{}.", self.tokens.next());
        let lease_ms = millis(group.lease);
        let ttl_ms = group.ttl_ms;
        let recs: Vec<String> = claims
            .iter()
            .map(|(key, _)| self.keys.scoped(consumer, key, "rec"))
            .collect();
        let mut tokens: Vec<String> = (1..=recs.len()).map(|n| format!("{prefix}{n}")).collect();
        let replies: Vec<Vec<String>> = if self.conn.is_single() {
            self.claim_batch_single(&recs, &mut tokens, lease_ms, ttl_ms)
                .await?
        } else {
            let calls = recs.iter().zip(&tokens).map(|(rec, token)| {
                let mut conn = self.conn();
                async move {
                    let r: Result<Vec<String>, RedisError> = self
                        .scripts
                        .claim
                        .key(rec)
                        .arg(token)
                        .arg(lease_ms)
                        .arg(ttl_ms)
                        .invoke_async(&mut conn)
                        .await;
                    r
                }
            });
            join_all(calls)
                .await
                .into_iter()
                .collect::<Result<_, _>>()
                .map_err(map_err)?
        };
        if replies.len() != claims.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!(
                    "batch claim answered {} of {} keys",
                    replies.len(),
                    claims.len()
                ),
            ));
        }
        let mut answers = Vec::with_capacity(claims.len());
        let mut held = Vec::new();
        for (((key, _), rec), (reply, token)) in
            claims.iter().zip(recs).zip(replies.into_iter().zip(tokens))
        {
            let answer = match reply.first().map(String::as_str) {
                Some("done") => {
                    let json = reply.get(1).map(String::as_str).unwrap_or_default();
                    Claim::Done(super::parse_done(consumer, key, json).ok_or_else(|| {
                        StoreError::corrupt(format!("unreadable done record: {json}"))
                    })?)
                }
                Some("busy") => Claim::InFlight,
                Some("new") => {
                    let (fencing, first_seen_ms) = new_lease(&reply);
                    let lost = Arc::new(AtomicBool::new(false));
                    held.push(Held {
                        rec,
                        token: token.clone(),
                        lost: Arc::clone(&lost),
                    });
                    Claim::New(RedisLease {
                        consumer: consumer.to_owned(),
                        key: (*key).to_owned(),
                        token,
                        fencing,
                        first_seen_ms,
                        lease: group.lease,
                        lost,
                        heartbeat: None,
                        release_on_drop: None,
                    })
                }
                _ => {
                    return Err(StoreError::new(
                        StoreErrorKind::Other,
                        format!("unexpected batch claim reply {reply:?}"),
                    ))
                }
            };
            answers.push(answer);
        }
        if let (false, Some(ack)) = (held.is_empty(), &self.options.replica_ack) {
            // Every master of the batch's keys (one WAIT on a single Redis).
            if let Err(e) = self.conn.wait_for_replicas(None, ack).await {
                if let Err(release) = release_now(&mut self.conn(), &held, ttl_ms).await {
                    tracing::warn!(error = %release, "releasing leases the replicas did not acknowledge failed; they expire after one lease");
                }
                return Err(e);
            }
        }
        if !held.is_empty() {
            lock(&group.held).extend(held);
            group.start_heartbeat();
        }
        Ok(answers)
    }

    /// The batch claim on one Redis: every key's plain `SET … NX GET` in
    /// one pipeline (a key without a record is this batch's at once, a
    /// `done` one a duplicate), then one claim script for the keys that had
    /// another record (leases, free records), with tokens of its own
    /// (written into `tokens`). Answers per key as the claim script does.
    async fn claim_batch_single(
        &self,
        recs: &[String],
        tokens: &mut [String],
        lease_ms: u64,
        ttl_ms: u64,
    ) -> Result<Vec<Vec<String>>, StoreError> {
        let mut replies: Vec<Option<Vec<String>>> = vec![None; recs.len()];
        if self.plain_claims_on() {
            let now = now_ms();
            let mut pipe = redis::pipe();
            for (rec, token) in recs.iter().zip(tokens.iter()) {
                pipe.add_command(super::store::plain_claim(rec, token, now, lease_ms, ttl_ms));
            }
            let previous: Result<Vec<Option<String>>, RedisError> =
                pipe.query_async(&mut self.conn()).await;
            match previous {
                Ok(previous) => {
                    for (reply, previous) in replies.iter_mut().zip(previous) {
                        *reply = match previous {
                            None => Some(vec!["new".into(), now.to_string(), now.to_string()]),
                            Some(v) => v
                                .strip_prefix("done:")
                                .map(|json| vec!["done".into(), json.to_owned()]),
                        };
                    }
                }
                Err(e) if self.plain_claims_refused(&e) => {}
                Err(e) => return Err(map_err(e)),
            }
        }
        let rest: Vec<usize> = (0..recs.len()).filter(|&n| replies[n].is_none()).collect();
        if !rest.is_empty() {
            let prefix = format!("{}.", self.tokens.next());
            let mut invocation = batch_scripts().claim.prepare_invoke();
            invocation.arg(&prefix).arg(lease_ms).arg(ttl_ms);
            for &n in &rest {
                invocation.key(&recs[n]);
            }
            let answers: Vec<Vec<String>> = invocation
                .invoke_async(&mut self.conn())
                .await
                .map_err(map_err)?;
            for (j, (&n, answer)) in rest.iter().zip(answers).enumerate() {
                tokens[n] = format!("{prefix}{}", j + 1);
                replies[n] = Some(answer);
            }
        }
        Ok(replies.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Stops the group's heartbeat and, in one round trip, completes `done`
    /// (compare-and-set on each lease's token, with the result and the
    /// retention TTL) and releases `failed` (compare-and-delete). Answers,
    /// per completion in order, whether it held.
    pub(super) async fn complete_leases(
        &self,
        mut group: RedisLeaseGroup,
        done: Vec<LeaseCompletion<'_>>,
        failed: Vec<RedisLease>,
    ) -> Result<Vec<bool>, StoreError> {
        group.disarm();
        let ttl_ms = group.ttl_ms;
        drop(group);
        if done.is_empty() && failed.is_empty() {
            return Ok(Vec::new());
        }
        let retention = millis(self.options.retention);
        let consumer = done
            .first()
            .map(|d| d.lease.consumer.as_str())
            .or_else(|| failed.first().map(|l| l.consumer.as_str()))
            .unwrap_or_default();
        let mut flags: Vec<bool> = if self.conn.is_single() {
            let mut invocation = batch_scripts().complete.prepare_invoke();
            invocation
                .key(self.keys.consumer(consumer, "done"))
                .key(self.keys.consumer(consumer, "failing"))
                .key(self.keys.consumers())
                .arg(retention)
                .arg(self.retention_horizon())
                .arg(consumer)
                .arg(done.len())
                .arg(u8::from(
                    !done.is_empty() && self.index_maintenance_due(consumer),
                ))
                .arg(ttl_ms);
            for d in &done {
                let (c, k) = (d.lease.consumer.as_str(), d.lease.key.as_str());
                invocation
                    .key(self.keys.scoped(c, k, "rec"))
                    .key(self.keys.scoped(c, k, "att"))
                    .arg(&d.lease.token)
                    .arg(done_value(d.fingerprint, d.result, d.lease.first_seen_ms))
                    .arg(d.lease.first_seen_ms)
                    .arg(k);
            }
            for l in &failed {
                invocation
                    .key(self.keys.scoped(&l.consumer, &l.key, "rec"))
                    .arg(&l.token);
            }
            let flags: Vec<i64> = invocation
                .invoke_async(&mut self.conn())
                .await
                .map_err(map_err)?;
            flags.into_iter().map(|f| f == 1).collect()
        } else {
            self.complete_per_key(&done, &failed, retention, ttl_ms)
                .await?
        };
        flags.resize(done.len(), false);
        for (d, ok) in done.iter().zip(&flags) {
            if !ok {
                d.lease.lost.store(true, Ordering::SeqCst);
            }
        }
        if let (true, Some(ack)) = (flags.contains(&true), &self.options.replica_ack) {
            self.conn.wait_for_replicas(None, ack).await?;
        }
        Ok(flags)
    }
}

impl RedisStore {
    /// Redis Cluster: every key's own complete and release scripts at once,
    /// then the consumer's index in one pipeline.
    async fn complete_per_key(
        &self,
        done: &[LeaseCompletion<'_>],
        failed: &[RedisLease],
        retention: u64,
        ttl_ms: u64,
    ) -> Result<Vec<bool>, StoreError> {
        let completions = done.iter().map(|d| {
            let mut conn = self.conn();
            let (c, k) = (d.lease.consumer.as_str(), d.lease.key.as_str());
            let invocation = {
                let mut i = self.scripts.complete.prepare_invoke();
                i.key(self.keys.scoped(c, k, "rec"))
                    .key(self.keys.scoped(c, k, "att"))
                    .arg(&d.lease.token)
                    .arg(done_value(d.fingerprint, d.result, d.lease.first_seen_ms))
                    .arg(retention);
                i
            };
            async move {
                let r: Result<i64, RedisError> = invocation.invoke_async(&mut conn).await;
                r
            }
        });
        let held: Vec<Held> = failed
            .iter()
            .map(|l| Held {
                rec: self.keys.scoped(&l.consumer, &l.key, "rec"),
                token: l.token.clone(),
                lost: Arc::clone(&l.lost),
            })
            .collect();
        let mut conn = self.conn();
        let (flags, released) = futures_util::future::join(
            join_all(completions),
            release(&mut conn, &self.scripts, &held, ttl_ms),
        )
        .await;
        released.map_err(map_err)?;
        let flags: Vec<bool> = flags
            .into_iter()
            .map(|r| r.map(|f| f >= 1))
            .collect::<Result<_, _>>()
            .map_err(map_err)?;
        let completed: Vec<&RedisLease> = done
            .iter()
            .zip(&flags)
            .filter(|(_, ok)| **ok)
            .map(|(d, _)| &d.lease)
            .collect();
        if let Some(first) = completed.first() {
            let keys: Vec<(i64, &str)> = completed
                .iter()
                .map(|l| (l.first_seen_ms, l.key.as_str()))
                .collect();
            self.index_completed(&first.consumer, &keys, self.options.retention)
                .await;
        }
        Ok(flags)
    }
}
