//! `idemq relay` end to end: outbox rows inserted with plain SQL (as any
//! producer, in any language, can write them) are relayed to a JSON-lines
//! file (SQLite) and to a Redis stream (PostgreSQL, MariaDB), then consumed
//! with `idemq consume --key header:event_id`: every event applied exactly
//! once, even when the relayed copies arrive twice, and the outbox is empty.
#![cfg(all(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis-streams"
))]

use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

const BIN: &str = env!("CARGO_BIN_EXE_idemq");

/// The result of one run of the binary.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn ok(self) -> Self {
        assert_eq!(self.code, 0, "idemq failed: {self:#?}");
        self
    }
}

/// Runs `idemq ARGS…` with a clean environment.
fn idemq(args: &[&str]) -> Run {
    let out = Command::new(BIN)
        .args(args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run idemq");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn unique(name: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{name}_{}_{nanos}", std::process::id())
}

/// Six payment events over two accounts (the key), in order per account:
/// (id, account, payment_id, amount, n).
fn events() -> Vec<(String, String, String, i64, u32)> {
    (0..6)
        .map(|i| {
            (
                format!("evt-{i}"),
                format!("acc-{}", i % 2),
                format!("p-{i}"),
                (i as i64 + 1) * 10,
                i / 2,
            )
        })
        .collect()
}

fn payload(account: &str, payment_id: &str, amount: i64, n: u32) -> String {
    serde_json::json!({ "payment_id": payment_id, "account": account, "amount": amount, "n": n })
        .to_string()
}

