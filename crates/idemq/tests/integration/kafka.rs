//! The Kafka source against a real Apache Kafka broker (KRaft, one node on
//! 127.0.0.1:9092, started by `scripts/kafka.sh`) with the PostgreSQL ledger:
//! poison and a record that cannot be mapped on the dead-letter topic, a
//! crash between the inbox commit and the offset commit (the offsets then
//! committed to the end), retries of one record key, a rebalance with
//! messages in flight, order per key within a partition whose records run
//! concurrently, a committed offset that never passes a record in flight,
//! and hot keys through a rebalance and a kill mid-flight. A consumer killed mid-handler is in `conformance.rs`.
#![cfg(all(feature = "kafka", feature = "postgres"))]

use crate::support;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::{payment, payments, Ledger, PgTx, Plan, Tally};
use idemq::source::kafka::{
    create_topic, default_key_spec, KafkaConfig, KafkaPublisher, KafkaSource,
    DEAD_LETTER_REASON_HEADER,
};
use idemq::source::Source;
use idemq::store::sql::postgres::PostgresStore;
use idemq::DeadLetterReason;
use idemq::{handler_fn, Consumer, HandlerError, Message, OutcomeKind, Summary};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

const BROKERS: &str = "127.0.0.1:9092";
const PARTITIONS: i32 = 3;

/// A fresh topic with `partitions` partitions.
async fn new_topic(partitions: i32) -> String {
    let name = support::unique("idemq");
    let created = create_topic(BROKERS, &name, partitions)
        .await
        .expect("create topic (is scripts/kafka.sh running?)");
    assert!(created, "topic {name} existed already");
    name
}

/// Short session and heartbeat so that rebalances are quick.
fn config(topic: &str, group: &str) -> KafkaConfig {
    KafkaConfig::new(BROKERS, topic, group)
        .session_timeout(Duration::from_secs(6))
        .revoke_grace(Duration::from_secs(2))
        .set("heartbeat.interval.ms", "500")
}

async fn source(topic: &str, group: &str) -> KafkaSource {
    KafkaSource::connect(config(topic, group)).await.unwrap()
}

async fn publish(topic: &str, messages: &[Message]) {
    let publisher = KafkaPublisher::connect(BROKERS, topic).await.unwrap();
    support::publish_all(&publisher, messages).await;
}

/// A client of `group` that never joins it: to read its committed offsets.
fn group_reader(group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap()
}

/// The number of partitions of `topic`.
fn partition_count(c: &BaseConsumer, topic: &str) -> i32 {
    let metadata = c
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .unwrap();
    metadata.topics()[0].partitions().len() as i32
}

/// The group's committed offset of `partition` (`None`: nothing committed).
async fn committed_offset(topic: &str, group: &str, partition: i32) -> Option<i64> {
    let (topic, group) = (topic.to_owned(), group.to_owned());
    tokio::task::spawn_blocking(move || {
        let c = group_reader(&group);
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&topic, partition);
        let committed = c.committed_offsets(tpl, Duration::from_secs(5)).unwrap();
        match committed.elements()[0].offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        }
    })
    .await
    .unwrap()
}

