#![cfg(all(feature = "redis", feature = "postgres"))]
//! The Redis lease store and the cache in front of PostgreSQL, against a real
//! Redis (127.0.0.1:6379, `IDEMQ_TEST_REDIS`) and, for the outage tests, a
//! throwaway `redis-server` that is killed and restarted mid-run.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{payment, unique, Ledger, PgTx};
use idemq::source::queue::MemoryQueue;
use idemq::store::cache::{CachedStore, RedisFilter};
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::{Claim, ClaimRequest, Store};
use idemq::{
    handler_fn, Consumer, ConsumerBuilder, HandlerError, KeySpec, Message, Outcome, OutcomeKind,
    RetryPolicy, StoreErrorKind,
};

fn redis_url() -> String {
    std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn options(prefix: &str) -> RedisOptions {
    RedisOptions::default()
        .prefix(prefix)
        .retention(Duration::from_secs(600))
        .timeouts(Duration::from_millis(500), Duration::from_millis(500))
}

async fn store(url: &str) -> (RedisStore, String) {
    let prefix = unique("rs");
    let store = RedisStore::connect_with(url, options(&prefix))
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

/// A downstream system that remembers the fencing numbers it accepted per
/// key and refuses a write carrying a lower number than one already seen.
#[derive(Default, Clone)]
struct Effects(Arc<Mutex<HashMap<String, Vec<u64>>>>);

impl Effects {
    fn apply(&self, key: &str, fence: u64) -> Result<(), HandlerError> {
        let mut map = self.0.lock().unwrap();
        let seen = map.entry(key.to_owned()).or_default();
        if seen.iter().any(|f| *f > fence) {
            return Err(HandlerError::permanent(format!(
                "stale fencing token {fence} for {key}"
            )));
        }
        seen.push(fence);
        Ok(())
    }

    fn snapshot(&self) -> HashMap<String, Vec<u64>> {
        self.0.lock().unwrap().clone()
    }

    /// Every key of `expected` was applied; a lease store cannot undo a
    /// handler's effect whose completion failed, so at most `in_flight`
    /// keys (the handlers in flight at an outage or a switch) were applied
    /// again, each time with a higher fencing number. Returns how many.
    fn assert_fenced_once(&self, expected: &BTreeMap<String, i64>, in_flight: usize) -> usize {
        let applied = self.snapshot();
        let lost: Vec<_> = expected
            .keys()
            .filter(|k| !applied.contains_key(*k))
            .collect();
        assert!(lost.is_empty(), "lost: {lost:?}");
        let repeated: Vec<_> = applied.iter().filter(|(_, f)| f.len() > 1).collect();
        assert!(
            repeated.len() <= in_flight,
            "repeated effects beyond the {in_flight} handlers in flight: {repeated:?}"
        );
        for fences in applied.values() {
            assert!(
                fences.windows(2).all(|w| w[0] < w[1]),
                "fences rise: {fences:?}"
            );
        }
        repeated.len()
    }
}

/// A consumer over the Redis store whose handler applies its effect to
/// `effects` with the lease's fencing number; payload `sleep_ms` delays it.
fn redis_consumer(store: &RedisStore, effects: &Effects) -> ConsumerBuilder<RedisStore> {
    let effects = effects.clone();
    Consumer::builder("ledger", store.clone())
        .key(KeySpec::json("/payment_id"))
        .retry(retry())
        .handler(handler_fn(move |ctx, lease: &mut RedisLease| {
            let effects = effects.clone();
            Box::pin(async move {
                let payload: serde_json::Value =
                    ctx.message.json().map_err(HandlerError::permanent)?;
                let sleep = payload["sleep_ms"].as_u64().unwrap_or(1);
                tokio::time::sleep(Duration::from_millis(sleep)).await;
                effects.apply(ctx.key, lease.fencing_token())?;
                Ok(Some(serde_json::json!({ "amount": payload["amount"] })))
            })
        }))
}

/// A consumer over `store` (PostgreSQL behind the cache) writing the ledger
/// row through the claim's transaction.
fn cached_pg_consumer(
    ledger: &Ledger,
    store: CachedStore<PostgresStore>,
) -> ConsumerBuilder<CachedStore<PostgresStore>> {
    let insert: Arc<str> = format!(
        "INSERT INTO {}ledger (msg_key, amount) VALUES ($1, $2)",
        ledger.store.tables().prefix
    )
    .into();
    Consumer::builder("ledger", store)
        .key(KeySpec::json("/payment_id"))
        .retry(retry())
        .handler(handler_fn(move |ctx, tx: &mut PgTx| {
            let insert = Arc::clone(&insert);
            Box::pin(async move {
                let payload: serde_json::Value =
                    ctx.message.json().map_err(HandlerError::permanent)?;
                if let Some(ms) = payload["sleep_ms"].as_u64() {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                sqlx::query(&insert)
                    .bind(ctx.key)
                    .bind(payload["amount"].as_i64().unwrap_or(0))
                    .execute(&mut **tx)
                    .await?;
                Ok(Some(serde_json::json!({ "amount": payload["amount"] })))
            })
        }))
}

/// 1,000 payments, each published 1 to 3 times; half of the copies shuffled.
fn duplicated(n: usize, extra: serde_json::Value) -> (Vec<Message>, BTreeMap<String, i64>) {
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..n {
        let key = format!("p-{i}");
        let amount = i as i64 + 1;
        for c in 0..1 + fastrand::usize(..3) {
            messages.push(payment(&format!("m-{i}-{c}"), &key, amount, extra.clone()));
        }
        expected.insert(key, amount);
    }
    let mut tail = messages.split_off(messages.len() / 2);
    fastrand::shuffle(&mut tail);
    messages.extend(tail);
    (messages, expected)
}

fn queue_of(messages: &[Message]) -> MemoryQueue {
    let queue = MemoryQueue::new("test");
    for m in messages {
        queue.push(m.clone());
    }
    queue.close();
    queue
}

/// Runs `workers` consumers (each with `concurrency`) over one queue; returns
/// the summed counts of processed and duplicate outcomes.
async fn run_workers<S: Store>(
    builders: Vec<ConsumerBuilder<S>>,
    queue: &MemoryQueue,
    limit: Duration,
) -> (u64, u64) {
    let handles: Vec<_> = builders
        .into_iter()
        .map(|b| {
            let consumer = b.build().unwrap();
            let source = queue.source();
            tokio::spawn(async move { consumer.run(source).await })
        })
        .collect();
    let (mut processed, mut duplicates) = (0, 0);
    for h in handles {
        let summary = tokio::time::timeout(limit, h)
            .await
            .expect("workers finish in time")
            .unwrap()
            .unwrap();
        processed += summary.count(OutcomeKind::Processed);
        duplicates += summary.count(OutcomeKind::Duplicate);
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 0);
        assert_eq!(summary.count(OutcomeKind::Conflict), 0);
    }
    (processed, duplicates)
}

fn req<'a>(key: &'a str, lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer: "ledger",
        key,
        fingerprint: "fp",
        lease,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_consumer_loses_its_lease_and_another_applies_once() {
    let (store, prefix) = store(&redis_url()).await;
    let lease = Duration::from_millis(300);

    // 1. A whole process dies mid-handler: its runtime (heartbeat included)
    // vanishes and nothing is released. Its lease expires after `lease`.
    let url = redis_url();
    let p = prefix.clone();
    let (dead_fence, claimed_at) = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let fence = rt.block_on(async {
            let store = RedisStore::connect_with(&url, options(&p)).await.unwrap();
            let Claim::New(held) = store.claim(&req("crash", lease)).await.unwrap() else {
                panic!("first claim must be new")
            };
            let claimed_at = Instant::now();
            let fence = held.fencing_token();
            std::mem::forget(held); // no drop, no release: the process is gone
            (fence, claimed_at)
        });
        drop(rt);
        fence
    })
    .join()
    .unwrap();
    let started = Instant::now();
    let takeover = loop {
        match store.claim(&req("crash", lease)).await.unwrap() {
            Claim::InFlight => tokio::time::sleep(Duration::from_millis(20)).await,
            Claim::New(l) => break l,
            Claim::Done(_) => panic!("never completed"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "lease never expired"
        );
    };
    assert!(
        claimed_at.elapsed() >= lease - Duration::from_millis(20),
        "not taken over before the dead holder's lease ended: {:?}",
        claimed_at.elapsed()
    );
    assert!(takeover.fencing_token() > dead_fence);
    store
        .commit(takeover, &req("crash", lease), None)
        .await
        .unwrap();

    // 2. A consumer task aborted mid-handler: its dropped lease is released,
    // the redelivery is handled by another consumer, and applied once.
    let effects = Effects::default();
    let queue = queue_of(&[payment(
        "m-h",
        "hang",
        7,
        serde_json::json!({ "sleep_ms": 60_000 }),
    )]);
    let first = redis_consumer(&store, &effects)
        .lease(lease)
        .build()
        .unwrap();
    let source = queue.source();
    let crashed = tokio::spawn(async move { first.run(source).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        in_flight(&store, "hang").await,
        "the first consumer holds the key"
    );
    crashed.abort();
    let _ = crashed.await;
    // The redelivery must not sleep a minute: make the second handler fast.
    let fast = Effects::default();
    let second = Consumer::builder("ledger", store.clone())
        .key(KeySpec::json("/payment_id"))
        .retry(retry())
        .lease(lease)
        .handler(handler_fn(move |ctx, l: &mut RedisLease| {
            let fast = fast.clone();
            Box::pin(async move {
                fast.apply(ctx.key, l.fencing_token())?;
                Ok(None)
            })
        }))
        .build()
        .unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(10), second.run(queue.source()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1);
    assert!(
        effects.snapshot().is_empty(),
        "the dead handler applied nothing"
    );
    assert_eq!(queue.acked(), 1);
    let report = idemq::store::StoreAdmin::inspect(&store, "ledger", "hang")
        .await
        .unwrap();
    assert!(report.inbox.is_some() && !report.in_flight);
    cleanup(&store, &prefix).await;
}

/// Whether `key` of consumer `ledger` is in flight.
async fn in_flight(store: &RedisStore, key: &str) -> bool {
    idemq::store::StoreAdmin::inspect(store, "ledger", key)
        .await
        .unwrap()
        .in_flight
}

/// One heartbeat task serves every lease of a store: leases of two
/// lengths, held for several of their periods at once, all stay their
/// holders' (a competing claim sees them in flight throughout), and a lease
/// whose guard went (committed) stops being extended without touching the
/// others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_heartbeat_keeps_many_leases_of_different_lengths() {
    let (store, prefix) = store(&redis_url()).await;
    let (short, long) = (Duration::from_millis(300), Duration::from_millis(600));
    let keys: Vec<(String, Duration)> = (0..6)
        .map(|n| (format!("hb-{n}"), if n % 2 == 0 { short } else { long }))
        .collect();
    let mut held = Vec::new();
    for (key, lease) in &keys {
        let Claim::New(lease_held) = store.claim(&req(key, *lease)).await.unwrap() else {
            panic!("{key} is new")
        };
        held.push(lease_held);
    }
    // The first one completes early; the others are held for 1.5 s (five
    // short periods, two and a half long ones).
    let first = held.remove(0);
    store
        .commit(first, &req(&keys[0].0, short), None)
        .await
        .unwrap();
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1_500) {
        for (key, lease) in &keys[1..] {
            match store.claim(&req(key, *lease)).await.unwrap() {
                Claim::InFlight => {}
                Claim::New(stolen) => {
                    store.rollback(stolen).await.unwrap();
                    panic!("{key}'s lease was taken over while held");
                }
                Claim::Done(_) => panic!("{key} is not done"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (lease_held, (key, lease)) in held.into_iter().zip(&keys[1..]) {
        assert!(!lease_held.lease_lost(), "{key}");
        store
            .commit(lease_held, &req(key, *lease), None)
            .await
            .unwrap();
    }
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_keeps_a_slow_handler_s_lease() {
    let (store, prefix) = store(&redis_url()).await;
    let effects = Effects::default();
    let queue = queue_of(&[payment(
        "m-s",
        "slow",
        3,
        serde_json::json!({ "sleep_ms": 1_200 }),
    )]);
    let consumer = redis_consumer(&store, &effects)
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let source = queue.source();
    let running = tokio::spawn(async move { consumer.run(source).await });

    while !in_flight(&store, "slow").await {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // A competing worker claims the key every 25 ms while the handler runs
    // for four lease periods: it must see InFlight throughout, then Done.
    let mut busy = 0;
    let done = loop {
        match store
            .claim(&req("slow", Duration::from_millis(300)))
            .await
            .unwrap()
        {
            Claim::InFlight => busy += 1,
            Claim::New(stolen) => {
                store.rollback(stolen).await.unwrap();
                panic!("the lease was taken over while its handler ran");
            }
            Claim::Done(record) => break record,
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(busy >= 20, "claims seen in flight: {busy}");
    assert_eq!(done.result, Some(serde_json::json!({ "amount": 3 })));
    let summary = running.await.unwrap().unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1);
    assert_eq!(effects.snapshot()["slow"].len(), 1);
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_holder_is_fenced_off() {
    let (store, prefix) = store(&redis_url()).await;
    let lease = Duration::from_millis(300);
    let effects = Effects::default();

    // Holder A's process stalls (a stop-the-world pause: its runtime thread
    // is blocked, so its heartbeat cannot run) for longer than the lease.
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let (url, p, fx) = (redis_url(), prefix.clone(), effects.clone());
    let stale = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let store = RedisStore::connect_with(&url, options(&p)).await.unwrap();
            let Claim::New(held) = store.claim(&req("k", lease)).await.unwrap() else {
                panic!("A's claim must be new")
            };
            tx.send(held.fencing_token()).unwrap();
            std::thread::sleep(Duration::from_millis(900)); // the stall
                                                            // Awake again: the heartbeat runs and finds the key taken.
            tokio::time::sleep(Duration::from_millis(200)).await;
            let lost = held.lease_lost();
            let downstream = fx.apply("k", held.fencing_token());
            let commit = store.commit(held, &req("k", lease), None).await;
            (lost, downstream, commit)
        })
    });
    let fence_a = rx.recv().unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    let Claim::New(b) = store.claim(&req("k", lease)).await.unwrap() else {
        panic!("B takes over the expired lease")
    };
    let fence_b = b.fencing_token();
    assert!(fence_b > fence_a, "fence {fence_b} > {fence_a}");
    effects.apply("k", fence_b).unwrap();
    store
        .commit(b, &req("k", lease), Some(&serde_json::json!("B")))
        .await
        .unwrap();

    let (lost, downstream, commit) = stale.join().unwrap();
    assert!(lost, "the heartbeat reported the lost lease");
    assert!(
        downstream.is_err(),
        "the downstream refused the stale fence"
    );
    assert!(
        matches!(&commit, Err(e) if e.kind() == StoreErrorKind::LeaseLost && e.message().contains(r#""k""#)),
        "{commit:?}"
    );
    assert_eq!(effects.snapshot()["k"], vec![fence_b]);
    let Claim::Done(record) = store.claim(&req("k", lease)).await.unwrap() else {
        panic!("done")
    };
    assert_eq!(
        record.result,
        Some(serde_json::json!("B")),
        "B's completion stands"
    );
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_apply_duplicated_messages_once_with_the_redis_store() {
    let (store, prefix) = store(&redis_url()).await;
    let effects = Effects::default();
    let (messages, expected) = duplicated(1000, serde_json::json!({}));
    let queue = queue_of(&messages);
    let builders = (0..8)
        .map(|_| redis_consumer(&store, &effects).concurrency(4))
        .collect();
    let (processed, duplicates) = run_workers(builders, &queue, Duration::from_secs(60)).await;
    assert_eq!(processed, 1000);
    assert_eq!(processed + duplicates, messages.len() as u64);
    assert_eq!(queue.acked(), messages.len() as u64);
    let applied = effects.snapshot();
    assert_eq!(applied.len(), expected.len());
    let doubled: Vec<_> = applied.iter().filter(|(_, f)| f.len() != 1).collect();
    assert!(doubled.is_empty(), "double effects: {doubled:?}");
    cleanup(&store, &prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_apply_duplicated_messages_once_with_the_cache_in_front_of_postgres() {
    let ledger = Ledger::new().await;
    let prefix = unique("rf");
    let filter = RedisFilter::connect(&redis_url(), options(&prefix))
        .await
        .unwrap();
    let (messages, expected) = duplicated(1000, serde_json::json!({}));
    let queue = queue_of(&messages);
    // Each worker is a "process" with its own local cache; Redis is shared.
    let builders = (0..8)
        .map(|_| {
            let cached = CachedStore::new(ledger.store.clone())
                .local(10_000)
                .redis(filter.clone());
            cached_pg_consumer(&ledger, cached).concurrency(2)
        })
        .collect();
    let (processed, duplicates) = run_workers(builders, &queue, Duration::from_secs(90)).await;
    assert_eq!(processed, 1000);
    assert_eq!(processed + duplicates, messages.len() as u64);
    ledger.assert_exactly_once(&expected).await;
    for (key, amount) in [("p-0", 1), ("p-500", 501), ("p-999", 1000)] {
        let mark = filter.get("ledger", key).await.unwrap().expect("marked");
        assert_eq!(mark.result, Some(serde_json::json!({ "amount": amount })));
    }
    let (store, _) = store(&redis_url()).await;
    cleanup(&store, &prefix).await;
    ledger.cleanup().await;
}

/// A throwaway `redis-server` on a free port, with an append-only file
/// (fsync always) in a temp dir so that a restart keeps the leases and
/// done records.
struct Throwaway {
    port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Throwaway {
    async fn start() -> Self {
        let port = support::free_port();
        let mut server = Self {
            port,
            dir: tempfile::tempdir().unwrap(),
            child: None,
        };
        server.restart().await;
        server
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    async fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let client = redis::Client::open(self.url()).unwrap();
        for _ in 0..100 {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                if redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .is_ok()
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("redis-server on port {} did not start", self.port);
    }
}

impl Drop for Throwaway {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Kills the server once `progress` reaches `at`, keeps it down for
/// `down`, restarts it; sets `restarted` when done. Returns `progress` at
/// the kill and at the restart.
async fn outage(
    server: &mut Throwaway,
    progress: &AtomicU32,
    at: u32,
    down: Duration,
    restarted: &AtomicBool,
) -> (u32, u32) {
    while progress.load(Ordering::SeqCst) < at {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    server.kill();
    let at_kill = progress.load(Ordering::SeqCst);
    tokio::time::sleep(down).await;
    let at_restart = progress.load(Ordering::SeqCst);
    server.restart().await;
    restarted.store(true, Ordering::SeqCst);
    (at_kill, at_restart)
}

fn count_outcomes(
    processed: &Arc<AtomicU32>,
    transient: &Arc<AtomicU32>,
) -> impl Fn(&Outcome) + Send + Sync + 'static {
    let (processed, transient) = (Arc::clone(processed), Arc::clone(transient));
    move |o: &Outcome| match o {
        Outcome::Processed { .. } => {
            processed.fetch_add(1, Ordering::SeqCst);
        }
        Outcome::RetryLater { error, .. } if error.contains("transient store error") => {
            transient.fetch_add(1, Ordering::SeqCst);
        }
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_outage_is_retried_and_loses_nothing() {
    let mut server = Throwaway::start().await;
    let (store, _) = store(&server.url()).await;
    let effects = Effects::default();
    let (messages, expected) = duplicated(300, serde_json::json!({ "sleep_ms": 3 }));
    let queue = queue_of(&messages);
    let (processed, transient) = (Arc::default(), Arc::default());
    let workers = 4;
    let concurrency = 4;
    let builders: Vec<_> = (0..workers)
        .map(|_| {
            redis_consumer(&store, &effects)
                .concurrency(concurrency)
                .lease(Duration::from_millis(500))
                .on_outcome(count_outcomes(&processed, &transient))
        })
        .collect();
    let restarted = AtomicBool::new(false);
    let run = run_workers(builders, &queue, Duration::from_secs(60));
    let kill = outage(
        &mut server,
        &processed,
        100,
        Duration::from_millis(700),
        &restarted,
    );
    let ((done, _), (at_kill, _)) = tokio::join!(run, kill);
    assert!(
        at_kill < 300,
        "the outage began mid-run ({at_kill} processed)"
    );
    assert!(restarted.load(Ordering::SeqCst));
    assert!(
        transient.load(Ordering::SeqCst) > 0,
        "the outage surfaced as transient store errors"
    );
    assert_eq!(
        queue.acked(),
        messages.len() as u64,
        "every delivery settled"
    );
    effects.assert_fenced_once(&expected, workers * concurrency);
    assert!(done > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_outage_degrades_the_cache_to_postgres_only() {
    let mut server = Throwaway::start().await;
    let ledger = Ledger::new().await;
    let filter = RedisFilter::connect(&server.url(), options(&unique("rf")))
        .await
        .unwrap();
    let (messages, expected) = duplicated(300, serde_json::json!({ "sleep_ms": 40 }));
    let queue = queue_of(&messages);
    let (processed, transient) = (Arc::default(), Arc::default());
    let builders: Vec<_> = (0..4)
        .map(|_| {
            // No local cache: every duplicate asks Redis first.
            let cached = CachedStore::new(ledger.store.clone()).redis(filter.clone());
            cached_pg_consumer(&ledger, cached)
                .concurrency(2)
                .on_outcome(count_outcomes(&processed, &transient))
        })
        .collect();
    let restarted = AtomicBool::new(false);
    let run = run_workers(builders, &queue, Duration::from_secs(60));
    // Long enough that the calls cut off by the kill time out and the
    // fallback shows, on a loaded machine too.
    let kill = outage(
        &mut server,
        &processed,
        80,
        Duration::from_millis(1000),
        &restarted,
    );
    let ((done, dups), (at_kill, at_restart)) = tokio::join!(run, kill);
    assert!(
        at_kill < at_restart && at_restart < 300,
        "processing went on during the outage ({at_kill} → {at_restart}) and after it"
    );
    assert!(restarted.load(Ordering::SeqCst));
    assert_eq!(done, 300);
    assert_eq!(done + dups, messages.len() as u64);
    assert_eq!(
        transient.load(Ordering::SeqCst),
        0,
        "Redis errors never reach the engine: the cache degrades to SQL"
    );
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cache_never_answers_duplicate_for_a_rolled_back_key() {
    let ledger = Ledger::new().await;
    let prefix = unique("rf");
    let filter = RedisFilter::connect(&redis_url(), options(&prefix))
        .await
        .unwrap();
    let store = CachedStore::new(ledger.store.clone())
        .local(100)
        .redis(filter.clone());
    let table = format!("{}ledger", ledger.store.tables().prefix);
    let insert = format!("INSERT INTO {table} (msg_key, amount) VALUES ($1, $2)");
    let lease = Duration::from_secs(30);

    // 1. Rolled back: not cached, not marked, claimable again.
    let Claim::New(mut tx) = store.claim(&req("r", lease)).await.unwrap() else {
        panic!("new")
    };
    sqlx::query(&insert)
        .bind("r")
        .bind(1i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    store.rollback(tx).await.unwrap();
    assert!(!store.cached_locally("ledger", "r"));
    assert!(filter.get("ledger", "r").await.unwrap().is_none());
    assert!(matches!(
        store.claim(&req("r", lease)).await.unwrap(),
        Claim::New(_)
    ));

    // 2. The commit itself fails (a deferred constraint): a mark that
    // appeared meanwhile is removed and nothing is cached.
    sqlx::query(&format!(
        "ALTER TABLE {table} ADD CONSTRAINT {table}_once UNIQUE (msg_key) DEFERRABLE INITIALLY DEFERRED"
    ))
    .execute(ledger.store.pool())
    .await
    .unwrap();
    let Claim::New(mut tx) = store.claim(&req("c", lease)).await.unwrap() else {
        panic!("new")
    };
    for _ in 0..2 {
        sqlx::query(&insert)
            .bind("c")
            .bind(1i64)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    let planted = idemq::store::InboxRecord {
        consumer: "ledger".into(),
        key: "c".into(),
        fingerprint: "fp".into(),
        result: None,
        first_seen_ms: 0,
    };
    filter.mark(&planted).await.unwrap();
    assert!(store.commit(tx, &req("c", lease), None).await.is_err());
    assert!(!store.cached_locally("ledger", "c"));
    assert!(
        filter.get("ledger", "c").await.unwrap().is_none(),
        "mark removed"
    );
    let Claim::New(tx) = store.claim(&req("c", lease)).await.unwrap() else {
        panic!("the failed key is claimable again, not a duplicate")
    };
    store.rollback(tx).await.unwrap();

    // 3. Committed: cached and marked, and answered as duplicate.
    let Claim::New(mut tx) = store.claim(&req("ok", lease)).await.unwrap() else {
        panic!("new")
    };
    sqlx::query(&insert)
        .bind("ok")
        .bind(2i64)
        .execute(&mut *tx)
        .await
        .unwrap();
    store
        .commit(tx, &req("ok", lease), Some(&serde_json::json!(2)))
        .await
        .unwrap();
    assert!(store.cached_locally("ledger", "ok"));
    assert!(filter.get("ledger", "ok").await.unwrap().is_some());
    let Claim::Done(record) = store.claim(&req("ok", lease)).await.unwrap() else {
        panic!("duplicate")
    };
    assert_eq!(record.result, Some(serde_json::json!(2)));
    assert_eq!(ledger.rows().await, vec![("ok".to_owned(), 2)]);

    let redis_store = RedisStore::connect(&redis_url()).await.unwrap();
    cleanup(&redis_store, &prefix).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_frees_a_held_lease_and_fences_off_its_holder() {
    use idemq::store::StoreAdmin;
    let (store, prefix) = store(&redis_url()).await;
    let lease = Duration::from_secs(60);
    let Claim::New(stale) = store.claim(&req("k", lease)).await.unwrap() else {
        panic!("new")
    };
    assert!(store.release("ledger", "k").await.unwrap());
    assert!(!store.release("ledger", "k").await.unwrap());
    let Claim::New(fresh) = store.claim(&req("k", lease)).await.unwrap() else {
        panic!("a released key is claimable at once")
    };
    assert!(fresh.fencing_token() > stale.fencing_token());
    assert_eq!(
        store
            .commit(stale, &req("k", lease), None)
            .await
            .map_err(|e| e.kind()),
        Err(StoreErrorKind::LeaseLost)
    );
    store.commit(fresh, &req("k", lease), None).await.unwrap();
    assert!(
        !store.release("ledger", "k").await.unwrap(),
        "done keys are not leases"
    );
    cleanup(&store, &prefix).await;
}

/// The Redis Cluster of `scripts/redis-cluster.sh` (three masters, three
/// replicas on 127.0.0.1:7000-7005), `IDEMQ_TEST_REDIS_CLUSTER` (nodes
/// separated by commas) to change.
fn cluster_nodes() -> Vec<String> {
    std::env::var("IDEMQ_TEST_REDIS_CLUSTER")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".into()
        })
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// One node of the cluster: `CLUSTER NODES` as (id, port, is master, slot
/// count), read through the first node that answers.
async fn cluster_layout() -> Vec<(String, u16, bool, usize)> {
    for node in cluster_nodes() {
        let Ok(client) = redis::Client::open(node.as_str()) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let Ok(text) = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async::<String>(&mut conn)
            .await
        else {
            continue;
        };
        return text
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let port = f.get(1)?.split(['@', ':']).nth(1)?.parse().ok()?;
                let master = f.get(2)?.contains("master");
                let slots = f[8.min(f.len())..]
                    .iter()
                    .filter(|s| !s.starts_with('['))
                    .map(|s| match s.split_once('-') {
                        Some((a, b)) => {
                            b.parse::<usize>().unwrap_or(0) + 1 - a.parse::<usize>().unwrap_or(0)
                        }
                        None => 1,
                    })
                    .sum();
                Some((f[0].to_owned(), port, master, slots))
            })
            .collect();
    }
    panic!("no node of the Redis Cluster answers (scripts/redis-cluster.sh)");
}

/// Runs `redis-cli ARGS…` to its end; panics with its output on failure.
async fn redis_cli(args: Vec<String>) {
    let run = args.clone();
    let out = tokio::task::spawn_blocking(move || Command::new("redis-cli").args(&run).output())
        .await
        .unwrap()
        .expect("redis-cli");
    assert!(
        out.status.success(),
        "redis-cli {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Moves `slots` slots from the master `from` to the master `to`
/// (`redis-cli --cluster reshard`: each slot's keys are MIGRATEd while
/// clients get ASK and MOVED redirections).
async fn reshard(from: &str, to: &str, slots: usize) {
    redis_cli(
        [
            "--cluster",
            "reshard",
            "127.0.0.1:7000",
            "--cluster-from",
            from,
            "--cluster-to",
            to,
            "--cluster-slots",
            &slots.to_string(),
            "--cluster-yes",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    )
    .await;
}

/// Payments of the cluster test.
const PAYMENTS: usize = 2000;

/// 2,000 payments with duplicates through 4 workers on the Redis Cluster;
/// at a fifth processed a replica takes over its master (`CLUSTER FAILOVER`,
/// the coordinated failover: the replica catches up first), at two fifths
/// 300 of a master's slots move to another master with their keys. Every
/// payment is applied, only handlers in flight at a switch may run again
/// (with a higher fencing number), and every duplicate is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_and_a_slot_migration_mid_run_lose_nothing_on_a_cluster() {
    let nodes = cluster_nodes();
    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let prefix = unique("rc");
    let store = RedisStore::connect_cluster(&nodes, options(&prefix))
        .await
        .expect("connect to the Redis Cluster (scripts/redis-cluster.sh)");
    let effects = Effects::default();
    let (messages, expected) = duplicated(PAYMENTS, serde_json::json!({ "sleep_ms": 20 }));
    let queue = queue_of(&messages);
    let (processed, transient) = (Arc::default(), Arc::default());
    let (workers, concurrency) = (4, 4);
    let builders: Vec<_> = (0..workers)
        .map(|_| {
            redis_consumer(&store, &effects)
                .concurrency(concurrency)
                .lease(Duration::from_secs(2))
                .on_outcome(count_outcomes(&processed, &transient))
        })
        .collect();
    let run = run_workers(builders, &queue, Duration::from_secs(120));
    let switches = {
        let processed = Arc::clone(&processed);
        async move {
            let reach = |n: u32| {
                let processed = Arc::clone(&processed);
                async move {
                    while processed.load(Ordering::SeqCst) < n {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            };
            reach(PAYMENTS as u32 / 5).await;
            let layout = cluster_layout().await;
            let (_, replica, ..) = layout.iter().find(|n| !n.2).expect("a replica").clone();
            redis_cli(vec![
                "-p".into(),
                replica.to_string(),
                "cluster".into(),
                "failover".into(),
            ])
            .await;
            let started = Instant::now();
            while !cluster_layout().await.iter().any(|n| n.1 == replica && n.2) {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "the failover to {replica} did not happen"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let at_failover = processed.load(Ordering::SeqCst);
            reach(PAYMENTS as u32 * 2 / 5).await;
            let masters: Vec<_> = cluster_layout()
                .await
                .into_iter()
                .filter(|n| n.2 && n.3 > 0)
                .collect();
            let (from, to) = (&masters[0], &masters[1]);
            let moved = 300.min(from.3 / 2);
            reshard(&from.0, &to.0, moved).await;
            let at_migration = processed.load(Ordering::SeqCst);
            (
                at_failover,
                at_migration,
                from.0.clone(),
                to.0.clone(),
                moved,
            )
        }
    };
    let ((done, _), (at_failover, at_migration, from, to, moved)) = tokio::join!(run, switches);
    eprintln!("failover at {at_failover} processed, {moved} slots migrated by {at_migration}; {done} processed, {} transient errors", transient.load(Ordering::SeqCst));
    assert!(
        at_migration < PAYMENTS as u32,
        "the migration ended mid-run ({at_migration} processed)"
    );
    assert_eq!(
        queue.acked(),
        messages.len() as u64,
        "every delivery settled"
    );
    // Two switches: the handlers in flight at either may run again.
    let repeated = effects.assert_fenced_once(&expected, 2 * workers * concurrency);
    eprintln!("repeated effects: {repeated}");
    // Put the slots back, so that runs do not drift the layout.
    reshard(&to, &from, moved).await;
}

/// `wait_for_replicas` on the single test Redis, which has no replica: a
/// claim is refused with a transient error naming `WAIT` and leaves no
/// lease behind, so the same key is claimed at once without the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_for_replicas_refuses_a_claim_no_replica_acknowledged_and_releases_it() {
    let prefix = unique("rw");
    let waiting = RedisStore::connect_with(
        &redis_url(),
        options(&prefix).wait_for_replicas(1, Duration::from_millis(50)),
    )
    .await
    .expect("connect to Redis");
    let e = match waiting.claim(&req("p-1", Duration::from_secs(30))).await {
        Err(e) => e,
        Ok(_) => panic!("a claim no replica acknowledged was answered"),
    };
    assert_eq!(e.kind(), StoreErrorKind::Transient, "{e}");
    assert!(e.to_string().contains("0 of 1 replicas"), "{e}");
    let plain = RedisStore::connect_with(&redis_url(), options(&prefix))
        .await
        .expect("connect to Redis");
    let Ok(Claim::New(lease)) = plain.claim(&req("p-1", Duration::from_secs(30))).await else {
        panic!("the refused claim left its lease behind")
    };
    plain
        .commit(lease, &req("p-1", Duration::from_secs(30)), None)
        .await
        .unwrap();
    cleanup(&plain, &prefix).await;
}

/// `wait_for_replicas(1, …)` on the cluster (one replica per master):
/// per-message and batch consumers apply 300 duplicated payments once,
/// every claim and completion acknowledged by the key's master's replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wait_for_replicas_on_a_cluster_applies_everything_once() {
    let nodes = cluster_nodes();
    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
    let prefix = unique("rcw");
    let store = RedisStore::connect_cluster(
        &nodes,
        options(&prefix).wait_for_replicas(1, Duration::from_secs(2)),
    )
    .await
    .expect("connect to the Redis Cluster (scripts/redis-cluster.sh)");
    let effects = Effects::default();
    let (messages, expected) = duplicated(300, serde_json::json!({}));
    let queue = queue_of(&messages);
    let per_message = redis_consumer(&store, &effects)
        .concurrency(4)
        .build()
        .unwrap();
    let batched = redis_consumer(&store, &effects)
        .concurrency(4)
        .build()
        .unwrap();
    let (a, b) = tokio::join!(
        per_message.run(queue.source()),
        batched.run_batched(
            queue.source(),
            idemq::engine::BatchOptions::new(20, Duration::from_millis(5))
        )
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        a.count(OutcomeKind::Processed) + b.count(OutcomeKind::Processed),
        expected.len() as u64
    );
    assert_eq!(
        queue.acked(),
        messages.len() as u64,
        "every delivery settled"
    );
    assert_eq!(effects.assert_fenced_once(&expected, 0), 0);
}
