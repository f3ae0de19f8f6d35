//! End-to-end tests of the `idemq` binary: SQLite in a temporary directory,
//! plus consume runs against the local PostgreSQL and MariaDB.
//!
//! Each test needs the backend feature it uses; in builds with only some
//! backends, helpers of the others are unused.
#![cfg_attr(
    not(all(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code, unused_imports)
)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idemq");

const CREATE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS ledger (payment_id TEXT PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL)";
const INSERT_LEDGER: &str =
    "INSERT INTO ledger (payment_id, account, amount) VALUES (:idemq_key, :account, :amount)";
const EVIL_ACCOUNT: &str = "x'); DROP TABLE ledger;--";

/// Ten lines: p-1 and p-2 twice (redeliveries), p-3 sent twice by a producer
/// retry (new envelope id, same payment_id), one line that is not JSON, one
/// without payment_id, p-4 with SQL metacharacters, p-2 reused with another amount.
const PAYMENTS: &str = r#"{"payment_id":"p-1","account":"acc-1","amount":100}
{"payment_id":"p-2","account":"acc-2","amount":250}
{"payment_id":"p-1","account":"acc-1","amount":100}
{"id":"env-1","payload":{"payment_id":"p-3","account":"acc-3","amount":75}}
{"id":"env-2","payload":{"payment_id":"p-3","account":"acc-3","amount":75}}
this is not json
{"account":"acc-4","amount":5}
{"payment_id":"p-4","account":"x'); DROP TABLE ledger;--","amount":1}

{"payment_id":"p-2","account":"acc-2","amount":250}
{"payment_id":"p-2","account":"acc-2","amount":999}
"#;

const FIRST_RUN: &str =
    "consumer payments: processed=4 duplicate=3 conflict=1 retry_later=0 dead_lettered=2";
const NOTHING: &str =
    "consumer payments: processed=0 duplicate=0 conflict=0 retry_later=0 dead_lettered=0";
const FULL_RERUN: &str =
    "consumer payments: processed=0 duplicate=7 conflict=1 retry_later=0 dead_lettered=2";

/// The result of one run of the binary.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {self:?}"))
    }

    #[track_caller]
    fn expect_code(self, code: i32) -> Self {
        assert_eq!(self.code, code, "unexpected exit code: {self:#?}");
        self
    }
}

/// Runs `idemq --store STORE ARGS…` with a clean environment, optionally feeding stdin.
fn idemq_with_stdin(store: &str, args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.arg("--store")
        .arg(store)
        .args(args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn idemq");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin pipe");
        pipe.write_all(input.as_bytes()).expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait for idemq");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn idemq(store: &str, args: &[&str]) -> Run {
    idemq_with_stdin(store, args, None)
}

/// A temporary SQLite store and the payments file.
struct Fixture {
    dir: tempfile::TempDir,
    store: String,
    input: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let input = dir.path().join("payments.jsonl");
        std::fs::write(&input, PAYMENTS).expect("write input");
        let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
        Self { dir, store, input }
    }

    fn input(&self) -> &str {
        self.input.to_str().expect("utf-8 path")
    }

    fn run(&self, args: &[&str]) -> Run {
        idemq(&self.store, args)
    }

    /// `consume` of the payments file into the ledger, with `extra` flags.
    fn consume(&self, extra: &[&str]) -> Run {
        let mut args = vec![
            "consume",
            self.input(),
            "--consumer",
            "payments",
            "--key",
            "json:/payment_id",
            "--concurrency",
            "1",
            "--init-sql",
            CREATE_LEDGER,
            "--apply-sql",
            INSERT_LEDGER,
        ];
        args.extend_from_slice(extra);
        self.run(&args)
    }

    #[cfg(feature = "sqlite")]
    async fn ledger(&self) -> Vec<(String, String, i64)> {
        let pool = sqlx::SqlitePool::connect(&self.store)
            .await
            .expect("open sqlite");
        let rows = sqlx::query_as::<_, (String, String, i64)>(
            "SELECT payment_id, account, amount FROM ledger ORDER BY payment_id",
        )
        .fetch_all(&pool)
        .await
        .expect("read ledger");
        pool.close().await;
        rows
    }
}

fn expected_ledger() -> Vec<(String, String, i64)> {
    vec![
        ("p-1".into(), "acc-1".into(), 100),
        ("p-2".into(), "acc-2".into(), 250),
        ("p-3".into(), "acc-3".into(), 75),
        ("p-4".into(), EVIL_ACCOUNT.into(), 1),
    ]
}

fn first_line(run: &Run) -> &str {
    run.stdout.lines().next().unwrap_or_default()
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn consume_applies_each_payment_once_and_reruns_are_harmless() {
    let f = Fixture::new();
    let first = f.consume(&[]).expect_code(0);
    assert_eq!(first_line(&first), FIRST_RUN, "{first:#?}");
    assert!(
        first
            .stdout
            .contains("dead letters: idemq dlq list --consumer payments"),
        "{first:#?}"
    );
    assert!(f
        .dir
        .path()
        .join("payments.jsonl.payments.checkpoint")
        .exists());

    // The checkpoint is at the end: nothing is read again.
    let second = f.consume(&[]).expect_code(0);
    assert_eq!(second.stdout.trim(), NOTHING, "{second:#?}");

    // Without it every line comes back: duplicates and the same dead letters, nothing applied.
    let third = f.consume(&["--no-checkpoint"]).expect_code(0);
    assert_eq!(first_line(&third), FULL_RERUN, "{third:#?}");

    assert_eq!(f.ledger().await, expected_ledger());
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sql_metacharacters_are_bound_verbatim() {
    let f = Fixture::new();
    f.consume(&[]).expect_code(0);
    let ledger = f.ledger().await; // the table is still there
    let p4 = ledger.iter().find(|(id, ..)| id == "p-4").expect("p-4 row");
    assert_eq!(p4.1, EVIL_ACCOUNT);
}

#[cfg(feature = "sqlite")]
/// `produce` to a JSON-lines file with every message duplicated both ways,
/// then `consume` of that file: the ledger is the same as from the original.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn produced_duplicates_of_both_kinds_apply_once() {
    let fx = Fixture::new();
    let out = fx.dir.path().join("produced.jsonl");
    let out_str = out.to_str().unwrap();
    let run = fx
        .run(&[
            "produce",
            fx.input(),
            "--to",
            out_str,
            "--key",
            "json:/payment_id",
            "--duplicates",
            "1",
            "--producer-retries",
            "1",
            "--seed",
            "7",
        ])
        .expect_code(0);
    assert_eq!(
        first_line(&run),
        "published=10 duplicates=10 producer_retries=10 raw=1"
    );
    let lines: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 30);
    // A duplicate keeps the id; a producer retry gets a new id, same key.
    assert_eq!(lines[0]["id"], lines[1]["id"]);
    assert_ne!(lines[0]["id"], lines[2]["id"]);
    assert_eq!(lines[0]["key"], lines[2]["key"]);
    assert_eq!(lines[0]["key"], "p-1");

    let mut args = vec!["consume", out_str];
    args.extend_from_slice(&[
        "--consumer",
        "payments",
        "--key",
        "json:/payment_id",
        "--init-sql",
        CREATE_LEDGER,
        "--apply-sql",
        INSERT_LEDGER,
    ]);
    let run = fx.run(&args).expect_code(0);
    assert!(
        first_line(&run).starts_with("consumer payments: processed=4 "),
        "{run:?}"
    );
    assert_eq!(fx.ledger().await, expected_ledger());
}

