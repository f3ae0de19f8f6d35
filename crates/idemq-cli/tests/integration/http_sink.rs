#![cfg(all(feature = "http", feature = "exec", feature = "sqlite"))]
//! The `--apply-http` and `--apply-exec` sinks of the `idemq` binary, over a
//! SQLite store in a temporary directory.
//!
//! `--apply-http` posts to a real HTTP server started by the test, which
//! answers per message with a chosen status (200, 201, 409 then 200, 422,
//! 400, 500 then 200, a timeout then 200); `--apply-exec` runs a shell
//! command that logs each call and exits with each mapped code. Both check
//! the summary line, the dead letters, the stored results, the headers or
//! environment the call got; that running the input again calls only the
//! dead-lettered messages again (they are not in the inbox); and that a
//! redelivery after a crash between the call and the commit (the inbox row
//! removed, the journal row kept) does not call again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};

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
        assert_eq!(self.code, 0, "unexpected exit code: {self:#?}");
        self
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// The summary line of `consume`.
    fn summary(&self) -> &str {
        self.stdout
            .lines()
            .find(|l| l.starts_with("consumer "))
            .unwrap_or_else(|| panic!("no summary: {}\nstderr: {}", self.stdout, self.stderr))
    }
}

/// Runs `idemq --store STORE ARGS…` with a clean environment.
fn idemq(store: &str, args: &[&str]) -> Run {
    let out = Command::new(BIN)
        .arg("--store")
        .arg(store)
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

/// A temporary directory with a SQLite store.
struct Fixture {
    dir: tempfile::TempDir,
    store: String,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
        Self { dir, store }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `lines` to a file `name`; returns its path as text.
    fn input(&self, name: &str, lines: &[&str]) -> String {
        let path = self.path(name);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path.display().to_string()
    }

    fn consume(&self, input: &str, args: &[&str]) -> Run {
        let mut all = vec!["consume", input];
        all.extend_from_slice(args);
        idemq(&self.store, &all).ok()
    }

    /// Dead letters of `consumer` by key: (reason, error).
    fn dead_letters(&self, consumer: &str) -> BTreeMap<String, (String, String)> {
        let run = idemq(
            &self.store,
            &["dlq", "list", "--consumer", consumer, "--json"],
        )
        .ok();
        run.json()
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["key"].as_str().unwrap().to_owned(),
                    (
                        d["reason"].as_str().unwrap().to_owned(),
                        d["error"].as_str().unwrap().to_owned(),
                    ),
                )
            })
            .collect()
    }

    /// The stored result of `key`.
    fn result(&self, consumer: &str, key: &str) -> Value {
        let run = idemq(
            &self.store,
            &["inspect", "--consumer", consumer, "--key", key, "--json"],
        )
        .ok();
        run.json()["inbox"]["result"].clone()
    }

    /// Deletes the inbox row of `key` and nothing else: the state a crash
    /// between the journal write and the inbox commit leaves.
    fn forget_commit(&self, consumer: &str, key: &str) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let pool = sqlx::SqlitePool::connect(&self.store).await.unwrap();
            let done = sqlx::query("DELETE FROM idemq_inbox WHERE consumer = ? AND msg_key = ?")
                .bind(consumer)
                .bind(key)
                .execute(&pool)
                .await
                .unwrap();
            assert_eq!(done.rows_affected(), 1);
            pool.close().await;
        });
    }
}

fn expected_key(consumer: &str, key: &str, step: &str) -> String {
    idemq::idempotency_key(consumer, key, step).to_string()
}

// ---- --apply-http ----

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Call {
    key: String,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

#[derive(Default)]
struct Server {
    calls: Mutex<Vec<Call>>,
}

impl Server {
    /// Starts the server on its own thread and runtime; returns its address.
    fn start() -> (Arc<Self>, SocketAddr) {
        let server = Arc::new(Self::default());
        let app = Router::new()
            .route("/pay", post(answer))
            .with_state(Arc::clone(&server));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                tx.send(listener.local_addr().unwrap()).unwrap();
                axum::serve(listener, app).await.unwrap();
            });
        });
        (server, rx.recv().unwrap())
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn count(&self, key: &str) -> usize {
        self.calls().iter().filter(|c| c.key == key).count()
    }
}

