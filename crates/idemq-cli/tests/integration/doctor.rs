//! `idemq doctor` against the real brokers (Apache Kafka on 127.0.0.1:9092,
//! RabbitMQ on :5672 with its management API on :15672): a prune
//! retention under a topic's `retention.ms` is a problem (exit 4) and one
//! above it is ok; a queue policy that drops messages is a problem, named,
//! with the password of the source URL nowhere in the output; a file
//! source has no broker to check.
#![cfg(all(feature = "sqlite", feature = "kafka", feature = "amqp"))]

use std::process::Output;

use crate::common::{free_port, idemq};

/// A name no earlier run used.
fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{}", std::process::id(), free_port())
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Publishes one message to `url` with `idemq produce` (creating the topic
/// or declaring the queue on the way).
fn produce_one(dir: &std::path::Path, url: &str) {
    let file = dir.join("one.jsonl");
    std::fs::write(
        &file,
        "{\"id\":\"m-1\",\"key\":\"p-1\",\"payload\":{\"amount\":1}}\n",
    )
    .unwrap();
    let out = idemq()
        .args(["produce", "--to", url])
        .arg(&file)
        .output()
        .unwrap();
    assert!(out.status.success(), "produce: {}", text(&out));
}

fn store(dir: &std::path::Path) -> String {
    let store = format!("sqlite://{}", dir.join("inbox.db").display());
    let out = idemq()
        .args(["--store", &store, "migrate"])
        .output()
        .unwrap();
    assert!(out.status.success(), "migrate: {}", text(&out));
    store
}

#[test]
fn a_retention_under_the_topics_is_a_problem_and_one_above_it_is_ok() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let topic = unique("doctor");
    produce_one(
        dir.path(),
        &format!("kafka://127.0.0.1:9092/{topic}?create_partitions=1"),
    );
    let source = format!("kafka://127.0.0.1:9092/{topic}?group=billing");
    let doctor = |older_than: &str| {
        idemq()
            .args(["--store", &store, "doctor", "--consumer", "billing"])
            .args(["--source", &source, "--older-than", older_than])
            .output()
            .unwrap()
    };
    let short = doctor("1d");
    let said = text(&short);
    assert_eq!(short.status.code(), Some(4), "{said}");
    assert!(
        said.contains(&format!("7d (topic {topic} retention.ms=604800000)")),
        "{said}"
    );
    assert!(said.contains("verdict      PROBLEM"), "{said}");
    assert!(said.contains("prune no sooner than 7d"), "{said}");
    let long = doctor("8d");
    let said = text(&long);
    assert_eq!(long.status.code(), Some(0), "{said}");
    assert!(said.contains("verdict      ok"), "{said}");
}

/// Sets (or deletes, with `None`) a policy of vhost `/` through the
/// management API.
fn policy(name: &str, rule: Option<serde_json::Value>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let url = format!("http://127.0.0.1:15672/api/policies/%2F/{name}");
        let client = reqwest::Client::new();
        let request = match &rule {
            Some(rule) => client
                .put(&url)
                .header("content-type", "application/json")
                .body(rule.to_string()),
            None => client.delete(&url),
        };
        let answer = request
            .basic_auth("guest", Some("guest"))
            .send()
            .await
            .expect("RabbitMQ's management API (scripts/services.sh)");
        assert!(answer.status().is_success(), "{name}: {}", answer.status());
    });
}