#[test]
fn stats_and_inspect_report_the_inbox() {
    let f = Fixture::new();
    f.consume(&[]).expect_code(0);

    let table = f.run(&["stats"]).expect_code(0);
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with("payments"))
        .unwrap_or_else(|| panic!("no payments row: {table:#?}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[1], "4", "{row}"); // processed
    assert_eq!(cells[4], "3", "{row}"); // dead letters
    assert_eq!(cells[5], "0", "{row}"); // failing

    let stats = f.run(&["stats", "--json"]).expect_code(0).json();
    let payments = &stats[0];
    assert_eq!(payments["consumer"], "payments");
    assert_eq!(payments["processed"], 4);
    assert_eq!(payments["dead_letters"], 3);
    assert!(payments["oldest"]
        .as_str()
        .is_some_and(|t| t.ends_with('Z')));

    let text = f
        .run(&["inspect", "--consumer", "payments", "--key", "p-2"])
        .expect_code(0);
    assert!(text.stdout.contains("processed at"), "{text:#?}");
    assert!(text.stdout.contains("rows_affected"), "{text:#?}");
    assert!(text.stdout.contains("conflict"), "{text:#?}");

    let json = f
        .run(&[
            "inspect",
            "--consumer",
            "payments",
            "--key",
            "p-2",
            "--json",
        ])
        .expect_code(0)
        .json();
    assert_eq!(json["found"], true);
    assert_eq!(json["inbox"]["result"]["rows_affected"], 1);
    assert_eq!(
        json["inbox"]["fingerprint"].as_str().map(str::len),
        Some(64)
    );
    assert_eq!(json["dead_letters"][0]["reason"], "conflict");

    let unknown = f
        .run(&["inspect", "--consumer", "payments", "--key", "p-404"])
        .expect_code(3);
    assert!(unknown.stderr.contains("unknown"), "{unknown:#?}");
    f.run(&["inspect", "--consumer", "other", "--key", "p-1"])
        .expect_code(3);
}

#[cfg(feature = "sqlite")]
#[test]
fn dlq_list_shows_bad_lines_with_their_reasons() {
    let f = Fixture::new();
    f.consume(&[]).expect_code(0);
    let list = f
        .run(&["dlq", "list", "--consumer", "payments", "--json"])
        .expect_code(0)
        .json();
    // Letters are listed in the order they were written; bad lines are
    // dead-lettered concurrently, so read them in file order.
    let mut letters = list.as_array().expect("array").clone();
    letters.sort_by_key(|d| d["offset"].as_i64());
    let reasons: Vec<&str> = letters
        .iter()
        .filter_map(|d| d["reason"].as_str())
        .collect();
    assert_eq!(reasons, ["malformed_record", "missing_key", "conflict"]);

    let malformed = &letters[0];
    assert_eq!(malformed["message"]["payload"], "this is not json");
    assert_eq!(malformed["source"], "jsonl");
    assert_eq!(malformed["offset"], 6);
    assert!(malformed["key"].is_null());
    let missing = &letters[1];
    assert_eq!(
        missing["message"]["payload"],
        r#"{"account":"acc-4","amount":5}"#
    );
    assert_eq!(missing["offset"], 7);
    assert_eq!(letters[2]["key"], "p-2");

    let table = f.run(&["dlq", "list"]).expect_code(0);
    assert!(table.stdout.starts_with("ID"), "{table:#?}");
    assert!(table.stdout.contains("malformed_record"), "{table:#?}");
    assert!(table.stdout.contains("this is not json"), "{table:#?}");

    let none = f
        .run(&["dlq", "list", "--consumer", "nobody"])
        .expect_code(0);
    assert_eq!(none.stdout.trim(), "no dead letters");
}

/// `--max-line-bytes`: a line longer than the limit becomes a `too_large`
/// dead letter; the lines around it are applied.
#[cfg(feature = "sqlite")]
#[test]
fn a_line_over_max_line_bytes_is_dead_lettered_as_too_large() {
    let f = Fixture::new();
    let big = format!(
        r#"{{"payment_id":"p-big","account":"{}","amount":1}}"#,
        "a".repeat(300)
    );
    let lines = format!(
        "{}\n{big}\n{}\n",
        r#"{"payment_id":"p-1","account":"acc-1","amount":100}"#,
        r#"{"payment_id":"p-2","account":"acc-2","amount":250}"#
    );
    std::fs::write(&f.input, lines).unwrap();
    let run = f.consume(&["--max-line-bytes", "200"]).expect_code(0);
    assert!(
        first_line(&run).contains("processed=2") && first_line(&run).contains("dead_lettered=1"),
        "{run:#?}"
    );
    let letters = f
        .run(&["dlq", "list", "--consumer", "payments", "--json"])
        .expect_code(0)
        .json();
    let letters = letters.as_array().expect("array");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["reason"], "too_large", "{letters:?}");

    let bad = f.consume(&["--max-line-bytes", "lots"]);
    assert_eq!(bad.code, 2, "a bad size is a usage error: {bad:#?}");
}

#[cfg(feature = "sqlite")]
#[test]
fn prune_older_than_zero_removes_every_row() {
    let f = Fixture::new();
    f.consume(&[]).expect_code(0);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let kept = f.run(&["prune", "--older-than", "7d"]).expect_code(0);
    assert_eq!(kept.stdout.trim(), "pruned 0 rows older than 7d");
    let pruned = f.run(&["prune", "--older-than", "0s"]).expect_code(0);
    assert_eq!(pruned.stdout.trim(), "pruned 4 rows older than 0s");

    let stats = f.run(&["stats", "--json"]).expect_code(0).json();
    assert_eq!(stats[0]["processed"], 0);
    assert_eq!(stats[0]["dead_letters"], 3, "dead letters are not pruned");
    f.run(&["inspect", "--consumer", "payments", "--key", "p-1"])
        .expect_code(3);
}

#[cfg(feature = "sqlite")]
#[test]
fn migrate_reports_the_store() {
    let f = Fixture::new();
    let run = f.run(&["migrate"]).expect_code(0);
    assert_eq!(
        run.stdout.trim(),
        format!("migrated {} (tables prefix idemq_)", f.store)
    );
    f.run(&["migrate"]).expect_code(0);
}

