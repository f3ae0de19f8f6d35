//! The NATS JetStream source against a real nats-server with JetStream
//! (127.0.0.1:4222 by default, `IDEMQ_TEST_NATS` to change) and the
//! PostgreSQL ledger of `tests/integration/support.rs`, in what is JetStream's own: the
//! duplicate window (same-id copies published outside it reach the inbox,
//! alone and with competing clients; inside it the server drops them),
//! poison on the dead-letter subject, a lost ack redelivered after
//! `ack_wait`, nak delays, a handler slower than `ack_wait`, and refused
//! headers and streams. A consumer killed mid-handler is in
//! `conformance.rs`.
#![cfg(all(feature = "nats", feature = "postgres"))]

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{
    assert_dead_lettered, payment, payments, run_until_settled, workload, Deliveries, Ledger, Plan,
    SwallowAcks, Tally,
};
use idemq::source::nats::{NatsConfig, NatsPublisher, NatsSource, REASON_HEADER};
use idemq::source::Publisher;
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind, SourceErrorKind};

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
    support::publish_all(&publisher, messages).await;
}

/// Deletes the test's stream and its dead-letter stream, if any.
async fn delete_streams(config: &NatsConfig) {
    let js = config.jetstream().await.unwrap();
    js.delete_stream(&config.stream).await.unwrap();
    let _ = js.delete_stream(format!("{}_dlq", config.stream)).await;
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
    support::receive(&mut source, n).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_applied_once_and_poison_is_dead_lettered() {
    let ledger = Ledger::new().await;
    let name = support::unique("dup");
    let config = config_short_window(&name).dead_letter_subject(format!("{name}.dead"));
    let w = workload(16, 2);
    publish_outside_window(&config, &w.messages).await;

    let tally = Tally::default();
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::new(Plan::default()))
            .concurrency(4),
    );
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    let total = w.messages.len();
    run_until_settled(&consumer, source, &tally, total, Duration::from_secs(30)).await;

    // Every copy reached the consumer (published outside the window), once each.
    assert_eq!(deliveries.total() as usize, total);
    ledger.assert_exactly_once(&w.expected).await;
    tally.assert_workload(&w);
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );

    // The poison is on the dead-letter subject too, with its reason and headers.
    let copies = read_dead_letters(&config, w.poison.len()).await;
    support::assert_dead_letter_copies(&copies, &w.poison, REASON_HEADER, "permanent_failure");
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
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    run_until_settled(&consumer, source, &tally, 2, Duration::from_secs(10)).await;
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
    let (messages, expected) = payments(3, serde_json::json!({}));
    publish(&config, &messages).await;

    // First consumer: commits p-1, but its ack never reaches the server.
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let source = SwallowAcks::new(NatsSource::connect(config.clone()).await.unwrap(), |d| {
        d.message.key.as_deref() == Some("p-1")
    });
    let swallowed = Arc::clone(&source.swallowed);
    run_until_settled(&consumer, source, &tally, 3, Duration::from_secs(10)).await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The consumer is gone (source dropped): p-1 comes back after ack_wait,
    // and a new client of the durable consumer finds it already processed.
    let again = Tally::default();
    let consumer = again.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    let started = Instant::now();
    run_until_settled(&consumer, source, &again, 1, Duration::from_secs(10)).await;
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
async fn retries_wait_for_the_nak_delay_and_end_on_the_dead_letter_subject() {
    let ledger = Ledger::new().await;
    let name = support::unique("retry");
    // A long ack_wait: a retry that came from its expiry would take 6 s.
    // The server's max_deliver (6) is above the engine's 3 attempts (and
    // above the default 5, under which the source refuses the consumer).
    let config = config(&name)
        .ack_wait(Duration::from_secs(6))
        .max_deliver(6)
        .dead_letter_subject(format!("{name}.dead"));
    let mut messages = support::flaky_and_bad().to_vec();
    messages.push(payment("m-ok", "p-ok", 5, serde_json::json!({})));
    publish(&config, &messages).await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    // A 2 s backoff: far from both an immediate redelivery and the 6 s ack_wait.
    let retry = support::fixed_backoff(Duration::from_secs(2));
    let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).retry(retry));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap());
    run_until_settled(&consumer, source, &tally, 3, Duration::from_secs(20)).await;

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
        tally.assert_gaps(
            key,
            3,
            Duration::from_millis(1900)..Duration::from_millis(5000),
            "the nak's 2 s delay",
        );
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
        let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).concurrency(3));
        runs.push((
            consumer,
            seen.wrap(NatsSource::connect(config.clone()).await.unwrap()),
        ));
    }
    support::run_all_until_settled(runs, &tally, total, Duration::from_secs(30)).await;
    ledger.assert_exactly_once(&w.expected).await;
    tally.assert_workload(&w);
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
    let (mut messages, mut expected) = payments(4, serde_json::json!({}));
    messages.insert(
        0,
        payment(
            "m-slow",
            "p-slow",
            9,
            serde_json::json!({ "sleep_ms": 6000 }),
        ),
    );
    expected.insert("p-slow".into(), 9);
    publish(&config, &messages).await;

    // Two clients pull from the consumer: a lapsed ack_wait would hand the
    // slow message to the other one.
    let tally = Tally::default();
    let deliveries = Deliveries::default();
    let plan = Arc::new(Plan::default());
    let mut runs = Vec::new();
    for _ in 0..2 {
        let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)));
        runs.push((
            consumer,
            deliveries.wrap(NatsSource::connect(config.clone()).await.unwrap()),
        ));
    }
    support::run_all_until_settled(runs, &tally, 5, Duration::from_secs(15)).await;
    assert_eq!(
        deliveries.get("p-slow"),
        (1, 1),
        "the slow message was delivered again"
    );
    assert_eq!(deliveries.total(), 5);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 5);
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
        Err(ref e) if e.kind() == SourceErrorKind::Other
    ));
    let missing = NatsConfig::new(support::unique("missing"), "billing").server(server());
    assert!(matches!(
        NatsSource::connect(missing).await,
        Err(ref e) if e.kind() == SourceErrorKind::Broker
    ));
    let wildcard = config.clone().subject(format!("{}.>", config.stream));
    assert!(matches!(
        NatsPublisher::connect(wildcard).await,
        Err(ref e) if e.kind() == SourceErrorKind::Config
    ));
    delete_streams(&config).await;
}

