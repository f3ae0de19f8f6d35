//! The MQTT source against a real broker (Mosquitto on 127.0.0.1:1883 by
//! default, `IDEMQ_TEST_MQTT` (`host:port`) to change) with the PostgreSQL
//! ledger of `tests/integration/support.rs`, in what is MQTT's own: the dead-letter topic
//! with its reason property, a PUBACK lost and resent by the session with
//! DUP, retries held for their delay, and refused connections. A consumer
//! killed mid-handler and competing consumers on a shared subscription are
//! in `conformance.rs`.
#![cfg(all(feature = "mqtt", feature = "postgres"))]

use crate::support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{
    assert_dead_lettered, payments, receive, run_until_settled, workload, Deliveries, Ledger, Plan,
    SwallowAcks, Tally,
};
use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource, REASON_PROPERTY};
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind, SourceErrorKind};

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

/// Subscribes as `client_id` (a persistent session of `expiry`), leaves
/// with `DISCONNECT`, lets `publish` run while the session is offline,
/// waits `away`, comes back and returns how many messages the broker still
/// had for the session within 3 s.
async fn kept_while_away<F, Fut>(topic: &str, expiry: &str, away: Duration, publish: F) -> usize
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let broker = std::env::var("IDEMQ_TEST_MQTT").unwrap_or_else(|_| "127.0.0.1:1883".into());
    let client_id = support::unique("away");
    let url = format!(
        "mqtt://{broker}/{topic}?client_id={client_id}&session_expiry={expiry}&min_retention=1s"
    );
    let config = MqttConfig::from_url(&url).unwrap();
    let mut source = MqttSource::connect(config.clone()).await.unwrap();
    idemq::source::Source::close(&mut source).await;
    drop(source);
    publish().await;
    tokio::time::sleep(away).await;
    let mut source = MqttSource::connect(config).await.unwrap();
    let mut got = 0;
    while let Ok(Ok(Some(delivery))) = tokio::time::timeout(
        Duration::from_secs(3),
        idemq::source::Source::next(&mut source),
    )
    .await
    {
        let (_, _, _, acker) = delivery.into_parts();
        acker.ack().await.unwrap();
        got += 1;
    }
    got
}

/// A `session_expiry` under `min_retention` is refused; what it does: the
/// broker deletes a session away longer than its expiry (2 s), with the 5
/// payments queued for it, while a session of 60 s keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_session_expiry_is_refused_and_does_lose_queued_messages() {
    let short =
        MqttConfig::from_url("mqtt://127.0.0.1:1883/t?client_id=c&session_expiry=2s").unwrap();
    let err = MqttSource::connect(short).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    assert!(
        err.to_string()
            .contains("session c: session_expiry=2s (under min_retention 86400s)"),
        "{err}"
    );
    let (messages, _) = payments(5, serde_json::json!({}));
    let away = Duration::from_secs(5);
    let topic = support::unique("expiring");
    let lost = kept_while_away(&topic, "2s", away, || publish(&topic, &messages)).await;
    assert_eq!(lost, 0, "the expired session's queued payments are gone");
    let topic = support::unique("kept");
    let kept = kept_while_away(&topic, "60s", away, || publish(&topic, &messages)).await;
    assert_eq!(kept, 5, "a live session keeps them");
}

/// A publisher's MQTT 5 message expiry interval (1 s) drops a payment
/// queued for a session that is away longer (the broker setting idemq
/// cannot see: docs/operations.md); without one the payment waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_expiry_drops_what_waits_longer() {
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};

    async fn publish_expiring(topic: &str, expiry: Option<u32>) {
        let mut options = MqttOptions::new(support::unique("expiring_pub"), "127.0.0.1", 1883);
        options.set_keep_alive(Duration::from_secs(5));
        let (client, mut events) = AsyncClient::new(options, 10);
        let properties = PublishProperties {
            message_expiry_interval: expiry,
            ..Default::default()
        };
        client
            .publish_with_properties(
                topic,
                QoS::AtLeastOnce,
                false,
                b"{\"payment_id\":\"p-x\"}".to_vec(),
                properties,
            )
            .await
            .unwrap();
        loop {
            let event = tokio::time::timeout(Duration::from_secs(5), events.poll())
                .await
                .expect("a PUBACK within 5 s")
                .unwrap();
            if let Event::Incoming(Packet::PubAck(_)) = event {
                break;
            }
        }
        client.disconnect().await.unwrap();
    }
    let away = Duration::from_secs(3);
    let topic = support::unique("msg_expiry");
    let expired = kept_while_away(&topic, "60s", away, || publish_expiring(&topic, Some(1))).await;
    assert_eq!(expired, 0, "the message expired while the session was away");
    let topic = support::unique("msg_no_expiry");
    let kept = kept_while_away(&topic, "60s", away, || publish_expiring(&topic, None)).await;
    assert_eq!(kept, 1);
}