/// Waits until the group's committed offsets reach the end of every
/// partition: every record was settled and its offset committed.
async fn committed_to_end(topic: &str, group: &str, limit: Duration) -> bool {
    let (topic, group) = (topic.to_owned(), group.to_owned());
    tokio::task::spawn_blocking(move || {
        let c = group_reader(&group);
        let partitions = partition_count(&c, &topic);
        let mut ends = Vec::new();
        for p in 0..partitions {
            ends.push(
                c.fetch_watermarks(&topic, p, Duration::from_secs(5))
                    .unwrap()
                    .1,
            );
        }
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(&topic, p);
        }
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(committed) = c.committed_offsets(tpl.clone(), Duration::from_secs(5)) {
                let done = committed.elements().iter().all(|e| {
                    let end = ends[e.partition() as usize];
                    e.offset() == Offset::Offset(end) || (end == 0 && e.offset() == Offset::Invalid)
                });
                if done {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        false
    })
    .await
    .unwrap()
}

/// Runs `consumer` over `source` until the group committed every offset of
/// the topic, then stops it; panics if that takes longer than `limit`.
async fn run_to_end(
    consumer: &Consumer<PostgresStore>,
    source: impl Source,
    topic: &str,
    group: &str,
    limit: Duration,
) -> Summary {
    let reached = AtomicBool::new(false);
    let summary = consumer
        .run_until(source, async {
            reached.store(
                committed_to_end(topic, group, limit).await,
                Ordering::SeqCst,
            );
        })
        .await
        .unwrap();
    assert!(
        reached.load(Ordering::SeqCst),
        "offsets were not committed to the end in {limit:?}: {summary}"
    );
    summary
}

/// [`run_to_end`] with a new member of `group`, within 60 s.
async fn run_group_to_end(consumer: &Consumer<PostgresStore>, topic: &str, group: &str) -> Summary {
    let source = source(topic, group).await;
    run_to_end(consumer, source, topic, group, Duration::from_secs(60)).await
}

/// Reads every record of a one-partition topic without joining a group.
async fn read_all(topic: &str, expect: usize) -> Vec<(Option<String>, Vec<u8>, Option<String>)> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", BROKERS)
            .set("group.id", support::unique("reader"))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning)
            .unwrap();
        c.assign(&tpl).unwrap();
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while out.len() < expect && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
                let reason = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == DEAD_LETTER_REASON_HEADER)
                        .and_then(|h| h.value)
                        .map(|v| String::from_utf8_lossy(v).into_owned())
                });
                let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
                out.push((key, m.payload().unwrap_or_default().to_vec(), reason));
            }
        }
        out
    })
    .await
    .unwrap()
}

/// Both kinds of duplicates are applied once, poison and an undecodable
/// record are dead-lettered (in the table and on the dead-letter topic), and
/// the partitions move on to their end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_poison_and_bad_records() {
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let dlq = new_topic(1).await;
    let group = support::unique("g");
    let work = support::workload(30, 2);
    publish(&topic, &work.messages).await;
    // A record whose key is not UTF-8, published around the publisher.
    let raw: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    raw.send(
        FutureRecord::to(&topic)
            .key(&[0xff_u8, 0xfe][..])
            .payload(r#"{"payment_id":"bad-key","amount":1}"#),
        Duration::from_secs(10),
    )
    .await
    .unwrap();

    let consumer = ledger
        .consumer("kafka-dups", Arc::new(Plan::default()))
        .key(default_key_spec())
        .build()
        .unwrap();
    let source = KafkaSource::connect(config(&topic, &group).dead_letter_topic(&dlq))
        .await
        .unwrap();
    let summary = run_to_end(&consumer, source, &topic, &group, Duration::from_secs(60)).await;

    ledger.assert_exactly_once(&work.expected).await;
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        work.expected.len() as u64
    );
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        work.duplicates as u64
    );
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 3);
    let letters = ledger.dead_letters().await;
    support::assert_dead_lettered(&letters, &work.poison, &DeadLetterReason::PermanentFailure);
    let poison = letters
        .iter()
        .find(|l| l.key.as_deref() == Some("poison-0"))
        .unwrap();
    assert_eq!(poison.message.id.as_deref(), Some("m-poison-0"));
    assert_eq!(poison.meta.source, "kafka");
    assert_eq!(poison.meta.topic.as_deref(), Some(topic.as_str()));
    assert!(poison.meta.partition.is_some() && poison.meta.offset.is_some());
    let bad: Vec<_> = letters
        .iter()
        .filter(|l| l.reason == "malformed_record")
        .collect();
    assert_eq!(bad.len(), 1, "{letters:?}");
    assert!(bad[0]
        .message
        .id
        .as_deref()
        .unwrap()
        .starts_with(&format!("{topic}-")));
    assert!(bad[0]
        .message
        .payload
        .starts_with(br#"{"payment_id":"bad-key""#));

    let mut forwarded = read_all(&dlq, 3).await;
    forwarded.sort();
    let reasons: Vec<_> = forwarded
        .iter()
        .map(|(k, _, r)| (k.clone(), r.clone()))
        .collect();
    assert_eq!(
        reasons,
        vec![
            (None, Some("malformed_record".into())),
            (Some("poison-0".into()), Some("permanent_failure".into())),
            (Some("poison-1".into()), Some("permanent_failure".into())),
        ]
    );
    ledger.cleanup().await;
}

/// The consumer commits the inbox transaction but dies before the offsets
/// are committed: the next member of the group gets those records again and
/// the inbox answers "duplicate".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_after_commit_before_offset_commit() {
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let group = support::unique("g");
    let work = support::workload(20, 0);
    publish(&topic, &work.messages).await;
    let plan = Arc::new(Plan::default());

    let first = ledger
        .consumer("kafka-crash", Arc::clone(&plan))
        .build()
        .unwrap();
    let wrapped = support::SwallowAcks::new(source(&topic, &group).await, |_| true);
    let swallowed = Arc::clone(&wrapped.swallowed);
    let summary = first
        .run_until(wrapped, async {
            // Every ack is swallowed, so every partition stops once its
            // window of unsettled records is full: wait until no more come.
            support::wait_until(Duration::from_secs(30), || {
                swallowed.load(Ordering::SeqCst) >= PARTITIONS as u32
            })
            .await;
            let mut last = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let now = swallowed.load(Ordering::SeqCst);
                if now == last {
                    break;
                }
                last = now;
            }
        })
        .await
        .unwrap();
    let crashed = summary.count(OutcomeKind::Processed);
    assert!(crashed >= PARTITIONS as u64, "{summary:?}");
    assert_eq!(ledger.rows().await.len() as u64, crashed);

    let second = ledger
        .consumer("kafka-crash", Arc::clone(&plan))
        .build()
        .unwrap();
    let summary = run_group_to_end(&second, &topic, &group).await;
    ledger.assert_exactly_once(&work.expected).await;
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        work.expected.len() as u64 - crashed
    );
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        work.duplicates as u64 + crashed,
        "the records whose offsets were not committed come back as duplicates"
    );
    ledger.cleanup().await;
}

