//! The Redis Streams source against a real Redis (127.0.0.1:6379 by default,
//! `IDEMQ_TEST_REDIS` to change) with the PostgreSQL ledger of
//! `tests/integration/support.rs`, in what is Redis's own: an entry without a payload and
//! poison on the dead-letter stream, a lost XACK re-read at once by the same
//! consumer name, retries held past the claim idle time, a slow entry not
//! claimed away from a live consumer, a dead consumer's pending entries
//! claimed by another, and a key of another type. A consumer killed
//! mid-handler is in `conformance.rs`.
#![cfg(all(feature = "redis-streams", feature = "postgres"))]

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{
    assert_dead_lettered, payment, payments, run_until_settled, workload, Deliveries, Ledger, Plan,
    SwallowAcks, Tally,
};
use idemq::source::redis_stream::{
    RedisStreamConfig, RedisStreamPublisher, RedisStreamSource, ENTRY_ID_HEADER, REASON_FIELD,
};
use idemq::source::Source;
use idemq::DeadLetterReason;
use idemq::{Message, OutcomeKind, SourceErrorKind};

fn redis_url() -> String {
    std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A fresh stream config: 1 s claim idle time, 200 ms blocking reads.
fn config(stream: &str) -> RedisStreamConfig {
    RedisStreamConfig::new(redis_url(), stream, "billing")
        .claim_idle(Duration::from_secs(1))
        .block(Duration::from_millis(200))
}

async fn redis() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn publish(config: &RedisStreamConfig, messages: &[Message]) {
    let publisher = RedisStreamPublisher::connect(config).await.unwrap();
    support::publish_all(&publisher, messages).await;
}

/// Deletes the test's streams.
async fn cleanup(streams: &[&str]) {
    let mut conn = redis().await;
    for s in streams {
        let _: i64 = redis::cmd("DEL")
            .arg(*s)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}

/// Entries pending in `group` of `stream`, per consumer.
async fn pending_per_consumer(stream: &str, group: &str) -> HashMap<String, usize> {
    let mut conn = redis().await;
    let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(1000)
        .query_async(&mut conn)
        .await
        .unwrap();
    let mut per = HashMap::new();
    for (_, consumer, _, _) in rows {
        *per.entry(consumer).or_default() += 1;
    }
    per
}

/// Reads `n` entries of the dead-letter stream `name` (through a source of its own group).
async fn read_dead_letter_stream(name: &str, n: usize) -> Vec<Message> {
    let mut source = RedisStreamSource::connect(config(name).consumer("inspector"))
        .await
        .unwrap();
    support::receive(&mut source, n).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_are_applied_once_and_poison_is_dead_lettered() {
    let ledger = Ledger::new().await;
    let stream = support::unique("dup");
    let dlq = support::unique("dup_dead");
    let config = config(&stream).dead_letter_stream(&dlq);
    let w = workload(16, 2);
    publish(&config, &w.messages).await;
    // An entry without a payload field: a defect the engine dead-letters.
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("id")
        .arg("m-broken")
        .arg("key")
        .arg("broken")
        .query_async(&mut redis().await)
        .await
        .unwrap();

    let tally = Tally::default();
    let consumer = tally.build(
        ledger
            .consumer("billing", Arc::new(Plan::default()))
            .concurrency(4),
    );
    let source = RedisStreamSource::connect(config).await.unwrap();
    let total = w.messages.len() + 1;
    run_until_settled(&consumer, source, &tally, total, Duration::from_secs(30)).await;

    ledger.assert_exactly_once(&w.expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), w.expected.len());
    assert_eq!(tally.count(OutcomeKind::Duplicate), w.duplicates);
    assert_eq!(tally.count(OutcomeKind::DeadLettered), w.poison.len() + 1);
    let letters = ledger.dead_letters().await;
    assert_dead_lettered(&letters, &w.poison, &DeadLetterReason::PermanentFailure);
    assert!(
        letters.iter().any(|l| l.reason == "malformed_record"),
        "the entry without payload: {letters:?}"
    );
    assert!(
        pending_per_consumer(&stream, "billing").await.is_empty(),
        "everything is acked"
    );

    // The dead letters are on the dead-letter stream too, with their reason.
    let mut copies = read_dead_letter_stream(&dlq, w.poison.len() + 1).await;
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(copies[0].key.as_deref(), Some("broken"));
    assert_eq!(
        copies[0].headers.get(REASON_FIELD),
        Some(&b"malformed_record"[..])
    );
    support::assert_dead_letter_copies(&copies[1..], &w.poison, REASON_FIELD, "permanent_failure");
    assert!(copies[1..]
        .iter()
        .all(|copy| copy.headers.get(ENTRY_ID_HEADER).is_some()));
    cleanup(&[&stream, &dlq]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_lost_after_the_commit_ends_as_a_duplicate() {
    let ledger = Ledger::new().await;
    let stream = support::unique("swallow");
    // A stable consumer name: the restarted consumer re-reads its own pending entries.
    let config = config(&stream).consumer("worker-1");
    let (messages, expected) = payments(3, serde_json::json!({}));
    publish(&config, &messages).await;

    // First consumer: commits p-1, but its XACK never reaches Redis.
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let source = SwallowAcks::new(
        RedisStreamSource::connect(config.clone()).await.unwrap(),
        |d| d.message.key.as_deref() == Some("p-1"),
    );
    let swallowed = Arc::clone(&source.swallowed);
    run_until_settled(&consumer, source, &tally, 3, Duration::from_secs(20)).await;
    assert_eq!(swallowed.load(Ordering::SeqCst), 1);
    assert_eq!(tally.count(OutcomeKind::Processed), 3);
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(
        pending_per_consumer(&stream, "billing").await,
        HashMap::from([("worker-1".to_owned(), 1)])
    );

    // The same consumer restarts: it re-reads its pending p-1 at once, and
    // the inbox finds it already processed. Its claim idle time is longer
    // than the wait, so only the re-read of its own pending entries can
    // deliver p-1 in time (not a claim after the idle time).
    let again = Tally::default();
    let consumer = again.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(
        RedisStreamSource::connect(config.claim_idle(Duration::from_secs(600)))
            .await
            .unwrap(),
    );
    run_until_settled(&consumer, source, &again, 1, Duration::from_secs(30)).await;
    assert_eq!(again.count(OutcomeKind::Duplicate), 1);
    assert_eq!(again.count(OutcomeKind::Processed), 0);
    assert_eq!(
        deliveries.get("p-1"),
        (1, 2),
        "one redelivery, delivered twice"
    );
    ledger.assert_exactly_once(&expected).await;
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_wait_for_their_delay_and_end_on_the_dead_letter_stream() {
    let ledger = Ledger::new().await;
    let stream = support::unique("retry");
    let dlq = support::unique("retry_dead");
    let config = config(&stream).dead_letter_stream(&dlq);
    publish(&config, &support::flaky_and_bad()).await;

    let tally = Tally::default();
    let plan = Arc::new(Plan::default());
    // A 1.5 s backoff, longer than the 1 s claim idle time: the held entries
    // must not be claimed (and delivered early) meanwhile.
    let retry = support::fixed_backoff(Duration::from_millis(1500));
    let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).retry(retry));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(RedisStreamSource::connect(config).await.unwrap());
    run_until_settled(&consumer, source, &tally, 2, Duration::from_secs(20)).await;

    ledger
        .assert_exactly_once(&BTreeMap::from([("p-flaky".to_owned(), 3)]))
        .await;
    assert_eq!(plan.calls.load(Ordering::SeqCst), 6, "3 calls each");
    assert_eq!(deliveries.get("p-flaky"), (3, 3));
    assert_eq!(deliveries.get("p-bad"), (3, 3));
    for key in ["p-flaky", "p-bad"] {
        tally.assert_gaps(
            key,
            3,
            Duration::from_millis(1400)..Duration::from_millis(3000),
            "the 1.5 s delay",
        );
    }
    assert_dead_lettered(
        &ledger.dead_letters().await,
        &["p-bad".to_owned()],
        &DeadLetterReason::RetriesExhausted,
    );
    let copies = read_dead_letter_stream(&dlq, 1).await;
    assert_eq!(copies[0].key.as_deref(), Some("p-bad"));
    assert_eq!(
        copies[0].headers.get(REASON_FIELD),
        Some(&b"retries_exhausted"[..])
    );
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream, &dlq]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn competing_consumers_apply_every_message_once() {
    let ledger = Ledger::new().await;
    let stream = support::unique("compete");
    let mut config = config(&stream);
    config.count = 3; // small batches, so that both consumers get work
    let mut w = workload(30, 0);
    // A handler slower than the claim idle time: its entry must stay with its consumer.
    w.messages.insert(
        0,
        payment(
            "m-slow",
            "p-slow",
            99,
            serde_json::json!({ "sleep_ms": 2500 }),
        ),
    );
    w.expected.insert("p-slow".into(), 99);
    publish(&config, &w.messages).await;

    let tally = Tally::default();
    let deliveries = [Deliveries::default(), Deliveries::default()];
    let plan = Arc::new(Plan::default());
    let total = w.messages.len();
    let mut runs = Vec::new();
    for seen in &deliveries {
        let consumer = tally.build(ledger.consumer("billing", Arc::clone(&plan)).concurrency(3));
        runs.push((
            consumer,
            seen.wrap(RedisStreamSource::connect(config.clone()).await.unwrap()),
        ));
    }
    support::run_all_until_settled(runs, &tally, total, Duration::from_secs(30)).await;
    ledger.assert_exactly_once(&w.expected).await;
    tally.assert_workload(&w);
    let per_consumer: Vec<u32> = deliveries.iter().map(Deliveries::total).collect();
    assert_eq!(
        per_consumer.iter().sum::<u32>(),
        total as u32,
        "every entry delivered once: {per_consumer:?}"
    );
    assert!(
        per_consumer.iter().all(|n| *n > 0),
        "both consumers got work: {per_consumer:?}"
    );
    let slow: Vec<(u32, u32)> = deliveries.iter().map(|d| d.get("p-slow")).collect();
    assert!(
        slow.contains(&(1, 1)) && slow.contains(&(0, 0)),
        "the slow entry was claimed away: {slow:?}"
    );
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_consumers_pending_entries_are_claimed_by_another() {
    let ledger = Ledger::new().await;
    let stream = support::unique("claim");
    let config = config(&stream);
    let (messages, expected) = payments(4, serde_json::json!({}));
    publish(&config, &messages).await;

    // A consumer reads all four entries and dies without settling them.
    let mut doomed = RedisStreamSource::connect(config.clone().consumer("doomed"))
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(doomed.next().await.unwrap().unwrap());
    }
    drop(held);
    drop(doomed);
    assert_eq!(
        pending_per_consumer(&stream, "billing").await,
        HashMap::from([("doomed".to_owned(), 4)])
    );

    // Another consumer: nothing new to read; it claims the idle entries.
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("billing", Arc::new(Plan::default())));
    let deliveries = Deliveries::default();
    let source = deliveries.wrap(
        RedisStreamSource::connect(config.clone().consumer("rescuer"))
            .await
            .unwrap(),
    );
    run_until_settled(&consumer, source, &tally, 4, Duration::from_secs(15)).await;
    assert_eq!(tally.count(OutcomeKind::Processed), 4);
    for i in 0..4 {
        assert_eq!(deliveries.get(&format!("p-{i}")), (1, 2), "p-{i}");
    }
    ledger.assert_exactly_once(&expected).await;
    assert!(pending_per_consumer(&stream, "billing").await.is_empty());
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

#[tokio::test]
async fn connecting_to_a_stream_of_another_type_fails() {
    let key = support::unique("not_a_stream");
    let mut conn = redis().await;
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(matches!(
        RedisStreamSource::connect(config(&key)).await,
        Err(ref e) if e.kind() == SourceErrorKind::Broker
    ));
    cleanup(&[&key]).await;
}

/// The group's `last-delivered-id` on `stream` and its oldest pending entry.
async fn group_position(stream: &str, group: &str) -> (String, Option<String>) {
    let mut conn = redis().await;
    let groups: redis::streams::StreamInfoGroupsReply = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    let last = groups
        .groups
        .into_iter()
        .find(|g| g.name == group)
        .unwrap()
        .last_delivered_id;
    let oldest: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(1)
        .query_async(&mut conn)
        .await
        .unwrap();
    (last, oldest.into_iter().next().map(|row| row.0))
}

/// `XTRIM stream <strategy> <threshold>` (exact, not `~`); the entries removed.
async fn xtrim(stream: &str, strategy: &str, threshold: &str) -> i64 {
    redis::cmd("XTRIM")
        .arg(stream)
        .arg(strategy)
        .arg(threshold)
        .query_async(&mut redis().await)
        .await
        .unwrap()
}

/// Loss the broker causes: a stream trimmed above its group's last
/// delivered id. The group exists, 300 payments are added, none read, and
/// `XTRIM MAXLEN 50` removes 250 the group never got. Connecting is refused,
/// naming the ids; accepted anyway (`broker_loss=warn`), the consumer gets
/// 50 — the loss is real — and once it has read past the gap, connecting
/// is no longer refused. Trimmed only below the group's position (`XTRIM
/// MINID` at its oldest pending entry, else its last delivered id), nothing
/// is refused and all 300 are applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_trimmed_above_the_groups_position_is_refused_and_does_lose_entries() {
    use idemq::source::loss::LossPolicy;
    let (messages, expected) = payments(300, serde_json::json!({}));

    let lossy_ledger = Ledger::new().await;
    let stream = support::unique("trimmed");
    let lossy = config(&stream);
    drop(RedisStreamSource::connect(lossy.clone()).await.unwrap()); // creates the group
    publish(&lossy, &messages).await;
    assert_eq!(xtrim(&stream, "MAXLEN", "50").await, 250);
    let first: Vec<(String, HashMap<String, String>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut redis().await)
        .await
        .unwrap();
    let first = &first[0].0;
    let err = match RedisStreamSource::connect(lossy.clone()).await {
        Err(e) => e,
        Ok(_) => panic!("a group that lost 250 unread entries was accepted"),
    };
    assert_eq!(err.kind(), SourceErrorKind::Config, "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "stream {stream}, group billing: 250 entries after the group's last-delivered-id 0-0 and before the stream's first entry {first} were trimmed before the group read them"
        )),
        "{text}"
    );
    assert!(text.contains("XTRIM MINID <last-delivered-id>"), "{text}");
    assert!(text.contains("broker_loss=warn"), "{text}");

    let tally = Tally::default();
    let consumer = tally.build(lossy_ledger.consumer("lossy", Arc::new(Plan::default())));
    let warned = lossy.clone().broker_loss(LossPolicy::Warn);
    let source = RedisStreamSource::connect(warned).await.unwrap();
    run_until_settled(&consumer, source, &tally, 50, Duration::from_secs(15)).await;
    assert_eq!(tally.count(OutcomeKind::Processed), 50);
    let mut got = tally.processed_keys();
    got.sort_by_key(|k| k[2..].parse::<u32>().unwrap_or(u32::MAX));
    let last_50: Vec<String> = (250..300).map(|i| format!("p-{i}")).collect();
    assert_eq!(got, last_50, "only the 50 left were delivered");
    // Read past the gap: the loss is behind the group, no longer refused.
    drop(RedisStreamSource::connect(lossy).await.unwrap());
    cleanup(&[&stream]).await;
    lossy_ledger.cleanup().await;

    let ledger = Ledger::new().await;
    let stream = support::unique("trimmed_safe");
    let safe = config(&stream).consumer("worker");
    drop(RedisStreamSource::connect(safe.clone()).await.unwrap());
    publish(&safe, &messages).await;
    let tally = Tally::default();
    let consumer = tally.build(ledger.consumer("safe", Arc::new(Plan::default())));
    let source = RedisStreamSource::connect(safe.clone()).await.unwrap();
    run_until_settled(&consumer, source, &tally, 100, Duration::from_secs(15)).await;
    let (last, oldest_pending) = group_position(&stream, "billing").await;
    let below = oldest_pending.unwrap_or(last);
    let removed = xtrim(&stream, "MINID", &below).await;
    assert!(removed >= 90, "the processed part was trimmed: {removed}");
    let source = RedisStreamSource::connect(safe).await.unwrap();
    run_until_settled(&consumer, source, &tally, 300, Duration::from_secs(20)).await;
    ledger.assert_exactly_once(&expected).await;
    assert_eq!(tally.count(OutcomeKind::Processed), 300);
    cleanup(&[&stream]).await;
    ledger.cleanup().await;
}

