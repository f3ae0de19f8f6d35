//! The source conformance suite: one set of scenarios, run for every broker
//! of the registry this build has, through nothing but its registration —
//! `open_publisher`, `open_source` and `competing_url` of a URL — into the
//! PostgreSQL ledger:
//!
//! - duplicates of both kinds (a redelivered copy, a producer retry with a
//!   new id), poison, and a handler that fails once and then succeeds;
//! - acks lost after the commit (as if the consumer died between the two),
//!   redelivered to the next consumer and caught by the inbox;
//! - a consumer killed while its handlers run, and a new one after it;
//! - two competing consumers.
//!
//! Each ends with the ledger holding every effect exactly once. A broker
//! added to the registry gets these tests by one line in `conformance!` at
//! the bottom, and its URL template in [`url_for`]; its own test file keeps
//! only what is specific to it.
#![cfg(feature = "postgres")]
#![allow(dead_code)] // a build without brokers uses none of this

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use idemq::source::registry::{self, Broker};
use idemq::source::{Publisher, Source};
use idemq::{DeadLetterReason, Message, OutcomeKind};
use support::{
    assert_dead_lettered, eventually, payment, payments, start, workload, Ledger, Plan, Running,
    SwallowAcks, Tally,
};

/// How long a scenario may wait for the brokers (redeliveries after a
/// visibility timeout, an ack wait, a rebalance).
const PATIENCE: Duration = Duration::from_secs(90);

/// A fresh URL of broker `id` for one test (the test services of
/// `scripts/`; the same shapes as `scripts/chaos.sh`).
fn url_for(id: &str) -> String {
    let run = support::unique("conf");
    match id {
        "kafka" => format!(
            "kafka://127.0.0.1:9092/{run}?group={run}&create_partitions=3&session_timeout_ms=6000"
        ),
        "amqp" => format!("amqp://guest:guest@127.0.0.1:5672/%2f?queue={run}"),
        "sqs" => format!(
            "sqs://{run}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=3"
        ),
        "nats" => format!(
            "nats://127.0.0.1:4222/{run}/{run}_c?subject={run}.orders&create=true&ack_wait=3s&wait=1s"
        ),
        "redis-stream" => {
            format!("redis-stream://127.0.0.1:6379/{run}?group=conformance&claim_idle=2s")
        }
        "mqtt" => format!("mqtt://127.0.0.1:1883/$share/conf/{run}/orders?client_id={run}"),
        "rocketmq" => format!("rocketmq://127.0.0.1:9876/{run}?group={run}_g"),
        other => panic!("no test URL for broker {other}: add one to url_for"),
    }
}

fn broker(id: &str) -> &'static Broker {
    registry::brokers()
        .find(|b| b.id == id)
        .unwrap_or_else(|| panic!("broker {id} is not registered"))
}

/// One scenario's broker: its URL, its publisher, and sources on demand.
struct Bench {
    broker: &'static Broker,
    url: String,
    publisher: Box<dyn Publisher>,
}

impl Bench {
    /// Opens the publisher first: it creates what the URL asks for (a
    /// Kafka topic, an SQS queue, a NATS stream, a RabbitMQ queue).
    async fn new(id: &str) -> Self {
        let broker = broker(id);
        let url = url_for(id);
        let publisher = (broker.open_publisher)(&url)
            .await
            .unwrap_or_else(|e| panic!("open a {} publisher: {e}", broker.name));
        Self {
            broker,
            url,
            publisher,
        }
    }

    /// A source for competing consumer `n`.
    async fn source(&self, n: usize) -> Box<dyn Source> {
        let url = (self.broker.competing_url)(&self.url, n);
        (self.broker.open_source)(&url)
            .await
            .unwrap_or_else(|e| panic!("open a {} source: {e}", self.broker.name))
    }

    async fn publish(&self, messages: &[Message]) {
        support::publish_all(&*self.publisher, messages).await;
    }

    /// Sources for consumers `0..n`, with `messages` published: before the
    /// sources subscribe, except where the broker drops what is published
    /// before a subscription exists.
    async fn sources_with(&self, n: usize, messages: &[Message]) -> Vec<Box<dyn Source>> {
        let mut sources = Vec::new();
        if self.broker.subscribe_before_publish {
            for i in 0..n {
                sources.push(self.source(i).await);
            }
            self.publish(messages).await;
        } else {
            self.publish(messages).await;
            for i in 0..n {
                sources.push(self.source(i).await);
            }
        }
        sources
    }
}

/// Waits until the ledger holds a row of every expected key.
async fn ledger_complete(ledger: &Ledger, expected: &BTreeMap<String, i64>) {
    eventually(PATIENCE, "every effect in the ledger", || async {
        let rows = ledger.rows().await;
        expected
            .keys()
            .all(|k| rows.iter().any(|(key, _)| key == k))
    })
    .await;
}

/// Whether the broker itself drops a message published again with an id it
/// has seen (NATS JetStream: the publisher sets `Nats-Msg-Id`).
fn drops_republished_ids(id: &str) -> bool {
    id == "nats"
}

/// How many messages repeat the id of an earlier one.
fn same_id_copies(messages: &[Message]) -> usize {
    let mut seen = std::collections::HashSet::new();
    messages
        .iter()
        .filter(|m| !seen.insert(m.id.clone()))
        .count()
}

