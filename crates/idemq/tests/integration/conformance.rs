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
//! - two competing consumers, both doing work, over duplicates and poison;
//! - the order of each record key's effects, where the broker keeps it.
//!
//! Each ends with the ledger holding every effect exactly once. What a
//! broker promises beyond that (order, delivery counts, no copies of its
//! own) is one row of [`PROMISES`], and the scenarios assert it where it
//! holds. A broker added to the registry gets these tests by one line in
//! `conformance!` at the bottom, its URL template in [`url_for`] and its row
//! in [`PROMISES`]; its own test file keeps only what is specific to it.
#![cfg(feature = "postgres")]
#![allow(dead_code)] // a build without brokers uses none of this

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{
    assert_dead_lettered, eventually, payment, payments, start, workload, Deliveries, Ledger, Plan,
    Running, SwallowAcks, Tally,
};
use idemq::source::registry::{self, Broker};
use idemq::source::{Publisher, Source};
use idemq::{DeadLetterReason, Message, OutcomeKind};

/// How long a scenario may wait for the brokers (redeliveries after a
/// visibility timeout, an ack wait, a rebalance).
const PATIENCE: Duration = Duration::from_secs(90);

/// The most one conformance test may take: a hang fails the test, naming it.
const WHOLE_TEST: Duration = Duration::from_secs(360);