/// A handler that fails twice then succeeds is applied once; one that always
/// fails is dead-lettered after the retry limit, and the partition (all
/// records share one record key here, so they go out one at a time, in
/// order) moves on past both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_then_dead_letter() {
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let group = support::unique("g");
    let one_partition = |mut m: Message| {
        m.key = Some("same-partition".into());
        m
    };
    let messages: Vec<Message> = [
        payment(
            "m-flaky",
            "p-flaky",
            5,
            serde_json::json!({ "fail": "retry", "fail_times": 2 }),
        ),
        payment("m-bad", "p-bad", 6, serde_json::json!({ "fail": "retry" })),
        payment("m-1", "p-1", 1, serde_json::json!({})),
        payment("m-2", "p-2", 2, serde_json::json!({})),
        payment("m-3", "p-3", 3, serde_json::json!({})),
    ]
    .into_iter()
    .map(one_partition)
    .collect();
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("kafka-retry", Arc::clone(&plan))
        .build()
        .unwrap();
    let summary = run_group_to_end(&consumer, &topic, &group).await;

    let expected = BTreeMap::from([
        ("p-flaky".to_owned(), 5),
        ("p-1".to_owned(), 1),
        ("p-2".to_owned(), 2),
        ("p-3".to_owned(), 3),
    ]);
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(summary.count(OutcomeKind::Processed), 4);
    assert_eq!(summary.count(OutcomeKind::RetryLater), 2 + 2);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 3 + 3 + 3);
    let letters = ledger.dead_letters().await;
    support::assert_dead_lettered(
        &letters,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    assert_eq!(letters[0].attempts, 3);
    assert_eq!(
        letters[0].meta.delivery_count, 3,
        "the same record, delivered three times"
    );
    ledger.cleanup().await;
}