#[cfg(feature = "sqlite")]
#[test]
fn print_sink_reads_stdin_and_still_dedups() {
    let f = Fixture::new();
    let input = "{\"id\":\"a\",\"payload\":{\"n\":1}}\n{\"id\":\"a\",\"payload\":{\"n\":1}}\n{\"id\":\"b\",\"payload\":\"plain text\"}\n";
    let run = idemq_with_stdin(
        &f.store,
        &["consume", "--consumer", "printer", "--print"],
        Some(input),
    )
    .expect_code(0);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{run:#?}");
    let printed: Vec<Value> = lines[..2]
        .iter()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert!(printed.contains(&serde_json::json!({"key": "a", "payload": {"n": 1}})));
    assert!(printed.contains(&serde_json::json!({"key": "b", "payload": "plain text"})));
    assert_eq!(
        lines[2],
        "consumer printer: processed=2 duplicate=1 conflict=0 retry_later=0 dead_lettered=0"
    );
}

#[cfg(feature = "sqlite")]
#[test]
fn dlq_replay_resolves_what_now_succeeds() {
    let f = Fixture::new();
    // amount 0 violates the CHECK: a permanent failure, dead-lettered.
    std::fs::write(
        &f.input,
        "{\"payment_id\":\"p-1\",\"account\":\"a\",\"amount\":5}\n\
         {\"payment_id\":\"p-0\",\"account\":\"a\",\"amount\":0}\n\
         {\"account\":\"a\",\"amount\":7}\n",
    )
    .expect("write input");
    let consumed = f
        .run(&[
            "consume",
            f.input(),
            "--consumer",
            "payments",
            "--key",
            "json:/payment_id",
            "--init-sql",
            "CREATE TABLE strict_ledger (payment_id TEXT PRIMARY KEY, amount INTEGER NOT NULL CHECK (amount > 0))",
            "--apply-sql",
            "INSERT INTO strict_ledger (payment_id, amount) VALUES (:idemq_key, :amount)",
        ])
        .expect_code(0);
    assert_eq!(
        first_line(&consumed),
        "consumer payments: processed=1 duplicate=0 conflict=0 retry_later=0 dead_lettered=2"
    );
    let letters = f
        .run(&["dlq", "list", "--consumer", "payments", "--json"])
        .expect_code(0)
        .json();
    let letters = letters.as_array().expect("array");
    assert_eq!(letters.len(), 2, "{letters:#?}");
    let id_of = |reason: &str| {
        letters
            .iter()
            .find(|d| d["reason"] == reason)
            .and_then(|d| d["id"].as_i64())
            .unwrap_or_else(|| panic!("no {reason} dead letter: {letters:#?}"))
    };
    let failed_id = id_of("permanent_failure");
    let missing_id = id_of("missing_key");

    let unknown = f
        .run(&[
            "dlq",
            "replay",
            "--consumer",
            "payments",
            "--id",
            "999",
            "--print",
        ])
        .expect_code(3);
    assert!(unknown.stderr.contains("#999 not found"), "{unknown:#?}");

    // Replayed into a sink that accepts it: processed, and its dead letter goes.
    let replay = f
        .run(&[
            "dlq",
            "replay",
            "--consumer",
            "payments",
            "--all",
            "--key",
            "json:/payment_id",
            "--print",
        ])
        .expect_code(0);
    assert!(
        replay
            .stdout
            .contains(&format!("#{failed_id} key \"p-0\": processed")),
        "{replay:#?}"
    );
    assert!(
        replay.stdout.contains(&format!(
            "#{missing_id} (no key): dead-lettered again (missing_key"
        )),
        "{replay:#?}"
    );
    // The printed payload is the message's JSON (its key order is serde_json's:
    // sorted, or as received when a dependency turns on preserve_order).
    let printed: Vec<serde_json::Value> = replay
        .stdout
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    assert_eq!(
        printed,
        vec![
            serde_json::json!({"key":"p-0","payload":{"account":"a","amount":0,"payment_id":"p-0"}})
        ],
        "{replay:#?}"
    );

    let after = f
        .run(&["dlq", "list", "--consumer", "payments", "--json"])
        .expect_code(0)
        .json();
    let after = after.as_array().expect("array");
    assert_eq!(
        after.len(),
        1,
        "only the still-keyless message stays: {after:#?}"
    );
    assert_eq!(after[0]["reason"], "missing_key");
    assert_eq!(
        after[0]["source"], "jsonl",
        "the origin survives the replay"
    );
    assert_eq!(after[0]["offset"], 3);
    assert_eq!(
        after[0]["id"], missing_id,
        "one letter per message: the same letter is kept, not written again"
    );
    assert!(
        replay
            .stdout
            .contains("dead letter kept (one letter per message)"),
        "{replay:#?}"
    );
    let inspect = f
        .run(&[
            "inspect",
            "--consumer",
            "payments",
            "--key",
            "p-0",
            "--json",
        ])
        .expect_code(0)
        .json();
    assert!(inspect["inbox"].is_object());
    assert_eq!(inspect["dead_letters"], serde_json::json!([]));

    // Still keyless: dead-lettered again, and the queue does not grow.
    let again = f
        .run(&[
            "dlq",
            "replay",
            "--consumer",
            "payments",
            "--all",
            "--print",
        ])
        .expect_code(0);
    assert!(again.stdout.contains("dead-lettered again"), "{again:#?}");
    let last = f
        .run(&["dlq", "list", "--consumer", "payments", "--json"])
        .expect_code(0)
        .json();
    assert_eq!(last.as_array().map(Vec::len), Some(1));
}

#[cfg(feature = "sqlite")]
#[test]
fn configuration_errors_exit_with_2() {
    let f = Fixture::new();
    let cases: Vec<Vec<&str>> = vec![
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--key",
            "bogus",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--fingerprint",
            "nope",
        ],
        vec!["consume", f.input(), "--consumer", "c"], // no sink
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--apply-sql",
            "SELECT 1",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--apply-sql",
            "SELECT 'x",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--apply-sql",
            "SELECT :a",
            "--param",
            "b=key",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--param",
            "a=key",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--apply-sql",
            "INSERT INTO missing_table VALUES (:a)",
        ],
        vec!["consume", f.input(), "--consumer", "", "--print"],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--concurrency",
            "0",
        ],
        // Offset-watermark mode needs a partitioned log read in offset order.
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--watermark",
        ],
        vec![
            "consume",
            f.input(),
            "--consumer",
            "c",
            "--print",
            "--dedup-keys",
        ],
        vec!["--table-prefix", "9bad", "stats"],
        vec!["prune", "--older-than", "soon"],
    ];
    for args in cases {
        let run = f.run(&args);
        assert_eq!(run.code, 2, "{args:?}: {run:#?}");
        assert!(!run.stderr.is_empty(), "{args:?}");
    }
    let scheme = idemq("ftp://example.org/x", &["stats"]).expect_code(2);
    assert!(
        scheme.stderr.contains("unknown store scheme"),
        "{scheme:#?}"
    );
}

#[cfg(feature = "sqlite")]
#[test]
fn runtime_errors_exit_with_1() {
    let f = Fixture::new();
    let missing = f.dir.path().join("absent.jsonl");
    let run = f
        .run(&[
            "consume",
            missing.to_str().expect("utf-8"),
            "--consumer",
            "c",
            "--print",
        ])
        .expect_code(1);
    assert!(run.stderr.contains("absent.jsonl"), "{run:#?}");
}

#[test]
fn every_command_has_help() {
    for args in [
        vec!["--help"],
        vec!["consume", "--help"],
        vec!["migrate", "--help"],
        vec!["prune", "--help"],
        vec!["stats", "--help"],
        vec!["inspect", "--help"],
        vec!["dlq", "--help"],
        vec!["dlq", "list", "--help"],
        vec!["dlq", "replay", "--help"],
    ] {
        let out = Command::new(BIN).args(&args).output().expect("run idemq");
        let run = Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
        .expect_code(0);
        assert!(run.stdout.contains("Usage:"), "{args:?}");
        if args != ["dlq", "--help"] {
            assert!(run.stdout.contains("EXIT CODES"), "{args:?}");
        }
    }
}

/// `idemq completions bash|zsh|fish|elvish|powershell` and `idemq man`
/// generate from the argument definitions: every subcommand and a recent
/// flag are in them, and the bash script parses.
#[test]
fn completions_and_the_man_page_generate() {
    let generate = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().expect("run idemq");
        assert!(out.status.success(), "{args:?}: {out:#?}");
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let bash = generate(&["completions", "bash"]);
    for word in [
        "consume",
        "relay",
        "dlq",
        "--http-addr",
        "--shutdown-timeout",
    ] {
        assert!(bash.contains(word), "bash completion lacks {word}");
    }
    let checked = Command::new("bash")
        .args(["-n", "-c", &bash])
        .status()
        .expect("run bash -n");
    assert!(checked.success(), "the bash completion does not parse");
    assert!(generate(&["completions", "zsh"]).starts_with("#compdef idemq"));
    assert!(generate(&["completions", "fish"]).contains("complete -c idemq"));
    let man = generate(&["man"]);
    assert!(man.contains(".TH idemq 1"), "{man}");
    assert!(man.contains("consume"), "{man}");
    let bad = Command::new(BIN)
        .args(["completions", "tcsh"])
        .output()
        .expect("run idemq");
    assert_eq!(
        bad.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

/// A suffix unique to this test run, for table names in shared databases.
fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}_{}", std::process::id(), nanos % 1_000_000_000)
}

