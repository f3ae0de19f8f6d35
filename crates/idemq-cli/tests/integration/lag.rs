//! `idemq_source_lag_messages` for the brokers other than Kafka (whose test
//! is in `ops.rs`): for each, a few hundred messages are produced to a fresh
//! queue or stream, then consumed one at a time by a slow effect with
//! `--http-addr`; `/metrics` must show a lag above 0 on the way, never above
//! what was produced, and 0 once everything is applied. Each broker's lag
//! is read every 5 s in the background (the source's `lag_interval`).

#![cfg(all(
    feature = "exec",
    feature = "sqlite",
    any(
        feature = "nats",
        feature = "redis-streams",
        feature = "amqp",
        feature = "sqs",
        feature = "rocketmq"
    )
))]

use std::process::Stdio;
use std::time::Duration;

use crate::common::{free_port, idemq, watch_series};

/// Messages produced per test.
const PRODUCED: usize = 300;
/// How long one test may take before it fails with what it saw.
const DEADLINE: Duration = Duration::from_secs(300);

/// A name no earlier run used.
fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{}", std::process::id(), free_port())
}

/// The lag series of `source` with these labels and no partition, as the
/// exporter writes it.
fn lag_series(source: &str, group: &str, topic: &str) -> String {
    format!("{}\"}}", lag_partitions(source, group, topic))
}

/// The start of the lag series of every partition of `topic`.
fn lag_partitions(source: &str, group: &str, topic: &str) -> String {
    format!(
        "idemq_source_lag_messages{{source=\"{source}\",group=\"{group}\",topic=\"{topic}\",partition=\""
    )
}

/// Produces [`PRODUCED`] messages to `url`, consumes them from `url` one at
/// a time with a slow effect, and scrapes `/metrics` every 200 ms until the
/// consumer exits (idle for 8 s) or [`DEADLINE`] passes. Returns the values
/// seen of the series that start with `lag_series` (summed), each change
/// once. Fails unless every message was processed. Each URL reads the lag
/// every second (`lag_interval=1s`), so several reads fall between the last
/// ack and the idle exit; `--http-linger` keeps the ended run serving until a
/// scrape has read its final values.
fn lags_while_consuming(url: &str, lag_series: &str) -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let lines: String = (0..PRODUCED)
        .map(|n| format!("{{\"id\":\"m-{n}\"}}\n"))
        .collect();
    std::fs::write(&input, lines).unwrap();
    let produced = idemq()
        .args(["produce"])
        .arg(&input)
        .args(["--to", url, "--key", "json:/id"])
        .output()
        .unwrap();
    assert!(produced.status.success(), "{produced:#?}");

    let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
    let port = free_port();
    let mut child = idemq()
        .args(["--store", &store, "consume", url, "--consumer", "lag"])
        .args(["--key", "json:/id", "--concurrency", "1"])
        .args(["--apply-exec", "sleep 0.03", "--idle-exit", "8s"])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        // The run that ended keeps serving until a scrape has read its final
        // values: the last value seen is the one at the end of the run.
        .args(["--http-linger", "60s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = watch_series(&mut child, port, lag_series, DEADLINE);
    let timed_out = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !timed_out,
        "the consumer was still running after {DEADLINE:?}; lags seen: {seen:?}\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("consumer lag: processed={PRODUCED}")),
        "lags seen: {seen:?}\n{stdout}\n{stderr}"
    );
    eprintln!("{lag_series}: {seen:?}");
    seen
}

/// The lag rose above 0 while the messages were worked off, never passed
/// what was produced (plus `slack`), and ended at 0.
fn assert_lag_moved_and_drained(seen: &[f64], slack: usize) {
    assert!(seen.iter().any(|lag| *lag > 0.0), "lags seen: {seen:?}");
    let most = (PRODUCED + slack) as f64;
    assert!(
        seen.iter().all(|lag| (0.0..=most).contains(lag)),
        "lags seen: {seen:?}"
    );
    assert_eq!(seen.last(), Some(&0.0), "lags seen: {seen:?}");
}

/// NATS JetStream: the durable consumer's `num_pending + num_ack_pending`.
#[cfg(feature = "nats")]
#[test]
fn nats_consumer_lag_is_exported() {
    let name = unique("lag");
    let url = format!(
        "nats://127.0.0.1:4222/{name}/{name}_c?subject={name}.lag&create=true&ack_wait=5s&wait=1s&lag_interval=1s"
    );
    let seen = lags_while_consuming(&url, &lag_series("nats", &format!("{name}_c"), &name));
    assert_lag_moved_and_drained(&seen, 0);
}

/// Redis Streams: `XINFO GROUPS` `lag + pending` of the group.
#[cfg(feature = "redis-streams")]
#[test]
fn redis_stream_group_lag_is_exported() {
    let name = unique("lag");
    let url = format!("redis-stream://127.0.0.1:6379/{name}?group={name}_g&lag_interval=1s");
    let seen = lags_while_consuming(
        &url,
        &lag_series("redis-stream", &format!("{name}_g"), &name),
    );
    assert_lag_moved_and_drained(&seen, 0);
}

/// RabbitMQ: the work queue's ready messages (a passive declare).
#[cfg(feature = "amqp")]
#[test]
fn rabbitmq_queue_depth_is_exported() {
    let name = unique("lag");
    let url = format!("amqp://guest:guest@127.0.0.1:5672/%2f?queue={name}&lag_interval=1s");
    let seen = lags_while_consuming(&url, &lag_series("amqp", "", &name));
    assert_lag_moved_and_drained(&seen, 0);
}

/// SQS: the messages not deleted yet (`GetQueueAttributes`: visible plus
/// not visible). The two counts are not taken at one instant (moto counts
/// one, then the other), so a message received in between counts in both:
/// a receive batch (10) of slack above what was produced.
#[cfg(feature = "sqs")]
#[test]
fn sqs_queue_backlog_is_exported() {
    let name = unique("lag");
    let url = format!(
        "sqs://{name}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=5&lag_interval=1s"
    );
    let seen = lags_while_consuming(&url, &lag_series("sqs", "", &name));
    assert_lag_moved_and_drained(&seen, 10);
}

/// RocketMQ: per queue this consumer holds, the max offset minus its own
/// consumed offset; summed over the topic's queues.
#[cfg(feature = "rocketmq")]
#[test]
fn rocketmq_consumer_lag_is_exported() {
    let name = unique("lag");
    let url = format!("rocketmq://127.0.0.1:9876/{name}?group={name}_g&lag_interval=1s");
    let seen = lags_while_consuming(
        &url,
        &lag_partitions("rocketmq", &format!("{name}_g"), &name),
    );
    assert_lag_moved_and_drained(&seen, 0);
}
