//! Loss the broker causes, on RabbitMQ (127.0.0.1:5672, its management API
//! on :15672, both started by `scripts/services.sh`) with the PostgreSQL
//! ledger. Policies are set through the management API, as an operator
//! would: a queue whose `max-length` drops its head is refused at connect,
//! naming the policy, and does lose what it dropped; with
//! `overflow=reject-publish` the same load, published at full speed by a
//! publisher that retries a refused message, is applied exactly once. A
//! `message-ttl` under `min_retention` is refused too, and a management API
//! that cannot be reached skips the check instead of stopping the consumer.
#![cfg(all(feature = "amqp", feature = "postgres"))]

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use crate::support::{eventually, payments, start, Ledger, Plan, Tally};
use idemq::source::amqp::{AmqpConfig, AmqpPublisher, AmqpSource};
use idemq::source::loss::LossPolicy;
use idemq::source::Publisher;
use idemq::{Message, SourceErrorKind};
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::json;

fn amqp_url() -> String {
    std::env::var("IDEMQ_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn management_url() -> String {
    std::env::var("IDEMQ_TEST_RABBITMQ_MANAGEMENT")
        .unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

/// Sets (or, with `None`, deletes) the policy `name` of vhost `/` through
/// the management API, as `rabbitmqctl set_policy` would.
async fn policy(name: &str, rule: Option<serde_json::Value>) {
    let url = format!("{}/api/policies/%2F/{name}", management_url());
    let client = reqwest::Client::new();
    let request = match rule {
        Some(rule) => client.put(&url).json(&rule),
        None => client.delete(&url),
    };
    let answer = request
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .expect("the management API (is scripts/services.sh's RabbitMQ running?)");
    assert!(answer.status().is_success(), "{name}: {}", answer.status());
}

/// A queue's config with a policy matching only it (and its dead-letter
/// queue), set before anything declares the queue.
async fn queue_with_policy(definition: serde_json::Value) -> (AmqpConfig, String) {
    let queue = support::unique("idemq_loss");
    let name = format!("{queue}-policy");
    policy(
        &name,
        Some(json!({
            "pattern": format!("^{queue}$"),
            "definition": definition,
            "apply-to": "queues",
            "priority": 0
        })),
    )
    .await;
    let config = AmqpConfig::from_url(&format!(
        "{}?queue={queue}&management_url={}",
        amqp_url(),
        management_url()
    ))
    .unwrap();
    (config, name)
}

/// Messages waiting in `queue`.
async fn ready(queue: &str) -> u32 {
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
    declared.message_count()
}

/// Publishes every message, retrying one the broker refused (a full queue
/// with `reject-publish` nacks it) until it is taken.
async fn publish_retrying(publisher: &AmqpPublisher, messages: &[Message]) -> usize {
    let mut refusals = 0;
    for message in messages {
        while let Err(e) = publisher.publish(message).await {
            assert_eq!(e.kind(), SourceErrorKind::Broker, "{e}");
            refusals += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    refusals
}

/// `max-length=20` by policy, overflow unset (drop-head): the consumer is
/// refused, naming the policy; 100 payments published with no consumer
/// leave the last 20, and a consumer run anyway (`broker_loss=warn`)
/// applies those 20 only. With `overflow=reject-publish` the consumer
/// starts, the publisher sees refusals while the queue is full, and all
/// 100 are applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_that_drops_its_head_is_refused_and_does_lose_messages() {
    let (messages, expected) = payments(100, json!({}));

    let (config, policy_name) = queue_with_policy(json!({"max-length": 20})).await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let err = AmqpSource::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    let queue = config.queue_name().to_owned();
    assert!(
        text.contains(&format!(
            "queue {queue}: max-length=20 (policy \"{policy_name}\") with overflow unset (drop-head)"
        )),
        "{text}"
    );
    assert!(text.contains("overflow=reject-publish"), "{text}");
    assert!(!text.contains("guest:guest"), "{text}");

    support::publish_all(&publisher, &messages).await;
    assert_eq!(ready(&queue).await, 20, "the queue dropped its head");
    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("lossy", Arc::new(Plan::default())));
    let source = AmqpSource::connect(config.clone().broker_loss(LossPolicy::Warn))
        .await
        .unwrap();
    support::run_until_settled(&consumer, source, &tally, 20, Duration::from_secs(30)).await;
    let mut applied = tally.processed_keys();
    applied.sort();
    let mut last: Vec<String> = (80..100).map(|i| format!("p-{i}")).collect();
    last.sort();
    assert_eq!(applied, last, "only the newest 20 were left to apply");
    assert_eq!(ledger.rows().await.len(), 20, "80 payments were lost");
    ledger.cleanup().await;
    publisher.delete_topology().await.unwrap();
    publisher.close().await.unwrap();
    policy(&policy_name, None).await;

    let (config, policy_name) =
        queue_with_policy(json!({"max-length": 20, "overflow": "reject-publish"})).await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("safe", Arc::new(Plan::default())));
    // Publish first: the queue fills and refuses; then the consumer drains
    // it while the publisher retries.
    let publishing = {
        let messages = messages.clone();
        tokio::spawn(async move {
            let refusals = publish_retrying(&publisher, &messages).await;
            (publisher, refusals)
        })
    };
    eventually(Duration::from_secs(20), "the queue full", || async {
        ready(config.queue_name()).await >= 20
    })
    .await;
    let source = AmqpSource::connect(config.clone()).await.unwrap();
    let run = start(&consumer, source);
    let (publisher, refusals) = publishing.await.unwrap();
    eventually(Duration::from_secs(30), "all 100 applied", || async {
        tally.finals() >= 100
    })
    .await;
    run.stop().await;
    assert!(
        refusals > 0,
        "the full queue refused publishes (the publisher saw them)"
    );
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
    publisher.delete_topology().await.unwrap();
    publisher.close().await.unwrap();
    policy(&policy_name, None).await;
}

/// `message-ttl=1000` by policy: refused under the default `min_retention`
/// (1 day), and the broker does discard the 30 payments left unconsumed a
/// second later. With `min_retention=500ms` the same queue passes; with a
/// management API that does not answer, the check is skipped (logged) and
/// the consumer starts.
#[tokio::test]
async fn a_message_ttl_under_min_retention_is_refused_and_does_discard() {
    let (messages, _) = payments(30, json!({}));
    let (config, policy_name) = queue_with_policy(json!({"message-ttl": 1000})).await;
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let err = AmqpSource::connect(config.clone()).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "queue {}: message-ttl=1s (policy \"{policy_name}\") under min_retention 86400s",
            config.queue_name()
        )),
        "{text}"
    );
    assert!(text.contains("discards a message"), "{text}");

    support::publish_all(&publisher, &messages).await;
    eventually(
        Duration::from_secs(10),
        "the TTL discarded all 30",
        || async { ready(config.queue_name()).await == 0 },
    )
    .await;

    let lenient = config.clone().min_retention(Duration::from_millis(500));
    AmqpSource::connect(lenient)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let unreachable = config
        .clone()
        .management_url(Some("http://127.0.0.1:1"))
        .unwrap();
    AmqpSource::connect(unreachable)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    publisher.delete_topology().await.unwrap();
    publisher.close().await.unwrap();
    policy(&policy_name, None).await;
}

