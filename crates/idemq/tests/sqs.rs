//! The SQS source against a real SQS endpoint (moto's server on
//! 127.0.0.1:5000 by default, `IDEMQ_TEST_SQS` to change; `scripts/sqs.sh`
//! starts it) with the PostgreSQL ledger of `tests/support`.
#![cfg(all(feature = "sqs", feature = "postgres"))]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemq::source::sqs::{SqsConfig, SqsPublisher, SqsSource, REASON_ATTRIBUTE};
use idemq::source::{Delivery, Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::DeadLetterReason;
use idemq::{Consumer, Message, Outcome, OutcomeKind, RetryPolicy, SourceError};
use support::{assert_dead_lettered, payment, workload, Ledger, Plan, SwallowAcks};

fn endpoint() -> String {
    std::env::var("IDEMQ_TEST_SQS").unwrap_or_else(|_| "http://127.0.0.1:5000".into())
}

/// A fresh queue config: 2 s visibility, 1 s long polls, queues created.
fn config(queue: &str) -> SqsConfig {
    SqsConfig::new(queue)
        .endpoint(endpoint())
        .region("us-east-1")
        .credentials("test", "test")
        .visibility(Duration::from_secs(2))
        .wait(Duration::from_secs(1))
        .create_queue(true)
}

async fn publish(config: &SqsConfig, messages: &[Message]) {
    let publisher = SqsPublisher::connect(config.clone()).await.unwrap();
    for m in messages {
        publisher.publish(m).await.unwrap();
    }
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

    fn processed_keys(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k == OutcomeKind::Processed)
            .filter_map(|(_, _, key)| key.clone())
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

/// Reads `n` messages from the dead-letter queue `name` and deletes them.
async fn drain_dead_letter_queue(name: &str, n: usize) -> Vec<Message> {
    let mut source = SqsSource::connect(config(name).create_queue(false))
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("dead-letter queue message in time")
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
    let queue = support::unique("dup");
    let dlq = support::unique("dup_dead");
    let config = config(&queue).dead_letter_queue(&dlq);
    let w = workload(16, 2);
    publish(&config, &w.messages).await;

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .concurrency(4)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SqsSource::connect(config).await.unwrap();
    let total = w.messages.len();
    run_until(&consumer, source, Duration::from_secs(40), || {
        tally.finals() >= total
    })
    .await;

    ledger.assert_exactly_once(&w.expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), w.expected.len());
    assert_eq!(tally.count(OutcomeKind::Duplicate), w.duplicates);
    assert_eq!(tally.count(OutcomeKind::DeadLettered), w.poison.len());
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );

    // The poison is in the SQS dead-letter queue too, with its reason and attributes.
    let mut copies = drain_dead_letter_queue(&dlq, w.poison.len()).await;
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    for (copy, key) in copies.iter().zip(&w.poison) {
        assert_eq!(copy.key.as_deref(), Some(key.as_str()));
        assert_eq!(copy.id, Some(format!("m-{key}")));
        assert_eq!(
            copy.headers.get(REASON_ATTRIBUTE),
            Some(&b"permanent_failure"[..])
        );
        assert_eq!(copy.headers.get("event_id"), Some(key.as_bytes()));
        assert_eq!(copy.json().unwrap()["payment_id"], key.as_str());
    }
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("swallow"));
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

    // First consumer: commits p-1, but its delete never reaches SQS.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SwallowAcks::new(SqsSource::connect(config.clone()).await.unwrap(), |d| {
        d.message.key.as_deref() == Some("p-1")
    });
    let swallowed = Arc::clone(&source.swallowed);
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 3
    })
    .await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The consumer is gone (source dropped): p-1 reappears after the
    // visibility timeout, and a new consumer finds it already processed.
    let again = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(again.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(SqsSource::connect(config).await.unwrap());
    let started = Instant::now();
    run_until(&consumer, source, Duration::from_secs(15), || {
        again.finals() >= 1
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "came back before the visibility timeout"
    );
    assert_eq!(again.count(OutcomeKind::Duplicate), 1);
    assert_eq!(again.count(OutcomeKind::Processed), 0);
    assert_eq!(
        deliveries.get("p-1"),
        (1, 2),
        "one redelivery, ApproximateReceiveCount 2"
    );
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_before_the_commit_applies_once_after_restart() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("kill"));
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
    let source = SqsSource::connect(config.clone()).await.unwrap();
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

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::clone(&plan))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(SqsSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 1
    })
    .await;
    assert_eq!(tally.count(OutcomeKind::Processed), 1);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        deliveries.get("p-0").1,
        2,
        "ApproximateReceiveCount of the redelivery"
    );
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-0".to_owned(), 7)]))
        .await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_wait_for_the_visibility_change_and_end_in_the_dead_letter_queue() {
    let ledger = Ledger::new().await;
    let dlq = support::unique("retry_dead");
    // A long visibility timeout: a retry that came from its expiry would take 6 s.
    let config = config(&support::unique("retry"))
        .visibility(Duration::from_secs(6))
        .dead_letter_queue(&dlq);
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
    // A 2 s backoff: far from both an immediate redelivery and the 6 s timeout.
    let retry = RetryPolicy {
        initial_backoff: Duration::from_secs(2),
        max_backoff: Duration::from_secs(2),
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
    let source = deliveries.wrap(SqsSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(30), || {
        tally.finals() >= 2
    })
    .await;

    ledger
        .assert_exactly_once(&BTreeMap::from([("p-flaky".to_owned(), 3)]))
        .await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 6, "3 calls each");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        let outcomes = tally.of(key);
        assert_eq!(outcomes.len(), 3, "{key}: {outcomes:?}");
        for pair in outcomes.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap >= Duration::from_millis(1900) && gap < Duration::from_millis(5000),
                "{key}: redelivered after {gap:?}, not after the nack's 2 s visibility change"
            );
        }
    }
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    let copies = drain_dead_letter_queue(&dlq, 1).await;
    assert_eq!(copies[0].key.as_deref(), Some("p-bad"));
    assert_eq!(
        copies[0].headers.get(REASON_ATTRIBUTE),
        Some(&b"retries_exhausted"[..])
    );
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_apply_every_message_once() {
    let ledger = Ledger::new().await;
    let mut config = config(&support::unique("compete"));
    config.batch = 3; // small batches, so that both consumers get work
    let w = workload(30, 0);
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
        let source = seen.wrap(SqsSource::connect(config.clone()).await.unwrap());
        let tally = tally.clone();
        runs.push(tokio::spawn(async move {
            run_until(&consumer, source, Duration::from_secs(40), || {
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
    assert!(
        per_consumer.iter().sum::<u32>() >= total as u32,
        "deliveries {per_consumer:?} for {total} messages"
    );
    println!("deliveries per consumer: {per_consumer:?}");
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_the_visibility_timeout_keeps_its_message() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("slow")); // 2 s visibility
    let mut messages = vec![payment(
        "m-slow",
        "p-slow",
        9,
        serde_json::json!({ "sleep_ms": 6000 }),
    )];
    messages.extend((0..4).map(|i| {
        payment(
            &format!("m-{i}"),
            &format!("p-{i}"),
            i + 1,
            serde_json::json!({}),
        )
    }));
    publish(&config, &messages).await;

    // Two consumers poll the queue: a lapsed visibility would hand the slow
    // message to the other one.
    let tally = Tally::default();
    let deliveries = Deliveries::default();
    let plan = Arc::new(Plan::default());
    let mut runs = Vec::new();
    for _ in 0..2 {
        let consumer = ledger
            .consumer("billing", Arc::clone(&plan))
            .on_outcome(tally.hook())
            .build()
            .unwrap();
        let source = deliveries.wrap(SqsSource::connect(config.clone()).await.unwrap());
        let tally = tally.clone();
        runs.push(tokio::spawn(async move {
            run_until(&consumer, source, Duration::from_secs(20), || {
                tally.finals() >= 5
            })
            .await
        }));
    }
    for run in runs {
        run.await.unwrap();
    }
    assert_eq!(
        deliveries.get("p-slow"),
        (1, 1),
        "the slow message was received again"
    );
    assert_eq!(deliveries.total(), 5);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 5);
    let mut expected: BTreeMap<String, i64> = (0..4).map(|i| (format!("p-{i}"), i + 1)).collect();
    expected.insert("p-slow".into(), 9);
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fifo_queue_keeps_the_order_of_each_message_group() {
    let ledger = Ledger::new().await;
    let config = config(&format!("{}.fifo", support::unique("order")));
    let groups = ["ga", "gb", "gc"];
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..5 {
        for (g, group) in groups.iter().enumerate() {
            let id = format!("{group}-{i}");
            let mut payload = serde_json::json!({ "payment_id": id, "amount": i + 1 });
            if g == 0 {
                payload["sleep_ms"] = 700.into(); // a slow group must not hold up the others
            }
            if g == 1 && i == 1 {
                // A retry in the middle of a group: the rest of the group waits for it.
                payload["fail"] = "retry".into();
                payload["fail_times"] = 1.into();
            }
            messages.push(
                Message::new(payload.to_string())
                    .with_id(format!("m-{id}"))
                    .with_key(*group),
            );
            expected.insert(id, i as i64 + 1);
        }
    }
    publish(&config, &messages).await;
    // The same message id again: SQS FIFO deduplicates it.
    publish(&config, &messages[..1]).await;

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .concurrency(6)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SqsSource::connect(config).await.unwrap();
    run_until(&consumer, source, Duration::from_secs(30), || {
        tally.finals() >= 15
    })
    .await;

    ledger.assert_exactly_once(&expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), 15);
    assert_eq!(tally.count(OutcomeKind::RetryLater), 1);
    let processed = tally.processed_keys();
    for group in groups {
        let order: Vec<&str> = processed
            .iter()
            .filter(|k| k.starts_with(&format!("{group}-")))
            .map(String::as_str)
            .collect();
        let want: Vec<String> = (0..5).map(|i| format!("{group}-{i}")).collect();
        assert_eq!(order, want, "order of group {group}");
    }
    // The groups ran concurrently: the fast groups did not wait for the slow one.
    let last_of = |key: &str| processed.iter().position(|k| k == key).unwrap();
    assert!(
        last_of("gc-4") < last_of("ga-4"),
        "processed order {processed:?}"
    );
    ledger.cleanup().await;
}

#[tokio::test]
async fn publishing_more_than_ten_attributes_is_refused() {
    let config = config(&support::unique("attrs"));
    let publisher = SqsPublisher::connect(config).await.unwrap();
    let mut message = Message::new("{}").with_id("m-1").with_key("k");
    for i in 0..9 {
        message = message.with_header(format!("h{i}"), "v");
    }
    assert!(matches!(
        publisher.publish(&message).await,
        Err(SourceError::Other(_))
    ));
    assert!(matches!(
        SqsSource::connect(SqsConfig::new(support::unique("missing")).endpoint(endpoint())).await,
        Err(SourceError::Broker(_))
    ));
}