/// Duplicates of both kinds, poison, and a handler that fails once per key
/// before it succeeds: every payment once, every poison message one dead
/// letter with its reason.
async fn duplicates_poison_and_retries(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let mut w = workload(24, 2);
    for i in 0..3 {
        let key = format!("flaky-{i}");
        w.messages.push(payment(
            &format!("m-flaky-{i}"),
            &key,
            70 + i,
            serde_json::json!({ "fail": "retry", "fail_times": 1 }),
        ));
        w.expected.insert(key, 70 + i);
    }
    let outcomes = Tally::default();
    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let mut sources = bench.sources_with(1, &w.messages).await;
    let run = start(&consumer, sources.remove(0));

    ledger_complete(&ledger, &w.expected).await;
    eventually(PATIENCE, "every poison message dead-lettered", || async {
        ledger.dead_letters().await.len() >= w.poison.len()
    })
    .await;
    // A broker that drops a republish of a message id it has seen
    // (JetStream's duplicate window, keyed by `Nats-Msg-Id`) never delivers
    // those copies: the inbox sees only the others.
    let copies = if drops_republished_ids(id) {
        w.duplicates - same_id_copies(&w.messages)
    } else {
        w.duplicates
    };
    eventually(PATIENCE, "every copy settled", || async {
        outcomes.count(OutcomeKind::Duplicate) >= copies
    })
    .await;
    let summary = run.stop().await;

    ledger.assert_exactly_once(&w.expected).await;
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        w.expected.len() as u64,
        "{} processed each key once",
        bench.broker.name
    );
    ledger.cleanup().await;
}

/// Acks lost between the commit and the broker: the next consumer gets
/// those messages again, and the inbox catches every one.
async fn lost_acks_are_redelivered_and_caught(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let (messages, expected) = payments(30, serde_json::json!({}));
    // One tally over both consumers: a broker may redeliver an unacked
    // message to the first one already (after its visibility timeout).
    let outcomes = Tally::default();
    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let mut sources = bench.sources_with(1, &messages).await;
    let mut n = 0_u32;
    let swallowing = SwallowAcks::new(sources.remove(0), move |_| {
        n += 1;
        n % 3 == 1 && n <= 15
    });
    let swallowed = Arc::clone(&swallowing.swallowed);
    let run = start(&consumer, swallowing);
    // The swallowed deliveries were committed (their ack is lost after the
    // commit). A source may stop handing out messages behind an unsettled
    // one (a partition commits only its contiguous position), so the first
    // consumer need not finish.
    eventually(PATIENCE, "the chosen acks swallowed", || async {
        swallowed.load(Ordering::SeqCst) >= 5
    })
    .await;
    // The consumer dies with the acks it never sent.
    run.kill().await;

    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let run = start(&consumer, bench.source(0).await);
    ledger_complete(&ledger, &expected).await;
    eventually(
        PATIENCE,
        "the unacked messages redelivered and caught",
        || async { outcomes.count(OutcomeKind::Duplicate) >= 5 },
    )
    .await;
    run.stop().await;

    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

/// A consumer killed while handlers run (their transactions roll back, no
/// ack is sent), then a new consumer: every effect once.
async fn a_consumer_killed_mid_handler_loses_nothing(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let (messages, expected) = payments(20, serde_json::json!({ "sleep_ms": 200 }));
    let plan = Arc::new(Plan::default());
    let consumer = Tally::default().build(
        ledger
            .consumer("conformance", Arc::clone(&plan))
            .concurrency(4),
    );
    let mut sources = bench.sources_with(1, &messages).await;
    let run = start(&consumer, sources.remove(0));
    eventually(PATIENCE, "handlers running", || async {
        plan.calls.load(Ordering::SeqCst) >= 6
    })
    .await;
    run.kill().await;

    let consumer = Tally::default().build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let run = start(&consumer, bench.source(0).await);
    ledger_complete(&ledger, &expected).await;
    run.stop().await;

    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

/// Two consumers compete for one URL's messages: every effect once.
async fn competing_consumers_apply_each_once(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let (messages, expected) = payments(60, serde_json::json!({}));
    let consumer = Tally::default().build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let sources = bench.sources_with(2, &messages).await;
    let runs: Vec<Running> = sources
        .into_iter()
        .map(|source| start(&consumer, source))
        .collect();
    ledger_complete(&ledger, &expected).await;
    for run in runs {
        run.stop().await;
    }

    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

/// The suite for each broker: `feature => module (registry id)`.
macro_rules! conformance {
    ($($feature:literal => $module:ident ($id:literal)),* $(,)?) => {$(
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test]
            async fn duplicates_poison_and_retries() {
                super::duplicates_poison_and_retries($id).await;
            }

            #[tokio::test]
            async fn lost_acks_are_redelivered_and_caught() {
                super::lost_acks_are_redelivered_and_caught($id).await;
            }

            #[tokio::test]
            async fn a_consumer_killed_mid_handler_loses_nothing() {
                super::a_consumer_killed_mid_handler_loses_nothing($id).await;
            }

            #[tokio::test]
            async fn competing_consumers_apply_each_once() {
                super::competing_consumers_apply_each_once($id).await;
            }
        }
    )*};
}

conformance! {
    "kafka" => kafka ("kafka"),
    "amqp" => amqp ("amqp"),
    "sqs" => sqs ("sqs"),
    "nats" => nats ("nats"),
    "redis-streams" => redis_stream ("redis-stream"),
    "mqtt" => mqtt ("mqtt"),
    "rocketmq" => rocketmq ("rocketmq"),
}

#[test]
fn every_registered_broker_has_a_test_url() {
    for broker in registry::brokers() {
        let url = url_for(broker.id);
        assert_eq!(
            registry::lookup(&url).ok().flatten().map(|b| b.id),
            Some(broker.id)
        );
        (broker.check)(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
    }
}
