//! The RocketMQ source against a real name server and broker (127.0.0.1:9876
//! and :10911, started by `scripts/rocketmq.sh`) with the PostgreSQL ledger:
//! duplicates of both kinds, poison, a crash between the inbox commit and the
//! consume status, a crash inside the handler, retries through the broker's
//! retry topic, the retry limit, and two competing consumers in one group.
//!
//! RocketMQ redelivers a `ReconsumeLater` message about 10 s later, so the
//! tests that need a redelivery take that long.
#![cfg(all(feature = "rocketmq", feature = "postgres"))]

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::source::rocketmq::{
    default_key_spec, RocketMqConfig, RocketMqPublisher, RocketMqSource,
    DEAD_LETTER_REASON_PROPERTY,
};
use idemq::source::Source;
use idemq::DeadLetterReason;
use idemq::{Message, Outcome, OutcomeKind, RetryPolicy, Summary};
use support::{payment, Ledger, Plan};

const NAME_SERVER: &str = "127.0.0.1:9876";

fn config(topic: &str, group: &str) -> RocketMqConfig {
    RocketMqConfig::new(NAME_SERVER, topic, group)
}

async fn source(config: RocketMqConfig) -> RocketMqSource {
    RocketMqSource::connect(config)
        .await
        .expect("start the consumer (is scripts/rocketmq.sh running?)")
}

/// Publishes `messages` to a (new, auto-created) topic.
async fn publish(topic: &str, messages: &[Message]) {
    let publisher = RocketMqPublisher::connect(NAME_SERVER, topic)
        .await
        .expect("start the producer (is scripts/rocketmq.sh running?)");
    support::publish_all(&publisher, messages).await;
}

/// Counts the outcomes of a consumer by kind.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<BTreeMap<&'static str, usize>>>);

impl Seen {
    fn hook(&self) -> impl Fn(&Outcome) + Send + Sync + 'static {
        let seen = Arc::clone(&self.0);
        move |o: &Outcome| *seen.lock().unwrap().entry(o.kind().as_str()).or_default() += 1
    }
    fn get(&self, kind: OutcomeKind) -> usize {
        self.0
            .lock()
            .unwrap()
            .get(kind.as_str())
            .copied()
            .unwrap_or(0)
    }
}

/// Waits until `check` holds, up to `limit`; whether it held.
async fn wait_until(limit: Duration, check: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check()
}

