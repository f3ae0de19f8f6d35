//! Property tests of the engine over the in-memory queue and lease store:
//! random interleavings of deliveries, duplicates (broker copies and
//! producer-retry copies with new message ids), retryable and permanent
//! handler failures, slow handlers that outlive their lease, and crashes
//! (a delivery dropped unsettled before it is processed, or a handler
//! aborted mid-way after its effect was written) keep the exactly-once
//! invariant, at concurrency 1 to 4.
//!
//! The memory store is a *lease* store: a handler's effect happens outside
//! it, so an effect made by a handler that then crashed, or whose lease was
//! taken over, is not undone. The effect sink here is therefore fenced, as
//! a real downstream of a lease store must be: it keeps, per key, the
//! highest fencing number it accepted and refuses lower ones (the handler
//! then fails retryably). The checked invariant, per business key:
//!
//! - a key whose handler succeeds: exactly one `Processed` outcome (one
//!   committed completion), the inbox holds it, the sink's final write
//!   carries the fencing number of that committed completion, every other
//!   copy ended as a `Duplicate`, and no dead letter;
//! - a key whose handler fails permanently: no `Processed` outcome, no
//!   inbox record, and exactly one `permanent_failure` dead letter per
//!   published copy (the inbox records no dead-lettered key, so each copy
//!   reaches the handler and is dead-lettered once);
//! - nothing lost: every published copy was acked by the queue, and the
//!   number of acks equals the number of final outcomes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::source::queue::MemoryQueue;
use idemq::source::Source;
use idemq::store::memory::{Lease, MemoryStore};
use idemq::store::StoreAdmin;
use idemq::{Consumer, HandlerError, KeySpec, Message, Outcome, RetryPolicy};
use proptest::prelude::*;
use tokio::sync::Notify;

const LEASE: Duration = Duration::from_millis(40);

/// What one handler invocation of a key does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Writes its effect, then the worker crashes (the task is aborted).
    Crash,
    /// Fails retryably before writing anything.
    Retry,
    /// Sleeps past its lease, then writes and succeeds (if still fenced in).
    Slow,
    /// Writes its effect and succeeds.
    Ok,
    /// Fails permanently before writing anything.
    Permanent,
}

#[derive(Clone, Debug)]
struct KeyPlan {
    /// Verdicts of the first invocations; afterwards `last` forever.
    first: Vec<Verdict>,
    last: Verdict,
    /// Extra copies: `true` = a producer retry (new message id), `false` = broker duplicate.
    copies: Vec<bool>,
}

#[derive(Clone, Debug)]
struct Scenario {
    keys: Vec<KeyPlan>,
    /// Publication order, as indexes into the list of all copies.
    order: Vec<usize>,
    concurrency: usize,
    /// Deliveries to drop unsettled before processing (crash before the claim).
    drops: Vec<bool>,
}

fn verdict() -> impl Strategy<Value = Verdict> {
    prop_oneof![
        3 => Just(Verdict::Crash),
        3 => Just(Verdict::Retry),
        1 => Just(Verdict::Slow),
    ]
}

fn key_plan() -> impl Strategy<Value = KeyPlan> {
    (
        prop::collection::vec(verdict(), 0..3),
        prop_oneof![4 => Just(Verdict::Ok), 1 => Just(Verdict::Permanent)],
        prop::collection::vec(any::<bool>(), 0..3),
    )
        .prop_map(|(first, last, copies)| KeyPlan {
            first,
            last,
            copies,
        })
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (prop::collection::vec(key_plan(), 1..6), 1..=4usize)
        .prop_flat_map(|(keys, concurrency)| {
            let total: usize = keys.iter().map(|k| 1 + k.copies.len()).sum();
            let order = Just((0..total).collect::<Vec<_>>()).prop_shuffle();
            let drops = prop::collection::vec(prop::bool::weighted(0.15), total * 2);
            (Just(keys), order, Just(concurrency), drops)
        })
        .prop_map(|(keys, order, concurrency, drops)| Scenario {
            keys,
            order,
            concurrency,
            drops,
        })
}

/// The downstream of the handler: a fenced keyed write.
#[derive(Default)]
struct Sink {
    /// key → highest fencing number accepted.
    fences: HashMap<String, u64>,
    /// key → writes accepted.
    writes: HashMap<String, u32>,
}