/// A stream created by someone else with `max_msgs=50` and `discard`.
async fn limited_stream(name: &str, discard: async_nats::jetstream::stream::DiscardPolicy) {
    let js = config(name).jetstream().await.unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.in")],
        max_messages: 50,
        discard,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Loss the broker causes: a stream whose limits discard its oldest
/// messages. idemq refuses it, naming the limit; accepted anyway
/// (`broker_loss=warn`), 300 payments published at full speed reach the
/// consumer as 50 — JetStream deleted the rest unprocessed. With the
/// recommended `discard: new` the same load loses nothing silently: the
/// stream refuses the publishes it cannot hold, the producer sees each
/// refusal, and every payment it stored is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_discards_unprocessed_messages_is_refused_and_does_lose_them() {
    use async_nats::jetstream::stream::DiscardPolicy;
    use idemq::source::loss::LossPolicy;
    let ledger = Ledger::new().await;
    let (messages, _) = payments(300, serde_json::json!({}));

    let name = support::unique("discard_old");
    limited_stream(&name, DiscardPolicy::Old).await;
    let err = NatsSource::connect(config(&name)).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    assert!(
        err.to_string()
            .contains(&format!("stream {name}: discard=old with max_msgs=50")),
        "{err}"
    );
    publish(&config(&name), &messages).await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("lossy", Arc::new(Plan::default())));
    let accepted = config(&name).broker_loss(LossPolicy::Warn);
    let source = NatsSource::connect(accepted.clone()).await.unwrap();
    run_until_settled(&consumer, source, &tally, 50, Duration::from_secs(30)).await;
    assert_eq!(tally.count(OutcomeKind::Processed), 50);
    let mut first: Vec<String> = tally.processed_keys();
    first.sort();
    assert!(
        !first.contains(&"p-0".to_owned()),
        "the oldest were dropped: {first:?}"
    );
    delete_streams(&accepted).await;

    let name = support::unique("discard_new");
    limited_stream(&name, DiscardPolicy::New).await;
    let recommended = config(&name);
    let publisher = NatsPublisher::connect(recommended.clone()).await.unwrap();
    let mut stored = BTreeMap::new();
    let mut refused = 0;
    for (i, m) in messages.iter().enumerate() {
        match publisher.publish(m).await {
            Ok(()) => {
                stored.insert(format!("p-{i}"), i as i64 + 1);
            }
            Err(_) => refused += 1,
        }
    }
    assert_eq!((stored.len(), refused), (50, 250));
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("safe", Arc::new(Plan::default())));
    let source = NatsSource::connect(recommended.clone()).await.unwrap();
    run_until_settled(&consumer, source, &tally, 50, Duration::from_secs(30)).await;
    let mut applied = tally.processed_keys();
    applied.sort();
    assert_eq!(applied, stored.keys().cloned().collect::<Vec<_>>());
    delete_streams(&recommended).await;
    ledger.cleanup().await;
}

/// A consumer whose `max_deliver` (2) gives up before idemq's retries (5)
/// is refused at connect, naming it; run anyway (`broker_loss=warn`), a
/// payment that fails twice and would succeed the third time is never
/// delivered a third time, and so never applied: JetStream keeps it in the
/// stream and delivers it to no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_max_deliver_under_the_retries_is_refused_and_does_lose_the_message() {
    let ledger = Ledger::new().await;
    let name = support::unique("maxdeliver");
    let config = config(&name).max_deliver(2);
    let err = NatsSource::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(
        text.contains("consumer billing: max_deliver=2 (not above idemq's default max_attempts 5)"),
        "{text}"
    );
    let messages = [
        payment(
            "m-flaky",
            "p-flaky",
            3,
            serde_json::json!({ "fail": "retry", "fail_times": 2 }),
        ),
        payment("m-ok", "p-ok", 5, serde_json::json!({})),
    ];
    publish(&config, &messages).await;
    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::clone(&plan))
            .retry(support::fast_retry().with_max_attempts(5)),
    );
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(
        NatsSource::connect(
            config
                .clone()
                .broker_loss(idemq::source::loss::LossPolicy::Warn),
        )
        .await
        .unwrap(),
    );
    // Two deliveries of p-flaky come within a second (50 ms, 100 ms
    // backoffs); a third would come as soon; 4 s (two ack_waits) is ample.
    consumer
        .run_until(source, tokio::time::sleep(Duration::from_secs(4)))
        .await
        .unwrap();
    assert_eq!(
        deliveries.get("p-flaky").0,
        2,
        "delivered twice, then never"
    );
    ledger
        .assert_exactly_once(&BTreeMap::from([("p-ok".to_owned(), 5)]))
        .await;
    delete_streams(&config).await;
    ledger.cleanup().await;
}
