//! The MQTT source against a real broker (Mosquitto on 127.0.0.1:1883 by
//! default, `IDEMQ_TEST_MQTT` (`host:port`) to change) with the PostgreSQL
//! ledger of `tests/support`, in what is MQTT's own: the dead-letter topic
//! with its reason property, a PUBACK lost and resent by the session with
//! DUP, retries held for their delay, and refused connections. A consumer
//! killed mid-handler and competing consumers on a shared subscription are
//! in `conformance.rs`.
#![cfg(all(feature = "mqtt", feature = "postgres"))]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource, REASON_PROPERTY};
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind, SourceErrorKind};
use support::{
    assert_dead_lettered, payments, receive, run_until_settled, workload, Deliveries, Ledger, Plan,
    SwallowAcks, Tally,
};

/// A config for `topic` as `client_id`, with a 60 s session expiry.
fn config(topic: &str, client_id: &str) -> MqttConfig {
    let broker = std::env::var("IDEMQ_TEST_MQTT").unwrap_or_else(|_| "127.0.0.1:1883".into());
    MqttConfig::from_url(&format!(
        "mqtt://{broker}/{topic}?client_id={client_id}&session_expiry=60s&min_retention=60s"
    ))
    .unwrap()
}

async fn publish(topic: &str, messages: &[Message]) {
    let publisher = MqttPublisher::connect(&config(topic, "producer"))
        .await
        .unwrap();
    support::publish_all(&publisher, messages).await;
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
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::new(Plan::default()))
            .concurrency(4),
    );
    let total = w.messages.len();
    run_until_settled(&consumer, source, &tally, total, Duration::from_secs(20)).await;

    ledger.assert_exactly_once(&w.expected).await;
    tally.assert_workload(&w);
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &w.poison,
        &DeadLetterReason::PermanentFailure,
    );
    let copies = receive(&mut dead_source, w.poison.len()).await;
    support::assert_dead_letter_copies(&copies, &w.poison, REASON_PROPERTY, "permanent_failure");
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_puback_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let topic = support::unique("swallow");
    let config = config(&topic, &support::unique("billing"));
    let source = MqttSource::connect(config.clone()).await.unwrap();
    let (messages, expected) = payments(3, serde_json::json!({}));
    publish(&topic, &messages).await;

    // First connection: commits p-1, but its PUBACK is never sent.
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let source = SwallowAcks::new(source, |d| d.message.key.as_deref() == Some("p-1"));
    let swallowed = Arc::clone(&source.swallowed);
    run_until_settled(&consumer, source, &tally, 3, Duration::from_secs(10)).await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;

    // The connection is gone; the same client id reconnects to its session,
    // the broker resends p-1 (DUP), and the inbox finds it processed.
    let again = Tally::default();
    let consumer = again.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(MqttSource::connect(config).await.unwrap());
    run_until_settled(&consumer, source, &again, 1, Duration::from_secs(10)).await;
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
    let (mut messages, mut expected) = payments(3, serde_json::json!({}));
    messages.splice(0..0, support::flaky_and_bad());
    publish(&topic, &messages).await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    let retry = support::fixed_backoff(Duration::from_millis(500));
    let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).retry(retry));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(source);
    run_until_settled(&consumer, source, &tally, 5, Duration::from_secs(15)).await;

    expected.insert("p-flaky".into(), 3);
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 9, "3 calls each + 3");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    assert_eq!(deliveries.get("p-bad"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        tally.assert_gaps(
            key,
            3,
            Duration::from_millis(450)..Duration::from_millis(2000),
            "the 500 ms delay",
        );
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

#[tokio::test]
async fn a_refused_connection_is_a_broker_error() {
    let mut config = config("t", "nobody");
    config.port = 1; // nothing listens there
    assert!(matches!(
        MqttSource::connect(config).await,
        Err(ref e) if e.kind() == SourceErrorKind::Broker
    ));
    assert!(matches!(
        MqttPublisher::connect(&self::config("a/#", "p")).await,
        Err(ref e) if e.kind() == SourceErrorKind::Config
    ));
}
