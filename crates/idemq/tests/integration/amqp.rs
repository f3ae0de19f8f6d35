//! The RabbitMQ source against the real broker on 127.0.0.1:5672
//! (`IDEMQ_TEST_AMQP`) with the PostgreSQL ledger, in what is RabbitMQ's
//! own: poison in the dead-letter queue with its reason header (and the
//! `idemq-key` header mapping), delayed retries through the retry queues,
//! and the poison accounting of quorum queues. Lost acks, a consumer killed
//! mid-handler and competing consumers are in `conformance.rs`.
#![cfg(all(feature = "amqp", feature = "postgres"))]

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{
    assert_dead_lettered, eventually, payment, start, workload, Deliveries, Ledger, Plan, Tally,
};
use idemq::source::amqp::{AmqpConfig, AmqpPublisher, AmqpSource, QueueType, REASON_HEADER};
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind};
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

fn amqp_url() -> String {
    std::env::var("IDEMQ_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// One test's queue topology, a publisher, and a plain channel to inspect it.
struct Rabbit {
    config: AmqpConfig,
    publisher: AmqpPublisher,
    inspect: lapin::Channel,
    _connection: lapin::Connection,
}

impl Rabbit {
    async fn new(queue_type: QueueType, prefetch: u16) -> Self {
        let queue = support::unique("idemq_q");
        let config = AmqpConfig::from_url(&format!("{}?queue={queue}", amqp_url()))
            .unwrap()
            .prefetch(prefetch)
            .queue_type(queue_type);
        let publisher = AmqpPublisher::connect(config.clone()).await.unwrap();
        let connection =
            lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let inspect = connection.create_channel().await.unwrap();
        Self {
            config,
            publisher,
            inspect,
            _connection: connection,
        }
    }

    async fn source(&self) -> AmqpSource {
        AmqpSource::connect(self.config.clone()).await.unwrap()
    }

    async fn publish(&self, messages: &[Message]) {
        support::publish_all(&self.publisher, messages).await;
    }

    /// Messages waiting in `queue`.
    async fn ready(&self, queue: &str) -> u32 {
        self.inspect
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    /// Takes everything from the dead-letter queue: (reason header, payment id).
    async fn dead_letter_queue(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let queue = self.config.dead_letter_queue();
        while let Some(got) = self
            .inspect
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let d = got.delivery;
            let reason = match d
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(REASON_HEADER))
            {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => panic!("dead letter without a reason header: {other:?}"),
            };
            let payload: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
            out.push((reason, payload["payment_id"].as_str().unwrap().to_owned()));
        }
        out.sort();
        out
    }

    async fn cleanup(self) {
        self.publisher.delete_topology().await.unwrap();
        self.publisher.close().await.unwrap();
    }
}

#[tokio::test]
async fn duplicates_of_both_kinds_apply_once_and_poison_is_dead_lettered_twice() {
    let ledger = Ledger::new().await;
    let rabbit = Rabbit::new(QueueType::Classic, 8).await;
    let w = workload(20, 2);
    let outcomes = Tally::default();
    let consumer = outcomes.build(ledger.consumer("amqp-dups", Arc::default()).concurrency(4));
    let seen = Deliveries::default();
    let source = seen.wrap(rabbit.source().await);
    rabbit.publish(&w.messages).await;

    let run = start(&consumer, source);
    eventually(Duration::from_secs(20), "every message settled", || async {
        outcomes.finals() >= w.messages.len()
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
        w.expected.len() as u64
    );
    assert_eq!(summary.count(OutcomeKind::Duplicate), w.duplicates as u64);
    // The message mapping: key from the idemq-key header, headers kept.
    let seen = seen.log();
    assert!(
        seen.iter()
            .all(|s| s.headers.get("event_id") == Some(&s.key)),
        "{seen:?}"
    );
    // Dead letters are in the dead-letter queue too, with their reason.
    let dlq = rabbit.dead_letter_queue().await;
    let want: Vec<_> = w
        .poison
        .iter()
        .map(|k| ("permanent_failure".to_owned(), k.clone()))
        .collect();
    assert_eq!(dlq, want);
    assert_eq!(rabbit.ready(rabbit.config.queue_name()).await, 0);
    rabbit.cleanup().await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn retries_go_through_the_delayed_retry_queues() {
    let ledger = Ledger::new().await;
    let rabbit = Rabbit::new(QueueType::Classic, 8).await;
    let plan = Arc::new(Plan::default());
    // fast_retry: 3 attempts, backoff 50 ms then 100 ms.
    let consumer = ledger
        .consumer("amqp-retry", Arc::clone(&plan))
        .build()
        .unwrap();
    let seen = Deliveries::default();
    let source = seen.wrap(rabbit.source().await);
    let started = Instant::now();
    rabbit
        .publish(&[
            payment(
                "m-flaky",
                "p-flaky",
                5,
                serde_json::json!({ "fail": "retry", "fail_times": 2 }),
            ),
            payment("m-bad", "p-bad", 6, serde_json::json!({ "fail": "retry" })),
        ])
        .await;
    let run = start(&consumer, source);
    eventually(
        Duration::from_secs(10),
        "success and dead letter",
        || async { ledger.rows().await.len() == 1 && ledger.dead_letters().await.len() == 1 },
    )
    .await;
    let elapsed = started.elapsed();
    let summary = run.stop().await;

    ledger
        .assert_exactly_once(&BTreeMap::from([("p-flaky".to_owned(), 5)]))
        .await;
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    assert_eq!(summary.count(OutcomeKind::RetryLater), 4, "{summary}");
    assert!(elapsed >= Duration::from_millis(150), "{elapsed:?}");

    let seen = seen.log();
    for key in ["p-flaky", "p-bad"] {
        let tries: Vec<_> = seen.iter().filter(|s| s.key == key).collect();
        let counts: Vec<_> = tries.iter().map(|s| s.count).collect();
        assert_eq!(counts, [1, 2, 3], "{key}: {seen:?}");
        // Each retry waited its backoff in its retry queue, whence it was
        // dead-lettered back (x-death names the queue).
        for (i, (delay, bucket)) in [(50, "retry.50ms"), (100, "retry.100ms")]
            .iter()
            .enumerate()
        {
            let gap = tries[i + 1].at - tries[i].at;
            assert!(
                gap >= Duration::from_millis(*delay),
                "{key} retry {i}: {gap:?}"
            );
            let death = &tries[i + 1].headers["x-death"];
            assert!(death.contains(bucket), "{key} retry {i}: {death}");
        }
    }
    assert_eq!(
        rabbit.dead_letter_queue().await,
        [("retries_exhausted".to_owned(), "p-bad".to_owned())]
    );
    rabbit.cleanup().await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn quorum_queue_delivery_count_dead_letters_a_consumer_killer() {
    let ledger = Ledger::new().await;
    let rabbit = Rabbit::new(QueueType::Quorum, 8).await;
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("amqp-quorum", Arc::clone(&plan))
        .retry(support::fast_retry().with_max_deliveries(Some(2)))
        .build()
        .unwrap();
    rabbit
        .publish(&[payment(
            "m-killer",
            "p-killer",
            9,
            serde_json::json!({ "sleep_ms": 60_000 }),
        )])
        .await;

    // Two consumers die in the middle of the handler.
    let mut counts = Vec::new();
    for round in 1..=2u32 {
        let seen = Deliveries::default();
        let run = start(&consumer, seen.wrap(rabbit.source().await));
        eventually(Duration::from_secs(10), "the handler to start", || async {
            plan.calls.load(Ordering::SeqCst) >= round
        })
        .await;
        run.kill().await;
        let seen = seen.log();
        counts.push((
            seen[0].count,
            seen[0].headers.get("x-delivery-count").cloned(),
        ));
    }
    // The third delivery is past max_deliveries: dead-lettered without running.
    let seen = Deliveries::default();
    let run = start(&consumer, seen.wrap(rabbit.source().await));
    eventually(Duration::from_secs(10), "the dead letter", || async {
        !ledger.dead_letters().await.is_empty()
    })
    .await;
    let summary = run.stop().await;
    let seen = seen.log();
    counts.push((
        seen[0].count,
        seen[0].headers.get("x-delivery-count").cloned(),
    ));

    assert_eq!(
        counts,
        [
            (1, None),
            (2, Some("1".to_owned())),
            (3, Some("2".to_owned()))
        ]
    );
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "{summary}");
    assert_eq!(plan.calls.load(Ordering::SeqCst), 2);
    assert!(ledger.rows().await.is_empty());
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-killer".to_owned()],
        &DeadLetterReason::DeliveryLimit,
    );
    assert_eq!(
        rabbit.dead_letter_queue().await,
        [("delivery_limit".to_owned(), "p-killer".to_owned())]
    );
    rabbit.cleanup().await;
    ledger.cleanup().await;
}