/// Answers by `X-Idemq-Key`: the n-th call for a key gets the status the
/// test chose for it.
async fn answer(State(server): State<Arc<Server>>, headers: HeaderMap, body: Bytes) -> Response {
    let text = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let key = text("x-idemq-key").unwrap_or_default();
    let n = {
        let mut calls = server.calls.lock().unwrap();
        calls.push(Call {
            key: key.clone(),
            headers: headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.as_str().to_owned(),
                        String::from_utf8_lossy(v.as_bytes()).into_owned(),
                    )
                })
                .collect(),
            body: body.to_vec(),
        });
        calls.iter().filter(|c| c.key == key).count()
    };
    let charged = || (StatusCode::OK, axum::Json(json!({ "charged": key }))).into_response();
    match (key.as_str(), n) {
        ("ok-200", _) => charged(),
        ("ok-201", _) => (StatusCode::CREATED, "created").into_response(),
        ("busy-409", 1) => (
            StatusCode::CONFLICT,
            [("retry-after", "0")],
            "still processing",
        )
            .into_response(),
        ("reused-422", _) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "key reused with another payload",
        )
            .into_response(),
        ("bad-400", _) => (StatusCode::BAD_REQUEST, "amount must be positive").into_response(),
        ("flaky-500", 1) => (StatusCode::INTERNAL_SERVER_ERROR, "database down").into_response(),
        ("slow", 1) => {
            tokio::time::sleep(Duration::from_secs(3)).await;
            charged()
        }
        ("raw-1", _) => (StatusCode::OK, "got it").into_response(),
        ("busy-409" | "flaky-500" | "slow", _) => charged(),
        _ => (StatusCode::NOT_FOUND, "unknown").into_response(),
    }
}

const HTTP_LINES: [&str; 9] = [
    r#"{"payment_id":"ok-200","amount":1}"#,
    r#"{"id":"env-201","payload":{"payment_id":"ok-201","amount":2}}"#,
    r#"{"payment_id":"busy-409","amount":3}"#,
    r#"{"payment_id":"reused-422","amount":4}"#,
    r#"{"payment_id":"bad-400","amount":-5}"#,
    r#"{"payment_id":"flaky-500","amount":6}"#,
    r#"{"payment_id":"slow","amount":7}"#,
    r#"{"id":"env-raw","key":"raw-1","payload":"raw text"}"#,
    r#"{"payment_id":"ok-200","amount":1}"#,
];