/// Runs `consumer` over `source` until the ledger holds every expected key
/// and `done` holds, then stops it.
async fn run_until_done<S: Source>(
    consumer: &idemq::Consumer<idemq::store::sql::postgres::PostgresStore>,
    source: S,
    ledger: &Ledger,
    expected: &BTreeMap<String, i64>,
    limit: Duration,
    done: impl Fn() -> bool,
) -> Summary {
    consumer
        .run_until(source, async {
            let deadline = tokio::time::Instant::now() + limit;
            loop {
                let rows = ledger.rows().await;
                let all = expected.keys().all(|k| rows.iter().any(|(r, _)| r == k));
                if (all && done()) || tokio::time::Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Let late duplicates show up.
            tokio::time::sleep(Duration::from_millis(300)).await;
        })
        .await
        .unwrap()
}

/// Both kinds of duplicates (the same producer id again, and a producer
/// retry with a new id but the same keys) are applied once with the default
/// key spec (the message keys); poison is dead-lettered and forwarded to the
/// dead-letter topic with its reason and the original keys and properties.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_and_poison() {
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let dlq = support::unique("idemq_dlq");
    let group = support::unique("g");
    let work = support::workload(20, 2);
    publish(&topic, &work.messages).await;

    let plan = Arc::new(Plan::default());
    let seen = Seen::default();
    let consumer = ledger
        .consumer("rocketmq-dups", Arc::clone(&plan))
        .key(default_key_spec())
        .on_outcome(seen.hook())
        .build()
        .unwrap();
    let total = work.messages.len();
    let summary = run_until_done(
        &consumer,
        source(config(&topic, &group).dead_letter_topic(&dlq)).await,
        &ledger,
        &work.expected,
        Duration::from_secs(60),
        || {
            let s = &seen;
            s.get(OutcomeKind::Processed)
                + s.get(OutcomeKind::Duplicate)
                + s.get(OutcomeKind::DeadLettered)
                >= total
        },
    )
    .await;
    eprintln!("summary: {summary}");

    ledger.assert_exactly_once(&work.expected).await;
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        work.expected.len() as u64
    );
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        work.duplicates as u64,
        "{summary}"
    );
    let letters = ledger.dead_letters().await;
    support::assert_dead_lettered(&letters, &work.poison, &DeadLetterReason::PermanentFailure);
    for letter in &letters {
        assert_eq!(letter.meta.source, "rocketmq");
        assert_eq!(letter.meta.topic.as_deref(), Some(topic.as_str()));
        assert_eq!(letter.meta.delivery_count, 1);
        assert!(letter
            .message
            .id
            .as_deref()
            .unwrap()
            .starts_with("m-poison-"));
    }

    // The forwarded copies on the dead-letter topic.
    let seen_dlq: Arc<Mutex<Vec<Message>>> = Arc::default();
    let mut dlq_source = source(config(&dlq, &support::unique("g"))).await;
    let got = tokio::time::timeout(Duration::from_secs(60), async {
        let mut got = Vec::new();
        while got.len() < work.poison.len() {
            let delivery = dlq_source.next().await.unwrap().unwrap();
            let (message, meta, _, acker) = delivery.into_parts();
            assert_eq!(meta.topic.as_deref(), Some(dlq.as_str()));
            acker.ack().await.unwrap();
            got.push(message);
        }
        got
    })
    .await
    .expect("the dead letters reach the dead-letter topic");
    seen_dlq.lock().unwrap().extend(got);
    dlq_source.shutdown().await;
    let mut keys: Vec<_> = seen_dlq
        .lock()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(
                m.headers.get(DEAD_LETTER_REASON_PROPERTY),
                Some(DeadLetterReason::PermanentFailure.code().as_bytes())
            );
            assert_eq!(
                m.headers.get("event_id"),
                m.key.as_deref().map(str::as_bytes)
            );
            m.key.clone().unwrap()
        })
        .collect();
    keys.sort();
    assert_eq!(keys, work.poison);
    ledger.cleanup().await;
}

/// The consumer "dies" after the inbox commit and before the consume status
/// reaches the client (the settlement is swallowed), then shuts down. A new
/// consumer in the group gets those messages again, and the inbox answers
/// "duplicate": every effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_after_commit_before_success() {
    const CRASHED: u32 = 3;
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let group = support::unique("g");
    let work = support::workload(8, 0);
    publish(&topic, &work.messages).await;
    let plan = Arc::new(Plan::default());

    let first = ledger
        .consumer("rocketmq-crash", Arc::clone(&plan))
        .build()
        .unwrap();
    // Three listener calls at once, all swallowed: the consumer is stuck.
    let wrapped = support::SwallowAcks::new(
        source(config(&topic, &group).consume_threads(CRASHED)).await,
        |_| true,
    );
    let swallowed = Arc::clone(&wrapped.swallowed);
    let summary = first
        .run_until(wrapped, async {
            wait_until(Duration::from_secs(30), || {
                swallowed.load(Ordering::SeqCst) >= CRASHED
            })
            .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        })
        .await
        .unwrap();
    eprintln!("summary: {summary}");
    let crashed = swallowed.load(Ordering::SeqCst);
    assert_eq!(crashed, CRASHED, "{summary}");
    let committed = summary.count(OutcomeKind::Processed);
    assert!(committed >= 1, "{summary}");
    assert_eq!(ledger.rows().await.len() as u64, committed);

    let seen = Seen::default();
    let second = ledger
        .consumer("rocketmq-crash", Arc::clone(&plan))
        .on_outcome(seen.hook())
        .build()
        .unwrap();
    let summary = run_until_done(
        &second,
        source(config(&topic, &group)).await,
        &ledger,
        &work.expected,
        Duration::from_secs(60),
        || seen.get(OutcomeKind::Duplicate) >= work.duplicates + committed as usize,
    )
    .await;
    eprintln!("summary: {summary}");
    ledger.assert_exactly_once(&work.expected).await;
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        work.expected.len() as u64 - committed,
        "{summary}"
    );
    assert!(
        summary.count(OutcomeKind::Duplicate) >= work.duplicates as u64 + committed,
        "the messages whose success was swallowed come back as duplicates: {summary}"
    );
    ledger.cleanup().await;
}

