//! Offset-watermark mode ([`Consumer::run_watermarked`]) with the Kafka
//! source against tansu and the PostgreSQL ledger: after a crash between the
//! database commit and the offset commit, the restarted consumer starts each
//! partition at its watermark and does not even fetch the applied records;
//! an offset reset of a running member seeks past the watermark; a source
//! that cannot seek is still answered by the per-record check; key dedup on
//! top catches producer retries; a rebalance with messages in flight
//! positions the moved partitions at their watermarks and loses nothing and
//! applies nothing twice.
#![cfg(all(feature = "kafka", feature = "postgres"))]

mod support;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemq::engine::WatermarkOptions;
use idemq::source::kafka::{create_topic, KafkaConfig, KafkaPublisher, KafkaSource};
use idemq::source::{Delivery, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::OffsetStore;
use idemq::SourceError;
use idemq::{Consumer, Message, OutcomeKind, Summary};
use support::{payments, Ledger, Plan, SwallowAcks, Tally};

const BROKERS: &str = "127.0.0.1:9092";
const PARTITIONS: i32 = 3;

async fn new_topic() -> String {
    let topic = support::unique("wm");
    assert!(create_topic(BROKERS, &topic, PARTITIONS).await.unwrap());
    topic
}

async fn source(topic: &str, group: &str) -> KafkaSource {
    let config = KafkaConfig::new(BROKERS, topic, group)
        .session_timeout(Duration::from_secs(6))
        .revoke_grace(Duration::from_secs(2))
        .set("heartbeat.interval.ms", "500");
    KafkaSource::connect(config).await.unwrap()
}

async fn publish(topic: &str, messages: &[Message]) {
    let publisher = KafkaPublisher::connect(BROKERS, topic).await.unwrap();
    support::publish_all(&publisher, messages).await;
}

/// A source that cannot seek: it forwards deliveries but not the
/// watermarks ([`Source::resume_from`]), as a source over a log without
/// positions would; the engine's per-record check must answer alone.
struct NoSeek(KafkaSource);

#[async_trait]
impl Source for NoSeek {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        self.0.next().await
    }

    async fn close(&mut self) {
        self.0.close().await
    }
}

/// Runs until `outcomes` deliveries were settled (or 60 s), then stops.
async fn run_for(
    consumer: &Consumer<PostgresStore>,
    source: impl Source,
    options: WatermarkOptions,
    seen: &Tally,
    outcomes: usize,
) -> Summary {
    let stop = support::wait_until(Duration::from_secs(60), || seen.total() >= outcomes);
    consumer
        .run_watermarked_until(source, options, async {
            stop.await;
        })
        .await
        .unwrap()
}

fn counting(ledger: &Ledger, name: &str, plan: &Arc<Plan>) -> (Consumer<PostgresStore>, Tally) {
    let seen = Tally::default();
    (seen.build(ledger.consumer(name, Arc::clone(plan))), seen)
}

