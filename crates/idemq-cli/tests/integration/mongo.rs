//! A broker into MongoDB through the CLI, with SIGKILLs: payments published
//! to NATS JetStream with duplicates, consumed by two competing `idemq
//! consume` processes on the MongoDB lease store (FerretDB, started by
//! `scripts/ferretdb.sh`) with `--apply-mongo`, each killed with SIGKILL now
//! and then and restarted; afterwards every payment is in the collection
//! exactly once, with its own amount, and nothing is dead-lettered.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idemq::effect::mongo::mongodb::bson::{doc, Document};
use idemq::effect::mongo::mongodb::{Client, Collection};

const BIN: &str = env!("CARGO_BIN_EXE_idemq");
const MONGO: &str = "mongodb://127.0.0.1:27017/idemq_cli";
const N: usize = 1_000;
const KILLS: usize = 6;

fn idemq(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_CONFIG")
        .env_remove("RUST_LOG")
        .env_remove("IDEMQ_LOG");
    cmd
}

fn suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{}{}", std::process::id(), nanos % 1_000_000_000)
}

#[tokio::test]
async fn nats_into_mongodb_with_sigkills_applies_each_payment_once() {
    let name = format!("cli_mongo_{}", suffix());
    let prefix = format!("m{}_", suffix());
    let collection_name = format!("pay_{name}");
    let source = format!(
        "nats://127.0.0.1:4222/{name}/{name}_c?subject={name}.payments&create=true&ack_wait=2s&wait=1s"
    );
    let effect = format!("mongodb://127.0.0.1:27017/idemq_cli.{collection_name}");

    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("payments.jsonl");
    let lines: String = (0..N)
        .map(|i| format!("{{\"payment_id\":\"p-{i}\",\"account\":\"acc\",\"amount\":{i}}}\n"))
        .collect();
    std::fs::write(&input, lines).unwrap();
    let produced = idemq(&[
        "produce",
        input.to_str().unwrap(),
        "--to",
        &source,
        "--key",
        "json:/payment_id",
        "--duplicates",
        "0.3",
        "--seed",
        "7",
    ])
    .output()
    .unwrap();
    let produced_out = String::from_utf8_lossy(&produced.stdout);
    assert!(
        produced.status.success() && produced_out.starts_with(&format!("published={N} ")),
        "{produced:?}"
    );

    let consume = |idle_exit: Option<&str>| {
        let mut args = vec![
            "--store",
            MONGO,
            "--table-prefix",
            &prefix,
            "consume",
            &source,
            "--consumer",
            "payments",
            "--key",
            "json:/payment_id",
            "--apply-mongo",
            &effect,
            "--concurrency",
            "4",
            "--lease",
            "3s",
        ];
        if let Some(idle) = idle_exit {
            args.extend_from_slice(&["--idle-exit", idle]);
        }
        idemq(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };

    let client = Client::with_uri_str(MONGO).await.unwrap();
    let collection: Collection<Document> =
        client.database("idemq_cli").collection(&collection_name);
    let count = || async { collection.count_documents(doc! {}).await.unwrap_or(0) };

    // Two competing consumers; every ~N/10 new documents one of them is
    // killed with SIGKILL (mid-handler, mid-completion: wherever it is) and
    // a fresh one takes its place.
    let mut workers: [Child; 2] = [consume(None), consume(None)];
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut kills = 0;
    let mut last = 0;
    while kills < KILLS {
        let now = count().await;
        if now >= last + (N as u64) / 10 {
            let victim = &mut workers[kills % 2];
            victim.kill().unwrap(); // SIGKILL
            victim.wait().unwrap();
            *victim = consume(None);
            kills += 1;
            last = now;
        }
        if now >= N as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{now} of {N} payments applied in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(kills >= KILLS / 2, "only {kills} kills before the end");
    for worker in &mut workers {
        worker.kill().unwrap();
        worker.wait().unwrap();
    }

    // What the killed workers left (unacknowledged deliveries, expired leases).
    let rest = consume(Some("8s")).wait_with_output().unwrap();
    let rest_out = String::from_utf8_lossy(&rest.stdout);
    assert!(rest.status.success(), "{rest:?}");
    assert!(rest_out.contains(" dead_lettered=0"), "{rest_out}");

    let mut documents = Vec::new();
    let mut cursor = collection.find(doc! {}).await.unwrap();
    while cursor.advance().await.unwrap() {
        documents.push(cursor.deserialize_current().unwrap());
    }
    assert_eq!(
        documents.len(),
        N,
        "after {kills} kills; last run: {rest_out}"
    );
    for document in &documents {
        let id = document.get_str("_id").unwrap();
        let amount = match document.get("amount") {
            Some(idemq::effect::mongo::mongodb::bson::Bson::Int64(n)) => *n,
            Some(idemq::effect::mongo::mongodb::bson::Bson::Int32(n)) => i64::from(*n),
            other => panic!("amount {other:?} in {document}"),
        };
        assert_eq!(id, format!("p-{amount}"), "{document}");
        assert_eq!(document.get_str("account").unwrap(), "acc");
    }

    let letters = idemq(&[
        "--store",
        MONGO,
        "--table-prefix",
        &prefix,
        "dlq",
        "list",
        "--consumer",
        "payments",
        "--json",
    ])
    .output()
    .unwrap();
    assert!(letters.status.success(), "{letters:?}");
    let letters: serde_json::Value = serde_json::from_slice(&letters.stdout).unwrap();
    assert_eq!(
        letters,
        serde_json::json!([]),
        "dead letters after the kills"
    );

    collection.drop().await.unwrap();
}
