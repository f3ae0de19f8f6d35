//! `idemq chaos`, one small cell: a JSON-lines file × SQLite, 300 orders
//! with duplicates of both kinds and poison, three workers killed with
//! SIGKILL at random moments and at the engine's named fail points. The
//! command's verdict is checked, and so is the ledger itself, independently.
//!
//! Needs the `failpoints` feature (the named points are compiled out otherwise).

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_idemq");

/// The Markdown row of the report, as cells.
fn report_row(report: &str) -> Vec<String> {
    let line = report
        .lines()
        .find(|l| l.starts_with("| jsonl "))
        .unwrap_or_else(|| panic!("no jsonl row in the report:\n{report}"));
    line.trim_matches('|')
        .split('|')
        .map(|c| c.trim().to_owned())
        .collect()
}

#[tokio::test]
async fn file_to_sqlite_survives_kills_at_every_point() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("chaos.db");
    let store = format!("sqlite://{}", db.display());
    let report = dir.path().join("report.md");
    let out = Command::new(BIN)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG")
        .args(["--store", &store, "chaos", "--source"])
        .arg(dir.path().join("orders-{run}.jsonl"))
        .args(["--messages", "300", "--poison", "6", "--workers", "3"])
        .args(["--kills", "5", "--idle-exit", "1s", "--timeout", "120s"])
        .args([
            "--kill-at",
            "after_claim:0.02,after_handler:0.02,before_commit:0.02,after_commit_before_ack:0.02",
        ])
        .arg("--work-dir")
        .arg(dir.path())
        .arg("--report")
        .arg(&report)
        .output()
        .expect("run idemq chaos");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );

    // | source | store | messages | dup same id | dup new id | poison | kills random |
    // after_claim | after_handler | before_commit | after_commit_before_ack | restarts |
    // db/broker | double | lost | dead letters | seconds | result |
    let row = report_row(&std::fs::read_to_string(&report).expect("report"));
    let n = |i: usize| -> u64 { row[i].parse().unwrap_or_else(|_| panic!("{row:?}")) };
    assert_eq!(row[1], "sqlite", "{row:?}");
    assert_eq!(n(2), 300, "{row:?}");
    assert!(n(3) > 0 && n(4) > 0, "duplicates of both kinds: {row:?}");
    assert_eq!(n(5), 6, "{row:?}");
    let random = n(6);
    let named: u64 = (7..=10).map(n).sum();
    assert!(random >= 5, "random kills: {row:?}");
    assert!(named >= 1, "kills at the named points: {row:?}");
    assert!(n(11) >= random + named, "every kill restarted: {row:?}");
    assert_eq!(n(13), 0, "double effects: {row:?}");
    assert_eq!(n(14), 0, "lost: {row:?}");
    assert!(n(15) >= 6, "dead letters: {row:?}");
    assert_eq!(row[17], "ok", "{row:?}");

    // The ledger and the dead letters, read directly.
    let pool = sqlx::SqlitePool::connect(&store)
        .await
        .expect("open sqlite");
    let (ledger,): (String,) = sqlx::query_as(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'chaos_%_ledger'",
    )
    .fetch_one(&pool)
    .await
    .expect("the ledger table");
    let prefix = ledger.trim_end_matches("ledger");
    let (rows, keys): (i64, i64) = sqlx::query_as(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM {ledger}"
    ))
    .fetch_one(&pool)
    .await
    .expect("count the ledger");
    assert_eq!((rows, keys), (300, 300), "one row per order");
    let reasons: Vec<(String,)> = sqlx::query_as(&format!(
        "SELECT DISTINCT reason FROM {prefix}dead_letters ORDER BY reason"
    ))
    .fetch_all(&pool)
    .await
    .expect("read the dead letters");
    let reasons: Vec<&str> = reasons.iter().map(|(r,)| r.as_str()).collect();
    assert_eq!(reasons, ["malformed_json", "missing_key"]);
    pool.close().await;
}
