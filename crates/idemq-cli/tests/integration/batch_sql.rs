//! `idemq consume --batch N --apply-sql`: set-based batches on PostgreSQL,
//! MariaDB and SQLite. An `INSERT … VALUES (…)` template writes a batch's
//! rows in one merged statement; a row the database refuses, or a row that
//! collides with one already there, fails the merged statement and the
//! batch runs again one message at a time (the bad message alone is
//! dead-lettered); a template that does not merge (an `UPDATE`) runs per
//! message in the batch's transaction. Every case checks the tables: each
//! payment applied exactly once, nothing lost.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_idemq");

/// Payments in the input file (not counting the two bad ones).
const PAYMENTS: i64 = 600;
const ACCOUNTS: i64 = 7;

/// The finished run of the binary.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// `idemq --store STORE --table-prefix PREFIX ARGS…`, logging the
/// pipeline's decisions at debug level.
fn idemq(store: &str, prefix: &str, args: &[&str]) -> Run {
    let out = Command::new(BIN)
        .args(["--store", store, "--table-prefix", prefix])
        .args(args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_CONFIG")
        .env("IDEMQ_LOG", "warn,idemq::engine::pipeline=debug")
        .stdin(Stdio::null())
        .output()
        .expect("run idemq");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// What the fallback to one message at a time logs.
const FELL_BACK: &str = "the batch runs again one message at a time";

/// The input: payments `p-0` … `p-599` (amount `i`, account `acc-{i % 7}`),
/// every third one sent twice (the copy later in the file), then a payment
/// without an amount and one whose ledger row exists already.
fn write_input(path: &Path) -> u64 {
    let mut lines = Vec::new();
    let mut copies = Vec::new();
    for i in 0..PAYMENTS {
        let line = format!(
            r#"{{"payment_id":"p-{i}","account":"acc-{}","amount":{i}}}"#,
            i % ACCOUNTS
        );
        if i % 3 == 0 {
            copies.push(line.clone());
        }
        lines.push(line);
        if i % 50 == 49 {
            lines.append(&mut copies);
        }
    }
    lines.append(&mut copies);
    lines.insert(
        250,
        r#"{"payment_id":"p-refused","account":"acc-0","amount":null}"#.into(),
    );
    lines.insert(
        420,
        r#"{"payment_id":"p-pre","account":"acc-0","amount":5}"#.into(),
    );
    let mut text = lines.join("\n");
    text.push('\n');
    std::fs::write(path, text).expect("write input");
    lines.len() as u64
}

/// The expected ledger total of the 600 payments.
fn total() -> i64 {
    (0..PAYMENTS).sum()
}

fn summary(run: &Run) -> &str {
    run.stdout.lines().next().unwrap_or_default()
}

/// A database under test: its URL and how to read it.
enum Db {
    #[cfg(feature = "postgres")]
    Postgres(String),
    #[cfg(feature = "mysql")]
    Mysql(String),
    #[cfg(feature = "sqlite")]
    Sqlite {
        url: String,
        _dir: tempfile::TempDir,
    },
}

impl Db {
    fn url(&self) -> &str {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(url) => url,
            #[cfg(feature = "mysql")]
            Db::Mysql(url) => url,
            #[cfg(feature = "sqlite")]
            Db::Sqlite { url, .. } => url,
        }
    }

    /// Rows of two columns, the second an integer.
    async fn pairs(&self, sql: &str) -> Vec<(String, i64)> {
        match self {
            #[cfg(feature = "postgres")]
            Db::Postgres(url) => {
                let pool = sqlx::PgPool::connect(url).await.expect("connect");
                let rows = sqlx::query_as(sql).fetch_all(&pool).await.expect(sql);
                pool.close().await;
                rows
            }
            #[cfg(feature = "mysql")]
            Db::Mysql(url) => {
                let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
                let rows = sqlx::query_as(sql).fetch_all(&pool).await.expect(sql);
                pool.close().await;
                rows
            }
            #[cfg(feature = "sqlite")]
            Db::Sqlite { url, .. } => {
                let pool = sqlx::SqlitePool::connect(url).await.expect("connect");
                let rows = sqlx::query_as(sql).fetch_all(&pool).await.expect(sql);
                pool.close().await;
                rows
            }
        }
    }

    async fn drop(&self, tables: &[String]) {
        for table in tables {
            let sql = format!("DROP TABLE IF EXISTS {table}");
            match self {
                #[cfg(feature = "postgres")]
                Db::Postgres(url) => {
                    let pool = sqlx::PgPool::connect(url).await.expect("connect");
                    sqlx::raw_sql(&sql).execute(&pool).await.expect(&sql);
                }
                #[cfg(feature = "mysql")]
                Db::Mysql(url) => {
                    let pool = sqlx::MySqlPool::connect(url).await.expect("connect");
                    sqlx::raw_sql(&sql).execute(&pool).await.expect(&sql);
                }
                #[cfg(feature = "sqlite")]
                Db::Sqlite { .. } => {}
            }
        }
    }
}

#[cfg(feature = "postgres")]
fn postgres() -> Db {
    Db::Postgres(
        std::env::var("IDEMQ_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
    )
}

#[cfg(feature = "mysql")]
fn mariadb() -> Db {
    Db::Mysql(
        std::env::var("IDEMQ_TEST_MYSQL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
    )
}

#[cfg(feature = "sqlite")]
fn sqlite() -> Db {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("idemq.db").display());
    Db::Sqlite { url, _dir: dir }
}

/// Table names unique to this run.
struct Names {
    prefix: String,
    ledger: String,
    accounts: String,
}

impl Names {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let suffix = format!("{tag}{}_{nanos}", std::process::id());
        Self {
            prefix: format!("b{suffix}_"),
            ledger: format!("ledger_{suffix}"),
            accounts: format!("accounts_{suffix}"),
        }
    }

    fn tables(&self) -> Vec<String> {
        let mut tables = vec![self.ledger.clone(), self.accounts.clone()];
        for t in [
            "inbox",
            "attempts",
            "dead_letters",
            "schema_migrations",
            "offsets",
        ] {
            tables.push(format!("{}{t}", self.prefix));
        }
        tables
    }
}

/// `consume` of `input` in batches of 100, two in flight, into `db`.
fn consume(db: &Db, names: &Names, input: &Path, init: &[String], apply: &str) -> Run {
    let mut args = vec![
        "consume".to_owned(),
        input.to_str().expect("utf-8 path").to_owned(),
        "--no-checkpoint".into(),
        "--consumer".into(),
        "payments".into(),
        "--key".into(),
        "json:/payment_id".into(),
        "--batch".into(),
        "100".into(),
        "--concurrency".into(),
        "2".into(),
        "--max-attempts".into(),
        "2".into(),
    ];
    for sql in init {
        args.push("--init-sql".into());
        args.push(sql.clone());
    }
    args.push("--apply-sql".into());
    args.push(apply.to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    idemq(db.url(), &names.prefix, &args)
}

/// The stored result of `key`.
fn stored(db: &Db, names: &Names, key: &str) -> serde_json::Value {
    let run = idemq(
        db.url(),
        &names.prefix,
        &["inspect", "--consumer", "payments", "--key", key, "--json"],
    );
    assert_eq!(run.code, 0, "{run:#?}");
    let json: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    json["inbox"]["result"].clone()
}

/// A plain multi-row `INSERT`: the refused row (NULL amount) and the row
/// that exists already (primary key) each fail the merged statement; the
/// batch runs per message and dead-letters just them.
async fn merged_inserts(db: Db, tag: &str) {
    let names = Names::new(tag);
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("payments.jsonl");
    let lines = write_input(&input);
    let ledger = &names.ledger;
    let init = [
        format!(
            "CREATE TABLE {ledger} (payment_id VARCHAR(64) PRIMARY KEY, account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
        ),
        format!("INSERT INTO {ledger} (payment_id, account, amount) VALUES ('p-pre', 'acc-0', 5)"),
    ];
    let apply = format!(
        "INSERT INTO {ledger} (payment_id, account, amount) VALUES (:idemq_key, :account, :amount)"
    );
    let run = consume(&db, &names, &input, &init, &apply);
    assert_eq!(run.code, 0, "{run:#?}");
    let duplicates = lines - PAYMENTS as u64 - 2;
    assert_eq!(
        summary(&run),
        format!(
            "consumer payments: processed={PAYMENTS} duplicate={duplicates} conflict=0 retry_later=0 dead_lettered=2"
        ),
        "{run:#?}"
    );
    assert!(run.stderr.contains(FELL_BACK), "{run:#?}");
    let rows = db
        .pairs(&format!(
            "SELECT payment_id, amount FROM {ledger} ORDER BY payment_id"
        ))
        .await;
    assert_eq!(
        rows.len() as i64,
        PAYMENTS + 1,
        "every payment once, and p-pre"
    );
    assert_eq!(rows.iter().map(|(_, a)| a).sum::<i64>(), total() + 5);
    assert_eq!(
        stored(&db, &names, "p-7"),
        serde_json::json!({ "rows_affected": 1 })
    );

    let letters = idemq(
        db.url(),
        &names.prefix,
        &["dlq", "list", "--consumer", "payments", "--json"],
    );
    assert_eq!(letters.code, 0, "{letters:#?}");
    let list: serde_json::Value = serde_json::from_str(&letters.stdout).expect("json");
    let mut reasons: Vec<String> = list
        .as_array()
        .expect("array")
        .iter()
        .map(|l| {
            format!(
                "{} {}",
                l["key"].as_str().unwrap_or("?"),
                l["reason"].as_str().unwrap_or("?")
            )
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        ["p-pre permanent_failure", "p-refused permanent_failure"],
        "{letters:#?}"
    );

    // Everything again: duplicates only, nothing written.
    let again = consume(&db, &names, &input, &[], &apply);
    assert_eq!(again.code, 0, "{again:#?}");
    assert!(summary(&again).contains("processed=0 "), "{again:#?}");
    let count = db
        .pairs(&format!("SELECT 'rows', COUNT(*) FROM {ledger}"))
        .await;
    assert_eq!(count[0].1, PAYMENTS + 1);
    db.drop(&names.tables()).await;
}

/// `ON CONFLICT DO NOTHING` (PostgreSQL, SQLite): the merged statement does
/// not fail on the row that exists, but changes one row fewer than it has
/// messages, which does not say whose; the batch runs per message so that
/// each stores its own `rows_affected`.
async fn merged_inserts_skipping_conflicts(db: Db, tag: &str) {
    let names = Names::new(tag);
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("payments.jsonl");
    write_input(&input);
    let ledger = &names.ledger;
    let init = [
        format!(
            "CREATE TABLE {ledger} (payment_id VARCHAR(64) PRIMARY KEY, account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
        ),
        format!("INSERT INTO {ledger} (payment_id, account, amount) VALUES ('p-pre', 'acc-0', 5)"),
    ];
    let apply = format!(
        "INSERT INTO {ledger} (payment_id, account, amount) VALUES (:idemq_key, :account, :amount) ON CONFLICT (payment_id) DO NOTHING"
    );
    let run = consume(&db, &names, &input, &init, &apply);
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(
        summary(&run).contains(&format!("processed={} ", PAYMENTS + 1)),
        "{run:#?}"
    );
    assert!(summary(&run).ends_with("dead_lettered=1"), "{run:#?}");
    assert_eq!(
        stored(&db, &names, "p-pre"),
        serde_json::json!({ "rows_affected": 0 })
    );
    assert_eq!(
        stored(&db, &names, "p-0"),
        serde_json::json!({ "rows_affected": 1 })
    );
    assert_eq!(
        stored(&db, &names, "p-599"),
        serde_json::json!({ "rows_affected": 1 })
    );
    let rows = db
        .pairs(&format!("SELECT payment_id, amount FROM {ledger}"))
        .await;
    assert_eq!(rows.len() as i64, PAYMENTS + 1);
    assert_eq!(rows.iter().map(|(_, a)| a).sum::<i64>(), total() + 5);
    db.drop(&names.tables()).await;
}

/// An `UPDATE` does not merge: it runs per message in the batch's
/// transaction. Balances are the sums of each account's payments, once.
async fn updates_run_per_message(db: Db, tag: &str) {
    let names = Names::new(tag);
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("payments.jsonl");
    write_input(&input);
    let accounts = &names.accounts;
    let mut init = vec![format!(
        "CREATE TABLE {accounts} (id VARCHAR(64) PRIMARY KEY, balance BIGINT NOT NULL)"
    )];
    for a in 0..ACCOUNTS {
        init.push(format!(
            "INSERT INTO {accounts} (id, balance) VALUES ('acc-{a}', 0)"
        ));
    }
    let apply = format!("UPDATE {accounts} SET balance = balance + :amount WHERE id = :account");
    let run = consume(&db, &names, &input, &init, &apply);
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(!run.stderr.contains(FELL_BACK), "never merged: {run:#?}");
    // p-refused binds NULL: the UPDATE fails on NOT NULL and is dead-lettered.
    assert!(
        summary(&run).contains(&format!("processed={} ", PAYMENTS + 1)),
        "{run:#?}"
    );
    assert!(summary(&run).ends_with("dead_lettered=1"), "{run:#?}");
    let balances: BTreeMap<String, i64> = db
        .pairs(&format!("SELECT id, balance FROM {accounts}"))
        .await
        .into_iter()
        .collect();
    for a in 0..ACCOUNTS {
        let mut expected: i64 = (0..PAYMENTS).filter(|i| i % ACCOUNTS == a).sum();
        if a == 0 {
            expected += 5; // p-pre
        }
        assert_eq!(balances[&format!("acc-{a}")], expected, "acc-{a}");
    }
    db.drop(&names.tables()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_merged_inserts_apply_each_payment_once() {
    merged_inserts(postgres(), "p").await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_merged_inserts_skipping_conflicts_store_each_count() {
    merged_inserts_skipping_conflicts(postgres(), "pc").await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_updates_run_per_message() {
    updates_run_per_message(postgres(), "pu").await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_merged_inserts_apply_each_payment_once() {
    merged_inserts(mariadb(), "m").await;
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn mariadb_updates_run_per_message() {
    updates_run_per_message(mariadb(), "mu").await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_merged_inserts_apply_each_payment_once() {
    merged_inserts(sqlite(), "s").await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_merged_inserts_skipping_conflicts_store_each_count() {
    merged_inserts_skipping_conflicts(sqlite(), "sc").await;
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_updates_run_per_message() {
    updates_run_per_message(sqlite(), "su").await;
}