#[derive(Default)]
struct World {
    sink: Mutex<Sink>,
    invocations: Mutex<HashMap<String, usize>>,
    /// Queue offset → the signal that aborts its in-flight task.
    crash: Mutex<HashMap<i64, Arc<Notify>>>,
    processed: Mutex<HashMap<String, Vec<u64>>>,
    /// Final outcomes (all but retry-later).
    outcomes: Mutex<u64>,
}

impl World {
    /// Applies a write with `fence`; false if the sink has seen a higher one.
    fn write(&self, key: &str, fence: u64) -> bool {
        let mut sink = self.sink.lock().unwrap();
        let seen = sink.fences.entry(key.to_owned()).or_default();
        if fence < *seen {
            return false;
        }
        *seen = fence;
        *sink.writes.entry(key.to_owned()).or_default() += 1;
        true
    }
}

fn run(scenario: &Scenario) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run_async(scenario))
}

async fn run_async(scenario: &Scenario) -> Result<(), TestCaseError> {
    let plans: HashMap<String, KeyPlan> = scenario
        .keys
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("k{i}"), p.clone()))
        .collect();
    let plans = Arc::new(plans);
    let world = Arc::new(World::default());
    let store = MemoryStore::new();

    let handler_world = Arc::clone(&world);
    let handler_plans = Arc::clone(&plans);
    let hook_world = Arc::clone(&world);
    let consumer = Consumer::builder("props", store.clone())
        .key(KeySpec::json("/k"))
        .lease(LEASE)
        .retry(
            RetryPolicy::default()
                .with_max_attempts(100)
                .with_initial_backoff(Duration::from_millis(1))
                .with_max_backoff(Duration::from_millis(5))
                .with_busy_delay(Duration::from_millis(5))
                .with_jitter(0.0),
        )
        .on_outcome(move |outcome| {
            if !matches!(outcome, Outcome::RetryLater { .. }) {
                *hook_world.outcomes.lock().unwrap() += 1;
            }
            if let Outcome::Processed { key, result } = outcome {
                let fence = result
                    .as_ref()
                    .and_then(|r| r["fence"].as_u64())
                    .unwrap_or(0);
                hook_world
                    .processed
                    .lock()
                    .unwrap()
                    .entry(key.clone())
                    .or_default()
                    .push(fence);
            }
        })
        .handler_fn(move |ctx, lease: &mut Lease| {
            let world = Arc::clone(&handler_world);
            let plans = Arc::clone(&handler_plans);
            let fence = lease.fencing_token();
            Box::pin(async move {
                let key = ctx.key.to_owned();
                let plan = &plans[&key];
                let n = {
                    let mut inv = world.invocations.lock().unwrap();
                    let n = inv.entry(key.clone()).or_default();
                    *n += 1;
                    *n - 1
                };
                let verdict = plan.first.get(n).copied().unwrap_or(plan.last);
                match verdict {
                    Verdict::Retry => return Err(HandlerError::retryable("flaky")),
                    Verdict::Permanent => return Err(HandlerError::permanent("rejected")),
                    Verdict::Slow => tokio::time::sleep(LEASE * 2).await,
                    Verdict::Crash | Verdict::Ok => {}
                }
                if !world.write(&key, fence) {
                    return Err(HandlerError::retryable("stale fencing token refused"));
                }
                if verdict == Verdict::Crash {
                    let offset = ctx.meta.offset.unwrap_or_default();
                    let signal = world.crash.lock().unwrap().get(&offset).cloned();
                    if let Some(signal) = signal {
                        signal.notify_one();
                        std::future::pending::<()>().await;
                    }
                }
                Ok(Some(serde_json::json!({ "fence": fence })))
            })
        })
        .build()
        .unwrap();

    // Publish every copy in the generated order.
    let mut copies: Vec<Message> = Vec::new();
    for (i, plan) in scenario.keys.iter().enumerate() {
        let payload = format!(r#"{{"k":"k{i}"}}"#);
        copies.push(Message::new(payload.clone()).with_id(format!("m{i}")));
        for (c, retry) in plan.copies.iter().enumerate() {
            let id = if *retry {
                format!("m{i}-retry{c}")
            } else {
                format!("m{i}")
            };
            copies.push(Message::new(payload.clone()).with_id(id));
        }
    }
    let queue = MemoryQueue::new("props");
    for &i in &scenario.order {
        queue.push(copies[i].clone());
    }
    queue.close();

    // The driver: up to `concurrency` deliveries in flight; some dropped
    // unsettled, some aborted mid-handler.
    let mut source = queue.source();
    let mut tasks = tokio::task::JoinSet::new();
    let permits = Arc::new(tokio::sync::Semaphore::new(scenario.concurrency));
    let mut drops = scenario.drops.iter().copied();
    let mut received = 0u32;
    loop {
        let permit = Arc::clone(&permits).acquire_owned().await.unwrap();
        let next = tokio::time::timeout(Duration::from_secs(20), source.next()).await;
        let Some(delivery) = next
            .map_err(|_| TestCaseError::fail("the queue stalled"))?
            .unwrap()
        else {
            break;
        };
        received += 1;
        prop_assert!(received < 2_000, "runaway redeliveries");
        if drops.next() == Some(true) {
            drop(delivery); // crash before the claim: redelivered at once
            continue;
        }
        let offset = delivery.meta.offset.unwrap_or_default();
        let signal = Arc::new(Notify::new());
        world
            .crash
            .lock()
            .unwrap()
            .insert(offset, Arc::clone(&signal));
        let consumer = consumer.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = consumer.process(delivery) => {}
                _ = signal.notified() => {} // the worker dies mid-handler
            }
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}

    // The invariant.
    let processed = world.processed.lock().unwrap().clone();
    let sink = std::mem::take(&mut *world.sink.lock().unwrap());
    let dead = store.dead_letters(None, 0, 10_000).await.unwrap();
    let mut dead_by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for d in &dead {
        dead_by_key
            .entry(d.key.clone().unwrap_or_default())
            .or_default()
            .push(d.reason.clone());
    }
    let published = copies.len() as u64;
    prop_assert_eq!(queue.acked(), published, "every copy acked once");
    prop_assert_eq!(queue.pending(), 0);
    prop_assert_eq!(*world.outcomes.lock().unwrap(), published);
    for (key, plan) in plans.iter() {
        let report = store.inspect("props", key).await.unwrap();
        let dead = dead_by_key.remove(key).unwrap_or_default();
        // A permanent key is processed only if a slow first invocation
        // completed before any copy reached the permanent failure.
        if plan.last == Verdict::Permanent && !processed.contains_key(key) {
            prop_assert!(!processed.contains_key(key), "{key} was processed");
            prop_assert!(report.inbox.is_none(), "{key} in the inbox");
            prop_assert_eq!(dead.len(), 1 + plan.copies.len(), "{} dead letters", key);
            prop_assert!(dead.iter().all(|r| r == "permanent_failure"), "{:?}", dead);
        } else {
            let fences = processed.get(key).cloned().unwrap_or_default();
            prop_assert_eq!(fences.len(), 1, "{} completed {:?}", key, fences);
            let inbox = report.inbox.as_ref();
            prop_assert!(inbox.is_some(), "{key} not in the inbox");
            prop_assert_eq!(
                inbox
                    .and_then(|r| r.result.as_ref())
                    .map(|r| r["fence"].clone()),
                Some(serde_json::json!(fences[0]))
            );
            prop_assert_eq!(sink.fences.get(key).copied(), Some(fences[0]));
            prop_assert!(dead.is_empty(), "{key} dead-lettered: {dead:?}");
        }
    }
    prop_assert!(
        dead_by_key.is_empty(),
        "dead letters of no key: {dead_by_key:?}"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_key_is_applied_once_or_dead_lettered(scenario in scenario()) {
        run(&scenario)?;
    }
}

/// A fixed scenario with every fault at once, so a failure is easy to replay.
#[test]
fn crashes_duplicates_and_failures_together() {
    let plan = |first: Vec<Verdict>, last, copies: Vec<bool>| KeyPlan {
        first,
        last,
        copies,
    };
    let scenario = Scenario {
        keys: vec![
            plan(
                vec![Verdict::Crash, Verdict::Retry],
                Verdict::Ok,
                vec![true, false],
            ),
            plan(vec![Verdict::Slow], Verdict::Ok, vec![false, false]),
            plan(vec![Verdict::Crash], Verdict::Permanent, vec![true]),
            plan(vec![], Verdict::Ok, vec![]),
        ],
        order: vec![0, 3, 6, 1, 4, 7, 2, 5, 8],
        concurrency: 3,
        drops: vec![false, true, false, false, true],
    };
    run(&scenario).unwrap();
}
