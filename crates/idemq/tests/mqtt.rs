//! The MQTT source against a real broker (Mosquitto on 127.0.0.1:1883 by
//! default, `IDEMQ_TEST_MQTT` (`host:port`) to change) with the PostgreSQL
//! ledger of `tests/support`.
#![cfg(all(feature = "mqtt", feature = "postgres"))]

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource, REASON_PROPERTY};
use idemq::source::{Delivery, Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::DeadLetterReason;
use idemq::{Consumer, Message, Outcome, OutcomeKind, RetryPolicy, SourceError};
use support::{assert_dead_lettered, payment, workload, Ledger, Plan, SwallowAcks};

/// A config for `topic` as `client_id`, with a 60 s session expiry.
fn config(topic: &str, client_id: &str) -> MqttConfig {
    let broker = std::env::var("IDEMQ_TEST_MQTT").unwrap_or_else(|_| "127.0.0.1:1883".into());
    MqttConfig::from_url(&format!(
        "mqtt://{broker}/{topic}?client_id={client_id}&session_expiry=60s"
    ))
    .unwrap()
}

async fn publish(topic: &str, messages: &[Message]) {
    let publisher = MqttPublisher::connect(&config(topic, "producer"))
        .await
        .unwrap();
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

/// Receives `n` messages on `source` and acks them.
async fn receive(source: &mut MqttSource, n: usize) -> Vec<Message> {
    let mut got = Vec::new();
    while got.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("message in time")
            .unwrap()
            .unwrap();
        let (message, _, _, acker) = delivery.into_parts();
        acker.ack().await.unwrap();
        got.push(message);
    }
    got
}

fn three_payments() -> (Vec<Message>, BTreeMap<String, i64>) {
    let messages = (0..3)
        .map(|i| {
            payment(
                &format!("m-{i}"),
                &format!("p-{i}"),
                i + 1,
                serde_json::json!({}),
            )
        })
        .collect();
    let expected = (0..3).map(|i| (format!("p-{i}"), i + 1)).collect();
    (messages, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_applied_once_and_poison_is_dead_lettered() {
    let ledger = Ledger::new().await;
    let topic = support::unique("dup");
    let dead = support::unique("dup_dead");
    let mut dead_source = MqttSource::connect(config(&dead, &support::unique("inspector")))
        .await
        .unwrap();
    let source =
        MqttSource::connect(config(&topic, &support::unique("billing")).dead_letter_topic(&dead))
            .await
            .unwrap();
    let w = workload(16, 2);
    publish(&topic, &w.messages).await;

    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .concurrency(4)
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let total = w.messages.len();
    run_until(&consumer, source, Duration::from_secs(20), || {
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
    let mut copies = receive(&mut dead_source, w.poison.len()).await;
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    for (copy, key) in copies.iter().zip(&w.poison) {
        assert_eq!(copy.key.as_deref(), Some(key.as_str()));
        assert_eq!(copy.id, Some(format!("m-{key}")));
        assert_eq!(
            copy.headers.get(REASON_PROPERTY),
            Some(&b"permanent_failure"[..])
        );
        assert_eq!(copy.headers.get("event_id"), Some(key.as_bytes()));
        assert_eq!(copy.json().unwrap()["payment_id"], key.as_str());
    }
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_puback_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let topic = support::unique("swallow");
    let config = config(&topic, &support::unique("billing"));
    let source = MqttSource::connect(config.clone()).await.unwrap();
    let (messages, expected) = three_payments();
    publish(&topic, &messages).await;

    // First connection: commits p-1, but its PUBACK is never sent.
    let tally = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(tally.hook())
        .build()
        .unwrap();
    let source = SwallowAcks::new(source, |d| d.message.key.as_deref() == Some("p-1"));
    let swallowed = Arc::clone(&source.swallowed);
    run_until(&consumer, source, Duration::from_secs(10), || {
        tally.finals() >= 3
    })
    .await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The connection is gone; the same client id reconnects to its session,
    // the broker resends p-1 (DUP), and the inbox finds it processed.
    let again = Tally::default();
    let consumer = ledger
        .consumer("billing", Arc::new(Plan::default()))
        .on_outcome(again.hook())
        .build()
        .unwrap();
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(MqttSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(10), || {
        again.finals() >= 1
    })
    .await;
    assert_eq!(again.count(OutcomeKind::Duplicate), 1);
    assert_eq!(again.count(OutcomeKind::Processed), 0);
    assert_eq!(deliveries.get("p-1"), (1, 2), "resent once, with DUP");
    assert_eq!(
        deliveries.total(),
        1,
        "only the unacknowledged message came back"
    );
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_before_the_commit_applies_once_after_restart() {
    let ledger = Ledger::new().await;
    let topic = support::unique("kill");
    let config = config(&topic, &support::unique("billing"));
    let source = MqttSource::connect(config.clone()).await.unwrap();
    publish(
        &topic,
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
    let source = deliveries.wrap(MqttSource::connect(config).await.unwrap());
    run_until(&consumer, source, Duration::from_secs(10), || {
        tally.finals() >= 1
    })
    .await;
    assert_eq!(tally.count(OutcomeKind::Processed), 1);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2);
    assert_eq!(deliveries.get("p-0"), (1, 2), "resent with DUP");
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-0".to_owned(), 7)]))
        .await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_wait_for_their_delay_and_end_on_the_dead_letter_topic() {
    let ledger = Ledger::new().await;
    let topic = support::unique("retry");
    let dead = support::unique("retry_dead");
    let mut dead_source = MqttSource::connect(config(&dead, &support::unique("inspector")))
        .await
        .unwrap();
    let source =
        MqttSource::connect(config(&topic, &support::unique("billing")).dead_letter_topic(&dead))
            .await
            .unwrap();
    let (mut messages, _) = three_payments();
    messages.insert(
        0,
        payment(
            "m-flaky",
            "p-flaky",
            3,
            serde_json::json!({ "fail": "retry", "fail_times": 2 }),
        ),
    );
    messages.insert(
        1,
        payment("m-bad", "p-bad", 4, serde_json::json!({ "fail": "retry" })),
    );
    publish(&topic, &messages).await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    let retry = RetryPolicy {
        initial_backoff: Duration::from_millis(500),
        max_backoff: Duration::from_millis(500),
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
    let source = deliveries.wrap(source);
    run_until(&consumer, source, Duration::from_secs(15), || {
        tally.finals() >= 5
    })
    .await;

    let mut expected: BTreeMap<String, i64> = (0..3).map(|i| (format!("p-{i}"), i + 1)).collect();
    expected.insert("p-flaky".into(), 3);
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 9, "3 calls each + 3");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    assert_eq!(deliveries.get("p-bad"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        let outcomes = tally.of(key);
        assert_eq!(outcomes.len(), 3, "{key}: {outcomes:?}");
        for pair in outcomes.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap >= Duration::from_millis(450) && gap < Duration::from_millis(2000),
                "{key}: redelivered after {gap:?}, not after the 500 ms delay"
            );
        }
    }
    // The held messages did not hold up the others.
    let first_retry_done = tally.of("p-flaky")[2].0;
    assert!(tally.of("p-2")[0].0 < first_retry_done);
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    let copies = receive(&mut dead_source, 1).await;
    assert_eq!(copies[0].key.as_deref(), Some("p-bad"));
    assert_eq!(
        copies[0].headers.get(REASON_PROPERTY),
        Some(&b"retries_exhausted"[..])
    );
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_on_a_shared_subscription_apply_every_message_once() {
    let ledger = Ledger::new().await;
    let topic = support::unique("compete");
    let shared = format!("$share/billing/{topic}");
    let w = workload(30, 0);
    let tally = Tally::default();
    let deliveries = [Deliveries::default(), Deliveries::default()];
    let plan = Arc::new(Plan::default());
    let mut sources = Vec::new();
    for seen in &deliveries {
        let source = MqttSource::connect(config(&shared, &support::unique("billing")))
            .await
            .unwrap();
        sources.push(seen.wrap(source));
    }
    publish(&topic, &w.messages).await;
    let total = w.messages.len();
    let mut runs = Vec::new();
    for source in sources {
        let consumer = ledger
            .consumer("billing", Arc::clone(&plan))
            .concurrency(3)
            .on_outcome(tally.hook())
            .build()
            .unwrap();
        let tally = tally.clone();
        runs.push(tokio::spawn(async move {
            run_until(&consumer, source, Duration::from_secs(20), || {
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
        "each message went to one consumer: {per_consumer:?}"
    );
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "both consumers got work: {per_consumer:?}"
    );
    ledger.cleanup().await;
}

#[tokio::test]
async fn a_refused_connection_is_a_broker_error() {
    let mut config = config("t", "nobody");
    config.port = 1; // nothing listens there
    assert!(matches!(
        MqttSource::connect(config).await,
        Err(SourceError::Broker(_))
    ));
    assert!(matches!(
        MqttPublisher::connect(&self::config("a/#", "p")).await,
        Err(SourceError::Config(_))
    ));
}