/// Consumes the payments file into `store` with per-run table names; returns
/// the ledger table name and the table prefix.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn consume_into(store: &str, ledger_type: &str, input: &Path) -> (String, String) {
    consume_into_prefix(store, ledger_type, input, &format!("t{}_", unique_suffix()))
}

/// [`consume_into`] with the idemq tables of `prefix` (migrated already or not).
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn consume_into_prefix(
    store: &str,
    ledger_type: &str,
    input: &Path,
    prefix: &str,
) -> (String, String) {
    let ledger = format!("ledger_{}", unique_suffix());
    let prefix = prefix.to_owned();
    let create = format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (payment_id {ledger_type} PRIMARY KEY, account TEXT NOT NULL, amount INTEGER NOT NULL)"
    );
    let insert = format!(
        "INSERT INTO {ledger} (payment_id, account, amount) VALUES (:idemq_key, :account, :amount)"
    );
    let input = input.to_str().expect("utf-8 path");
    let args = |extra: &'static str| {
        let mut a = vec![
            "--table-prefix",
            prefix.as_str(),
            "consume",
            input,
            "--consumer",
            "payments",
            "--key",
            "json:/payment_id",
            "--concurrency",
            "1",
            "--init-sql",
            create.as_str(),
            "--apply-sql",
            insert.as_str(),
        ];
        if !extra.is_empty() {
            a.push(extra);
        }
        a
    };
    let first = idemq(store, &args("--no-checkpoint")).expect_code(0);
    assert_eq!(first_line(&first), FIRST_RUN, "{first:#?}");
    let again = idemq(store, &args("--no-checkpoint")).expect_code(0);
    assert_eq!(first_line(&again), FULL_RERUN, "{again:#?}");
    let stats = idemq(store, &["--table-prefix", &prefix, "stats", "--json"])
        .expect_code(0)
        .json();
    assert_eq!(stats[0]["processed"], 4);
    (ledger, prefix)
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn consume_into_postgres() {
    let url = std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let f = Fixture::new();
    let (ledger, prefix) = consume_into(&url, "TEXT", &f.input);
    let pool = sqlx::PgPool::connect(&url).await.expect("connect postgres");
    let rows = sqlx::query_as::<_, (String, String, i32)>(&format!(
        "SELECT payment_id, account, amount FROM {ledger} ORDER BY payment_id"
    ))
    .fetch_all(&pool)
    .await
    .expect("read ledger");
    let rows: Vec<(String, String, i64)> = rows
        .into_iter()
        .map(|(p, a, n)| (p, a, i64::from(n)))
        .collect();
    assert_eq!(rows, expected_ledger());
    drop_tables(&pool, &ledger, &prefix).await;
    pool.close().await;
}

/// `migrate --partitioned-inbox` makes a time-partitioned inbox that
/// `consume` (which migrates again) keeps and dedups through.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn consume_into_a_partitioned_postgres_inbox() {
    let url = std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let f = Fixture::new();
    let prefix = format!("tp{}_", unique_suffix());
    let migrate = [
        "--table-prefix",
        &prefix,
        "migrate",
        "--partitioned-inbox",
        "1h",
    ];
    idemq(&url, &migrate).expect_code(0);
    let (ledger, prefix) = consume_into_prefix(&url, "TEXT", &f.input, &prefix);
    let pool = sqlx::PgPool::connect(&url).await.expect("connect postgres");
    let (kind, partitions): (String, i64) = sqlx::query_as(&format!(
        "SELECT relkind::text, (SELECT COUNT(*) FROM pg_inherits WHERE inhparent = oid) \
         FROM pg_class WHERE oid = '{prefix}inbox'::regclass"
    ))
    .fetch_one(&pool)
    .await
    .expect("the inbox");
    assert_eq!(kind, "p", "a partitioned inbox");
    assert_eq!(partitions, 3, "the current hour and two ahead");
    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {ledger}"))
        .fetch_one(&pool)
        .await
        .expect("read ledger");
    assert_eq!(rows, i64::try_from(expected_ledger().len()).unwrap());
    drop_tables(&pool, &ledger, &prefix).await;
    pool.close().await;
}

/// The same on MariaDB: `migrate --partitioned-inbox` makes the inbox
/// partitioned, with partitions ahead, and `consume` dedups through it.
#[cfg(feature = "mysql")]
#[tokio::test]
async fn consume_into_a_partitioned_mariadb_inbox() {
    let url = std::env::var("IDEMQ_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let f = Fixture::new();
    let prefix = format!("tp{}_", unique_suffix());
    let migrate = [
        "--table-prefix",
        &prefix,
        "migrate",
        "--partitioned-inbox",
        "1h",
    ];
    idemq(&url, &migrate).expect_code(0);
    let (ledger, prefix) = consume_into_prefix(&url, "VARCHAR(64)", &f.input, &prefix);
    let pool = sqlx::MySqlPool::connect(&url)
        .await
        .expect("connect mariadb");
    let partitions: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() \
         AND TABLE_NAME = ? AND PARTITION_NAME IS NOT NULL",
    )
    .bind(format!("{prefix}inbox"))
    .fetch_one(&pool)
    .await
    .expect("the inbox's partitions");
    assert_eq!(partitions, 3, "the current hour and two ahead");
    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {ledger}"))
        .fetch_one(&pool)
        .await
        .expect("read ledger");
    assert_eq!(rows, i64::try_from(expected_ledger().len()).unwrap());
    drop_tables(&pool, &ledger, &prefix).await;
    pool.close().await;
}

#[cfg(feature = "sqlite")]
#[test]
fn a_partitioned_inbox_needs_postgres_or_mariadb() {
    let f = Fixture::new();
    let run = f
        .run(&["migrate", "--partitioned-inbox", "1d"])
        .expect_code(2);
    assert!(run.stderr.contains("postgres:// or mariadb://"), "{run:#?}");
}