/// A fresh URL of broker `id` for one test (the test services of
/// `scripts/`; the same shapes as `scripts/chaos.sh`).
fn url_for(id: &str) -> String {
    let run = support::unique("conf");
    match id {
        "kafka" => format!(
            "kafka://127.0.0.1:9092/{run}?group={run}&create_partitions=3&session_timeout_ms=6000&heartbeat.interval.ms=500"
        ),
        "amqp" => format!("amqp://guest:guest@127.0.0.1:5672/%2f?queue={run}"),
        // A 10 s visibility, extended every 3.3 s: a held message lapses
        // only if an extension is 6.7 s late (with 3 s, a 2 s stall of moto
        // on a loaded machine let another consumer receive one).
        "sqs" => format!(
            "sqs://{run}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=10"
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

/// A fresh URL of broker `id` on which it keeps the order of each record
/// key, as [`Promises::order`] says.
fn ordered_url_for(id: &str) -> String {
    match promises(id).order {
        // A FIFO queue: the record key is the message group.
        Order::OnFifoQueues if id == "sqs" => format!(
            "sqs://{}.fifo?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=10",
            support::unique("conf")
        ),
        Order::OnFifoQueues => panic!("no FIFO URL for broker {id}: add one to ordered_url_for"),
        Order::Always | Order::No => url_for(id),
    }
}

/// Whether, and where, a broker keeps the order of one record key's
/// messages (the transport key: a Kafka record key, an SQS message group)
/// through idemq's source: the next one is handed out only after the one
/// before it was settled, also when that one failed and waits for its
/// retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// On every topic (Kafka: a record key is one partition, and the source
    /// hands out a record key's records one at a time).
    Always,
    /// On FIFO queues only, the URL of which [`ordered_url_for`] gives.
    OnFifoQueues,
    /// Not kept: a retry goes behind later messages (a retry queue, a nak
    /// delay, a retry topic, a message held by the source), and messages
    /// of one key run concurrently.
    No,
}

/// What a broker promises beyond redelivering what was not acked.
#[derive(Debug, Clone, Copy)]
struct Promises {
    /// Where the effects of one record key keep their publishing order.
    order: Order,
    /// A message handed to a consumer that died before settling it comes
    /// back with a delivery count of 2 or more. (Kafka counts only within
    /// one process; RocketMQ counts trips through its retry topic, and the
    /// messages of a consumer killed with its process come back from the
    /// original queue with the count they had.)
    counts_redeliveries: bool,
    /// Every message is delivered once unless a consumer failed to settle
    /// it: acks are per message, the source keeps a message it holds from
    /// going to another consumer (SQS: it extends the visibility until the
    /// settle), and the broker adds no copies of its own. (Kafka and
    /// RocketMQ move offsets, and a rebalance hands a member's unsettled
    /// records to another. AWS may, rarely, deliver a standard queue's
    /// message twice; moto, which these tests run against, does not.)
    delivers_once: bool,
    /// A message published again with an id the broker has seen is dropped
    /// (JetStream's duplicate window, keyed by `Nats-Msg-Id`, which the
    /// publisher sets): the inbox never sees those copies.
    drops_republished_ids: bool,
    /// One consumer gets the messages in publishing order while none fails
    /// (on the [`ordered_url_for`] URL), so the first of two copies of a
    /// business key is the one the engine's key lane runs first. (RocketMQ
    /// spreads a topic over queues that its consumer reads concurrently.)
    one_consumer_in_order: bool,
}

/// One row per broker of the registry.
const PROMISES: &[(&str, Promises)] = &[
    (
        "kafka",
        Promises {
            order: Order::Always,
            counts_redeliveries: false,
            delivers_once: false,
            drops_republished_ids: false,
            one_consumer_in_order: true,
        },
    ),
    (
        "amqp",
        Promises {
            order: Order::No,
            counts_redeliveries: true,
            delivers_once: true,
            drops_republished_ids: false,
            one_consumer_in_order: true,
        },
    ),
    (
        "sqs",
        Promises {
            order: Order::OnFifoQueues,
            counts_redeliveries: true,
            delivers_once: true,
            drops_republished_ids: false,
            one_consumer_in_order: true,
        },
    ),
    (
        "nats",
        Promises {
            order: Order::No,
            counts_redeliveries: true,
            delivers_once: true,
            drops_republished_ids: true,
            one_consumer_in_order: true,
        },
    ),
    (
        "redis-stream",
        Promises {
            order: Order::No,
            counts_redeliveries: true,
            delivers_once: true,
            drops_republished_ids: false,
            one_consumer_in_order: true,
        },
    ),
    (
        "mqtt",
        Promises {
            order: Order::No,
            counts_redeliveries: true,
            delivers_once: true,
            drops_republished_ids: false,
            one_consumer_in_order: true,
        },
    ),
    (
        "rocketmq",
        Promises {
            order: Order::No,
            counts_redeliveries: false,
            delivers_once: false,
            drops_republished_ids: false,
            one_consumer_in_order: false,
        },
    ),
];

fn promises(id: &str) -> Promises {
    PROMISES
        .iter()
        .find(|(broker, _)| *broker == id)
        .map(|(_, promises)| *promises)
        .unwrap_or_else(|| panic!("no promises of broker {id}: add a row to PROMISES"))
}

fn broker(id: &str) -> &'static Broker {
    registry::brokers()
        .find(|b| b.id == id)
        .unwrap_or_else(|| panic!("broker {id} is not registered"))
}

/// One scenario's broker: its URL, its publisher, and sources on demand.
struct Bench {
    broker: &'static Broker,
    promises: Promises,
    url: String,
    publisher: Box<dyn Publisher>,
}

impl Bench {
    /// A bench on a fresh URL of broker `id` ([`url_for`]).
    async fn new(id: &str) -> Self {
        Self::at(id, url_for(id)).await
    }

    /// Opens the publisher first: it creates what the URL asks for (a
    /// Kafka topic, an SQS queue, a NATS stream, a RabbitMQ queue).
    async fn at(id: &str, url: String) -> Self {
        let broker = broker(id);
        let publisher = (broker.open_publisher)(&url)
            .await
            .unwrap_or_else(|e| panic!("open a {} publisher: {e}", broker.name));
        Self {
            broker,
            promises: promises(id),
            url,
            publisher,
        }
    }

    /// Deletes what the URL created on the broker ([`Broker::remove`]); the
    /// sources are gone by then.
    async fn remove(self) {
        drop(self.publisher);
        (self.broker.remove)(&self.url)
            .await
            .unwrap_or_else(|e| panic!("remove {} objects: {e}", self.broker.name));
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

    /// How many of `messages` reach a consumer: all but the copies the
    /// broker drops ([`Promises::drops_republished_ids`]).
    fn delivered(&self, messages: &[Message]) -> usize {
        if self.promises.drops_republished_ids {
            messages.len() - same_id_copies(messages)
        } else {
            messages.len()
        }
    }

    /// How many of the `copies` extra copies of `messages` reach a consumer.
    fn delivered_copies(&self, messages: &[Message], copies: usize) -> usize {
        copies - (messages.len() - self.delivered(messages))
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

/// How many messages repeat the id of an earlier one.
fn same_id_copies(messages: &[Message]) -> usize {
    let mut seen = std::collections::HashSet::new();
    messages
        .iter()
        .filter(|m| !seen.insert(m.id.clone()))
        .count()
}

/// `messages` with a handler that sleeps `ms` on each.
fn slowed(messages: &mut [Message], ms: u64) {
    for m in messages {
        let mut payload: serde_json::Value = m.json().expect("a JSON payment");
        payload["sleep_ms"] = ms.into();
        m.payload = payload.to_string().into_bytes();
    }
}

/// Duplicates of both kinds, poison, and a handler that fails once per key
/// before it succeeds: every payment once, every poison message one dead
/// letter with its reason; where the broker delivers each message once,
/// one duplicate outcome per copy and nothing more.
async fn duplicates_poison_and_retries(id: &str) {
    const FLAKY: usize = 3;
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let mut w = workload(24, 2);
    for i in 0..FLAKY {
        let key = format!("flaky-{i}");
        let amount = 70 + i as i64;
        w.messages.push(payment(
            &format!("m-flaky-{i}"),
            &key,
            amount,
            serde_json::json!({ "fail": "retry", "fail_times": 1 }),
        ));
        w.expected.insert(key, amount);
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
    let copies = bench.delivered_copies(&w.messages, w.duplicates);
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
    let name = bench.broker.name;
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        w.expected.len() as u64,
        "{name} processed each key once"
    );
    assert!(
        summary.count(OutcomeKind::RetryLater) >= FLAKY as u64,
        "{name}: the flaky handlers failed first: {summary}"
    );
    if bench.promises.delivers_once {
        assert_eq!(
            summary.count(OutcomeKind::Duplicate),
            copies as u64,
            "{name} delivered each copy once: {summary}"
        );
        assert_eq!(
            summary.count(OutcomeKind::DeadLettered),
            w.poison.len() as u64,
            "{name} delivered each poison message once: {summary}"
        );
    }
    ledger.cleanup().await;
    bench.remove().await;
}

/// Acks lost between the commit and the broker: the consumer dies with
/// them, every message whose ack was lost is delivered again (with a
/// delivery count of 2 or more where the broker counts), and the inbox
/// catches every one.
async fn lost_acks_are_redelivered_and_caught(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let (messages, expected) = payments(30, serde_json::json!({}));
    // One tally and one delivery log over both consumers: a broker may
    // redeliver an unacked message to the first one already (after its
    // visibility timeout).
    let outcomes = Tally::default();
    let seen = Deliveries::default();
    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let mut sources = bench.sources_with(1, &messages).await;
    let chosen: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let mut n = 0_u32;
    let swallowing = SwallowAcks::new(seen.wrap(sources.remove(0)), {
        let chosen = Arc::clone(&chosen);
        move |d| {
            n += 1;
            let swallow = n % 3 == 1 && n <= 15;
            if swallow {
                let key = d.message.key.clone().expect("a payment has a key");
                chosen.lock().unwrap().insert(key);
            }
            swallow
        }
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
    let chosen = chosen.lock().unwrap().clone();

    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let run = start(&consumer, seen.wrap(bench.source(0).await));
    ledger_complete(&ledger, &expected).await;
    eventually(
        PATIENCE,
        "every unacked message delivered again",
        || async { chosen.iter().all(|key| seen.get(key).0 >= 2) },
    )
    .await;
    run.stop().await;

    ledger.assert_exactly_once(&expected).await;
    let name = bench.broker.name;
    assert!(
        outcomes.count(OutcomeKind::Duplicate) >= chosen.len(),
        "{name}: the redeliveries of {chosen:?} were caught as duplicates"
    );
    if bench.promises.counts_redeliveries {
        for key in &chosen {
            assert!(
                seen.get(key).1 >= 2,
                "{name}: {key} came back without a higher delivery count: {:?}",
                seen.log()
            );
        }
    }
    ledger.cleanup().await;
    bench.remove().await;
}

/// A consumer killed while handlers run (their transactions roll back, no
/// ack is sent), then a new consumer: the messages the dead one had taken
/// come back (counted as redeliveries where the broker counts), every
/// effect once, nothing dead-lettered.
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
    let first = Deliveries::default();
    let mut sources = bench.sources_with(1, &messages).await;
    let run = start(&consumer, first.wrap(sources.remove(0)));
    eventually(PATIENCE, "handlers running", || async {
        plan.calls.load(Ordering::SeqCst) >= 6
    })
    .await;
    run.kill().await;
    // A commit under way at the kill has landed or rolled back once the dead
    // run's connections are back in the pool: the pool pings each one it
    // takes back, which reads the answer to what was sent on it.
    let pool = ledger.store.pool();
    eventually(
        PATIENCE,
        "the killed run's connections back in the pool",
        || async { pool.num_idle() == pool.size() as usize },
    )
    .await;
    let applied: BTreeSet<String> = ledger.rows().await.into_iter().map(|(k, _)| k).collect();
    let started = plan.calls.load(Ordering::SeqCst) as usize;
    let name = bench.broker.name;
    assert!(
        started > applied.len(),
        "{name}: no handler was running at the kill ({started} started, {} applied)",
        applied.len()
    );
    let interrupted: BTreeSet<String> = first
        .log()
        .into_iter()
        .map(|s| s.key)
        .filter(|k| !applied.contains(k))
        .collect();

    let tally = Tally::default();
    let consumer = tally.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let second = Deliveries::default();
    let run = start(&consumer, second.wrap(bench.source(0).await));
    ledger_complete(&ledger, &expected).await;
    let summary = run.stop().await;

    ledger.assert_exactly_once(&expected).await;
    assert!(
        ledger.dead_letters().await.is_empty(),
        "{name}: a killed handler's message was dead-lettered"
    );
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        (expected.len() - applied.len()) as u64,
        "{name}: the new consumer applied what the dead one had not: {summary}"
    );
    if bench.promises.counts_redeliveries {
        for key in &interrupted {
            assert!(
                second.get(key).1 >= 2,
                "{name}: {key}, taken by the dead consumer, came back without a higher delivery count: {:?}",
                second.log()
            );
        }
    }
    ledger.cleanup().await;
    bench.remove().await;
}

/// Two consumers compete for one URL's messages, duplicates of both kinds
/// and poison among them: both do work, every effect once, every poison
/// message one dead letter; where the broker delivers each message once,
/// the two together received each message once.
async fn competing_consumers_apply_each_once(id: &str) {
    let ledger = Ledger::new().await;
    let bench = Bench::new(id).await;
    let mut w = workload(40, 2);
    // Long enough for one consumer alone (about 3 s at 4 handlers) that the
    // other one joins before the work is done (a rebalance included).
    slowed(&mut w.messages, 300);
    let sources = bench.sources_with(2, &w.messages).await;
    let logs: Vec<Deliveries> = sources.iter().map(|_| Deliveries::default()).collect();
    let meeting = Rendezvous::of(sources.len());
    let runs: Vec<Running> = sources
        .into_iter()
        .map(|source| meeting.wrap(source))
        .zip(&logs)
        .map(|(source, log)| {
            let consumer = Tally::default().build(
                ledger
                    .consumer("conformance", Arc::default())
                    .concurrency(4),
            );
            start(&consumer, log.wrap(source))
        })
        .collect();
    ledger_complete(&ledger, &w.expected).await;
    eventually(PATIENCE, "every poison message dead-lettered", || async {
        ledger.dead_letters().await.len() >= w.poison.len()
    })
    .await;
    let delivered = bench.delivered(&w.messages);
    if bench.promises.delivers_once {
        eventually(PATIENCE, "every message delivered", || async {
            logs.iter().map(Deliveries::total).sum::<u32>() as usize >= delivered
        })
        .await;
    }
    let mut summaries = Vec::new();
    for run in runs {
        summaries.push(run.stop().await);
    }

    ledger.assert_exactly_once(&w.expected).await;
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );
    let name = bench.broker.name;
    let processed: Vec<u64> = summaries
        .iter()
        .map(|s| s.count(OutcomeKind::Processed))
        .collect();
    assert!(
        processed.iter().all(|n| *n > 0),
        "{name}: both consumers applied effects: {processed:?}"
    );
    if bench.promises.delivers_once {
        let per_consumer: Vec<u32> = logs.iter().map(Deliveries::total).collect();
        assert_eq!(
            per_consumer.iter().sum::<u32>() as usize,
            delivered,
            "{name}: each message went to one consumer, once: {per_consumer:?}"
        );
    }
    ledger.cleanup().await;
    bench.remove().await;
}

/// Holds each consumer's first delivery until every consumer of a
/// [`competing_consumers_apply_each_once`] run has received one (or
/// [`RENDEZVOUS`] passed). Without it, "both consumers do work" is a race
/// against the broker's group join: under CI load a Kafka rebalance can take
/// longer than the whole workload, and the first member then applies
/// everything. With it, the first member's partitions are revoked while its
/// first delivery is still unsettled (after the source's revoke grace), so
/// the run also crosses a rebalance with work in flight.
#[derive(Clone)]
struct Rendezvous {
    arrived: Arc<std::sync::atomic::AtomicUsize>,
    expected: usize,
}

/// How long [`Rendezvous`] waits for the other consumers before it lets a
/// consumer go on alone (the assertion that both did work then decides).
const RENDEZVOUS: Duration = Duration::from_secs(30);

impl Rendezvous {
    fn of(expected: usize) -> Self {
        Self {
            arrived: Arc::default(),
            expected,
        }
    }

    fn wrap<S: Source>(&self, inner: S) -> Met<S> {
        Met {
            inner,
            meeting: self.clone(),
            met: false,
        }
    }
}

/// A source behind a [`Rendezvous`].
struct Met<S> {
    inner: S,
    meeting: Rendezvous,
    met: bool,
}

#[async_trait::async_trait]
impl<S: Source> Source for Met<S> {
    async fn next(&mut self) -> Result<Option<idemq::source::Delivery>, idemq::SourceError> {
        let delivery = self.inner.next().await?;
        if !self.met && delivery.is_some() {
            self.met = true;
            let arrived = self.meeting.arrived.fetch_add(1, Ordering::SeqCst) + 1;
            let (meeting, expected) = (self.meeting.arrived.clone(), self.meeting.expected);
            if arrived < expected {
                support::wait_until(RENDEZVOUS, || meeting.load(Ordering::SeqCst) >= expected)
                    .await;
            }
        }
        Ok(delivery)
    }

    // A wrapper forwards what the engine tells the source (see `Source`).
    async fn close(&mut self) {
        self.inner.close().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn idemq::source::OffsetLookup>) {
        self.inner.resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.inner.settle_out_of_order(per_partition)
    }
}

/// Record keys × messages, each message with a business key of its own and
/// the third of each record key failing its first attempt: every effect
/// once, and where the broker keeps order ([`Promises::order`], on
/// [`ordered_url_for`]) each record key's effects in publishing order, the
/// retried one in its place.
async fn each_record_keys_order_where_the_broker_keeps_it(id: &str) {
    const KEYS: usize = 4;
    const SEQ: usize = 8;
    let ledger = Ledger::new().await;
    let bench = Bench::at(id, ordered_url_for(id)).await;
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for seq in 0..SEQ {
        for k in 0..KEYS {
            let event = format!("a{k}-{seq}");
            let extra = if seq == 2 {
                serde_json::json!({ "fail": "retry", "fail_times": 1 })
            } else {
                serde_json::json!({})
            };
            let amount = seq as i64 + 1;
            let mut m = payment(&format!("m-{event}"), &event, amount, extra);
            m.key = Some(format!("account-{k}"));
            messages.push(m);
            expected.insert(event, amount);
        }
    }
    let outcomes = Tally::default();
    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(4),
    );
    let mut sources = bench.sources_with(1, &messages).await;
    let run = start(&consumer, sources.remove(0));
    ledger_complete(&ledger, &expected).await;
    let summary = run.stop().await;

    ledger.assert_exactly_once(&expected).await;
    let name = bench.broker.name;
    assert!(
        summary.count(OutcomeKind::RetryLater) >= KEYS as u64,
        "{name}: the third message of each record key failed first: {summary}"
    );
    if bench.promises.order != Order::No {
        let applied = ledger.keys_in_order().await;
        for k in 0..KEYS {
            let prefix = format!("a{k}-");
            let of_key: Vec<&str> = applied
                .iter()
                .filter(|e| e.starts_with(&prefix))
                .map(String::as_str)
                .collect();
            let want: Vec<String> = (0..SEQ).map(|seq| format!("a{k}-{seq}")).collect();
            assert_eq!(of_key, want, "{name}: the order of record key account-{k}");
        }
    }
    ledger.cleanup().await;
    bench.remove().await;
}

/// Two copies of each business key with different amounts (a reused key),
/// published one right after the other and consumed by one consumer at
/// concurrency 64: each key is applied once and the other copy is the
/// conflict's dead letter; where one consumer gets the messages in
/// publishing order, the first copy is the one applied (issue 12's "0
/// later-copy-wins" for the brokers).
async fn the_first_copy_of_a_reused_key_wins(id: &str) {
    const KEYS: usize = 60;
    let ledger = Ledger::new().await;
    let bench = Bench::at(id, ordered_url_for(id)).await;
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    for k in 0..KEYS {
        let key = format!("reused-{k}");
        messages.push(payment(
            &format!("first-{k}"),
            &key,
            1,
            serde_json::json!({}),
        ));
        messages.push(payment(
            &format!("second-{k}"),
            &key,
            2,
            serde_json::json!({}),
        ));
        expected.insert(key, 1);
    }
    let outcomes = Tally::default();
    let consumer = outcomes.build(
        ledger
            .consumer("conformance", Arc::default())
            .concurrency(64),
    );
    let mut sources = bench.sources_with(1, &messages).await;
    let run = start(&consumer, sources.remove(0));
    ledger_complete(&ledger, &expected).await;
    eventually(PATIENCE, "a conflict dead letter per key", || async {
        ledger.dead_letters().await.len() >= KEYS
    })
    .await;
    let summary = run.stop().await;

    let name = bench.broker.name;
    let keys: Vec<String> = expected.keys().cloned().collect();
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &keys,
        &DeadLetterReason::Conflict,
    );
    if bench.promises.one_consumer_in_order {
        ledger.assert_exactly_once(&expected).await;
    } else {
        let rows = ledger.rows().await;
        assert_eq!(rows.len(), KEYS, "{name}: one effect per key: {rows:?}");
        assert!(rows.iter().all(|(_, amount)| *amount == 1 || *amount == 2));
    }
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        KEYS as u64,
        "{name}: {summary}"
    );
    ledger.cleanup().await;
    bench.remove().await;
}