/// The ledger holds `n` rows, one per distinct record, summing to `sum`.
async fn assert_applied_once(ledger: &Ledger, n: usize, sum: i64) {
    let rows = ledger.rows().await;
    let distinct: HashSet<_> = rows.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(rows.len(), n, "rows: {rows:?}");
    assert_eq!(distinct.len(), n, "a record applied twice: {rows:?}");
    assert_eq!(rows.iter().map(|(_, a)| a).sum::<i64>(), sum);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_seeks_past_the_watermark_and_fetches_nothing_applied() {
    let ledger = Ledger::new().await;
    let topic = new_topic().await;
    let (messages, _) = payments(24, serde_json::json!({}));
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let options = WatermarkOptions::default();
    let group = support::unique("g");
    let parts = PARTITIONS as u64;

    // A applies the first record of each partition and dies before any
    // offset commit reaches Kafka: the group's offsets stay behind the
    // watermarks.
    let (a, seen) = counting(&ledger, "wm", &plan);
    let swallowing = SwallowAcks::new(source(&topic, &group).await, |_| true);
    let first = run_for(&a, swallowing, options, &seen, PARTITIONS as usize).await;
    assert_eq!(first.count(OutcomeKind::Processed), parts);

    // B, same group, restarted: every partition is assigned at its
    // watermark, so the applied records are neither fetched nor handled.
    let (b, seen) = counting(&ledger, "wm", &plan);
    let b_source = source(&topic, &group).await;
    let b_counters = b_source.counters();
    let second = run_for(&b, b_source, options, &seen, 24 - PARTITIONS as usize).await;
    assert_eq!(second.count(OutcomeKind::Processed), 24 - parts, "{second}");
    assert_eq!(second.count(OutcomeKind::Duplicate), 0, "{second}");
    assert_eq!(b_counters.positioned_at_assignment(), parts);
    assert_eq!(
        b_counters.fetched(),
        24 - parts,
        "records below the watermark were fetched"
    );
    assert_eq!(b_counters.dropped_below_watermark(), 0);
    assert_eq!(
        plan.calls.load(Ordering::SeqCst),
        24,
        "the handler ran once per record"
    );

    // C, a new group (an offset reset to the earliest record) that joined
    // and fetched everything before its run began: the run seeks its
    // partitions past the watermarks and drops what was buffered.
    let (c, seen) = counting(&ledger, "wm", &plan);
    let c_source = source(&topic, &support::unique("g")).await;
    let c_counters = c_source.counters();
    assert!(
        support::wait_until(Duration::from_secs(60), || c_counters.fetched() >= 24).await,
        "C fetched {} records",
        c_counters.fetched()
    );
    let stop = async {
        assert!(
            support::wait_until(Duration::from_secs(30), || c_counters.sought() >= parts).await
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let reset = c
        .run_watermarked_until(c_source, options, stop)
        .await
        .unwrap();
    assert_eq!(seen.total(), 0, "{reset}");
    assert_eq!(c_counters.sought(), parts);
    assert_eq!(c_counters.dropped_below_watermark(), 24);
    assert_eq!(
        c_counters.fetched(),
        24,
        "nothing fetched again after the seek"
    );

    // D, another new group over a source that cannot seek: everything is
    // delivered again and the watermark answers every record.
    let (d, seen) = counting(&ledger, "wm", &plan);
    let d_source = NoSeek(source(&topic, &support::unique("g")).await);
    let replay = run_for(&d, d_source, options, &seen, 24).await;
    assert_eq!(replay.count(OutcomeKind::Duplicate), 24, "{replay}");
    assert_eq!(replay.count(OutcomeKind::Processed), 0, "{replay}");
    assert_eq!(
        plan.calls.load(Ordering::SeqCst),
        24,
        "the handler never ran again"
    );

    assert_applied_once(&ledger, 24, (1..=24).sum()).await;
    // O(partitions) state: no inbox rows, one watermark per partition.
    let inbox: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {}",
        ledger.store.tables().inbox
    ))
    .fetch_one(ledger.store.pool())
    .await
    .unwrap();
    assert_eq!(inbox, 0);
    let mut next = 0;
    for p in 0..PARTITIONS {
        next += ledger
            .store
            .watermark("wm", &topic, p)
            .await
            .unwrap()
            .unwrap_or(0);
    }
    assert_eq!(next, 24, "the watermarks sum to the records applied");
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_dedup_on_top_catches_producer_retries() {
    let ledger = Ledger::new().await;
    let topic = new_topic().await;
    let workload = support::workload(20, 1);
    publish(&topic, &workload.messages).await;
    let plan = Arc::new(Plan::default());
    let (consumer, seen) = counting(&ledger, "wm-keys", &plan);
    let options = WatermarkOptions { dedup_keys: true };
    let total = workload.messages.len();
    let summary = run_for(
        &consumer,
        source(&topic, &support::unique("g")).await,
        options,
        &seen,
        total,
    )
    .await;
    assert_eq!(summary.count(OutcomeKind::Processed), 20, "{summary}");
    assert_eq!(
        summary.count(OutcomeKind::Duplicate) as usize,
        workload.duplicates,
        "{summary}"
    );
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "{summary}");
    ledger.assert_exactly_once(&workload.expected).await;
    // The dead-lettered record moved the watermark too: a re-read from the
    // start (over a source that does not seek) finds every record applied
    // or dead-lettered.
    let (again, seen) = counting(&ledger, "wm-keys", &plan);
    let reread = run_for(
        &again,
        NoSeek(source(&topic, &support::unique("g")).await),
        options,
        &seen,
        total,
    )
    .await;
    assert_eq!(
        reread.count(OutcomeKind::Duplicate) as usize,
        total,
        "{reread}"
    );
    assert_eq!(ledger.dead_letters().await.len(), 1);
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rebalance_with_messages_in_flight() {
    let ledger = Ledger::new().await;
    let topic = new_topic().await;
    let (messages, _) = payments(60, serde_json::json!({ "sleep_ms": 150 }));
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let group = support::unique("g");
    let options = WatermarkOptions::default();
    let seen = Tally::default();
    let build = || seen.build(ledger.consumer("wm-group", Arc::clone(&plan)));
    let (a, b) = (build(), build());
    let stop = Arc::new(tokio::sync::Notify::new());
    let first = source(&topic, &group).await;
    let a_counters = first.counters();
    let run_a = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            a.run_watermarked_until(first, options, stop.notified_owned())
                .await
        }
    });
    assert!(
        support::wait_until(Duration::from_secs(60), || seen.total() >= 5).await,
        "the first member settled nothing"
    );
    let second = source(&topic, &group).await;
    let b_counters = second.counters();
    let run_b = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            b.run_watermarked_until(second, options, stop.notified_owned())
                .await
        }
    });
    let rows = ledger
        .wait_for(Duration::from_secs(90), |rows| rows.len() >= 60)
        .await;
    assert_eq!(rows.len(), 60, "lost records");
    // Let redeliveries of revoked partitions arrive and be answered.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.notify_waiters();
    let (sa, sb) = (run_a.await.unwrap().unwrap(), run_b.await.unwrap().unwrap());
    assert!(
        sb.count(OutcomeKind::Processed) + sb.count(OutcomeKind::Duplicate) > 0,
        "{sa} / {sb}"
    );
    // The rebalance assigned partitions with watermarks to both members,
    // which started them there.
    assert!(
        b_counters.positioned_at_assignment() >= 1,
        "B started no partition at its watermark"
    );
    assert!(
        a_counters.positioned_at_assignment() >= 1,
        "A started no partition at its watermark after the rebalance"
    );
    assert_applied_once(&ledger, 60, (1..=60).sum()).await;
    ledger.cleanup().await;
}