#[cfg(feature = "mysql")]
#[tokio::test]
async fn consume_into_mariadb() {
    let url = std::env::var("IDEMQ_TEST_MYSQL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let f = Fixture::new();
    // The mariadb:// spelling is rewritten for the driver.
    let store = url.replacen("mysql://", "mariadb://", 1);
    let (ledger, prefix) = consume_into(&store, "VARCHAR(64)", &f.input);
    let pool = sqlx::MySqlPool::connect(&url)
        .await
        .expect("connect mariadb");
    let rows = sqlx::query_as::<_, (String, String, i32)>(&format!(
        "SELECT payment_id, account, amount FROM {ledger} ORDER BY payment_id"
    ))
    .fetch_all(&pool)
    .await
    .expect("read ledger");
    let rows: Vec<(String, String, i64)> = rows
        .into_iter()
        .map(|(p, a, n)| (p, a, i64::from(n)))
        .collect();
    assert_eq!(rows, expected_ledger());
    drop_tables(&pool, &ledger, &prefix).await;
    pool.close().await;
}

/// Values of different JSON types for one parameter (integer, float, null)
/// in consecutive messages; returns the table name and prefix.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn consume_mixed_types(store: &str, id_type: &str) -> (String, String) {
    let f = Fixture::new();
    std::fs::write(
        &f.input,
        "{\"id\":\"a\",\"amount\":5,\"note\":\"x\"}\n\
         {\"id\":\"b\",\"amount\":2.5,\"note\":null}\n\
         {\"id\":\"c\",\"amount\":null,\"note\":\"z\"}\n",
    )
    .expect("write input");
    let suffix = unique_suffix();
    let table = format!("mixed_{suffix}");
    let prefix = format!("m{suffix}_");
    let create = format!(
        "CREATE TABLE {table} (id {id_type} PRIMARY KEY, amount NUMERIC(10,2) NULL, note TEXT NULL)"
    );
    let insert = format!("INSERT INTO {table} (id, amount, note) VALUES (:id, :amount, :note)");
    let run = idemq(
        store,
        &[
            "--table-prefix",
            &prefix,
            "consume",
            f.input(),
            "--no-checkpoint",
            "--consumer",
            "mixed",
            "--key",
            "json:/id",
            "--concurrency",
            "1",
            "--init-sql",
            &create,
            "--apply-sql",
            &insert,
        ],
    )
    .expect_code(0);
    assert_eq!(
        first_line(&run),
        "consumer mixed: processed=3 duplicate=0 conflict=0 retry_later=0 dead_lettered=0",
        "{run:#?}"
    );
    (table, prefix)
}

/// One test per database: three messages bind text, a decimal string and
/// NULL to the same parameters; the rows read back as text must match.
macro_rules! mixed_types_test {
    ($name:ident, $feature:literal, $env:literal, $default:literal, $id_type:literal, $pool:ty, $amount:literal) => {
        #[cfg(feature = $feature)]
        #[tokio::test]
        async fn $name() {
            let url = std::env::var($env).unwrap_or_else(|_| $default.to_owned());
            let (table, prefix) = consume_mixed_types(&url, $id_type);
            let pool = <$pool>::connect(&url).await.expect("connect");
            let rows = sqlx::query_as::<_, (String, Option<String>, Option<String>)>(&format!(
                "SELECT id, {}, note FROM {table} ORDER BY id",
                $amount
            ))
            .fetch_all(&pool)
            .await
            .expect("read table");
            assert_eq!(
                rows,
                [
                    ("a".into(), Some("5.00".into()), Some("x".into())),
                    ("b".into(), Some("2.50".into()), None),
                    ("c".into(), None, Some("z".into())),
                ]
            );
            drop_tables(&pool, &table, &prefix).await;
            pool.close().await;
        }
    };
}

mixed_types_test!(
    postgres_binds_differently_typed_values_per_message,
    "postgres",
    "IDEMQ_TEST_POSTGRES",
    "postgres://postgres@127.0.0.1:5432/test",
    "TEXT",
    sqlx::PgPool,
    "amount::text"
);
mixed_types_test!(
    mariadb_binds_differently_typed_values_per_message,
    "mysql",
    "IDEMQ_TEST_MYSQL",
    "mysql://root@127.0.0.1:3306/test",
    "VARCHAR(64)",
    sqlx::MySqlPool,
    "CAST(amount AS CHAR)"
);

/// Drops a test's tables (best effort).
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn drop_tables<DB>(pool: &sqlx::Pool<DB>, table: &str, prefix: &str)
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let tables = idemq::store::sql::Tables::new(prefix).expect("a valid prefix");
    let idemq_tables = [
        &tables.inbox,
        &tables.attempts,
        &tables.dead_letters,
        &tables.migrations,
        &tables.offsets,
        &tables.effects,
    ]
    .map(String::to_owned);
    // A partitioned layout's tables too.
    for name in std::iter::once(table.to_owned())
        .chain(idemq_tables)
        .chain(tables.partition_tables())
    {
        let _ = sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {name}"))
            .execute(pool)
            .await;
    }
    for function in tables.partition_functions() {
        let _ = sqlx::raw_sql(&format!("DROP FUNCTION IF EXISTS {function}"))
            .execute(pool)
            .await;
    }
}

/// The Redis lease store from the CLI: the print sink applies each payment
/// once, a rerun answers duplicates, dead letters and inspect work, SQL-only
/// flags are usage errors, and `release` finds no lease on a completed key.
#[cfg(feature = "redis")]
#[test]
fn redis_store_consumes_once_and_reports() {
    lease_store_round_trip("redis://127.0.0.1:6379");
}

/// The same on the MongoDB-wire server of `scripts/ferretdb.sh`.
#[cfg(feature = "mongodb")]
#[test]
fn mongodb_store_consumes_once_and_reports() {
    lease_store_round_trip("mongodb://127.0.0.1:27017/idemq_cli");
}

/// The same on the Redis Cluster of `scripts/redis-cluster.sh`, named by two
/// of its nodes, each write acknowledged by its master's replica
/// (`wait_replicas=1`: `WAIT` after every claim and completion).
#[cfg(feature = "redis")]
#[test]
fn a_redis_cluster_store_consumes_once_and_reports() {
    lease_store_round_trip(
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001?wait_replicas=1&wait_timeout_ms=2000",
    );
}

/// A lease store (`redis://`, `mongodb://`) through the CLI: the fixture's
/// payments consumed with `--print` (eight in flight), a rerun, inspect,
/// release, and the SQL-only flags refused.
#[cfg(any(feature = "redis", feature = "mongodb"))]
fn lease_store_round_trip(store: &str) {
    let fx = Fixture::new();
    let prefix = format!("cli{}_", unique_suffix());
    let consume = |extra: &[&str]| {
        let mut args = vec![
            "--table-prefix",
            prefix.as_str(),
            "consume",
            fx.input(),
            "--consumer",
            "payments",
            "--key",
            "json:/payment_id",
            "--no-checkpoint",
            "--print",
        ];
        args.extend_from_slice(extra);
        idemq(store, &args)
    };
    // Eight in flight: duplicates of a key in flight wait for its result.
    let first = consume(&["--concurrency", "8", "--in-flight", "wait"]).expect_code(0);
    let printed: Vec<Value> = first
        .stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut keys: Vec<&str> = printed.iter().filter_map(|p| p["key"].as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["p-1", "p-2", "p-3", "p-4"], "{first:#?}");
    assert!(
        first.stdout.contains(
            "consumer payments: processed=4 duplicate=3 conflict=1 retry_later=0 dead_lettered=2"
        ),
        "{first:#?}"
    );
    let again = consume(&[]).expect_code(0);
    assert!(
        again
            .stdout
            .contains("consumer payments: processed=0 duplicate=7 conflict=1"),
        "{again:#?}"
    );

    let inspect = idemq(
        store,
        &[
            "--table-prefix",
            &prefix,
            "inspect",
            "--consumer",
            "payments",
            "--key",
            "p-1",
            "--json",
        ],
    )
    .expect_code(0)
    .json();
    assert_eq!(inspect["key"], "p-1", "{inspect}");
    assert_eq!(inspect["in_flight"], false, "{inspect}");
    assert!(inspect["inbox"]["fingerprint"].is_string(), "{inspect}");
    let release = idemq(
        store,
        &[
            "--table-prefix",
            &prefix,
            "release",
            "--consumer",
            "payments",
            "--key",
            "p-1",
            "--yes",
        ],
    );
    assert_eq!(release.code, 3, "{release:#?}");
    assert!(
        release.stdout.contains("no in-flight lease"),
        "{release:#?}"
    );

    let sql = idemq(
        store,
        &[
            "--table-prefix",
            &prefix,
            "consume",
            fx.input(),
            "--consumer",
            "payments",
            "--apply-sql",
            INSERT_LEDGER,
        ],
    );
    assert_eq!(sql.code, 2, "{sql:#?}");
    assert!(sql.stderr.contains("needs a SQL store"), "{sql:#?}");

    // A lease store has no SQL side: --init-sql is refused before anything runs.
    let init = idemq(
        store,
        &[
            "--table-prefix",
            &prefix,
            "consume",
            fx.input(),
            "--consumer",
            "payments",
            "--init-sql",
            "SELECT 1",
            "--print",
        ],
    );
    assert_eq!(init.code, 2, "{init:#?}");
    assert!(
        init.stderr.contains("--init-sql needs a SQL store"),
        "{init:#?}"
    );
}

