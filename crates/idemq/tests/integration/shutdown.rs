//! A run asked to stop (`Consumer::run_until`) waits for the deliveries in
//! flight up to its grace period (`ConsumerBuilder::shutdown_grace`), then
//! abandons the rest to be redelivered: their transactions roll back, and a
//! next run applies each of them exactly once.
#![cfg(feature = "postgres")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{payment, Ledger, Plan};
use idemq::source::queue::MemoryQueue;
use idemq::OutcomeKind;

/// Ten quick payments and two whose handler sleeps `sleep_ms` first.
fn queue(sleep_ms: u64) -> (MemoryQueue, std::collections::BTreeMap<String, i64>) {
    let queue = MemoryQueue::new("shutdown");
    let mut expected = std::collections::BTreeMap::new();
    for i in 0..12 {
        let id = format!("p{i}");
        let extra = if i >= 10 {
            serde_json::json!({ "sleep_ms": sleep_ms })
        } else {
            serde_json::json!({})
        };
        queue.push(payment(&format!("m{i}"), &id, i, extra));
        expected.insert(id, i);
    }
    queue.close();
    (queue, expected)
}

/// Stops the run once `n` deliveries were processed.
async fn processed(plan: &Plan, n: u32) {
    while plan.calls.load(std::sync::atomic::Ordering::SeqCst) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn the_grace_period_ends_and_what_is_in_flight_is_redelivered_and_applied_once() {
    let ledger = Ledger::new().await;
    // Slow enough to outlast the grace (and the stop's bound below), quick
    // enough for the second run.
    let (queue, expected) = queue(8_000);
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("shutdown", Arc::clone(&plan))
        .concurrency(12)
        .shutdown_grace(Duration::from_secs(2))
        .build()
        .unwrap();
    let started = Instant::now();
    let summary = consumer
        .run_until(queue.source(), processed(&plan, 12))
        .await
        .unwrap();
    let took = started.elapsed();
    // Under the slow handlers' 8 s: the stop did not wait for them.
    assert!(took < Duration::from_secs(7), "the stop took {took:?}");
    assert_eq!(summary.abandoned(), 2, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 10, "{summary}");
    assert!(summary.to_string().contains("abandoned=2"), "{summary}");

    // The two abandoned payments come back and are applied, once.
    let again = ledger
        .consumer("shutdown", Arc::new(Plan::default()))
        .build()
        .unwrap();
    let summary = again.run(queue.source()).await.unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 2, "{summary}");
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn within_the_grace_period_every_delivery_in_flight_finishes() {
    let ledger = Ledger::new().await;
    let (queue, expected) = queue(300);
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("shutdown", Arc::clone(&plan))
        .concurrency(12)
        .shutdown_grace(Duration::from_secs(10))
        .build()
        .unwrap();
    let summary = consumer
        .run_until(queue.source(), processed(&plan, 12))
        .await
        .unwrap();
    assert_eq!(summary.abandoned(), 0, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 12, "{summary}");
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}

/// A source that ends as soon as it has handed out `left` deliveries,
/// without waiting for them to settle (as an idle exit or a broker's end
/// may).
struct EndsEarly {
    inner: idemq::source::jsonl::JsonLinesSource,
    left: usize,
}

#[async_trait::async_trait]
impl idemq::source::Source for EndsEarly {
    async fn next(&mut self) -> Result<Option<idemq::source::Delivery>, idemq::SourceError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        self.inner.next().await
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

/// A source that ended by itself while handlers still run: a stop asked
/// during that drain still bounds it by the grace period (it used to wait
/// for the handlers however long they took).
#[tokio::test]
async fn a_stop_during_the_drain_after_the_source_ended_is_bounded_by_the_grace() {
    use idemq::source::jsonl::JsonLinesSource;
    let ledger = Ledger::new().await;
    let mut lines = String::new();
    let mut expected = std::collections::BTreeMap::new();
    for i in 0..12 {
        let sleep_ms = if i >= 10 { 30_000 } else { 0 };
        lines.push_str(&format!(
            "{{\"id\":\"m{i}\",\"payload\":{{\"payment_id\":\"p{i}\",\"amount\":{i},\"sleep_ms\":{sleep_ms}}}}}\n"
        ));
        expected.insert(format!("p{i}"), i);
    }
    let plan = Arc::new(Plan::default());
    let consumer = ledger
        .consumer("shutdown", Arc::clone(&plan))
        .concurrency(12)
        .shutdown_grace(Duration::from_secs(2))
        .build()
        .unwrap();
    let started = Instant::now();
    let source = EndsEarly {
        inner: JsonLinesSource::from_reader(
            std::io::Cursor::new(lines.clone().into_bytes()),
            "eof",
        ),
        left: 12,
    };
    let summary = consumer
        .run_until(source, processed(&plan, 12))
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "the stop took {took:?}");
    assert_eq!(summary.abandoned(), 2, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 10, "{summary}");

    // The two abandoned lines, read again (quick this time), are applied once.
    let again = ledger
        .consumer("shutdown", Arc::new(Plan::default()))
        .build()
        .unwrap();
    let quick = lines.replace("30000", "0");
    let summary = again
        .run(JsonLinesSource::from_reader(
            std::io::Cursor::new(quick.into_bytes()),
            "eof",
        ))
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 2, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Duplicate), 10, "{summary}");
    ledger.assert_exactly_once(&expected).await;
    ledger.cleanup().await;
}
