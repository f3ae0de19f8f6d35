//! Loss the broker causes, on Kafka (Apache Kafka 4.1, KRaft, one node on
//! 127.0.0.1:9092, started by `scripts/kafka.sh`) with the PostgreSQL
//! ledger: a topic whose retention deletes records the group never read is
//! refused at connect, naming `retention.ms`; run anyway
//! (`broker_loss=warn`), its consumer gets only what the broker had not
//! deleted yet; with the broker's default retention the same load is
//! applied exactly once.
#![cfg(all(feature = "kafka", feature = "postgres"))]

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::{payment, payments, Ledger, Plan, Tally};
use idemq::source::kafka::{create_topic, delete_topic, KafkaConfig, KafkaPublisher, KafkaSource};
use idemq::source::loss::LossPolicy;
use idemq::SourceErrorKind;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::producer::{FutureProducer, FutureRecord};

const BROKERS: &str = "127.0.0.1:9092";

/// A fresh one-partition topic that deletes records a second after they
/// were written. `cleanup.policy=compact,delete`: the broker applies
/// retention to a `delete` topic only every `log.retention.check.interval.ms`
/// (5 minutes by default, the broker's own setting), but the log cleaner
/// applies it to a `compact,delete` topic at each of its passes (every
/// `log.cleaner.backoff.ms`, 15 s) — the same `retention.ms` deletion,
/// soon enough for a test. The payments' keys are all different, so
/// compaction itself removes nothing.
async fn short_retention_topic() -> String {
    lossy_topic("idemq_retention", &[("retention.ms", "1000")]).await
}

/// A fresh one-partition `compact,delete` topic (see
/// [`short_retention_topic`]) whose segments roll after a second, with
/// `settings` on top.
async fn lossy_topic(prefix: &str, settings: &[(&str, &str)]) -> String {
    let name = support::unique(prefix);
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    let mut topic = NewTopic::new(&name, 1, TopicReplication::Fixed(1))
        .set("cleanup.policy", "compact,delete")
        .set("segment.ms", "1000")
        .set("file.delete.delay.ms", "1000");
    for (key, value) in settings {
        topic = topic.set(key, value);
    }
    let created = admin
        .create_topics(
            [&topic],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create topic (is scripts/kafka.sh running?)");
    assert!(
        matches!(created.as_slice(), [Ok(_)]),
        "create {name}: {created:?}"
    );
    name
}

/// (low, high) watermarks of partition 0 of `topic`.
async fn watermarks(topic: &str) -> (i64, i64) {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", BROKERS)
            .create()
            .unwrap();
        c.fetch_watermarks(&topic, 0, Duration::from_secs(5))
            .unwrap()
    })
    .await
    .unwrap()
}

/// Waits until the broker deleted every record of partition 0 of `topic`
/// (its low watermark reached the high one, `published`), up to `limit`.
async fn wait_deleted(topic: &str, published: i64, limit: Duration) -> (i64, i64) {
    let started = Instant::now();
    loop {
        let marks = watermarks(topic).await;
        if marks.0 >= published || started.elapsed() > limit {
            return marks;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Publishes payments `late-0 … late-{n-1}` stamped ten minutes ahead, so
/// that retention, which goes by the records' timestamps, keeps them while
/// the test reads them (Kafka accepts timestamps up to an hour ahead).
async fn publish_late(topic: &str, n: usize) -> Vec<String> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("acks", "all")
        .create()
        .unwrap();
    let ahead = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        + 600_000;
    let mut keys = Vec::new();
    for i in 0..n {
        let key = format!("late-{i}");
        let message = payment(&format!("m-late-{i}"), &key, 1, serde_json::json!({}));
        producer
            .send(
                FutureRecord::to(topic)
                    .key(&key)
                    .payload(&message.payload)
                    .timestamp(ahead),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        keys.push(key);
    }
    keys.sort();
    keys
}

/// A topic with `retention.ms=1000` is refused at connect, naming it; the
/// broker then deletes 300 payments published to it before any consumer
/// read them, and a consumer run anyway (`broker_loss=warn`) gets only the
/// 50 published after the deletion. On a topic with the broker's default
/// retention (7 days, `delete`) the same 300 are applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_topic_whose_retention_deletes_unread_records_is_refused_and_does_lose_them() {
    let (messages, expected) = payments(300, serde_json::json!({}));

    let topic = short_retention_topic().await;
    let group = support::unique("g");
    let config = KafkaConfig::new(BROKERS, &topic, &group);
    let err = KafkaSource::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("topic {topic}: retention.ms=1000")),
        "{text}"
    );
    assert!(text.contains("broker_loss=warn"), "{text}");

    let publisher = KafkaPublisher::connect(BROKERS, &topic).await.unwrap();
    support::publish_all(&publisher, &messages).await;
    let (low, high) = wait_deleted(&topic, 300, Duration::from_secs(40)).await;
    assert_eq!(
        (low, high),
        (300, 300),
        "the broker did not delete the 300 records within 40 s"
    );
    let late = publish_late(&topic, 50).await;

    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("lossy", Arc::new(Plan::default())));
    let source = KafkaSource::connect(config.broker_loss(LossPolicy::Warn))
        .await
        .unwrap();
    support::run_until_settled(&consumer, source, &tally, 50, Duration::from_secs(30)).await;
    let mut applied = tally.processed_keys();
    applied.sort();
    assert_eq!(
        applied, late,
        "only the records published after the deletion reach the consumer"
    );
    let rows = ledger.rows().await;
    assert_eq!(rows.len(), 50, "300 payments were lost: {rows:?}");
    ledger.cleanup().await;
    delete_topic(BROKERS, &topic).await.unwrap();

    let topic = support::unique("idemq_retained");
    assert!(create_topic(BROKERS, &topic, 1).await.unwrap());
    let publisher = KafkaPublisher::connect(BROKERS, &topic).await.unwrap();
    support::publish_all(&publisher, &messages).await;
    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("safe", Arc::new(Plan::default())));
    let source = KafkaSource::connect(KafkaConfig::new(BROKERS, &topic, support::unique("g")))
        .await
        .unwrap();
    support::run_until_settled(&consumer, source, &tally, 300, Duration::from_secs(30)).await;
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
    delete_topic(BROKERS, &topic).await.unwrap();
}