/// The consumer is killed inside its handlers, before the inbox commit: the
/// transactions roll back, the broker redelivers after the restart, and
/// every effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_inside_the_handler() {
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let group = support::unique("g");
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..6 {
        messages.push(payment(
            &format!("m-{i}"),
            &format!("p-{i}"),
            i + 1,
            serde_json::json!({ "sleep_ms": 1500 }),
        ));
        expected.insert(format!("p-{i}"), i + 1);
    }
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("rocketmq-kill", Arc::clone(&plan))
        .build()
        .unwrap();
    let first = source(config(&topic, &group)).await;
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(first).await }
    });
    assert!(
        wait_until(Duration::from_secs(30), || plan
            .calls
            .load(Ordering::SeqCst)
            >= 3)
        .await,
        "the handlers did not start"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    run.abort(); // the handlers are still sleeping: killed before their commits
    assert!(run.await.unwrap_err().is_cancelled());
    assert!(
        ledger.rows().await.is_empty(),
        "a killed handler's effect must not be visible"
    );

    let summary = run_until_done(
        &consumer,
        source(config(&topic, &group)).await,
        &ledger,
        &expected,
        Duration::from_secs(60),
        || true,
    )
    .await;
    eprintln!("summary: {summary}");
    ledger.assert_exactly_once(&expected).await;
    assert!(summary.count(OutcomeKind::Processed) >= 1, "{summary}");
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 0);
    ledger.cleanup().await;
}

/// A handler that fails once is retried through the broker's retry topic
/// (`ReconsumeLater`) and applied once; one that always fails is
/// dead-lettered when the engine's attempt limit is reached, with the
/// delivery count taken from `reconsume_times`, and the consumer moves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_then_dead_letter() {
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let group = support::unique("g");
    let messages = vec![
        payment(
            "m-flaky",
            "p-flaky",
            5,
            serde_json::json!({ "fail": "retry", "fail_times": 1 }),
        ),
        payment("m-bad", "p-bad", 6, serde_json::json!({ "fail": "retry" })),
        payment("m-1", "p-1", 1, serde_json::json!({})),
        payment("m-2", "p-2", 2, serde_json::json!({})),
    ];
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let counts: Deliveries = Arc::default();
    let seen = Seen::default();
    let consumer = ledger
        .consumer("rocketmq-retry", Arc::clone(&plan))
        .retry(RetryPolicy {
            max_attempts: 2,
            ..support::fast_retry()
        })
        .on_outcome(seen.hook())
        .build()
        .unwrap();
    // Record what each delivery looked like, through a thin source wrapper.
    let source = Recording {
        inner: source(config(&topic, &group).max_reconsume_times(5)).await,
        counts: Arc::clone(&counts),
    };
    let expected = BTreeMap::from([
        ("p-flaky".to_owned(), 5),
        ("p-1".to_owned(), 1),
        ("p-2".to_owned(), 2),
    ]);
    let summary = run_until_done(
        &consumer,
        source,
        &ledger,
        &expected,
        Duration::from_secs(60),
        || seen.get(OutcomeKind::DeadLettered) >= 1,
    )
    .await;
    eprintln!("summary: {summary}");

    ledger.assert_exactly_once(&expected).await;
    assert_eq!(summary.count(OutcomeKind::Processed), 3, "{summary}");
    assert_eq!(summary.count(OutcomeKind::RetryLater), 2, "{summary}");
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2 + 2 + 1 + 1);
    let letters = ledger.dead_letters().await;
    support::assert_dead_lettered(
        &letters,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    assert_eq!(letters[0].attempts, 2);
    assert_eq!(
        letters[0].meta.delivery_count, 2,
        "reconsume_times + 1 on the retried copy"
    );
    let counts = counts.lock().unwrap().clone();
    for key in ["p-flaky", "p-bad"] {
        let id = format!("m-{}", &key[2..]);
        assert_eq!(
            counts[key],
            vec![(1, Some(id.clone())), (2, Some(id))],
            "{key}: delivery counts and a stable id across the retry"
        );
    }
    ledger.cleanup().await;
}