/// The suite for each broker: `feature => module (registry id)`.
macro_rules! conformance {
    ($($feature:literal => $module:ident ($id:literal)),* $(,)?) => {$(
        #[cfg(feature = $feature)]
        mod $module {
            #[tokio::test]
            async fn duplicates_poison_and_retries() {
                crate::support::within(super::WHOLE_TEST, stringify!(duplicates_poison_and_retries), super::duplicates_poison_and_retries($id)).await;
            }

            #[tokio::test]
            async fn lost_acks_are_redelivered_and_caught() {
                crate::support::within(super::WHOLE_TEST, stringify!(lost_acks_are_redelivered_and_caught), super::lost_acks_are_redelivered_and_caught($id)).await;
            }

            #[tokio::test]
            async fn a_consumer_killed_mid_handler_loses_nothing() {
                crate::support::within(super::WHOLE_TEST, stringify!(a_consumer_killed_mid_handler_loses_nothing), super::a_consumer_killed_mid_handler_loses_nothing($id)).await;
            }

            #[tokio::test]
            async fn competing_consumers_apply_each_once() {
                crate::support::within(super::WHOLE_TEST, stringify!(competing_consumers_apply_each_once), super::competing_consumers_apply_each_once($id)).await;
            }

            #[tokio::test]
            async fn the_first_copy_of_a_reused_key_wins() {
                crate::support::within(super::WHOLE_TEST, stringify!(the_first_copy_of_a_reused_key_wins), super::the_first_copy_of_a_reused_key_wins($id)).await;
            }

            #[tokio::test]
            async fn each_record_keys_order_where_the_broker_keeps_it() {
                crate::support::within(super::WHOLE_TEST, stringify!(each_record_keys_order_where_the_broker_keeps_it), super::each_record_keys_order_where_the_broker_keeps_it($id)).await;
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
fn every_registered_broker_has_test_urls_and_promises() {
    for broker in registry::brokers() {
        promises(broker.id);
        for url in [url_for(broker.id), ordered_url_for(broker.id)] {
            assert_eq!(
                registry::lookup(&url).ok().flatten().map(|b| b.id),
                Some(broker.id)
            );
            (broker.check)(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
        }
    }
}