/// Two members of one group compete for the partitions; the second joins
/// while the first has messages in flight, forcing a rebalance. Every
/// message is applied exactly once and none is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_and_a_rebalance() {
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let group = support::unique("g");
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    // About 7.5 s of work for one member (8 handlers at once, records of
    // one partition included); a rebalance takes a few seconds.
    for i in 0..75 {
        let m = payment(
            &format!("m-{i}"),
            &format!("p-{i}"),
            i + 1,
            serde_json::json!({ "sleep_ms": 800 }),
        );
        messages.push(m.clone());
        if i % 5 == 0 {
            messages.push(m); // redelivered by the producer with the same id
        }
        expected.insert(format!("p-{i}"), i + 1);
    }
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let seen = Tally::default();
    let a = seen.build(ledger.consumer("kafka-group", Arc::clone(&plan)));
    let b = ledger
        .consumer("kafka-group", Arc::clone(&plan))
        .build()
        .unwrap();
    let stop = Arc::new(tokio::sync::Notify::new());
    let first = source(&topic, &group).await;
    let run_a = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move { a.run_until(first, stop.notified_owned()).await.unwrap() }
    });
    // Start the second member while the first is busy.
    support::wait_until(Duration::from_secs(30), || seen.total() >= 5).await;
    assert!(
        seen.total() < messages.len(),
        "the first member finished too early"
    );
    let second = source(&topic, &group).await;
    let run_b = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move { b.run_until(second, stop.notified_owned()).await.unwrap() }
    });
    let done = committed_to_end(&topic, &group, Duration::from_secs(90)).await;
    stop.notify_waiters();
    let (sa, sb) = (run_a.await.unwrap(), run_b.await.unwrap());
    assert!(done, "offsets were not committed to the end: {sa} / {sb}");
    ledger.assert_exactly_once(&expected).await;
    let total = |s: &Summary| s.count(OutcomeKind::Processed) + s.count(OutcomeKind::Duplicate);
    assert!(
        total(&sb) > 0,
        "the second member got no partition: {sa} / {sb}"
    );
    assert_eq!(
        sa.count(OutcomeKind::Processed) + sb.count(OutcomeKind::Processed),
        expected.len() as u64
    );
    assert!(total(&sa) + total(&sb) >= messages.len() as u64);
    ledger.cleanup().await;
}

/// Records of one record key reach the handler in order and never two at
/// once, even when some fail and are retried, although each has a business
/// key of its own (the `event_id` header); different record keys run
/// concurrently, also within one partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn order_within_a_partition() {
    const KEYS: usize = 9;
    const SEQ: u64 = 12;
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let group = support::unique("g");
    let mut messages = Vec::new();
    for seq in 0..SEQ {
        for k in 0..KEYS {
            let key = format!("k{k}");
            messages.push(
                Message::new(serde_json::json!({ "key": key, "seq": seq }).to_string())
                    .with_id(format!("{key}-{seq}"))
                    .with_key(key.clone())
                    .with_header("event_id", format!("{key}-{seq}")),
            );
        }
    }
    publish(&topic, &messages).await;

    let seen: Arc<Mutex<BTreeMap<String, Vec<u64>>>> = Arc::default();
    // Keys in their handler right now, and per partition how many.
    type Busy = (HashSet<String>, BTreeMap<i32, usize>);
    let busy: Arc<Mutex<Busy>> = Arc::default();
    let max_in_partition = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicU32::new(0));
    let consumer = Consumer::builder("kafka-order", ledger.store.clone())
        .key(default_key_spec())
        .retry(support::fast_retry())
        .handler(handler_fn({
            let (seen, busy, max_in_partition, overlaps) = (
                Arc::clone(&seen),
                Arc::clone(&busy),
                Arc::clone(&max_in_partition),
                Arc::clone(&overlaps),
            );
            move |ctx, _tx: &mut PgTx| {
                let (seen, busy, max_in_partition, overlaps) = (
                    Arc::clone(&seen),
                    Arc::clone(&busy),
                    Arc::clone(&max_in_partition),
                    Arc::clone(&overlaps),
                );
                Box::pin(async move {
                    let p: serde_json::Value =
                        ctx.message.json().map_err(HandlerError::permanent)?;
                    let partition = ctx.meta.partition.unwrap_or(-1);
                    let key = p["key"].as_str().unwrap_or_default().to_owned();
                    {
                        let mut busy = busy.lock().unwrap();
                        if !busy.0.insert(key.clone()) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        let n = busy.1.entry(partition).or_default();
                        *n += 1;
                        max_in_partition.fetch_max(*n, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(15)).await;
                    {
                        let mut busy = busy.lock().unwrap();
                        busy.0.remove(&key);
                        if let Some(n) = busy.1.get_mut(&partition) {
                            *n -= 1;
                        }
                    }
                    let seq = p["seq"].as_u64().unwrap_or(u64::MAX);
                    if seq % 5 == 3 && ctx.meta.delivery_count == 1 {
                        return Err(HandlerError::retryable("first attempt fails"));
                    }
                    seen.lock().unwrap().entry(key).or_default().push(seq);
                    Ok(None)
                })
            }
        }))
        .build()
        .unwrap();
    let summary = run_group_to_end(&consumer, &topic, &group).await;

    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two deliveries of one key at once"
    );
    assert!(
        max_in_partition.load(Ordering::SeqCst) >= 2,
        "the keys of one partition were not processed concurrently"
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), KEYS);
    for (key, seqs) in &seen {
        assert_eq!(seqs, &(0..SEQ).collect::<Vec<_>>(), "order of {key}");
    }
    assert_eq!(summary.count(OutcomeKind::Processed), KEYS as u64 * SEQ);
    // Two failed first attempts per key; a key's later records wait in the
    // source meanwhile, so none is deferred.
    assert_eq!(summary.count(OutcomeKind::RetryLater), KEYS as u64 * 2);
    ledger.cleanup().await;
}