/// (delivery count, id) of every delivery, by key.
type Deliveries = Arc<Mutex<BTreeMap<String, Vec<(u32, Option<String>)>>>>;

/// Records the delivery count and id of every delivery, by key.
struct Recording<S> {
    inner: S,
    counts: Deliveries,
}

#[async_trait::async_trait]
impl<S: Source> Source for Recording<S> {
    async fn next(&mut self) -> Result<Option<idemq::source::Delivery>, idemq::SourceError> {
        let delivery = self.inner.next().await?;
        if let Some(d) = &delivery {
            self.counts
                .lock()
                .unwrap()
                .entry(d.message.key.clone().unwrap_or_default())
                .or_default()
                .push((d.meta.delivery_count, d.message.id.clone()));
        }
        Ok(delivery)
    }
}

/// Two members of one group share the topic's queues: every message is
/// applied exactly once and both members get work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers() {
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let group = support::unique("g");
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for i in 0..32 {
        let m = payment(
            &format!("m-{i}"),
            &format!("p-{i}"),
            i + 1,
            serde_json::json!({ "sleep_ms": 250 }),
        );
        messages.push(m.clone());
        if i % 4 == 0 {
            messages.push(m); // sent again with the same producer id
        }
        expected.insert(format!("p-{i}"), i + 1);
    }
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let settled = Arc::new(AtomicUsize::new(0));
    let build = |n: Arc<AtomicU32>| {
        let settled = Arc::clone(&settled);
        ledger
            .consumer("rocketmq-group", Arc::clone(&plan))
            .on_outcome(move |_| {
                n.fetch_add(1, Ordering::SeqCst);
                settled.fetch_add(1, Ordering::SeqCst);
            })
            .build()
            .unwrap()
    };
    let (na, nb) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (a, b) = (build(Arc::clone(&na)), build(Arc::clone(&nb)));
    let (sa, sb) = tokio::join!(
        source(config(&topic, &group).consume_threads(2)),
        source(config(&topic, &group).consume_threads(2)),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let run_a = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move { a.run_until(sa, stop.notified_owned()).await.unwrap() }
    });
    let run_b = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move { b.run_until(sb, stop.notified_owned()).await.unwrap() }
    });
    let total = messages.len();
    let done = wait_until(Duration::from_secs(90), || {
        settled.load(Ordering::SeqCst) >= total
    })
    .await;
    let rows = ledger
        .wait_for(Duration::from_secs(30), |rows| rows.len() >= expected.len())
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.notify_waiters();
    let (sa, sb) = (run_a.await.unwrap(), run_b.await.unwrap());
    eprintln!("member a: {sa}; member b: {sb}");
    assert!(
        done,
        "not every message was settled: {sa} / {sb} ({} rows)",
        rows.len()
    );
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(
        sa.count(OutcomeKind::Processed) + sb.count(OutcomeKind::Processed),
        expected.len() as u64
    );
    assert!(
        na.load(Ordering::SeqCst) > 0 && nb.load(Ordering::SeqCst) > 0,
        "both members must get work: {sa} / {sb}"
    );
    ledger.cleanup().await;
}