/// `delivery-limit=1` by policy on a quorum queue: refused (not above
/// idemq's default 5 attempts), and the broker does drop a payment
/// returned twice — what a consumer killed twice mid-message does.
#[tokio::test]
async fn a_low_delivery_limit_is_refused_and_does_drop_returned_messages() {
    let (messages, _) = payments(1, json!({}));
    let (config, policy_name) = queue_with_policy(json!({"delivery-limit": 1})).await;
    let config = config.queue_type(idemq::source::amqp::QueueType::Quorum);
    let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
    let err = AmqpSource::connect(config.clone()).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "queue {}: delivery-limit=1 (policy \"{policy_name}\") not above idemq's default max_attempts 5",
            config.queue_name()
        )),
        "{text}"
    );

    support::publish_all(&publisher, &messages).await;
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for _ in 0..2 {
        let got = channel
            .basic_get(
                config.queue_name().into(),
                lapin::options::BasicGetOptions::default(),
            )
            .await
            .unwrap()
            .expect("the payment is still there to be returned");
        got.delivery
            .acker
            .nack(lapin::options::BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    eventually(Duration::from_secs(10), "the payment dropped", || async {
        ready(config.queue_name()).await == 0
    })
    .await;
    let after = channel
        .basic_get(
            config.queue_name().into(),
            lapin::options::BasicGetOptions::default(),
        )
        .await
        .unwrap();
    assert!(
        after.is_none(),
        "returned twice past delivery-limit=1, it is gone"
    );
    connection.close(200, "done".into()).await.unwrap();
    publisher.delete_topology().await.unwrap();
    publisher.close().await.unwrap();
    policy(&policy_name, None).await;
}
