//! The Redis Streams source against a real Redis (127.0.0.1:6379 by default,
//! `IDEMQ_TEST_REDIS` to change) with the PostgreSQL ledger of `tests/support`.
#![cfg(all(feature = "redis-streams", feature = "postgres"))]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemq::source::redis_stream::{
    RedisStreamConfig, RedisStreamPublisher, RedisStreamSource, ENTRY_ID_HEADER, REASON_FIELD,
};
use idemq::source::{Delivery, Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::DeadLetterReason;
use idemq::{Consumer, Message, Outcome, OutcomeKind, RetryPolicy, SourceError};
use support::{assert_dead_lettered, payment, workload, Ledger, Plan, SwallowAcks};

fn redis_url() -> String {
    std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A fresh stream config: 1 s claim idle time, 200 ms blocking reads.
fn config(stream: &str) -> RedisStreamConfig {
    RedisStreamConfig::new(redis_url(), stream, "billing")
        .claim_idle(Duration::from_secs(1))
        .block(Duration::from_millis(200))
}

async fn redis() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn publish(config: &RedisStreamConfig, messages: &[Message]) {
    let publisher = RedisStreamPublisher::connect(config).await.unwrap();
    for m in messages {
        publisher.publish(m).await.unwrap();
    }
}

/// Deletes the test's streams.
async fn cleanup(streams: &[&str]) {
    let mut conn = redis().await;
    for s in streams {
        let _: i64 = redis::cmd("DEL")
            .arg(*s)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// Entries pending in `group` of `stream`, per consumer.
async fn pending_per_consumer(stream: &str, group: &str) -> HashMap<String, usize> {
    let mut conn = redis().await;
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(1000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut per = HashMap::new();
    for (_, consumer, _, _) in rows {
        *per.entry(consumer).or_default() += 1;
    }
    per
}

fn outcome_key(outcome: &Outcome) -> Option<String> {
    match outcome {
        Outcome::Processed { key, .. } => Some(key.clone()),
        Outcome::Duplicate { record } | Outcome::Conflict { record, .. } => {
            Some(record.key.clone())
        }
        Outcome::RetryLater { key, .. } | Outcome::DeadLettered { key, .. } => key.clone(),
    }
}

/// Every outcome with its time, shared by the consumers of one test.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<Vec<Entry>>>);

/// When, what, and for which key.
type Entry = (Instant, OutcomeKind, Option<String>);

impl Tally {
    fn hook(&self) -> impl Fn(&Outcome) + Send + Sync + 'static {
        let all = Arc::clone(&self.0);
        move |o: &Outcome| {
            all.lock()
                .unwrap()
                .push((Instant::now(), o.kind(), outcome_key(o)))
        }
    }

    /// Outcomes that end a delivery for good (everything but retry-later).
    fn finals(&self) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k != OutcomeKind::RetryLater)
            .count()
    }

    fn count(&self, kind: OutcomeKind) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k == kind)
            .count()
    }

    /// (time, kind) of every outcome of `key`, in order.
    fn of(&self, key: &str) -> Vec<(Instant, OutcomeKind)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, k)| k.as_deref() == Some(key))
            .map(|(t, kind, ..)| (*t, *kind))
            .collect()
    }
}

/// Counts the deliveries a source hands out, per message key, and the
/// highest delivery count seen per key.
#[derive(Clone, Default)]
struct Deliveries(Arc<Mutex<HashMap<String, (u32, u32)>>>);

impl Deliveries {
    fn wrap<S: Source>(&self, inner: S) -> Counting<S> {
        Counting {
            inner,
            seen: self.clone(),
        }
    }

    fn get(&self, key: &str) -> (u32, u32) {
        self.0.lock().unwrap().get(key).copied().unwrap_or_default()
    }

    fn total(&self) -> u32 {
        self.0.lock().unwrap().values().map(|(n, _)| n).sum()
    }
}

struct Counting<S> {
    inner: S,
    seen: Deliveries,
}