/// The fast path in front of SQLite: with a local cache and the Redis filter,
/// the ledger is exactly the one without them, on the first run and the rerun.
#[cfg(all(feature = "sqlite", feature = "redis"))]
#[tokio::test]
async fn caches_in_front_of_sql_change_no_outcome() {
    let fx = Fixture::new();
    let cache = ["--local-cache", "1000", "--cache", "redis://127.0.0.1:6379"];
    let consumer = format!("payments-{}", unique_suffix());
    let consume = |extra: &[&str]| {
        let mut args = vec![
            "consume",
            fx.input(),
            "--consumer",
            consumer.as_str(),
            "--key",
            "json:/payment_id",
            "--no-checkpoint",
            "--concurrency",
            "1",
            "--init-sql",
            CREATE_LEDGER,
            "--apply-sql",
            INSERT_LEDGER,
        ];
        args.extend_from_slice(extra);
        fx.run(&args)
    };
    let first = consume(&cache).expect_code(0);
    assert!(
        first_line(&first)
            .ends_with("processed=4 duplicate=3 conflict=1 retry_later=0 dead_lettered=2"),
        "{first:#?}"
    );
    let rerun = consume(&cache).expect_code(0);
    assert!(
        first_line(&rerun)
            .ends_with("processed=0 duplicate=7 conflict=1 retry_later=0 dead_lettered=2"),
        "{rerun:#?}"
    );
    assert_eq!(fx.ledger().await, expected_ledger());
}

/// `produce` the payments file to a broker with duplicates of both kinds,
/// then `consume` it into SQLite until the broker is idle: the ledger is
/// exactly the one from the file, and a second consume finds nothing.
#[cfg(all(
    feature = "sqlite",
    any(
        feature = "amqp",
        feature = "kafka",
        feature = "sqs",
        feature = "nats",
        feature = "redis-streams",
        feature = "mqtt",
        feature = "rocketmq"
    )
))]
async fn broker_round_trip(url: &str) {
    broker_round_trip_with(url, true, &[]).await;
}

/// `consume` of the payments published to the broker `url` into the
/// fixture's ledger, until the broker is idle (3 s; 15 s on Kafka and
/// RocketMQ), with `extra` flags.
#[cfg(all(
    feature = "sqlite",
    any(
        feature = "amqp",
        feature = "kafka",
        feature = "sqs",
        feature = "nats",
        feature = "redis-streams",
        feature = "mqtt",
        feature = "rocketmq"
    )
))]
fn consume_broker(fx: &Fixture, url: &str, extra: &[&str]) -> Run {
    /// The idle clock runs from the start, so on Kafka and RocketMQ it must
    /// also cover joining the group and the first rebalance on a loaded
    /// machine (as `scripts/chaos.sh` does).
    fn idle_exit_for(url: &str) -> &'static str {
        if url.starts_with("kafka://") || url.starts_with("rocketmq://") {
            "15s"
        } else {
            "3s"
        }
    }
    let mut args = vec![
        "consume",
        url,
        "--consumer",
        "payments",
        "--key",
        "json:/payment_id",
        "--idle-exit",
        idle_exit_for(url),
        "--init-sql",
        CREATE_LEDGER,
        "--apply-sql",
        INSERT_LEDGER,
    ];
    args.extend_from_slice(extra);
    fx.run(&args)
}

/// [`broker_round_trip`] for a broker that keeps the order of one key's
/// messages (`ordered`) or not (SQS standard queues, RocketMQ's concurrent
/// consumers over several queues), with `extra` consume flags; returns the
/// fixture (its store holds the ledger).
#[cfg(all(
    feature = "sqlite",
    any(
        feature = "amqp",
        feature = "kafka",
        feature = "sqs",
        feature = "nats",
        feature = "redis-streams",
        feature = "mqtt",
        feature = "rocketmq"
    )
))]
async fn broker_round_trip_with(url: &str, ordered: bool, extra: &[&str]) -> Fixture {
    let fx = Fixture::new();
    let produced = fx
        .run(&[
            "produce",
            fx.input(),
            "--to",
            url,
            "--key",
            "json:/payment_id",
            "--duplicates",
            "0.5",
            "--producer-retries",
            "0.5",
            "--seed",
            "11",
        ])
        .expect_code(0);
    assert!(
        first_line(&produced).starts_with("published=10 "),
        "{produced:#?}"
    );
    let consume = || consume_broker(&fx, url, extra);
    let first = consume().expect_code(0);
    assert!(
        first_line(&first).starts_with("consumer payments: processed=4 "),
        "{first:#?}"
    );
    let ledger = fx.ledger().await;
    if ordered {
        assert_eq!(ledger, expected_ledger());
    } else {
        // Without per-key order, the conflicting reuse of p-2 (amount 999)
        // may arrive first and win; every key is still applied once.
        let mut expected = expected_ledger();
        let p2 = ledger
            .iter()
            .find(|(k, _, _)| k == "p-2")
            .map(|(_, _, a)| *a);
        assert!(matches!(p2, Some(250 | 999)), "{ledger:?}");
        expected[1].2 = p2.unwrap_or(250);
        assert_eq!(ledger, expected);
    }
    let second = consume().expect_code(0);
    assert!(
        first_line(&second).starts_with("consumer payments: processed=0 duplicate=0 "),
        "{second:#?}"
    );
    fx
}

#[cfg(all(feature = "sqlite", feature = "amqp"))]
#[tokio::test]
async fn rabbitmq_produce_and_consume() {
    let queue = format!("cli_{}", unique_suffix());
    broker_round_trip(&format!(
        "amqp://guest:guest@127.0.0.1:5672/%2f?queue={queue}"
    ))
    .await;
}

#[cfg(all(feature = "sqlite", feature = "kafka"))]
#[tokio::test]
async fn kafka_produce_and_consume() {
    let topic = format!("cli_{}", unique_suffix());
    broker_round_trip(&format!(
        "kafka://127.0.0.1:9092/{topic}?group={topic}&create_partitions=3"
    ))
    .await;
}

/// `--watermark --dedup-keys`: the same outcomes as per-message mode (the
/// key claim catches the producer retries, new records with an old key);
/// and a new consumer group, which has no committed offsets and would read
/// the topic from its start, resumes every partition at the stored
/// watermark and applies nothing again.
#[cfg(all(feature = "sqlite", feature = "kafka"))]
#[tokio::test]
async fn kafka_watermark_mode_resumes_a_new_group_at_the_watermark() {
    let topic = format!("cli_wm_{}", unique_suffix());
    let url =
        |group: &str| format!("kafka://127.0.0.1:9092/{topic}?group={group}&create_partitions=3");
    let fx = broker_round_trip_with(&url("wm1"), true, &["--watermark", "--dedup-keys"]).await;
    let fresh_group =
        consume_broker(&fx, &url("wm2"), &["--watermark", "--dedup-keys"]).expect_code(0);
    assert!(
        first_line(&fresh_group).starts_with("consumer payments: processed=0 duplicate=0 "),
        "{fresh_group:#?}"
    );
    assert_eq!(fx.ledger().await, expected_ledger());
}