/// Records of one partition run concurrently, but its committed offset never
/// passes a record still in flight. The partition's first record sleeps in
/// its handler while the 29 after it are processed; the committed offset
/// stays at the first record; the consumer is then killed. The next member
/// gets all 30 again: it applies the first and answers the rest as
/// duplicates, so no record was skipped and none applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_committed_offset_never_passes_a_record_in_flight() {
    let ledger = Ledger::new().await;
    let topic = new_topic(1).await;
    let group = support::unique("g");
    let (mut messages, mut expected) = payments(29, serde_json::json!({}));
    messages.insert(
        0,
        payment(
            "m-slow",
            "p-slow",
            7,
            serde_json::json!({ "sleep_ms": 5000 }),
        ),
    );
    expected.insert("p-slow".to_owned(), 7);
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let processed = Arc::new(AtomicUsize::new(0));
    let consumer = ledger
        .consumer("kafka-gap", Arc::clone(&plan))
        .on_outcome({
            let processed = Arc::clone(&processed);
            move |outcome| {
                if outcome.kind() == OutcomeKind::Processed {
                    processed.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .build()
        .unwrap();
    let first = source(&topic, &group).await;
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(first).await }
    });
    assert!(
        support::wait_until(Duration::from_secs(30), || processed.load(Ordering::SeqCst)
            >= 29)
        .await,
        "the records after the slow one were not processed while it ran"
    );
    let slow_done = ledger.rows().await.iter().any(|(k, _)| k == "p-slow");
    assert!(!slow_done, "the slow record must still be in its handler");
    let committed = committed_offset(&topic, &group, 0).await;
    assert!(
        committed.is_none_or(|o| o == 0),
        "committed {committed:?} past the record in flight at offset 0"
    );
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());

    let second = ledger
        .consumer("kafka-gap", Arc::clone(&plan))
        .build()
        .unwrap();
    let summary = run_group_to_end(&second, &topic, &group).await;
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Duplicate), 29, "{summary}");
    ledger.cleanup().await;
}