#[async_trait]
impl<S: Source> Source for Counting<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let delivery = self.inner.next().await?;
        if let Some(d) = &delivery {
            let key = d.message.key.clone().unwrap_or_default();
            let mut seen = self.seen.0.lock().unwrap();
            let entry = seen.entry(key).or_default();
            entry.0 += 1;
            entry.1 = entry.1.max(d.meta.delivery_count);
        }
        Ok(delivery)
    }
}

/// Runs `source` until `done` holds (checked every 50 ms) or `limit` passes.
async fn run_until(
    consumer: &Consumer<PostgresStore>,
    source: impl Source,
    limit: Duration,
    done: impl Fn() -> bool,
) {
    let deadline = Instant::now() + limit;
    consumer
        .run_until(source, async {
            while !done() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .unwrap();
    assert!(done(), "not done within {limit:?}");
}

/// Reads `n` entries of the dead-letter stream `name` (through a source of its own group).
async fn read_dead_letter_stream(name: &str, n: usize) -> Vec<Message> {
    let mut source = RedisStreamSource::connect(config(name).consumer("inspector"))
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("dead-letter stream entry in time")
            .unwrap()
            .unwrap();
        let (message, _, _, acker) = delivery.into_parts();
        acker.ack().await.unwrap();
        got.push(message);
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_applied_once_and_poison_is_dead_lettered() {
    let ledger = Ledger::new().await;
    let stream = support::unique("dup");
    let dlq = support::unique("dup_dead");
    let config = config(&stream).dead_letter_stream(&dlq);
    let w = workload(16, 2);
    publish(&config, &w.messages).await;
    // An entry without a payload field: a defect the engine dead-letters.
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("id")
        .arg("m-broken")
        .arg("key")
        .arg("broken")
        .query_async(&mut redis().await)
        .await
        .unwrap();

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .concurrency(4)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = RedisStreamSource::connect(config).await.unwrap();
    let total = w.messages.len() + 1;
    run_until(&consumer, source, Duration::from_secs(30), || {
        tally.finals() >= total
    })
    .await;

    ledger.assert_exactly_once(&w.expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), w.expected.len());
    assert_eq!(tally.count(OutcomeKind::Duplicate), w.duplicates);
    assert_eq!(tally.count(OutcomeKind::DeadLettered), w.poison.len() + 1);
    let letters = ledger.dead_letters().await;
    assert_dead_lettered(&letters, &w.poison, &DeadLetterReason::PermanentFailure);
    assert!(
        letters.iter().any(|l| l.reason == "malformed_record"),
        "the entry without payload: {letters:?}"
    );
    assert!(
        pending_per_consumer(&stream, "billing").await.is_empty(),
        "everything is acked"
    );

    // The dead letters are on the dead-letter stream too, with their reason.
    let mut copies = read_dead_letter_stream(&dlq, w.poison.len() + 1).await;
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(copies[0].key.as_deref(), Some("broken"));
    assert_eq!(
        copies[0].headers.get(REASON_FIELD),
        Some(&b"malformed_record"[..])
    );
    for (copy, key) in copies[1..].iter().zip(&w.poison) {
        assert_eq!(copy.key.as_deref(), Some(key.as_str()));
        assert_eq!(copy.id, Some(format!("m-{key}")));
        assert_eq!(
            copy.headers.get(REASON_FIELD),
            Some(&b"permanent_failure"[..])
        );
        assert_eq!(copy.headers.get("event_id"), Some(key.as_bytes()));
        assert!(copy.headers.get(ENTRY_ID_HEADER).is_some());
        assert_eq!(copy.json().unwrap()["payment_id"], key.as_str());
    }
    cleanup(&[&stream, &dlq]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let stream = support::unique("swallow");
    // A stable consumer name: the restarted consumer re-reads its own pending entries.
    let config = config(&stream).consumer("worker-1");
    let messages: Vec<Message> = (0..3)
        .map(|i| {
            payment(
                &format!("m-{i}"),
                &format!("p-{i}"),
                i + 1,
                serde_json::json!({}),
            )
        })
        .collect();
    publish(&config, &messages).await;
    let expected: BTreeMap<String, i64> = (0..3).map(|i| (format!("p-{i}"), i + 1)).collect();

    // First consumer: commits p-1, but its XACK never reaches Redis.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SwallowAcks::new(
        RedisStreamSource::connect(config.clone()).await.unwrap(),
        |d| d.message.key.as_deref() == Some("p-1"),
    );
    let swallowed = Arc::clone(&source.swallowed);
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 3
    })
    .await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(
        pending_per_consumer(&stream, "billing").await,
        HashMap::from([("worker-1".to_owned(), 1)])
    );

    // The same consumer restarts: it re-reads its pending p-1 at once, and
    // the inbox finds it already processed.
    let again = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(again.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(RedisStreamSource::connect(config).await.unwrap());
    let started = Instant::now();
    run_until(&consumer, source, Duration::from_secs(10), || {
        again.finals() >= 1
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "re-read at once, not claimed after the idle time"
    );
    assert_eq!(again.count(OutcomeKind::Duplicate), 1);
    assert_eq!(again.count(OutcomeKind::Processed), 0);
    assert_eq!(
        deliveries.get("p-1"),
        (1, 2),
        "one redelivery, delivered twice"
    );
    ledger.assert_exactly_once(&expected).await;
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_before_the_commit_applies_once_after_restart() {
    let ledger = Ledger::new().await;
    let stream = support::unique("kill");
    let config = config(&stream);
    publish(
        &config,
        &[payment(
            "m-0",
            "p-0",
            7,
            serde_json::json!({ "sleep_ms": 1500 }),
        )],
    )
    .await;

    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("billing", Arc::clone(&plan))
        .build()
        .unwrap();
    let source = RedisStreamSource::connect(config.clone()).await.unwrap();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while plan.calls.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the handler was never called");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    run.abort(); // killed mid-handler, before the commit
    assert!(run.await.unwrap_err().is_cancelled());
    assert!(ledger.rows().await.is_empty());

    // A new consumer (another name) claims the entry once it is idle.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::clone(&plan))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(RedisStreamSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 1
    })
    .await;
    assert_eq!(tally.count(OutcomeKind::Processed), 1);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2);
    assert_eq!(deliveries.get("p-0"), (1, 2), "claimed, delivery count 2");
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-0".to_owned(), 7)]))
        .await;
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_wait_for_their_delay_and_end_on_the_dead_letter_stream() {
    let ledger = Ledger::new().await;
    let stream = support::unique("retry");
    let dlq = support::unique("retry_dead");
    let config = config(&stream).dead_letter_stream(&dlq);
    publish(
        &config,
        &[
            payment(
                "m-flaky",
                "p-flaky",
                3,
                serde_json::json!({ "fail": "retry", "fail_times": 2 }),
            ),
            payment("m-bad", "p-bad", 4, serde_json::json!({ "fail": "retry" })),
        ],
    )
    .await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    // A 1.5 s backoff, longer than the 1 s claim idle time: the held entries
    // must not be claimed (and delivered early) meanwhile.
    let retry = RetryPolicy {
        initial_backoff: Duration::from_millis(1500),
        max_backoff: Duration::from_millis(1500),
        multiplier: 1.0,
        ..support::fast_retry()
    };
    let consumer = ledger
        .consumer("billing", Arc::clone(&plan))
        .retry(retry)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(RedisStreamSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 2
    })
    .await;

    ledger
        .assert_exactly_once(&BTreeMap::from([("p-flaky".to_owned(), 3)]))
        .await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 6, "3 calls each");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    assert_eq!(deliveries.get("p-bad"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        let outcomes = tally.of(key);
        assert_eq!(outcomes.len(), 3, "{key}: {outcomes:?}");
        for pair in outcomes.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap >= Duration::from_millis(1400) && gap < Duration::from_millis(3000),
                "{key}: redelivered after {gap:?}, not after the 1.5 s delay"
            );
        }
    }
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    let copies = read_dead_letter_stream(&dlq, 1).await;
    assert_eq!(copies[0].key.as_deref(), Some("p-bad"));
    assert_eq!(
        copies[0].headers.get(REASON_FIELD),
        Some(&b"retries_exhausted"[..])
    );
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream, &dlq]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_apply_every_message_once() {
    let ledger = Ledger::new().await;
    let stream = support::unique("compete");
    let mut config = config(&stream);
    config.count = 3; // small batches, so that both consumers get work
    let mut w = workload(30, 0);
    // A handler slower than the claim idle time: its entry must stay with its consumer.
    w.messages.insert(
        0,
        payment(
            "m-slow",
            "p-slow",
            99,
            serde_json::json!({ "sleep_ms": 2500 }),
        ),
    );
    w.expected.insert("p-slow".into(), 99);
    publish(&config, &w.messages).await;

    let tally = Tally::default();
    let deliveries = [Deliveries::default(), Deliveries::default()];
    let plan = Arc::new(Plan::default());
    let total = w.messages.len();
    let mut runs = Vec::new();
    for seen in &deliveries {
        let consumer = ledger
            .consumer("billing", Arc::clone(&plan))
            .concurrency(3)
            .on_outcome(tally.hook())
            .build()
            .unwrap();
        let source = seen.wrap(RedisStreamSource::connect(config.clone()).await.unwrap());
        let tally = tally.clone();
        runs.push(tokio::spawn(async move {
            run_until(&consumer, source, Duration::from_secs(30), || {
                tally.finals() >= total
            })
            .await
        }));
    }
    for run in runs {
        run.await.unwrap();
    }
    ledger.assert_exactly_once(&w.expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), w.expected.len());
    assert_eq!(tally.count(OutcomeKind::Duplicate), w.duplicates);
    let per_consumer: Vec<u32> = deliveries.iter().map(Deliveries::total).collect();
    assert_eq!(
        per_consumer.iter().sum::<u32>(),
        total as u32,
        "every entry delivered once: {per_consumer:?}"
    );
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "both consumers got work: {per_consumer:?}"
    );
    let slow: Vec<(u32, u32)> = deliveries.iter().map(|d| d.get("p-slow")).collect();
    assert!(
        slow.contains(&(1, 1)) && slow.contains(&(0, 0)),
        "the slow entry was claimed away: {slow:?}"
    );
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_consumers_pending_entries_are_claimed_by_another() {
    let ledger = Ledger::new().await;
    let stream = support::unique("claim");
    let config = config(&stream);
    let messages: Vec<Message> = (0..4)
        .map(|i| {
            payment(
                &format!("m-{i}"),
                &format!("p-{i}"),
                i + 1,
                serde_json::json!({}),
            )
        })
        .collect();
    publish(&config, &messages).await;

    // A consumer reads all four entries and dies without settling them.
    let mut doomed = RedisStreamSource::connect(config.clone().consumer("doomed"))
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(doomed.next().await.unwrap().unwrap());
    }
    drop(held);
    drop(doomed);
    assert_eq!(
        pending_per_consumer(&stream, "billing").await,
        HashMap::from([("doomed".to_owned(), 4)])
    );

    // Another consumer: nothing new to read; it claims the idle entries.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(
        RedisStreamSource::connect(config.clone().consumer("rescuer"))
            .await
            .unwrap(),
    );
    run_until(&consumer, source, Duration::from_secs(15), || {
        tally.finals() >= 4
    })
    .await;
    assert_eq!(tally.count(OutcomeKind::Processed), 4);
    for i in 0..4 {
        assert_eq!(deliveries.get(&format!("p-{i}")), (1, 2), "p-{i}");
    }
    let expected: BTreeMap<String, i64> = (0..4).map(|i| (format!("p-{i}"), i + 1)).collect();
    ledger.assert_exactly_once(&expected).await;
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn connecting_to_a_stream_of_another_type_fails() {
    let key = support::unique("not_a_stream");
    let mut conn = redis().await;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(matches!(
        RedisStreamSource::connect(config(&key)).await,
        Err(SourceError::Broker(_))
    ));
    cleanup(&[&key]).await;
}