#[test]
fn apply_http_maps_each_status_class_and_never_calls_twice() {
    let (server, addr) = Server::start();
    let fx = Fixture::new();
    let url = format!("http://{addr}/pay");
    let input = fx.input("payments.jsonl", &HTTP_LINES);
    let args = [
        "--consumer",
        "web",
        "--key",
        "key|json:/payment_id",
        "--apply-http",
        &url,
        "--http-timeout",
        "1s",
        "--http-header",
        "Authorization: Bearer t0ken",
        "--max-attempts",
        "3",
        "--backoff",
        "50ms",
        // (The JSON-lines checkpoint is not under test here.)
        "--no-checkpoint",
    ];
    let run = fx.consume(&input, &args);
    assert_eq!(
        run.summary(),
        "consumer web: processed=6 duplicate=1 conflict=1 retry_later=3 dead_lettered=1",
        "{run:#?}"
    );
    let calls: BTreeMap<&str, usize> = [
        ("ok-200", 1),
        ("ok-201", 1),
        ("busy-409", 2),
        ("reused-422", 1),
        ("bad-400", 1),
        ("flaky-500", 2),
        ("slow", 2),
        ("raw-1", 1),
    ]
    .into();
    for (key, n) in &calls {
        assert_eq!(server.count(key), *n, "calls for {key}");
    }
    assert_eq!(server.calls().len(), 11);

    // What each request carried.
    for call in server.calls() {
        let h = &call.headers;
        assert_eq!(
            h["idempotency-key"],
            format!("\"{}\"", expected_key("web", &call.key, "http")),
            "{call:?}"
        );
        assert_eq!(h["x-idemq-consumer"], "web");
        assert_eq!(h["authorization"], "Bearer t0ken");
        let json = call.key != "raw-1";
        assert_eq!(
            h["content-type"],
            if json {
                "application/json"
            } else {
                "application/octet-stream"
            },
            "{call:?}"
        );
        if json {
            let payload: Value = serde_json::from_slice(&call.body).unwrap();
            assert_eq!(payload["payment_id"], call.key.as_str());
        } else {
            assert_eq!(call.body, b"raw text");
        }
        let id = h.get("x-idemq-message-id").map(String::as_str);
        let want = match call.key.as_str() {
            "ok-201" => Some("env-201"),
            "raw-1" => Some("env-raw"),
            _ => None,
        };
        assert_eq!(id, want, "{call:?}");
    }

    // The dead letters: 422 as a conflict, 400 with its status and body.
    let dead = fx.dead_letters("web");
    assert_eq!(dead.len(), 2, "{dead:?}");
    let (reason, error) = &dead["reused-422"];
    assert_eq!(reason, "conflict");
    assert!(error.contains("HTTP 422"), "{error}");
    assert!(error.contains("key reused with another payload"), "{error}");
    let (reason, error) = &dead["bad-400"];
    assert_eq!(reason, "permanent_failure");
    assert!(error.contains("HTTP 400"), "{error}");
    assert!(error.contains("amount must be positive"), "{error}");

    // The stored results: status and body.
    assert_eq!(
        fx.result("web", "ok-200"),
        json!({ "status": 200, "body": { "charged": "ok-200" } })
    );
    assert_eq!(
        fx.result("web", "ok-201"),
        json!({ "status": 201, "body": "created" })
    );
    assert_eq!(
        fx.result("web", "slow"),
        json!({ "status": 200, "body": { "charged": "slow" } })
    );
    // `inspect` shows the effect journal's entries of a key.
    let journaled = |key: &str| {
        idemq(
            &fx.store,
            &["inspect", "--consumer", "web", "--key", key, "--json"],
        )
        .ok()
        .json()["effects"]
            .clone()
    };
    assert_eq!(
        journaled("ok-200"),
        json!([{ "step": "http", "result": { "status": 200, "body": { "charged": "ok-200" } } }])
    );
    assert_eq!(journaled("bad-400"), json!([]));

    // The same file again: everything settled is a duplicate and is not
    // called; only the two dead letters (not in the inbox) are tried again.
    let run = fx.consume(&input, &args);
    assert_eq!(
        run.summary(),
        "consumer web: processed=0 duplicate=7 conflict=1 retry_later=0 dead_lettered=1"
    );
    assert_eq!(server.calls().len(), 13);
    for (key, n) in &calls {
        let again = usize::from(key.ends_with("422") || key.ends_with("400"));
        assert_eq!(server.count(key), n + again, "calls for {key}");
    }

    // A crash after the call was journaled and before the commit: the
    // redelivery is processed from the journal, without calling.
    fx.forget_commit("web", "ok-201");
    let text = idemq(
        &fx.store,
        &["inspect", "--consumer", "web", "--key", "ok-201"],
    )
    .ok();
    assert!(
        text.stdout.contains("processed     no")
            && text.stdout.contains("effects       1 journaled"),
        "{text:?}"
    );
    let one = fx.input("one.jsonl", &[HTTP_LINES[1]]);
    let run = fx.consume(&one, &args);
    assert_eq!(
        run.summary(),
        "consumer web: processed=1 duplicate=0 conflict=0 retry_later=0 dead_lettered=0"
    );
    assert_eq!(server.count("ok-201"), 1, "the journal answered");
    assert_eq!(
        fx.result("web", "ok-201"),
        json!({ "status": 201, "body": "created" })
    );
}

#[test]
fn apply_http_flags_are_checked() {
    let fx = Fixture::new();
    let input = fx.input("p.jsonl", &[HTTP_LINES[0]]);
    let base = ["consume", &input, "--consumer", "c"];
    for extra in [
        &["--apply-http", "ftp://example.com/x"][..],
        &[
            "--apply-http",
            "http://127.0.0.1:1/",
            "--http-header",
            "Idempotency-Key: \"x\"",
        ],
        &[
            "--apply-http",
            "http://127.0.0.1:1/",
            "--http-header",
            "no colon",
        ],
        &[
            "--apply-http",
            "http://127.0.0.1:1/",
            "--apply-exec",
            "true",
        ],
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let run = idemq(&fx.store, &args);
        assert_eq!(run.code, 2, "{extra:?}: {run:#?}");
    }
}

// ---- --apply-exec ----

