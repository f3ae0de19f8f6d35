//! The NATS JetStream source against a real nats-server with JetStream
//! (127.0.0.1:4222 by default, `IDEMQ_TEST_NATS` to change) and the
//! PostgreSQL ledger of `tests/support`: duplicates of both kinds and
//! poison, a lost ack after the commit, a crash inside the handler, nak
//! delays and retries ending in the dead-letter subject, competing clients
//! on one durable consumer, and a handler slower than `ack_wait`.
#![cfg(all(feature = "nats", feature = "postgres"))]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemq::source::nats::{NatsConfig, NatsPublisher, NatsSource, REASON_HEADER};
use idemq::source::{Delivery, Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::DeadLetterReason;
use idemq::{Consumer, Message, Outcome, OutcomeKind, RetryPolicy, SourceError};
use support::{assert_dead_lettered, payment, workload, Ledger, Plan, SwallowAcks};

fn server() -> String {
    std::env::var("IDEMQ_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A fresh stream `name` with subject `name.in` and a durable consumer
/// `billing`: 2 s ack_wait, 1 s pull requests, created on connect.
fn config(name: &str) -> NatsConfig {
    NatsConfig::new(name, "billing")
        .server(server())
        .subject(format!("{name}.in"))
        .ack_wait(Duration::from_secs(2))
        .wait(Duration::from_secs(1))
        .create(true)
}

/// With the shortest duplicate window JetStream allows (100 ms); publish
/// with [`publish_outside_window`] so that same-id copies are kept and the
/// inbox has to catch them.
fn config_short_window(name: &str) -> NatsConfig {
    config(name).duplicate_window(DUPLICATE_WINDOW)
}

const DUPLICATE_WINDOW: Duration = Duration::from_millis(100);

/// Publishes in order, waiting before a same-id copy until the duplicate
/// window of its first copy has passed, so that JetStream stores it too.
async fn publish_outside_window(config: &NatsConfig, messages: &[Message]) {
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    let mut sent: HashMap<Option<String>, Instant> = HashMap::new();
    for m in messages {
        if let Some(at) = sent.get(&m.id) {
            let ready = *at + DUPLICATE_WINDOW * 2;
            tokio::time::sleep_until(ready.into()).await;
        }
        publisher.publish(m).await.unwrap();
        sent.insert(m.id.clone(), Instant::now());
    }
}

async fn publish(config: &NatsConfig, messages: &[Message]) {
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    for m in messages {
        publisher.publish(m).await.unwrap();
    }
}

/// Deletes the test's stream and its dead-letter stream, if any.
async fn delete_streams(config: &NatsConfig) {
    let js = config.jetstream().await.unwrap();
    js.delete_stream(&config.stream).await.unwrap();
    let _ = js.delete_stream(format!("{}_dlq", config.stream)).await;
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

/// Reads `n` copies from the dead-letter subject of `config` (its stream
/// `<STREAM>_dlq`), acking them.
async fn read_dead_letters(config: &NatsConfig, n: usize) -> Vec<Message> {
    let subject = config.dead_letter_subject.clone().unwrap();
    let dlq = NatsConfig::new(format!("{}_dlq", config.stream), "drain")
        .server(server())
        .subject(subject)
        .ack_wait(Duration::from_secs(2))
        .wait(Duration::from_secs(1))
        .create(true);
    let mut source = NatsSource::connect(dlq).await.unwrap();
    let mut got = Vec::new();
    while got.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("dead-letter copy in time")
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
    let name = support::unique("dup");
    let config = config_short_window(&name).dead_letter_subject(format!("{name}.dead"));
    let w = workload(16, 2);
    publish_outside_window(&config, &w.messages).await;

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .concurrency(4)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    let total = w.messages.len();
    run_until(&consumer, source, Duration::from_secs(30), || {
        tally.finals() >= total
    })
    .await;

    // Every copy reached the consumer (published outside the window), once each.
    assert_eq!(deliveries.total() as usize, total);
    ledger.assert_exactly_once(&w.expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), w.expected.len());
    assert_eq!(tally.count(OutcomeKind::Duplicate), w.duplicates);
    assert_eq!(tally.count(OutcomeKind::DeadLettered), w.poison.len());
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );

    // The poison is on the dead-letter subject too, with its reason and headers.
    let mut copies = read_dead_letters(&config, w.poison.len()).await;
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    for (copy, key) in copies.iter().zip(&w.poison) {
        assert_eq!(copy.key.as_deref(), Some(key.as_str()));
        assert_eq!(copy.id, Some(format!("m-{key}")));
        assert_eq!(
            copy.headers.get(REASON_HEADER),
            Some(&b"permanent_failure"[..])
        );
        assert_eq!(copy.headers.get("event_id"), Some(key.as_bytes()));
        assert_eq!(copy.json().unwrap()["payment_id"], key.as_str());
    }
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_drops_a_same_id_republish_and_the_inbox_the_producer_retry() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("window")); // the default 2 min window
    let m = payment("m-1", "p-1", 5, serde_json::json!({}));
    let retry = payment("m-1-retry", "p-1", 5, serde_json::json!({}));
    publish(&config, &[m.clone(), m, retry]).await;

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(10), || {
        tally.finals() >= 2
    })
    .await;
    // Give a wrongly kept third copy the time to show up.
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    consumer
        .run_until(source, tokio::time::sleep(Duration::from_millis(1500)))
        .await
        .unwrap();
    assert_eq!(deliveries.get("p-1"), (2, 1), "the same-id copy was stored");
    assert_eq!(tally.count(OutcomeKind::Processed), 1);
    assert_eq!(tally.count(OutcomeKind::Duplicate), 1);
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-1".to_owned(), 5)]))
        .await;
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_lost_after_the_commit_ends_as_a_duplicate() {
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

    // First consumer: commits p-1, but its ack never reaches the server.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SwallowAcks::new(NatsSource::connect(config.clone()).await.unwrap(), |d| {
        d.message.key.as_deref() == Some("p-1")
    });
    let swallowed = Arc::clone(&source.swallowed);
    run_until(&consumer, source, Duration::from_secs(10), || {
        tally.finals() >= 3
    })
    .await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The consumer is gone (source dropped): p-1 comes back after ack_wait,
    // and a new client of the durable consumer finds it already processed.
    let again = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(again.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    let started = Instant::now();
    run_until(&consumer, source, Duration::from_secs(10), || {
        again.finals() >= 1
    })
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "came back before ack_wait"
    );
    assert_eq!(again.count(OutcomeKind::Duplicate), 1);
    assert_eq!(again.count(OutcomeKind::Processed), 0);
    assert_eq!(deliveries.get("p-1"), (1, 2), "one redelivery, delivered 2");
    assert_eq!(deliveries.total(), 1, "p-0 and p-2 were acked");
    ledger.assert_exactly_once(&expected).await;
    delete_streams(&config).await;
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
    let source = NatsSource::connect(config.clone()).await.unwrap();
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
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(15), || {
        tally.finals() >= 1
    })
    .await;
    assert_eq!(tally.count(OutcomeKind::Processed), 1);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        deliveries.get("p-0"),
        (1, 2),
        "the redelivery, with delivered 2"
    );
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-0".to_owned(), 7)]))
        .await;
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_wait_for_the_nak_delay_and_end_on_the_dead_letter_subject() {
    let ledger = Ledger::new().await;
    let name = support::unique("retry");
    // A long ack_wait: a retry that came from its expiry would take 6 s.
    // The server's max_deliver (5) is above the engine's 3 attempts.
    let config = config(&name)
        .ack_wait(Duration::from_secs(6))
        .max_deliver(5)
        .dead_letter_subject(format!("{name}.dead"));
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
            payment("m-ok", "p-ok", 5, serde_json::json!({})),
        ],
    )
    .await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    // A 2 s backoff: far from both an immediate redelivery and the 6 s ack_wait.
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
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(20), || {
        tally.finals() >= 3
    })
    .await;

    ledger
        .assert_exactly_once(&BTreeMap::from([
            ("p-flaky".to_owned(), 3),
            ("p-ok".to_owned(), 5),
        ]))
        .await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 7, "3 calls each, p-ok 1");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    assert_eq!(deliveries.get("p-bad"), (3, 3));
    // The consumer moved on: p-ok did not wait behind the failing messages.
    let ok = tally.of("p-ok");
    let bad = tally.of("p-bad");
    assert!(ok[0].0 < bad[1].0, "p-ok waited for p-bad's retries");
    for key in ["p-flaky", "p-bad"] {
        let outcomes = tally.of(key);
        assert_eq!(outcomes.len(), 3, "{key}: {outcomes:?}");
        for pair in outcomes.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap >= Duration::from_millis(1900) && gap < Duration::from_millis(5000),
                "{key}: redelivered after {gap:?}, not after the nak's 2 s delay"
            );
        }
    }
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    let copies = read_dead_letters(&config, 1).await;
    assert_eq!(copies[0].key.as_deref(), Some("p-bad"));
    assert_eq!(
        copies[0].headers.get(REASON_HEADER),
        Some(&b"retries_exhausted"[..])
    );

    // Terminated, not redelivered: nothing comes back within a pull.
    let late = Deliveries::default();
    let source = late.wrap(NatsSource::connect(config.clone()).await.unwrap());
    consumer
        .run_until(source, tokio::time::sleep(Duration::from_millis(1500)))
        .await
        .unwrap();
    assert_eq!(late.total(), 0);
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_apply_every_message_once() {
    let ledger = Ledger::new().await;
    let config = config_short_window(&support::unique("compete")).batch(3);
    let w = workload(30, 0);
    publish_outside_window(&config, &w.messages).await;

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
        let source = seen.wrap(NatsSource::connect(config.clone()).await.unwrap());
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
        "every stored message delivered once: {per_consumer:?}"
    );
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "both clients got work: {per_consumer:?}"
    );
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_slower_than_ack_wait_keeps_its_message() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("slow")); // 2 s ack_wait
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

    // Two clients pull from the consumer: a lapsed ack_wait would hand the
    // slow message to the other one.
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
        let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
        let tally = tally.clone();
        runs.push(tokio::spawn(async move {
            run_until(&consumer, source, Duration::from_secs(15), || {
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
        "the slow message was delivered again"
    );
    assert_eq!(deliveries.total(), 5);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 5);
    let mut expected: BTreeMap<String, i64> = (0..4).map(|i| (format!("p-{i}"), i + 1)).collect();
    expected.insert("p-slow".into(), 9);
    ledger.assert_exactly_once(&expected).await;
    delete_streams(&config).await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn bad_headers_and_missing_streams_are_refused() {
    let config = config(&support::unique("refuse"));
    let publisher = NatsPublisher::connect(config.clone()).await.unwrap();
    let message = Message::new("{}")
        .with_id("m-1")
        .with_header("raw", vec![0xff]);
    assert!(matches!(
        publisher.publish(&message).await,
        Err(SourceError::Other(_))
    ));
    let missing = NatsConfig::new(support::unique("missing"), "billing").server(server());
    assert!(matches!(
        NatsSource::connect(missing).await,
        Err(SourceError::Broker(_))
    ));
    let wildcard = config.clone().subject(format!("{}.>", config.stream));
    assert!(matches!(
        NatsPublisher::connect(wildcard).await,
        Err(SourceError::Config(_))
    ));
    delete_streams(&config).await;
}