/// Hot record keys and cold ones over 3 partitions, their records run
/// concurrently within each partition; a second member joins mid-run (a
/// rebalance with records in flight) and then the first is killed with its
/// handlers running. The group's offsets end committed to the end of every
/// partition with every record applied exactly once — no gap skipped, none
/// applied twice — and each hot key's records applied in offset order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hot_keys_a_rebalance_and_a_kill_mid_flight() {
    const HOT: usize = 4;
    const SEQ: usize = 30;
    const COLD: usize = 60;
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let group = support::unique("g");
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    let slow = serde_json::json!({ "sleep_ms": 120 });
    for seq in 0..SEQ {
        for k in 0..HOT {
            let event = format!("a{k}-{seq:02}");
            let amount = (seq * HOT + k + 1) as i64;
            let mut m = payment(&format!("m-{event}"), &event, amount, slow.clone());
            m.key = Some(format!("account-{k}"));
            messages.push(m);
            expected.insert(event, amount);
        }
        for c in (seq * COLD / SEQ)..((seq + 1) * COLD / SEQ) {
            let event = format!("c{c:02}");
            let amount = 1000 + c as i64;
            messages.push(payment(&format!("m-{event}"), &event, amount, slow.clone()));
            expected.insert(event, amount);
        }
    }
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let build = || {
        ledger
            .consumer("kafka-hot", Arc::clone(&plan))
            .concurrency(8)
            .build()
            .unwrap()
    };
    let (a, b) = (build(), build());
    let run_a = support::start(&a, source(&topic, &group).await);
    eventually_rows(&ledger, 20).await;
    let run_b = support::start(&b, source(&topic, &group).await);
    eventually_rows(&ledger, 90).await;
    let applied = ledger.rows().await.len();
    assert!(
        applied < expected.len(),
        "the first member finished before the kill"
    );
    run_a.kill().await;

    let done = committed_to_end(&topic, &group, Duration::from_secs(120)).await;
    let summary = run_b.stop().await;
    assert!(done, "offsets were not committed to the end: {summary}");
    ledger.assert_exactly_once(&expected).await;
    assert!(
        summary.count(OutcomeKind::Processed) > 0,
        "the second member applied nothing: {summary}"
    );
    let order = ledger.keys_in_order().await;
    for k in 0..HOT {
        let prefix = format!("a{k}-");
        let of_key: Vec<&String> = order.iter().filter(|e| e.starts_with(&prefix)).collect();
        let mut sorted = of_key.clone();
        sorted.sort();
        assert_eq!(of_key, sorted, "the order of record key account-{k}");
    }
    ledger.cleanup().await;
}

/// Waits until the ledger holds at least `n` rows (60 s at most).
async fn eventually_rows(ledger: &Ledger, n: usize) {
    support::eventually(Duration::from_secs(60), "ledger rows", || async {
        ledger.rows().await.len() >= n
    })
    .await;
}

/// A flood of one business key in one partition leaves the other partitions
/// running. Partition 0 holds 40 copies of one payment whose first copy
/// takes 3 s in its handler: the 39 copies after it wait in its key lane.
/// Partitions 1 and 2 hold 48 other payments of 50 ms each. A partition may
/// hold only half of the consumer's read-ahead, so the copies waiting in
/// the lane never take the room the other partitions' payments run in:
/// every one of them is applied before the slow first copy is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_one_key_leaves_the_other_partitions_running() {
    const COPIES: usize = 40;
    const OTHERS: usize = 48;
    let ledger = Ledger::new().await;
    let topic = new_topic(PARTITIONS).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    let send = |partition: i32, payload: String| {
        let producer = producer.clone();
        let topic = topic.clone();
        async move {
            producer
                .send(
                    FutureRecord::<(), _>::to(&topic)
                        .partition(partition)
                        .payload(&payload),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)
                .unwrap();
        }
    };
    let hot = serde_json::json!({ "payment_id": "hot", "amount": 1, "sleep_ms": 3000 });
    for _ in 0..COPIES {
        send(0, hot.to_string()).await;
    }
    let mut expected = BTreeMap::from([("hot".to_owned(), 1)]);
    for i in 0..OTHERS {
        let key = format!("other-{i:02}");
        let amount = 100 + i as i64;
        let payload = serde_json::json!({ "payment_id": key, "amount": amount, "sleep_ms": 50 });
        send(1 + (i % 2) as i32, payload.to_string()).await;
        expected.insert(key, amount);
    }

    let tally = Tally::default();
    let consumer = tally.build(
        ledger
            .consumer("kafka-flood", Arc::new(Plan::default()))
            .concurrency(8),
    );
    let group = support::unique("g");
    support::run_until(
        &consumer,
        source(&topic, &group).await,
        Duration::from_secs(60),
        || {
            tally.count(OutcomeKind::Processed) == OTHERS + 1
                && tally.count(OutcomeKind::Duplicate) == COPIES - 1
        },
    )
    .await;

    ledger.assert_exactly_once(&expected).await;
    let processed = tally.processed_keys();
    assert_eq!(
        processed.last().map(String::as_str),
        Some("hot"),
        "a payment of another partition waited behind the flood: {processed:?}"
    );
    ledger.cleanup().await;
}