/// A new group with `auto.offset.reset=latest` is refused at connect,
/// naming it; run anyway (`broker_loss=warn`), it skips the 20 payments
/// published before it joined and applies only the 10 published after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_group_starting_at_latest_is_refused_and_skips_what_came_before() {
    let topic = support::unique("idemq_latest");
    assert!(create_topic(BROKERS, &topic, 1).await.unwrap());
    let group = support::unique("g");
    let mut config = KafkaConfig::new(BROKERS, &topic, &group);
    config.auto_offset_reset = "latest".into();
    let err = KafkaSource::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("consumer group {group}: auto.offset.reset=latest")),
        "{text}"
    );

    let publisher = KafkaPublisher::connect(BROKERS, &topic).await.unwrap();
    let (before, _) = payments(20, serde_json::json!({}));
    support::publish_all(&publisher, &before).await;
    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("latest", Arc::new(Plan::default())));
    let source = KafkaSource::connect(config.broker_loss(LossPolicy::Warn))
        .await
        .unwrap();
    let after: Vec<_> = (0..10)
        .map(|i| {
            payment(
                &format!("m-after-{i}"),
                &format!("after-{i}"),
                1,
                serde_json::json!({}),
            )
        })
        .collect();
    // Publish the later payments once the group has its partition (the
    // consumer applies nothing until then, so keep publishing them until
    // one is applied; the keys make repeats duplicates).
    let run = {
        let consumer = consumer.clone();
        tokio::spawn(async move {
            consumer
                .run_until(source, tokio::time::sleep(Duration::from_secs(25)))
                .await
        })
    };
    let started = Instant::now();
    while tally.processed_keys().len() < 10 && started.elapsed() < Duration::from_secs(20) {
        support::publish_all(&publisher, &after).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    run.abort();
    let mut applied = tally.processed_keys();
    applied.sort();
    let mut expected: Vec<String> = (0..10).map(|i| format!("after-{i}")).collect();
    expected.sort();
    assert_eq!(
        applied, expected,
        "the 20 published before the group joined were skipped"
    );
    ledger.cleanup().await;
    delete_topic(BROKERS, &topic).await.unwrap();
}

/// `retention.bytes=1` is refused at connect, naming it; the broker then
/// deletes the 100 payments published to it as soon as a newer segment
/// exists (one record a second later rolls it), before any consumer read
/// them: a consumer run anyway gets only what came after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_topic_retained_by_size_is_refused_and_does_delete_unread_records() {
    let topic = lossy_topic("idemq_bytes", &[("retention.bytes", "1")]).await;
    let group = support::unique("g");
    let config = KafkaConfig::new(BROKERS, &topic, &group);
    let err = KafkaSource::connect(config.clone()).await.unwrap_err();
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("topic {topic}: retention.bytes=1")),
        "{text}"
    );

    let (messages, _) = payments(100, serde_json::json!({}));
    let publisher = KafkaPublisher::connect(BROKERS, &topic).await.unwrap();
    support::publish_all(&publisher, &messages).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = publish_late(&topic, 1).await;
    let (low, _) = wait_deleted(&topic, 100, Duration::from_secs(40)).await;
    assert!(
        low >= 100,
        "the broker did not delete the first segment within 40 s (low watermark {low})"
    );

    let ledger = Ledger::new().await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("bytes", Arc::new(Plan::default())));
    let source = KafkaSource::connect(config.broker_loss(LossPolicy::Warn))
        .await
        .unwrap();
    support::run_until_settled(&consumer, source, &tally, 1, Duration::from_secs(30)).await;
    assert_eq!(tally.processed_keys(), late, "the 100 were deleted unread");
    ledger.cleanup().await;
    delete_topic(BROKERS, &topic).await.unwrap();
}
