#![cfg(feature = "redis")]
//! Batch mode over the Redis lease store ([`Consumer::run_batched`] with a
//! [`RedisStore`]; its [`UnitStore`] units) against a real Redis (127.0.0.1:6379,
//! `IDEMQ_TEST_REDIS`), each test under its own key prefix: duplicates
//! inside and across batches with competing batch and per-message
//! consumers, a failing message in the middle of a batch, crashes before and
//! after the completion round trip, the batch heartbeat, lease expiry and
//! fencing of a stale batch holder, and keys in flight elsewhere.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemq::engine::BatchOptions;
use idemq::source::queue::{MemoryQueue, QueueSource};
use idemq::source::{Acknowledger, Delivery, Source};
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::store::unit::{Completion, MemberAnswer, MemberClaim, UnitOptions, WorkUnit};
use idemq::store::{Claim, ClaimRequest, Store, StoreAdmin, UnitStore};
use idemq::{
    handler_fn, Consumer, ConsumerBuilder, HandlerError, InFlightPolicy, KeySpec, Message,
    OutcomeKind, RetryPolicy, SourceError,
};

fn redis_url() -> String {
    std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn unique(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{what}-{}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        fastrand::u32(..)
    )
}

fn options(prefix: &str) -> RedisOptions {
    RedisOptions::default()
        .prefix(prefix)
        .retention(Duration::from_secs(600))
        .timeouts(Duration::from_millis(500), Duration::from_millis(500))
}

async fn store() -> (RedisStore, String) {
    let prefix = unique("rb");
    let store = RedisStore::connect_with(&redis_url(), options(&prefix))
        .await
        .expect("connect to Redis");
    (store, prefix)
}

/// Deletes every key under `prefix`.
async fn cleanup(store: &RedisStore, prefix: &str) {
    let mut conn = store.connection().clone();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("scan");
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .expect("del");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

fn retry() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(3)
        .with_initial_backoff(Duration::from_millis(10))
        .with_max_backoff(Duration::from_millis(50))
        .with_jitter(0.0)
        .with_busy_delay(Duration::from_millis(20))
}

fn batches(max_size: usize) -> BatchOptions {
    BatchOptions::new(max_size, Duration::from_millis(5))
}

/// Batches of `n`, for a test that queues exactly `n` messages and needs
/// them in one batch: the batch closes when its `n`-th member arrives (or the
/// source ends), never on the wait, however slowly the run loop hands the
/// members over. (With [`batches`], 5 ms after the first member, a loaded
/// machine can split them: the engine promises no more.)
fn one_batch(n: usize) -> BatchOptions {
    BatchOptions::new(n, Duration::from_secs(60))
}

fn payment(key: &str, amount: i64, extra: serde_json::Value) -> Message {
    let mut payload = serde_json::json!({ "payment_id": key, "amount": amount });
    if let (Some(p), Some(e)) = (payload.as_object_mut(), extra.as_object()) {
        p.extend(e.clone());
    }
    Message::new(payload.to_string())
}

fn queue_of(messages: impl IntoIterator<Item = Message>) -> MemoryQueue {
    let queue = MemoryQueue::new("test");
    for m in messages {
        queue.push(m);
    }
    queue.close();
    queue
}