#[test]
fn a_queue_policy_that_drops_messages_is_a_problem_and_a_file_has_no_broker() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let queue = unique("doctor_q");
    let amqp = format!("amqp://guest:guest@127.0.0.1:5672/%2f?queue={queue}");
    produce_one(dir.path(), &amqp);
    let policy_name = format!("{queue}-cap");
    policy(
        &policy_name,
        Some(serde_json::json!({
            "pattern": format!("^{queue}$"),
            "definition": {"max-length": 10},
            "apply-to": "queues"
        })),
    );
    let file = dir.path().join("orders.jsonl");
    std::fs::write(&file, "").unwrap();
    let config = dir.path().join("idemq.toml");
    std::fs::write(
        &config,
        format!(
            "store = \"{store}\"\n\n\
             [[consumer]]\nconsumer = \"billing\"\nsource = \"{amqp}\"\nprint = true\n\n\
             [[consumer]]\nconsumer = \"files\"\nsource = \"{}\"\nprint = true\n",
            file.display()
        ),
    )
    .unwrap();
    let out = idemq()
        .args(["doctor", "--json", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    policy(&policy_name, None);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(4), "{said}");
    assert!(
        !said.contains("guest:guest"),
        "a password in the output: {said}"
    );
    let reports: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let billing = &reports[0];
    assert_eq!(billing["consumer"], "billing", "{said}");
    assert_eq!(billing["verdict"], "PROBLEM", "{said}");
    let risk = billing["risks"][0].as_str().unwrap_or_default();
    assert!(
        risk.contains(&format!(
            "queue {queue}: max-length=10 (policy \"{policy_name}\") with overflow unset (drop-head)"
        )),
        "{said}"
    );
    assert!(
        billing["horizon"]
            .as_str()
            .unwrap_or_default()
            .starts_with("unbounded"),
        "{said}"
    );
    assert_eq!(billing["inbox_keys"], 0, "{said}");
    let files = &reports[1];
    assert_eq!(files["consumer"], "files", "{said}");
    assert_eq!(files["verdict"], "ok", "{said}");
}

#[test]
fn prune_refuses_a_cutoff_under_the_horizon_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let topic = unique("prune_floor");
    produce_one(
        dir.path(),
        &format!("kafka://127.0.0.1:9092/{topic}?create_partitions=1"),
    );
    let source = format!("kafka://127.0.0.1:9092/{topic}?group=billing");
    let prune = |extra: &[&str]| {
        idemq()
            .args(["--store", &store, "prune", "--source", &source])
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = prune(&["--older-than", "1d"]);
    let said = text(&refused);
    assert_eq!(refused.status.code(), Some(2), "{said}");
    assert!(said.contains("refusing to prune"), "{said}");
    assert!(
        said.contains(&format!("7d (topic {topic} retention.ms=604800000)")),
        "{said}"
    );
    let forced = prune(&["--older-than", "1d", "--force"]);
    let said = text(&forced);
    assert_eq!(forced.status.code(), Some(0), "{said}");
    assert!(said.contains("pruning anyway (--force)"), "{said}");
    assert!(said.contains("pruned 0 rows"), "{said}");
    let safe = prune(&["--older-than", "7d"]);
    assert_eq!(safe.status.code(), Some(0), "{}", text(&safe));
    // A floor for what cannot be read: a file has no horizon.
    let floored = idemq()
        .args([
            "--store",
            &store,
            "prune",
            "--older-than",
            "1h",
            "--floor",
            "2d",
        ])
        .output()
        .unwrap();
    assert_eq!(floored.status.code(), Some(2), "{}", text(&floored));
    assert!(
        text(&floored).contains("under the floor of 2d"),
        "{}",
        text(&floored)
    );
}

/// RocketMQ's horizon is the brokers' `fileReservedTime` (96 h in
/// `scripts/rocketmq.sh`): a prune under it is refused, naming the broker's
/// setting, and one above it goes through.
#[cfg(feature = "rocketmq")]
#[test]
fn prune_refuses_a_cutoff_under_the_rocketmq_brokers_retention() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let topic = unique("prune_floor_rmq");
    produce_one(dir.path(), &format!("rocketmq://127.0.0.1:9876/{topic}"));
    let source = format!("rocketmq://127.0.0.1:9876/{topic}?group={topic}_g");
    let prune = |older_than: &str| {
        idemq()
            .args(["--store", &store, "prune", "--source", &source])
            .args(["--older-than", older_than])
            .output()
            .unwrap()
    };
    let refused = prune("3d");
    let said = text(&refused);
    assert_eq!(refused.status.code(), Some(2), "{said}");
    assert!(said.contains("refusing to prune"), "{said}");
    assert!(
        said.contains("(127.0.0.1:10911) fileReservedTime=96 (hours)"),
        "{said}"
    );
    let safe = prune("5d");
    assert_eq!(safe.status.code(), Some(0), "{}", text(&safe));
}
