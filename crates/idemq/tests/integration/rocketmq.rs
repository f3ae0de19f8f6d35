//! The RocketMQ source against a real name server and broker (127.0.0.1:9876
//! and :10911, started by `scripts/rocketmq.sh`) with the PostgreSQL ledger,
//! in what is RocketMQ's own: poison on the dead-letter topic with its
//! reason property and the original keys, and retries through the broker's
//! retry topic with `reconsume_times` as the delivery count. A crash between
//! the inbox commit and the consume status, a crash inside the handler and
//! two competing consumers in one group are in `conformance.rs`.
//!
//! RocketMQ redelivers a `ReconsumeLater` message about 10 s later, so the
//! tests that need a redelivery take that long.
#![cfg(all(feature = "rocketmq", feature = "postgres"))]

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{payment, Ledger, Plan};
use idemq::source::rocketmq::{
    default_key_spec, RocketMqConfig, RocketMqPublisher, RocketMqSource,
    DEAD_LETTER_REASON_PROPERTY,
};
use idemq::source::Source;
use idemq::DeadLetterReason;
use idemq::{Message, Outcome, OutcomeKind, Summary};

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
        .retry(support::fast_retry().with_max_attempts(2))
        .on_outcome(seen.hook())
        .build()
        .unwrap();
    // Record what each delivery looked like, through a thin source wrapper.
    let source = Recording {
        inner: source(config(&topic, &group).max_reconsume_times(6)).await,
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

/// `max_reconsume_times=0` (not above idemq's default 5 attempts) is
/// refused at connect, naming it; run anyway (`broker_loss=warn`), a
/// payment whose handler fails once, and would succeed the second time,
/// goes to the broker's `%DLQ%` topic at its first `ReconsumeLater` and is
/// never delivered again (a retry comes about 10 s later otherwise, as in
/// `retries_then_dead_letter`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn few_reconsumes_are_refused_and_the_broker_takes_the_message_away() {
    let ledger = Ledger::new().await;
    let topic = support::unique("idemq");
    let group = support::unique("g");
    let risky = config(&topic, &group).max_reconsume_times(0);
    let err = RocketMqSource::connect(risky.clone()).await.unwrap_err();
    assert_eq!(err.kind(), idemq::SourceErrorKind::Config, "{err}");
    assert!(
        err.to_string()
            .contains("max_reconsume_times=0 (not above idemq's default max_attempts 5)"),
        "{err}"
    );
    let messages = vec![
        payment(
            "m-flaky",
            "p-flaky",
            5,
            serde_json::json!({ "fail": "retry", "fail_times": 1 }),
        ),
        payment("m-1", "p-1", 1, serde_json::json!({})),
    ];
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("rocketmq-dlq", Arc::clone(&plan))
        .retry(support::fast_retry().with_max_attempts(5))
        .build()
        .unwrap();
    let counts: Deliveries = Arc::default();
    let source = Recording {
        inner: source(risky.broker_loss(idemq::source::loss::LossPolicy::Warn)).await,
        counts: Arc::clone(&counts),
    };
    // p-1 is applied at once; p-flaky fails once and, past a retry's 10 s,
    // never comes back.
    consumer
        .run_until(source, tokio::time::sleep(Duration::from_secs(16)))
        .await
        .unwrap();
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-1".to_owned(), 1)]))
        .await;
    let counts = counts.lock().unwrap().clone();
    assert_eq!(
        counts.get("p-flaky").map(Vec::len),
        Some(1),
        "delivered once, then taken to %DLQ%: {counts:?}"
    );
    ledger.cleanup().await;
}

/// The horizon of `url`'s source as `idemq doctor` and the retention floor
/// read it.
async fn horizon(url: &str) -> idemq::source::health::Horizon {
    let broker = idemq::source::registry::lookup(url)
        .expect("a known scheme")
        .expect("a broker");
    (broker.inspect)(url).await.expect("inspect").horizon
}

/// The broker's commit-log retention (`fileReservedTime`, 96 h in
/// `scripts/rocketmq.sh`) is the source's redelivery horizon, read from the
/// topic's master broker; on the broker with authentication the requests
/// are signed with the URL's credentials, and without credentials the
/// horizon is unknown, saying why, without the secret.
#[tokio::test]
async fn the_brokers_commit_log_retention_is_the_horizon() {
    use idemq::source::health::Horizon;
    let topic = support::unique("horizon").replace('-', "_");
    publish(&topic, &[payment("m-1", "p-1", 1, serde_json::json!({}))]).await;
    let url = format!("rocketmq://{NAME_SERVER}/{topic}?group={topic}_g");
    match horizon(&url).await {
        Horizon::Bounded { limit, setting } => {
            assert_eq!(limit, Duration::from_secs(96 * 3_600), "{setting}");
            assert!(
                setting.contains("(127.0.0.1:10911) fileReservedTime=96"),
                "{setting}"
            );
        }
        other => panic!("the retention was not read: {other:?}"),
    }
    // A topic no broker holds has no route: unknown, and why.
    let missing = format!("rocketmq://{NAME_SERVER}/{topic}_none?group=g");
    let Horizon::Unknown { why } = horizon(&missing).await else {
        panic!("a horizon for a topic without a route");
    };
    assert!(why.contains("route"), "{why}");
    // With authentication (ACL 2.0): signed with the URL's credentials.
    let acl = |auth: &str| format!("rocketmq://{auth}127.0.0.1:9877/{topic}_acl?group={topic}_g");
    let signed = acl("idemq:idemq-secret@");
    let broker = idemq::source::registry::lookup(&signed).unwrap().unwrap();
    let publisher = (broker.open_publisher)(&signed)
        .await
        .expect("a publisher with credentials");
    support::publish_all(
        &*publisher,
        &[payment("m-1", "p-1", 1, serde_json::json!({}))],
    )
    .await;
    match horizon(&signed).await {
        Horizon::Bounded { limit, setting } => {
            assert_eq!(limit, Duration::from_secs(96 * 3_600), "{setting}");
            assert!(setting.contains("broker acl-broker"), "{setting}");
        }
        other => panic!("the signed requests were refused: {other:?}"),
    }
    // Unsigned, or signed with a wrong secret: the broker refuses, and the
    // horizon says so without the secret.
    for auth in ["", "idemq:wrong-s3cret@"] {
        let Horizon::Unknown { why } = horizon(&acl(auth)).await else {
            panic!("read without valid credentials ({auth})");
        };
        assert!(why.contains("the broker's configuration: code"), "{why}");
        assert!(
            !why.contains("s3cret") && !why.contains("idemq-secret"),
            "{why}"
        );
    }
}