#[cfg(all(feature = "sqlite", feature = "sqs"))]
#[tokio::test]
async fn sqs_produce_and_consume() {
    let queue = format!("cli_{}", unique_suffix());
    broker_round_trip_with(
        &format!(
            "sqs://{queue}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1"
        ),
        false,
        &[],
    )
    .await;
}

/// `--batch`: the same outcomes and ledger as per-message mode, batch by
/// batch; with a lease store it is a usage error.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn batch_mode_gives_the_same_outcomes() {
    let fx = Fixture::new();
    let run = fx
        .consume(&["--batch", "4", "--no-checkpoint"])
        .expect_code(0);
    assert_eq!(first_line(&run), FIRST_RUN, "{run:#?}");
    assert_eq!(fx.ledger().await, expected_ledger());
    let rerun = fx
        .consume(&["--batch", "100", "--no-checkpoint"])
        .expect_code(0);
    assert_eq!(first_line(&rerun), FULL_RERUN, "{rerun:#?}");
    assert_eq!(fx.ledger().await, expected_ledger());
    let cached = fx.consume(&["--batch", "4", "--local-cache", "10"]);
    assert_eq!(cached.code, 2, "{cached:#?}");
}

#[cfg(all(feature = "sqlite", feature = "nats"))]
#[tokio::test]
async fn nats_produce_and_consume() {
    let name = format!("cli_{}", unique_suffix());
    broker_round_trip(&format!(
        "nats://127.0.0.1:4222/{name}/{name}_c?subject={name}.payments&create=true&ack_wait=5s&wait=1s"
    ))
    .await;
}

#[cfg(all(feature = "sqlite", feature = "redis-streams"))]
#[tokio::test]
async fn redis_stream_produce_and_consume() {
    let stream = format!("cli_{}", unique_suffix());
    broker_round_trip(&format!(
        "redis-stream://127.0.0.1:6379/{stream}?group=cli&consumer=cli-1"
    ))
    .await;
}

/// MQTT keeps messages only for sessions that exist: the consumer's
/// persistent session is created first (a consume that ends when idle),
/// then the file is published, then consumed.
#[cfg(all(feature = "sqlite", feature = "mqtt"))]
#[tokio::test]
async fn mqtt_produce_and_consume() {
    let name = format!("cli_{}", unique_suffix());
    let url = format!("mqtt://127.0.0.1:1883/{name}/payments?client_id={name}");
    let fx = Fixture::new();
    let session = fx
        .run(&[
            "consume",
            &url,
            "--consumer",
            "payments",
            "--idle-exit",
            "1s",
            "--print",
        ])
        .expect_code(0);
    assert!(first_line(&session).contains("processed=0"), "{session:#?}");
    broker_round_trip(&url).await;
}

#[cfg(all(feature = "sqlite", feature = "rocketmq"))]
#[tokio::test]
async fn rocketmq_produce_and_consume() {
    let name = format!("cli_{}", unique_suffix());
    broker_round_trip_with(
        &format!("rocketmq://127.0.0.1:9876/{name}?group={name}_g"),
        false,
        &[],
    )
    .await;
}

/// SIGTERM to a consumer of broker `url` in the middle of a stream: 600
/// payments (with duplicates) published by `idemq produce`, the consumer
/// stopped once 50 are in the ledger. It exits 0 with its summary within
/// the shutdown timeout; a second consumer takes the rest, and every
/// payment is in the ledger exactly once, none dead-lettered. What the
/// first consumer had fetched ahead but not handed over comes back after
/// the broker's own timeout (NATS `ack_wait` 5 s, SQS visibility 5 s), and
/// a Kafka group takes seconds to assign its partitions again: the second
/// consumer stops after 12 idle seconds, which outlasts both. For MQTT the
/// consumer's session is made first (`mqtt_session`), as MQTT keeps only
/// what arrives for a session.
#[cfg(all(
    feature = "sqlite",
    unix,
    any(
        feature = "amqp",
        feature = "kafka",
        feature = "sqs",
        feature = "nats",
        feature = "redis-streams",
        feature = "mqtt",
        feature = "rocketmq"
    )
))]
async fn sigterm_mid_stream(url: &str, mqtt_session: bool) {
    const N: usize = 600;
    let fx = Fixture::new();
    let input = fx.dir.path().join("many.jsonl");
    let lines: String = (0..N)
        .map(|i| format!("{{\"payment_id\":\"p-{i}\",\"account\":\"acc\",\"amount\":{i}}}\n"))
        .collect();
    std::fs::write(&input, lines).expect("write the payments");
    let input = input.to_str().expect("utf-8 path");
    let consume_args = [
        "consume",
        url,
        "--consumer",
        "payments",
        "--key",
        "json:/payment_id",
        "--init-sql",
        CREATE_LEDGER,
        "--apply-sql",
        INSERT_LEDGER,
        "--concurrency",
        "4",
    ];
    if mqtt_session {
        fx.run(&[&consume_args[..], &["--idle-exit", "1s"]].concat())
            .expect_code(0);
    }
    let produced = fx
        .run(&[
            "produce",
            input,
            "--to",
            url,
            "--key",
            "json:/payment_id",
            "--duplicates",
            "0.3",
            "--seed",
            "5",
        ])
        .expect_code(0);
    assert!(
        first_line(&produced).starts_with(&format!("published={N} ")),
        "{produced:#?}"
    );
    let mut child = Command::new(BIN)
        .arg("--store")
        .arg(&fx.store)
        .args(consume_args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemq");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    loop {
        let applied = match sqlx::SqlitePool::connect(&fx.store).await {
            Ok(pool) => {
                let n: Result<i64, _> = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
                    .fetch_one(&pool)
                    .await;
                pool.close().await;
                n.unwrap_or(0)
            }
            Err(_) => 0,
        };
        if applied >= 50 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the consumer applied {applied} payments in 90 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let stopped = std::time::Instant::now();
    while child.try_wait().expect("wait for idemq").is_none() {
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(25),
            "idemq did not exit within its shutdown timeout after SIGTERM"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let first = child.wait_with_output().expect("idemq output");
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert_eq!(first.status.code(), Some(0), "{stdout}");
    let summary = stdout.lines().next().unwrap_or_default().to_owned();
    assert!(
        summary.starts_with("consumer payments: processed="),
        "{stdout}"
    );
    assert!(summary.contains(" dead_lettered=0"), "{stdout}");

    let rest = fx
        .run(&[&consume_args[..], &["--idle-exit", "12s"]].concat())
        .expect_code(0);
    assert!(first_line(&rest).contains(" dead_lettered=0"), "{rest:#?}");
    let ledger = fx.ledger().await;
    assert_eq!(ledger.len(), N, "first run: {summary}; then: {rest:#?}");
    for (payment, _, amount) in &ledger {
        assert_eq!(payment, &format!("p-{amount}"));
    }
}

#[cfg(all(feature = "sqlite", feature = "kafka", unix))]
#[tokio::test]
async fn kafka_sigterm_mid_stream_loses_and_doubles_nothing() {
    let topic = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!("kafka://127.0.0.1:9092/{topic}?group={topic}&create_partitions=3"),
        false,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "amqp", unix))]
#[tokio::test]
async fn rabbitmq_sigterm_mid_stream_loses_and_doubles_nothing() {
    let queue = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!("amqp://guest:guest@127.0.0.1:5672/%2f?queue={queue}"),
        false,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "nats", unix))]
