//! The SQS source against a real SQS endpoint (moto's server on
//! 127.0.0.1:5000 by default, `IDEMQ_TEST_SQS` to change; `scripts/sqs.sh`
//! starts it) with the PostgreSQL ledger of `tests/integration/support.rs`, in what is
//! SQS's own: poison in the dead-letter queue with its reason attribute, a
//! lost delete redelivered after the visibility timeout, retries through a
//! visibility change, a handler slower than the visibility timeout, the
//! order and concurrency of FIFO message groups, the attribute limit, and
//! queues whose retention or redrive policy can take messages away. A
//! consumer killed mid-handler and competing consumers are in
//! `conformance.rs`.
#![cfg(all(feature = "sqs", feature = "postgres"))]

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{
    assert_dead_lettered, payment, payments, run_until_settled, workload, Deliveries, Ledger, Plan,
    SwallowAcks, Tally,
};
use aws_sdk_sqs::types::QueueAttributeName;
use idemq::source::loss::LossPolicy;
use idemq::source::sqs::{SqsConfig, SqsPublisher, SqsSource, REASON_ATTRIBUTE};
use idemq::source::{Publisher, Source};
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind, SourceErrorKind};

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
    support::publish_all(&publisher, messages).await;
}

/// Reads `n` messages from the dead-letter queue `name` and deletes them.
async fn drain_dead_letter_queue(name: &str, n: usize) -> Vec<Message> {
    let mut source = SqsSource::connect(config(name).create_queue(false))
        .await
        .unwrap();
    support::receive(&mut source, n).await
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
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::new(Plan::default()))
            .concurrency(4),
    );
    let source = SqsSource::connect(config).await.unwrap();
    let total = w.messages.len();
    run_until_settled(&consumer, source, &tally, total, Duration::from_secs(40)).await;

    ledger.assert_exactly_once(&w.expected).await;
    tally.assert_workload(&w);
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );

    // The poison is in the SQS dead-letter queue too, with its reason and attributes.
    let copies = drain_dead_letter_queue(&dlq, w.poison.len()).await;
    support::assert_dead_letter_copies(&copies, &w.poison, REASON_ATTRIBUTE, "permanent_failure");
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delete_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("swallow"));
    let (messages, expected) = payments(3, serde_json::json!({}));
    publish(&config, &messages).await;

    // First consumer: commits p-1, but its delete never reaches SQS.
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let source = SwallowAcks::new(SqsSource::connect(config.clone()).await.unwrap(), |d| {
        d.message.key.as_deref() == Some("p-1")
    });
    let swallowed = Arc::clone(&source.swallowed);
    run_until_settled(&consumer, source, &tally, 3, Duration::from_secs(20)).await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The consumer is gone (source dropped): p-1 reappears after the
    // visibility timeout, and a new consumer finds it already processed.
    let again = Tally::default();
    let consumer = again.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(SqsSource::connect(config).await.unwrap());
    let started = Instant::now();
    run_until_settled(&consumer, source, &again, 1, Duration::from_secs(15)).await;
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
async fn retries_wait_for_the_visibility_change_and_end_in_the_dead_letter_queue() {
    let ledger = Ledger::new().await;
    let dlq = support::unique("retry_dead");
    // A long visibility timeout: a retry that came from its expiry would take 6 s.
    let config = config(&support::unique("retry"))
        .visibility(Duration::from_secs(6))
        .dead_letter_queue(&dlq);
    publish(&config, &support::flaky_and_bad()).await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    // A 2 s backoff: far from both an immediate redelivery and the 6 s timeout.
    let retry = support::fixed_backoff(Duration::from_secs(2));
    let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).retry(retry));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(SqsSource::connect(config).await.unwrap());
    run_until_settled(&consumer, source, &tally, 2, Duration::from_secs(30)).await;

    ledger
        .assert_exactly_once(&BTreeMap::from([("p-flaky".to_owned(), 3)]))
        .await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 6, "3 calls each");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        tally.assert_gaps(
            key,
            3,
            Duration::from_millis(1900)..Duration::from_millis(5000),
            "the nack's 2 s visibility change",
        );
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
async fn a_handler_slower_than_the_visibility_timeout_keeps_its_message() {
    let ledger = Ledger::new().await;
    let config = config(&support::unique("slow")); // 2 s visibility
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

    // Two consumers poll the queue: a lapsed visibility would hand the slow
    // message to the other one.
    let tally = Tally::default();
    let deliveries = Deliveries::default();
    let plan = Arc::new(Plan::default());
    let mut runs = Vec::new();
    for _ in 0..2 {
        let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)));
        runs.push((
            consumer,
            deliveries.wrap(SqsSource::connect(config.clone()).await.unwrap()),
        ));
    }
    support::run_all_until_settled(runs, &tally, 5, Duration::from_secs(20)).await;
    assert_eq!(
        deliveries.get("p-slow"),
        (1, 1),
        "the slow message was received again"
    );
    assert_eq!(deliveries.total(), 5);
    assert_eq!(plan.calls.load(Ordering::SeqCst), 5);
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
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::new(Plan::default()))
            .concurrency(6),
    );
    let source = SqsSource::connect(config).await.unwrap();
    // Until every message was processed: a redelivery under load is a final
    // outcome too, so counting finals may stop before the slow group's last.
    support::run_until(&consumer, source, Duration::from_secs(30), || {
        tally.count(OutcomeKind::Processed) >= 15
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
        Err(ref e) if e.kind() == SourceErrorKind::Other
    ));
    assert!(matches!(
        SqsSource::connect(SqsConfig::new(support::unique("missing")).endpoint(endpoint())).await,
        Err(ref e) if e.kind() == SourceErrorKind::Broker
    ));
}