/// A downstream system that records, per key, the fencing numbers of the
/// writes it accepted, and refuses a write with a lower number than one it
/// has seen for the key. Calls counts every handler call per key.
#[derive(Default, Clone)]
struct Effects {
    applied: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl Effects {
    fn apply(&self, key: &str, fence: u64) -> Result<(), HandlerError> {
        let mut map = self.applied.lock().unwrap();
        let seen = map.entry(key.to_owned()).or_default();
        if seen.iter().any(|f| *f > fence) {
            return Err(HandlerError::permanent(format!(
                "stale fencing token {fence} for {key}"
            )));
        }
        seen.push(fence);
        Ok(())
    }

    fn call(&self, key: &str) {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default() += 1;
    }

    fn applied(&self) -> HashMap<String, Vec<u64>> {
        self.applied.lock().unwrap().clone()
    }

    fn calls(&self, key: &str) -> u32 {
        self.calls.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

/// A consumer whose handler, by payload field: `fail` = `"retry"` fails
/// retryably `fail_times` times (always if absent), `"permanent"` fails
/// permanently, `"panic"` panics, `"hang"` hangs on its first call;
/// `sleep_ms` delays it. On success it applies the effect with the lease's
/// fencing number and stores `{"amount": …}`.
fn consumer(store: &RedisStore, effects: &Effects) -> ConsumerBuilder<RedisStore> {
    let effects = effects.clone();
    let failures: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    Consumer::builder("ledger", store.clone())
        .key(KeySpec::json("/payment_id"))
        .retry(retry())
        .handler(handler_fn(move |ctx, lease: &mut RedisLease| {
            let effects = effects.clone();
            let failures = Arc::clone(&failures);
            Box::pin(async move {
                effects.call(ctx.key);
                let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                if let Some(ms) = p["sleep_ms"].as_u64() {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                match p["fail"].as_str() {
                    Some("retry") => {
                        let n = {
                            let mut f = failures.lock().unwrap();
                            let n = f.entry(ctx.key.to_owned()).or_default();
                            *n += 1;
                            *n
                        };
                        if n <= p["fail_times"].as_u64().unwrap_or(u64::MAX) {
                            return Err(HandlerError::retryable(format!("flaky call {n}")));
                        }
                    }
                    Some("permanent") => return Err(HandlerError::permanent("rejected")),
                    Some("panic") => panic!("handler bug"),
                    Some("hang") if effects.calls(ctx.key) == 1 => {
                        std::future::pending::<()>().await
                    }
                    _ => {}
                }
                effects.apply(ctx.key, lease.fencing_token())?;
                Ok(Some(serde_json::json!({ "amount": p["amount"] })))
            })
        }))
}

async fn report(store: &RedisStore, key: &str) -> idemq::store::KeyReport {
    store.inspect("ledger", key).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_inside_and_across_batches_with_competing_consumers_apply_once() {
    let (store, prefix) = store().await;
    let effects = Effects::default();
    let mut messages = Vec::new();
    let mut expected = HashMap::new();
    for i in 0..600i64 {
        // Back-to-back copies land in one batch; the shuffled half spreads
        // copies over batches and workers.
        for _ in 0..1 + fastrand::usize(..3) {
            messages.push(payment(&format!("p-{i}"), i + 1, serde_json::json!({})));
        }
        expected.insert(format!("p-{i}"), i + 1);
    }
    let mut tail = messages.split_off(messages.len() / 2);
    fastrand::shuffle(&mut tail);
    messages.extend(tail);
    let total = messages.len() as u64;
    let queue = queue_of(messages);
    // Three batch workers and one per-message worker compete for the keys.
    let mut workers = Vec::new();
    for w in 0..4 {
        let consumer = consumer(&store, &effects).concurrency(3).build().unwrap();
        let source = queue.source();
        workers.push(tokio::spawn(async move {
            if w == 0 {
                consumer.run(source).await
            } else {
                consumer.run_batched(source, batches(40)).await
            }
        }));
    }
    let (mut processed, mut duplicates) = (0, 0);
    for w in workers {
        let summary = tokio::time::timeout(Duration::from_secs(60), w)
            .await
            .expect("workers finish")
            .unwrap()
            .unwrap();
        processed += summary.count(OutcomeKind::Processed);
        duplicates += summary.count(OutcomeKind::Duplicate);
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 0, "{summary}");
        assert_eq!(summary.count(OutcomeKind::Conflict), 0, "{summary}");
    }
    assert_eq!(processed, 600);
    assert_eq!(processed + duplicates, total);
    assert_eq!(queue.acked(), total);
    let applied = effects.applied();
    assert_eq!(applied.len(), expected.len());
    let doubled: Vec<_> = applied.iter().filter(|(_, f)| f.len() != 1).collect();
    assert!(doubled.is_empty(), "double effects: {doubled:?}");
    // Every key is done in Redis with its result; none is left in flight.
    for (key, amount) in [("p-0", 1), ("p-299", 300), ("p-599", 600)] {
        let r = report(&store, key).await;
        assert!(!r.in_flight);
        let record = r.inbox.expect("done");
        assert_eq!(record.result, Some(serde_json::json!({ "amount": amount })));
    }
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].processed, 600, "the done index holds every key");
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_in_the_middle_of_a_batch_is_retried_alone() {
    let (store, prefix) = store().await;
    let effects = Effects::default();
    let none = serde_json::json!({});
    let queue = queue_of([
        payment("a", 1, none.clone()),
        payment("bad", 1, serde_json::json!({ "fail": "permanent" })),
        payment(
            "flaky",
            5,
            serde_json::json!({ "fail": "retry", "fail_times": 1 }),
        ),
        payment("a", 1, none.clone()), // a copy of "a" in the same batch
        payment("panics", 1, serde_json::json!({ "fail": "panic" })),
        payment("c", 3, none.clone()),
    ]);
    let consumer = consumer(&store, &effects).build().unwrap();
    let summary = tokio::time::timeout(
        Duration::from_secs(30),
        consumer.run_batched(queue.source(), batches(10)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        3,
        "a, c, flaky: {summary}"
    );
    assert_eq!(summary.count(OutcomeKind::Duplicate), 1, "{summary}");
    assert_eq!(
        summary.count(OutcomeKind::DeadLettered),
        2,
        "bad, panics: {summary}"
    );
    // Only the failing messages ran again: a and c ran once, flaky twice,
    // panics once per allowed attempt, bad once (permanent).
    assert_eq!(effects.calls("a"), 1);
    assert_eq!(effects.calls("c"), 1);
    assert_eq!(effects.calls("flaky"), 2);
    assert_eq!(effects.calls("bad"), 1);
    assert_eq!(effects.calls("panics"), 3);
    let mut applied: Vec<_> = effects.applied().into_keys().collect();
    applied.sort();
    assert_eq!(applied, ["a", "c", "flaky"]);
    // The failed keys were released, not left in flight, and never done.
    for key in ["bad", "panics"] {
        let r = report(&store, key).await;
        assert!(!r.in_flight && r.inbox.is_none(), "{key}: {r:?}");
        assert_eq!(r.dead_letters.len(), 1, "{key}");
    }
    let r = report(&store, "flaky").await;
    assert!(
        r.inbox.is_some() && r.attempts.is_none(),
        "attempts cleared: {r:?}"
    );
    let mut reasons: Vec<_> = store
        .dead_letters(Some("ledger"), 0, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.reason)
        .collect();
    reasons.sort();
    assert_eq!(reasons, ["permanent_failure", "retries_exhausted"]);
    assert_eq!(queue.acked(), 6);
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_completion_releases_the_batch_and_effects_stay_once() {
    let (store, prefix) = store().await;
    let calls: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let hung = Arc::new(AtomicU32::new(0));
    let fences: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    // The handler makes its external call through the effect journal, so a
    // redelivery of an applied key gets the stored result back instead of
    // calling again; "h" hangs on its first run.
    let build = || {
        let (calls, hung, fences) = (Arc::clone(&calls), Arc::clone(&hung), Arc::clone(&fences));
        Consumer::builder("ledger", store.clone())
            .key(KeySpec::json("/payment_id"))
            .retry(retry())
            .handler(handler_fn(move |ctx, lease: &mut RedisLease| {
                let (calls, hung, fences) =
                    (Arc::clone(&calls), Arc::clone(&hung), Arc::clone(&fences));
                Box::pin(async move {
                    fences
                        .lock()
                        .unwrap()
                        .push((ctx.key.to_owned(), lease.fencing_token()));
                    if ctx.key == "h" && hung.fetch_add(1, Ordering::SeqCst) == 0 {
                        std::future::pending::<()>().await;
                    }
                    let receipt = ctx
                        .effect("charge", |_idempotency_key| async {
                            *calls.lock().unwrap().entry(ctx.key.to_owned()).or_default() += 1;
                            Ok::<_, HandlerError>(serde_json::json!({ "charged": ctx.key }))
                        })
                        .await?;
                    Ok(Some(receipt))
                })
            }))
            .build()
            .unwrap()
    };
    let none = serde_json::json!({});
    let queue = queue_of(["x", "y", "h", "z"].map(|k| payment(k, 1, none.clone())));
    let first = build();
    let source = queue.source();
    let crashed = tokio::spawn(async move { first.run_batched(source, one_batch(4)).await });
    // The keys before h ran, h hangs: the batch holds four leases, none
    // completed.
    let started = Instant::now();
    while hung.load(Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < Duration::from_secs(10), "h never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for key in ["x", "y", "h", "z"] {
        let r = report(&store, key).await;
        assert!(r.in_flight && r.inbox.is_none(), "{key}: {r:?}");
    }
    // The keys whose handlers ran in the first run (the batch runs its
    // members in the order the run loop formed it, not necessarily x y h z).
    let ran_first: Vec<String> = fences
        .lock()
        .unwrap()
        .iter()
        .map(|(k, _)| k.clone())
        .collect();
    assert!(ran_first.iter().any(|k| k == "h"), "{ran_first:?}");
    crashed.abort();
    let _ = crashed.await;
    // The aborted batch released its leases at once: the release runs on a
    // task spawned by the drop, so it lands within moments, far inside the
    // 30 s lease (no lease expiry wait).
    let released = Instant::now();
    for key in ["x", "y", "h", "z"] {
        while report(&store, key).await.in_flight {
            assert!(
                released.elapsed() < Duration::from_secs(10),
                "{key} released"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let second = build();
    let summary = tokio::time::timeout(
        Duration::from_secs(10),
        second.run_batched(queue.source(), one_batch(4)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 4, "{summary}");
    assert_eq!(queue.acked(), 4);
    // The keys that ran before the hang ran twice (the batch was redone) but
    // were charged once each; every retry of a key carried a higher fencing
    // number.
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4);
    assert!(calls.values().all(|n| *n == 1), "{calls:?}");
    let fences = fences.lock().unwrap().clone();
    for key in ["x", "y", "h", "z"] {
        let f: Vec<u64> = fences
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, f)| *f)
            .collect();
        let runs = if ran_first.iter().any(|k| k == key) {
            2
        } else {
            1
        };
        assert_eq!(f.len(), runs, "{key}: {fences:?}");
        assert!(f.windows(2).all(|w| w[1] > w[0]), "{key}: {f:?}");
    }
    let r = report(&store, "x").await;
    assert_eq!(
        r.inbox.unwrap().result,
        Some(serde_json::json!({ "charged": "x" }))
    );
    cleanup(&store, &prefix).await;
}

/// Holds every ack of the first `hold` deliveries forever (the worker
/// "dies" while acking, after the completion round trip).
struct StuckAcks {
    inner: QueueSource,
    hold: usize,
}

struct StuckAck(#[allow(dead_code)] Box<dyn Acknowledger>);

#[async_trait]
impl Acknowledger for StuckAck {
    async fn ack(self: Box<Self>) -> Result<(), SourceError> {
        std::future::pending().await
    }
    async fn nack(self: Box<Self>, _delay: Duration) -> Result<(), SourceError> {
        std::future::pending().await
    }
}

#[async_trait]
impl Source for StuckAcks {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let Some(delivery) = self.inner.next().await? else {
            return Ok(None);
        };
        if self.hold == 0 {
            return Ok(Some(delivery));
        }
        self.hold -= 1;
        let (message, meta, _, acker) = delivery.into_parts();
        Ok(Some(Delivery::new(
            message,
            meta,
            Box::new(StuckAck(acker)),
        )))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_completion_makes_the_redeliveries_duplicates() {
    let (store, prefix) = store().await;
    let effects = Effects::default();
    let queue = queue_of((0..5).map(|i| payment(&format!("k{i}"), i, serde_json::json!({}))));
    let first = consumer(&store, &effects).build().unwrap();
    let source = StuckAcks {
        inner: queue.source(),
        hold: 5,
    };
    let crashed = tokio::spawn(async move { first.run_batched(source, batches(10)).await });
    // Every key completed in Redis (in however many batches the run loop
    // formed); the acks never finish; the worker dies.
    let started = Instant::now();
    for i in 0..5 {
        while report(&store, &format!("k{i}")).await.inbox.is_none() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "k{i} never completed"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    crashed.abort();
    let _ = crashed.await;
    assert_eq!(queue.acked(), 0);
    let second = consumer(&store, &effects).build().unwrap();
    let summary = tokio::time::timeout(
        Duration::from_secs(10),
        second.run_batched(queue.source(), batches(10)),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(summary.count(OutcomeKind::Duplicate), 5, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 0, "{summary}");
    assert_eq!(queue.acked(), 5);
    let applied = effects.applied();
    assert_eq!(applied.len(), 5);
    assert!(applied.values().all(|f| f.len() == 1), "{applied:?}");
    for i in 0..5 {
        assert_eq!(effects.calls(&format!("k{i}")), 1);
    }
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_heartbeat_keeps_every_lease_of_a_slow_batch() {
    let (store, prefix) = store().await;
    let effects = Effects::default();
    let slow = serde_json::json!({ "sleep_ms": 500 });
    let queue = queue_of([
        payment("s1", 1, slow.clone()),
        payment("s2", 2, slow.clone()),
        payment("s3", 3, slow),
    ]);
    let lease = Duration::from_millis(300);
    let consumer = consumer(&store, &effects).lease(lease).build().unwrap();
    let source = queue.source();
    let running = tokio::spawn(async move { consumer.run_batched(source, one_batch(3)).await });
    let started = Instant::now();
    while !report(&store, "s1").await.in_flight {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "s1 never claimed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // For five lease periods (three handlers of 500 ms, one after the other
    // in the one batch), a competitor finds every key of the batch in flight
    // (s3's handler starts after a second), then done.
    let (mut first_busy, mut last_busy) = (None, None);
    for key in ["s3", "s2", "s1"] {
        let req = ClaimRequest {
            consumer: "ledger",
            key,
            fingerprint: "fp",
            lease,
        };
        loop {
            match store.claim(&req).await.unwrap() {
                Claim::InFlight => {
                    let now = Instant::now();
                    if first_busy.is_none() {
                        first_busy = Some(now);
                    }
                    last_busy = Some(now);
                }
                Claim::New(stolen) => {
                    store.rollback(stolen).await.unwrap();
                    panic!("{key}'s lease was taken over while its batch ran");
                }
                Claim::Done(_) => break,
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    // Seen in flight for more than three lease periods: the heartbeat
    // renewed the leases (a time span, not a count of claims, which a slow
    // Redis round trip would shrink).
    let busy = match (first_busy, last_busy) {
        (Some(first), Some(last)) => last - first,
        _ => Duration::ZERO,
    };
    assert!(busy > lease * 3, "in flight for {busy:?} only");
    let summary = running.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 3, "{summary}");
    assert!(effects.applied().values().all(|f| f.len() == 1));
    cleanup(&store, &prefix).await;
}

fn req(key: &str, lease: Duration) -> MemberClaim<'_> {
    MemberClaim::Key(ClaimRequest {
        consumer: "ledger",
        key,
        fingerprint: "fp",
        lease,
    })
}

/// A unit of `store` whose leases last `lease`.
fn unit(store: &Arc<RedisStore>, lease: Duration) -> idemq::store::redis::RedisUnit {
    store.begin(UnitOptions::new(false, lease, InFlightPolicy::Reject))
}

/// Completions of `members`, each with `result`.
fn completions<'a>(
    members: &[usize],
    result: Option<&'a serde_json::Value>,
) -> Vec<Completion<'a>> {
    members
        .iter()
        .map(|&member| Completion {
            member,
            result,
            watermark: None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_batch_holder_is_fenced_off() {
    let (store, prefix) = store().await;
    let store = Arc::new(store);
    let lease = Duration::from_millis(300);
    // Batch A claims k1 and k2, then its process stalls (its runtime thread
    // is blocked, so the heartbeat cannot run) for longer than the lease.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u64>>();
    // The stall lasts until B has taken k1 over (a condition, not 900 ms).
    let (wake, woken) = std::sync::mpsc::channel::<()>();
    let url = redis_url();
    let p = prefix.clone();
    let stale = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let store = Arc::new(RedisStore::connect_with(&url, options(&p)).await.unwrap());
            let mut a = unit(&store, lease);
            let claims = [req("k1", lease), req("k2", lease)];
            let answers = a.claim(&claims).await.unwrap();
            assert_eq!(answers, [MemberAnswer::New, MemberAnswer::New]);
            let fences = (0..2).map(|n| a.tx(n).unwrap().fencing_token()).collect();
            tx.send(fences).unwrap();
            // The stall: the thread blocks, so no heartbeat runs.
            woken.recv().unwrap();
            // Awake again: the heartbeat runs and finds k1 taken over.
            let awake = Instant::now();
            while !a.tx(0).unwrap().lease_lost() {
                assert!(
                    awake.elapsed() < Duration::from_secs(10),
                    "no heartbeat ran"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let lost: Vec<bool> = (0..2).map(|n| a.tx(n).unwrap().lease_lost()).collect();
            let flags = a
                .complete(&claims, &completions(&[0, 1], None))
                .await
                .unwrap();
            (lost, flags)
        })
    });
    let fences_a = rx.recv().unwrap();
    // Both of A's leases run out while its thread is stalled.
    let stalled = Instant::now();
    for key in ["k1", "k2"] {
        while store.inspect("ledger", key).await.unwrap().in_flight {
            assert!(
                stalled.elapsed() < Duration::from_secs(10),
                "{key}'s lease never ran out"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // B takes k1 over after A's lease expired, with a higher fencing number.
    let mut b = unit(&store, lease);
    let claims = [req("k1", lease)];
    assert_eq!(
        b.claim(&claims).await.unwrap(),
        [MemberAnswer::New],
        "B takes over the expired lease"
    );
    let fence_b = b.tx(0).unwrap().fencing_token();
    assert!(fence_b > fences_a[0], "{fence_b} > {}", fences_a[0]);
    let result = serde_json::json!("B");
    let flags = b
        .complete(&claims, &completions(&[0], Some(&result)))
        .await
        .unwrap();
    assert_eq!(flags, [true]);
    wake.send(()).unwrap();

    // Both of A's leases expired during the stall. k1 was taken over: the
    // heartbeat reports it lost and A's completion of it is refused. Nobody
    // took k2 over, so it is still A's (its record keeps the lease until a
    // claim takes it): the heartbeat renews it and A completes it.
    let (lost, flags) = stale.join().unwrap();
    assert_eq!(lost, [true, false], "the heartbeat reported k1 lost");
    assert_eq!(flags, [false, true], "A's completion of k1 is refused");
    let k1 = store.inspect("ledger", "k1").await.unwrap().inbox.unwrap();
    assert_eq!(
        k1.result,
        Some(serde_json::json!("B")),
        "B's completion stands"
    );
    let k2 = store.inspect("ledger", "k2").await.unwrap();
    assert!(k2.inbox.is_some() && !k2.in_flight, "{k2:?}");
    let mut again = unit(&store, lease);
    let claims = [req("k2", lease), req("k3", lease)];
    let answers = again.claim(&claims).await.unwrap();
    assert!(
        matches!(answers[0], MemberAnswer::Done(_)),
        "k2's redelivery is a duplicate: {answers:?}"
    );
    assert_eq!(answers[1], MemberAnswer::New);
    let fence_k3 = again.tx(1).unwrap().fencing_token();
    again.abort().await;
    let k3 = store.inspect("ledger", "k3").await.unwrap();
    assert!(
        k3.inbox.is_none() && !k3.in_flight,
        "abort released k3: {k3:?}"
    );
    // The released record keeps the fencing counter: k3's next holder gets more.
    let mut next = unit(&store, lease);
    let claims = [req("k3", lease)];
    assert_eq!(next.claim(&claims).await.unwrap(), [MemberAnswer::New]);
    assert!(next.tx(0).unwrap().fencing_token() > fence_k3);
    next.abort().await;
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_in_flight_elsewhere_follow_the_in_flight_policy() {
    let (store, prefix) = store().await;
    let effects = Effects::default();
    let none = serde_json::json!({});
    let lease = Duration::from_secs(5);
    let held_req = ClaimRequest {
        consumer: "ledger",
        key: "held",
        fingerprint: "fp",
        lease,
    };

    // Reject: the held key is retried later, the rest of the batch goes on.
    let Claim::New(other) = store.claim(&held_req).await.unwrap() else {
        panic!("new")
    };
    let queue = MemoryQueue::new("test");
    queue.push(payment("free", 1, none.clone()));
    queue.push(payment("held", 2, none.clone()));
    queue.close();
    // Runs until "free" is processed and "held" was answered retry-later at
    // least once (a condition, not a time: a loaded machine may need longer).
    let seen = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let rejecting = consumer(&store, &effects)
        .on_outcome({
            let seen = Arc::clone(&seen);
            move |outcome| match outcome.kind() {
                OutcomeKind::Processed => {
                    seen.0.fetch_add(1, Ordering::SeqCst);
                }
                OutcomeKind::RetryLater => {
                    seen.1.fetch_add(1, Ordering::SeqCst);
                }
                _ => {}
            }
        })
        .build()
        .unwrap();
    let stop = {
        let seen = Arc::clone(&seen);
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while seen.0.load(Ordering::SeqCst) < 1 || seen.1.load(Ordering::SeqCst) < 1 {
                assert!(
                    Instant::now() < deadline,
                    "no outcome for both keys in 30 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let summary = rejecting
        .run_batched_until(queue.source(), batches(10), stop)
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
    assert!(summary.count(OutcomeKind::RetryLater) >= 1, "{summary}");
    assert_eq!(effects.calls("held"), 0, "never ran while held elsewhere");

    // Wait: the batch polls the held key until its holder completes it, and
    // answers the copy as a duplicate with the stored result.
    let holder = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let result = serde_json::json!({ "amount": 2 });
            let req = ClaimRequest {
                consumer: "ledger",
                key: "held",
                fingerprint: &payment_fp(),
                lease,
            };
            store.commit(other, &req, Some(&result)).await.unwrap();
        })
    };
    let waiting = consumer(&store, &effects)
        .in_flight(InFlightPolicy::Wait {
            poll: Duration::from_millis(20),
            max_wait: Duration::from_secs(5),
        })
        .build()
        .unwrap();
    let summary = tokio::time::timeout(
        Duration::from_secs(10),
        waiting.run_batched(queue.source(), batches(10)),
    )
    .await
    .unwrap()
    .unwrap();
    holder.await.unwrap();
    assert_eq!(summary.count(OutcomeKind::Duplicate), 1, "{summary}");
    assert_eq!(effects.calls("held"), 0);
    assert_eq!(queue.acked(), 2);
    cleanup(&store, &prefix).await;
}

/// The fingerprint the consumer computes for `payment("held", 2, {})`.
fn payment_fp() -> String {
    idemq::FingerprintSpec::Payload
        .compute(&payment("held", 2, serde_json::json!({})))
        .unwrap()
}