/// The `error` events logged in this process, as `field=value` text (a
/// global subscriber: the lag poller logs from its own task).
fn errors_logged() -> &'static std::sync::Mutex<Vec<String>> {
    use std::fmt::Write;
    use std::sync::{Mutex, OnceLock};
    use tracing::{field, span, Event, Level, Metadata};
    static LOGGED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    struct Errors;
    struct Text(String);
    impl field::Visit for Text {
        fn record_debug(&mut self, f: &field::Field, value: &dyn std::fmt::Debug) {
            let _ = write!(self.0, "{}={value:?} ", f.name());
        }
    }
    impl tracing::Subscriber for Errors {
        fn enabled(&self, metadata: &Metadata<'_>) -> bool {
            *metadata.level() == Level::ERROR
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, event: &Event<'_>) {
            let mut text = Text(String::new());
            event.record(&mut text);
            if let Some(logged) = LOGGED.get() {
                logged.lock().unwrap().push(text.0);
            }
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }
    LOGGED.get_or_init(|| {
        let _ = tracing::subscriber::set_global_default(Errors);
        Mutex::default()
    })
}

/// A trim after connecting cannot be refused: the lag poller finds it at
/// its next reading and logs it at `error`, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_trim_while_running_is_logged_as_an_error_once() {
    let logged = errors_logged();
    let stream = support::unique("trimmed_live");
    let config = config(&stream).lag_interval(Duration::from_secs(1));
    let source = RedisStreamSource::connect(config.clone()).await.unwrap();
    let (messages, _) = payments(300, serde_json::json!({}));
    publish(&config, &messages).await;
    assert_eq!(xtrim(&stream, "MAXLEN", "50").await, 250);
    let about_it = || -> Vec<String> {
        logged
            .lock()
            .unwrap()
            .iter()
            .filter(|line| line.contains(&stream))
            .cloned()
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while about_it().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(2500)).await; // two more readings
    let lines = about_it();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("250 entries after the group's last-delivered-id 0-0"),
        "{lines:?}"
    );
    drop(source);
    cleanup(&[&stream]).await;
}