/// Creates the queue `name` with these attributes, straight through the SDK.
async fn create_with(name: &str, attributes: &[(QueueAttributeName, String)]) -> String {
    let client = config(name).client().await.unwrap();
    let mut request = client.create_queue().queue_name(name);
    for (attribute, value) in attributes {
        request = request.attributes(attribute.clone(), value);
    }
    let out = request.send().await.unwrap();
    let url = out.queue_url().unwrap().to_owned();
    let arn = client
        .get_queue_attributes()
        .queue_url(&url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap();
    arn.attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn))
        .unwrap()
        .clone()
}

/// Connecting to `queue` fails with a configuration error naming `setting`.
async fn assert_refused(config: SqsConfig, queue: &str, setting: &str) {
    let err = SqsSource::connect(config).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("queue {queue}")), "{text}");
    assert!(text.contains(setting), "{text}");
    assert!(text.contains("broker_loss=warn"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retention_shorter_than_min_retention_is_refused_and_deletes_unreceived_messages() {
    let queue = support::unique("short_retention");
    create_with(
        &queue,
        &[(QueueAttributeName::MessageRetentionPeriod, "60".into())],
    )
    .await;
    let config = config(&queue).create_queue(false);
    assert_refused(config.clone(), &queue, "MessageRetentionPeriod=60").await;
    // A min_retention the queue meets, or none, passes.
    SqsSource::connect(config.clone().min_retention(Duration::from_secs(60)))
        .await
        .unwrap();
    SqsSource::connect(config.clone().min_retention(Duration::ZERO))
        .await
        .unwrap();

    // Run anyway: what the check is about. moto enforces the retention
    // period on receive (a message older than it is never returned), as
    // SQS deletes it: p-0, published before a 62 s wait, is gone; p-1,
    // published after, arrives.
    let warned = config.broker_loss(LossPolicy::Warn);
    let (messages, _) = payments(2, serde_json::json!({}));
    publish(&warned, &messages[..1]).await;
    tokio::time::sleep(Duration::from_secs(62)).await;
    publish(&warned, &messages[1..]).await;
    let mut source = SqsSource::connect(warned).await.unwrap();
    let got = support::receive(&mut source, 1).await;
    assert_eq!(got[0].key.as_deref(), Some("p-1"));
    let more = tokio::time::timeout(Duration::from_secs(5), source.next()).await;
    assert!(
        more.is_err(),
        "a message older than the retention period was delivered"
    );
}

#[tokio::test]
async fn a_redrive_policy_below_the_retry_attempts_is_refused_and_does_move_messages() {
    let redrive = support::unique("redrive_target");
    let arn = create_with(&redrive, &[]).await;
    let queue = support::unique("redrive");
    let policy = serde_json::json!({ "deadLetterTargetArn": arn, "maxReceiveCount": "1" });
    create_with(
        &queue,
        &[(QueueAttributeName::RedrivePolicy, policy.to_string())],
    )
    .await;
    let refused = config(&queue).create_queue(false);
    assert_refused(
        refused.clone(),
        &queue,
        &format!("RedrivePolicy maxReceiveCount=1 to queue {redrive}"),
    )
    .await;
    SqsSource::connect(refused.clone().broker_loss(LossPolicy::Warn))
        .await
        .unwrap();

    // What the check is about: a payment received once and not deleted (a
    // consumer that crashed, or an idemq retry) is moved to the redrive
    // queue at its next receive, never to reach the consumer again.
    let (messages, _) = payments(1, serde_json::json!({}));
    publish(&refused, &messages).await;
    let client = refused.client().await.unwrap();
    let url_of = |name: String| {
        let client = client.clone();
        async move {
            client
                .get_queue_url()
                .queue_name(name)
                .send()
                .await
                .unwrap()
                .queue_url()
                .unwrap()
                .to_owned()
        }
    };
    let (source_url, target_url) = (url_of(queue.clone()).await, url_of(redrive.clone()).await);
    let receive = |url: String| {
        let client = client.clone();
        async move {
            client
                .receive_message()
                .queue_url(url)
                .visibility_timeout(0)
                .wait_time_seconds(1)
                .send()
                .await
                .unwrap()
                .messages()
                .len()
        }
    };
    assert_eq!(receive(source_url.clone()).await, 1, "the first receive");
    assert_eq!(receive(source_url).await, 0, "moved away at the second");
    assert_eq!(receive(target_url).await, 1, "now in the redrive queue");
    // A queue the source creates has SQS's defaults: no risk.
    SqsSource::connect(config(&support::unique("created")))
        .await
        .unwrap();
}