#[test]
fn apply_exec_maps_exit_codes_and_never_runs_twice() {
    let fx = Fixture::new();
    let dir = fx.dir.path().display().to_string();
    let script = format!(
        r#"d='{dir}'
printf '%s %s %s %s %s\n' "$IDEMQ_KEY" "$IDEMQ_IDEMPOTENCY_KEY" "${{IDEMQ_MESSAGE_ID:-none}}" "$IDEMQ_CONSUMER" "$(cat)" >> "$d/calls.log"
case "$IDEMQ_KEY" in
  ok) printf '{{"receipt":"r-%s"}}' "$IDEMQ_KEY" ;;
  text) echo "hello world" ;;
  tempfail) [ -e "$d/tempfail.once" ] || {{ touch "$d/tempfail.once"; exit 75; }} ;;
  conflict) echo "payload differs" >&2; exit 65 ;;
  broken) echo "no such account" >&2; exit 3 ;;
  killed) [ -e "$d/killed.once" ] || {{ touch "$d/killed.once"; kill -9 $$; }} ;;
  slow) [ -e "$d/slow.once" ] || {{ touch "$d/slow.once"; sleep 10; }} ;;
esac"#
    );
    let lines = [
        r#"{"id":"ok","n":1}"#,
        r#"{"id":"text","n":2}"#,
        r#"{"id":"tempfail","n":3}"#,
        r#"{"id":"conflict","n":4}"#,
        r#"{"id":"broken","n":5}"#,
        r#"{"id":"killed","n":6}"#,
        r#"{"id":"slow","n":7}"#,
        r#"{"id":"ok","n":1}"#,
    ];
    let input = fx.input("jobs.jsonl", &lines);
    let args = [
        "--consumer",
        "jobs",
        "--key",
        "json:/id",
        "--apply-exec",
        &script,
        "--exec-timeout",
        "1s",
        "--max-attempts",
        "3",
        "--backoff",
        "50ms",
        "--no-checkpoint",
    ];
    let started = std::time::Instant::now();
    let run = fx.consume(&input, &args);
    assert_eq!(
        run.summary(),
        "consumer jobs: processed=5 duplicate=1 conflict=1 retry_later=3 dead_lettered=1",
        "{run:#?}"
    );
    // The timed-out command's `sleep 10` was killed with its group.
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );

    let log = || std::fs::read_to_string(fx.path("calls.log")).unwrap();
    let count = |key: &str| {
        log()
            .lines()
            .filter(|l| l.split(' ').next() == Some(key))
            .count()
    };
    let want = [
        ("ok", 1),
        ("text", 1),
        ("tempfail", 2),
        ("conflict", 1),
        ("broken", 1),
        ("killed", 2),
        ("slow", 2),
    ];
    for (key, n) in want {
        assert_eq!(count(key), n, "runs of {key}: {}", log());
    }
    // The environment and stdin each run got.
    for line in log().lines() {
        let parts: Vec<&str> = line.splitn(5, ' ').collect();
        let key = parts[0];
        assert_eq!(parts[1], expected_key("jobs", key, "exec"), "{line}");
        assert_eq!(parts[2], "none", "{line}");
        assert_eq!(parts[3], "jobs", "{line}");
        let payload: Value = serde_json::from_str(parts[4]).unwrap();
        assert_eq!(payload["id"], key);
    }

    let dead = fx.dead_letters("jobs");
    assert_eq!(dead.len(), 2, "{dead:?}");
    let (reason, error) = &dead["conflict"];
    assert_eq!(reason, "conflict");
    assert!(error.contains("exited with 65"), "{error}");
    assert!(error.contains("payload differs"), "{error}");
    let (reason, error) = &dead["broken"];
    assert_eq!(reason, "permanent_failure");
    assert!(error.contains("exited with 3: no such account"), "{error}");

    assert_eq!(fx.result("jobs", "ok"), json!({ "receipt": "r-ok" }));
    assert_eq!(fx.result("jobs", "text"), json!("hello world"));
    assert_eq!(fx.result("jobs", "tempfail"), Value::Null);

    // The same file again: duplicates, not run; only the two dead letters
    // are run again.
    let runs = log().lines().count();
    let run = fx.consume(&input, &args);
    assert_eq!(
        run.summary(),
        "consumer jobs: processed=0 duplicate=6 conflict=1 retry_later=0 dead_lettered=1"
    );
    assert_eq!(log().lines().count(), runs + 2);
    assert_eq!((count("conflict"), count("broken"), count("ok")), (2, 2, 1));
    let runs = runs + 2;

    // Journaled, then crashed before the commit: not run again.
    fx.forget_commit("jobs", "ok");
    let one = fx.input("one.jsonl", &[lines[0]]);
    let run = fx.consume(&one, &args);
    assert_eq!(
        run.summary(),
        "consumer jobs: processed=1 duplicate=0 conflict=0 retry_later=0 dead_lettered=0"
    );
    assert_eq!(log().lines().count(), runs);
    assert_eq!(fx.result("jobs", "ok"), json!({ "receipt": "r-ok" }));
}