#[tokio::test]
async fn nats_sigterm_mid_stream_loses_and_doubles_nothing() {
    let name = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!(
            "nats://127.0.0.1:4222/{name}/{name}_c?subject={name}.payments&create=true&ack_wait=5s&wait=1s"
        ),
        false,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "redis-streams", unix))]
#[tokio::test]
async fn redis_stream_sigterm_mid_stream_loses_and_doubles_nothing() {
    let stream = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!("redis-stream://127.0.0.1:6379/{stream}?group=cli&consumer=cli-1"),
        false,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "sqs", unix))]
#[tokio::test]
async fn sqs_sigterm_mid_stream_loses_and_doubles_nothing() {
    let queue = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!(
            "sqs://{queue}?endpoint=http://127.0.0.1:5000&region=us-east-1&create=true&wait=1&visibility=5"
        ),
        false,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "mqtt", unix))]
#[tokio::test]
async fn mqtt_sigterm_mid_stream_loses_and_doubles_nothing() {
    let name = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!("mqtt://127.0.0.1:1883/{name}/payments?client_id={name}"),
        true,
    )
    .await;
}

#[cfg(all(feature = "sqlite", feature = "rocketmq", unix))]
#[tokio::test]
async fn rocketmq_sigterm_mid_stream_loses_and_doubles_nothing() {
    let name = format!("cli_{}", unique_suffix());
    sigterm_mid_stream(
        &format!("rocketmq://127.0.0.1:9876/{name}?group={name}_g"),
        false,
    )
    .await;
}

/// SIGTERM (what `docker stop`, systemd and Kubernetes send) drains: the
/// process stops taking messages, settles what it took, prints its summary
/// and exits 0 — also while its stdin is still open.
#[cfg(all(feature = "sqlite", unix))]
#[test]
fn sigterm_drains_and_exits_with_the_summary() {
    let f = Fixture::new();
    let mut child = Command::new(BIN)
        .arg("--store")
        .arg(&f.store)
        .args(["consume", "--consumer", "term", "--print", "-"])
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemq");
    // Two messages, and stdin stays open: the run would go on forever.
    let mut stdin = child.stdin.take().expect("stdin pipe");
    stdin
        .write_all(b"{\"id\":\"a\",\"payload\":1}\n{\"id\":\"b\",\"payload\":2}\n")
        .expect("write stdin");
    stdin.flush().expect("flush stdin");
    let mut stdout = std::io::BufReader::new(child.stdout.take().expect("stdout pipe"));
    let mut printed = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stdout, &mut line).expect("a printed message");
        printed.push(line);
    }
    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for idemq") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "idemq did not exit after SIGTERM (printed {printed:?})"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    drop(stdin);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).expect("read stdout");
    assert_eq!(status.code(), Some(0), "stdout: {printed:?} {rest}");
    assert!(
        rest.contains(
            "consumer term: processed=2 duplicate=0 conflict=0 retry_later=0 dead_lettered=0"
        ),
        "the summary after SIGTERM: {rest:?}"
    );
}

/// SIGTERM with a message whose effect outlasts `--shutdown-timeout`: the
/// process exits within the timeout (not after the effect), exit 0, with
/// the message counted as abandoned; the next run applies it, once.
#[cfg(all(feature = "sqlite", feature = "exec", unix))]
#[test]
fn sigterm_abandons_what_outlasts_the_shutdown_timeout() {
    let f = Fixture::new();
    let input = f.dir.path().join("slow.jsonl");
    std::fs::write(&input, "{\"id\":\"a\",\"payload\":{\"n\":1}}\n").unwrap();
    let marks = f.dir.path().join("marks");
    let consume = |effect: &str| {
        let mut command = Command::new(BIN);
        command
            .arg("--store")
            .arg(&f.store)
            .args([
                "consume",
                "--consumer",
                "slow",
                "--shutdown-timeout",
                "300ms",
            ])
            .arg("--apply-exec")
            .arg(effect)
            .arg(&input)
            .env_remove("IDEMQ_STORE")
            .env_remove("IDEMQ_TABLE_PREFIX")
            .env_remove("IDEMQ_CONSUMER")
            .env_remove("IDEMQ_LOG")
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };
    let started_mark = f.dir.path().join("started");
    let mut child = consume(&format!(
        "touch {}; sleep 30; echo $IDEMQ_KEY >> {}",
        started_mark.display(),
        marks.display()
    ))
    .spawn()
    .expect("spawn idemq");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !started_mark.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the effect never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(killed.success());
    let stopped = std::time::Instant::now();
    let output = loop {
        if child.try_wait().expect("wait for idemq").is_some() {
            break child.wait_with_output().expect("idemq output");
        }
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(10),
            "idemq did not exit within its shutdown timeout"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("processed=0"), "{stdout}");
    assert!(stdout.contains("abandoned=1"), "{stdout}");
    assert!(!marks.exists(), "the abandoned effect ran to its end");

    // The next run applies it, once.
    let output = consume(&format!("echo $IDEMQ_KEY >> {}", marks.display()))
        .output()
        .expect("run idemq");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("processed=1"), "{stdout}");
    assert_eq!(std::fs::read_to_string(&marks).unwrap().lines().count(), 1);
}

/// No password, token or key given in a URL reaches the output, the errors
/// or the dead-letter table: broker URLs with user info or secret
/// parameters that fail to parse or to connect, a store URL with a
/// password, an HTTP sink URL with an `api_key` whose calls fail.
#[cfg(all(
    feature = "sqlite",
    feature = "postgres",
    feature = "kafka",
    feature = "nats",
    feature = "redis-streams",
    feature = "http"
))]
#[test]
fn no_secret_in_any_output() {
    const SECRET: &str = "hunter2";
    let f = Fixture::new();
    let input = f.dir.path().join("one.jsonl");
    std::fs::write(&input, "{\"id\":\"a\",\"payload\":1}\n").expect("write input");
    let input = input.to_string_lossy().into_owned();
    let runs = [
        idemq(
            &f.store,
            &[
                "consume",
                "--consumer",
                "s1",
                "--print",
                "kafka://127.0.0.1:1/t?group=g&sasl.password=hunter2&bogus=1",
            ],
        ),
        idemq(
            &f.store,
            &[
                "consume",
                "--consumer",
                "s2",
                "--print",
                "nats://u:hunter2@127.0.0.1:1/s/c?token=hunter2",
            ],
        ),
        idemq(
            &f.store,
            &[
                "consume",
                "--consumer",
                "s3",
                "--print",
                "--idle-exit",
                "1s",
                "redis-stream://:hunter2@127.0.0.1:1/s?group=g",
            ],
        ),
        idemq(
            "postgres://u:hunter2@127.0.0.1:1/db",
            &["consume", "--consumer", "s4", "--print", &input],
        ),
        idemq(
            &f.store,
            &[
                "consume",
                "--consumer",
                "s5",
                "--max-attempts",
                "1",
                "--apply-http",
                "https://u:hunter2@127.0.0.1:1/?api_key=hunter2",
                &input,
            ],
        ),
        idemq(&f.store, &["dlq", "list", "--consumer", "s5"]),
    ];
    for run in &runs {
        assert!(
            !run.stdout.contains(SECRET) && !run.stderr.contains(SECRET),
            "a secret in the output: {run:#?}"
        );
    }
    assert!(
        runs[5].stdout.contains("api_key"),
        "the dead letter of the HTTP call is listed: {:#?}",
        runs[5]
    );
}