/// Inserts the events with plain SQL (`$n` or `?` placeholders), and one
/// more in a transaction that rolls back.
macro_rules! insert_events {
    ($pool:expr, $table:expr, $placeholders:expr) => {{
        let sql = format!(
            "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, headers) VALUES {}",
            $table, $placeholders
        );
        for (id, account, payment_id, amount, n) in events() {
            sqlx::query(&sql)
                .bind(&id)
                .bind("payments")
                .bind(&account)
                .bind("PaymentCaptured")
                .bind(payload(&account, &payment_id, amount, n).into_bytes())
                .bind(r#"{"source":"sql"}"#)
                .execute($pool)
                .await
                .unwrap();
        }
        let mut tx = $pool.begin().await.unwrap();
        sqlx::query(&sql)
            .bind("evt-rolled-back")
            .bind("payments")
            .bind("acc-0")
            .bind("PaymentCaptured")
            .bind(payload("acc-0", "p-rolled-back", 1, 99).into_bytes())
            .bind(r#"{}"#)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.rollback().await.unwrap();
    }};
}

/// `published=N` of the relay's summary line.
fn published(run: &Run) -> u64 {
    run.stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("published="))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no summary: {run:#?}"))
}

const CREATE_LEDGER: &str =
    "CREATE TABLE IF NOT EXISTS ledger_NAME (payment_id VARCHAR(64), account VARCHAR(64), amount BIGINT)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rows_are_relayed_to_a_file_and_consumed_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let store = format!("sqlite://{}", db.display());
    let out = dir.path().join("relayed.jsonl");
    let out = out.to_str().unwrap();

    // --migrate creates the table; an empty outbox with --idle-exit 0s ends at once.
    let first = idemq(&[
        "--store",
        &store,
        "relay",
        "--to",
        out,
        "--migrate",
        "--idle-exit",
        "0s",
    ])
    .ok();
    assert_eq!(published(&first), 0);

    let pool = sqlx::SqlitePool::connect(&store).await.unwrap();
    insert_events!(&pool, "idemq_outbox", "(?, ?, ?, ?, ?, ?)");

    let run = idemq(&[
        "--store",
        &store,
        "relay",
        "--to",
        out,
        "--batch",
        "4",
        "--idle-exit",
        "2s",
    ])
    .ok();
    assert_eq!(published(&run), 6, "{run:#?}");
    let (left,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM idemq_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the outbox is empty");
    // A second relay finds nothing.
    assert_eq!(
        published(&idemq(&["--store", &store, "relay", "--to", out, "--idle-exit", "0s"]).ok()),
        0
    );

    // The file holds the envelopes: id = event_id header = the row id,
    // key = the account, the row's headers, in order per account.
    let text = std::fs::read_to_string(out).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "{text}");
    let mut last_n = std::collections::HashMap::new();
    for line in &lines {
        assert_eq!(line["id"], line["headers"]["event_id"]);
        assert_eq!(line["headers"]["event_type"], "PaymentCaptured");
        assert_eq!(line["headers"]["source"], "sql");
        assert_eq!(line["key"], line["payload"]["account"]);
        let n = line["payload"]["n"].as_i64().unwrap();
        let prev = last_n.insert(line["key"].to_string(), n);
        assert!(
            prev.is_none_or(|p| p < n),
            "order of {}: {text}",
            line["key"]
        );
    }
    assert!(!text.contains("rolled-back"));

    // A relay that crashed after publishing and before deleting sends rows
    // again with the same ids: append two copies, as it would have.
    let copies: String = text.lines().take(2).map(|l| format!("{l}\n")).collect();
    std::fs::write(out, format!("{text}{copies}")).unwrap();
    let ledger = CREATE_LEDGER.replace("NAME", "sqlite");
    let consume = idemq(&[
        "--store",
        &store,
        "consume",
        out,
        "--consumer",
        "billing",
        "--key",
        "header:event_id",
        "--init-sql",
        &ledger,
        "--apply-sql",
        "INSERT INTO ledger_sqlite VALUES (:payment_id, :account, :amount)",
    ])
    .ok();
    assert!(
        consume
            .stdout
            .contains("processed=6 duplicate=2 conflict=0"),
        "{consume:#?}"
    );
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT payment_id, amount FROM ledger_sqlite ORDER BY payment_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let want: Vec<(String, i64)> = events().into_iter().map(|e| (e.2, e.3)).collect();
    assert_eq!(rows, want, "each payment once");
}

/// Relays `table`'s rows to a fresh Redis stream and consumes them into
/// `ledger` with the store `store` (prefix `prefix`); returns the consume run.
fn relay_and_consume(store: &str, prefix: &str, ledger: &str, insert: &str) -> Run {
    let stream = unique("relay_cli");
    let to = format!("redis-stream://127.0.0.1:6379/{stream}");
    let run = idemq(&[
        "--store",
        store,
        "--table-prefix",
        prefix,
        "relay",
        "--to",
        &to,
        "--batch",
        "3",
        "--idle-exit",
        "2s",
    ])
    .ok();
    assert_eq!(published(&run), 6, "{run:#?}");
    let source = format!("redis-stream://127.0.0.1:6379/{stream}?group=billing&block=200ms");
    let create = CREATE_LEDGER.replace("ledger_NAME", ledger);
    let consumed = idemq(&[
        "--store",
        store,
        "--table-prefix",
        prefix,
        "consume",
        &source,
        "--consumer",
        "billing",
        "--key",
        "header:event_id",
        "--idle-exit",
        "2s",
        "--init-sql",
        &create,
        "--apply-sql",
        insert,
    ])
    .ok();
    // Reading the same stream again from the start (a new group) delivers
    // every event a second time: all duplicates.
    let again = format!("redis-stream://127.0.0.1:6379/{stream}?group=replay&block=200ms");
    let replay = idemq(&[
        "--store",
        store,
        "--table-prefix",
        prefix,
        "consume",
        &again,
        "--consumer",
        "billing",
        "--key",
        "header:event_id",
        "--idle-exit",
        "2s",
        "--apply-sql",
        insert,
    ])
    .ok();
    assert!(
        replay.stdout.contains("processed=0 duplicate=6"),
        "{replay:#?}"
    );
    consumed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_are_relayed_to_redis_and_consumed_exactly_once() {
    let url = std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let prefix = format!("{}_", unique("relaycli"));
    let ledger = format!("{prefix}ledger");
    idemq(&[
        "--store",
        &url,
        "--table-prefix",
        &prefix,
        "relay",
        "--to",
        "-",
        "--migrate",
        "--idle-exit",
        "0s",
    ])
    .ok();
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    insert_events!(&pool, format!("{prefix}outbox"), "($1, $2, $3, $4, $5, $6)");

    let insert = format!("INSERT INTO {ledger} VALUES (:payment_id, :account, :amount)");
    let consumed = relay_and_consume(&url, &prefix, &ledger, &insert);
    assert!(
        consumed.stdout.contains("processed=6 duplicate=0"),
        "{consumed:#?}"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT payment_id, amount FROM {ledger} ORDER BY payment_id"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let want: Vec<(String, i64)> = events().into_iter().map(|e| (e.2, e.3)).collect();
    assert_eq!(rows, want);
    let (left,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {prefix}outbox"))
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    for t in [
        "ledger",
        "outbox",
        "inbox",
        "attempts",
        "dead_letters",
        "schema_migrations",
        "offsets",
        "effects",
    ] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{t}"))
            .execute(&pool)
            .await;
    }
    let _ = sqlx::query(&format!("DROP FUNCTION IF EXISTS {prefix}outbox_notify()"))
        .execute(&pool)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_rows_are_relayed_to_redis_and_consumed_exactly_once() {
    let url = std::env::var("IDEMQ_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let prefix = format!("{}_", unique("relaycli"));
    let ledger = format!("{prefix}ledger");
    idemq(&[
        "--store",
        &url,
        "--table-prefix",
        &prefix,
        "relay",
        "--to",
        "-",
        "--migrate",
        "--idle-exit",
        "0s",
    ])
    .ok();
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    insert_events!(&pool, format!("{prefix}outbox"), "(?, ?, ?, ?, ?, ?)");

    let insert = format!("INSERT INTO {ledger} VALUES (:payment_id, :account, :amount)");
    let consumed = relay_and_consume(&url, &prefix, &ledger, &insert);
    assert!(
        consumed.stdout.contains("processed=6 duplicate=0"),
        "{consumed:#?}"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT payment_id, amount FROM {ledger} ORDER BY payment_id"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let want: Vec<(String, i64)> = events().into_iter().map(|e| (e.2, e.3)).collect();
    assert_eq!(rows, want);
    for t in [
        "ledger",
        "outbox",
        "inbox",
        "attempts",
        "dead_letters",
        "schema_migrations",
        "offsets",
        "effects",
    ] {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{t}"))
            .execute(&pool)
            .await;
    }
}

#[test]
fn a_missing_table_is_reported_with_a_hint_and_a_bad_prefix_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("empty.db").display());
    let missing = idemq(&["--store", &store, "relay", "--to", "-", "--idle-exit", "0s"]);
    assert_eq!(missing.code, 1, "{missing:#?}");
    assert!(missing.stderr.contains("--migrate"), "{missing:#?}");
    let bad = idemq(&[
        "--store",
        &store,
        "--table-prefix",
        "a-b",
        "relay",
        "--to",
        "-",
    ]);
    assert_eq!(bad.code, 2, "{bad:#?}");
}
