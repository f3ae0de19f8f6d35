//! `idemq run --config FILE` and `idemq config check`: two consumers of one
//! file run in one process, each exactly once, with one `--http-addr`
//! endpoint for both; the environment beats the file and a flag beats both;
//! `config check` hides secrets and rejects a bad file with exit 2.
#![cfg(feature = "sqlite")]

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_idemq");

fn idemq() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_TABLE_PREFIX")
        .env_remove("IDEMQ_CONSUMER")
        .env_remove("IDEMQ_CONFIG")
        .env_remove("IDEMQ_LOG")
        .env_remove("RUST_LOG");
    cmd
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn sqlite(dir: &Path, name: &str) -> String {
    format!("sqlite://{}", dir.join(name).display())
}

/// Two files of payments (the second with a duplicate) and a file naming
/// a consumer for each, into one ledger table.
fn setup(dir: &Path) -> std::path::PathBuf {
    std::fs::write(
        dir.join("a.jsonl"),
        "{\"id\":\"a-1\",\"amount\":1}\n{\"id\":\"a-2\",\"amount\":2}\n{\"id\":\"a-3\",\"amount\":3}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("b.jsonl"),
        "{\"id\":\"b-1\",\"amount\":10}\n{\"id\":\"b-1\",\"amount\":10}\n{\"id\":\"b-2\",\"amount\":20}\n",
    )
    .unwrap();
    let config = dir.join("idemq.toml");
    let consumer = |name: &str, file: &str| {
        format!(
            "[[consumer]]\nconsumer = \"{name}\"\nsource = \"{}\"\nkey = \"json:/id\"\n\
             init_sql = \"CREATE TABLE IF NOT EXISTS ledger (id TEXT, amount INTEGER)\"\n\
             apply-sql = \"INSERT INTO ledger VALUES (:idemq_key, :amount)\"\nconcurrency = 2\n",
            dir.join(file).display()
        )
    };
    std::fs::write(
        &config,
        format!(
            "store = \"{}\"\n\n{}\n{}",
            sqlite(dir, "file.db"),
            consumer("billing", "a.jsonl"),
            consumer("audit", "b.jsonl")
        ),
    )
    .unwrap();
    config
}

fn stats(store: &str) -> String {
    let out = idemq().args(["--store", store, "stats"]).output().unwrap();
    assert!(out.status.success(), "{out:#?}");
    text(&out.stdout)
}

#[test]
fn a_file_with_two_consumers_runs_both_once() {
    let dir = tempfile::tempdir().unwrap();
    let config = setup(dir.path());
    let run = || {
        let out = idemq()
            .args(["run", "--config"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:#?}");
        text(&out.stdout)
    };
    let first = run();
    assert!(
        first.contains("consumer billing: processed=3 duplicate=0"),
        "{first}"
    );
    assert!(
        first.contains("consumer audit: processed=2 duplicate=1"),
        "{first}"
    );
    // Each consumer's checkpoint and inbox: the second run applies nothing.
    let second = run();
    assert!(second.contains("consumer billing: processed=0"), "{second}");
    assert!(second.contains("consumer audit: processed=0"), "{second}");
    let file_stats = stats(&sqlite(dir.path(), "file.db"));
    assert!(
        file_stats.contains("billing") && file_stats.contains("audit"),
        "{file_stats}"
    );

    // The environment beats the file, a flag beats both. Each run starts
    // from the files' first lines again.
    let run_into = |env_store: &str, flag_store: Option<&str>| {
        for checkpoint in ["a.jsonl.billing.checkpoint", "b.jsonl.audit.checkpoint"] {
            std::fs::remove_file(dir.path().join(checkpoint)).unwrap();
        }
        let mut cmd = idemq();
        cmd.env("IDEMQ_STORE", env_store);
        if let Some(store) = flag_store {
            cmd.args(["--store", store]);
        }
        let out = cmd.args(["run", "--config"]).arg(&config).output().unwrap();
        assert!(out.status.success(), "{out:#?}");
        text(&out.stdout)
    };
    let env_store = sqlite(dir.path(), "env.db");
    assert!(run_into(&env_store, None).contains("consumer billing: processed=3"));
    assert!(stats(&env_store).contains("billing"));
    let flag_store = sqlite(dir.path(), "flag.db");
    assert!(run_into(&env_store, Some(&flag_store)).contains("consumer audit: processed=2"));
    assert!(stats(&flag_store).contains("audit"));

    let check = idemq()
        .env("IDEMQ_STORE", "postgres://app:hunter2@db/x")
        .args(["config", "check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let shown = text(&check.stdout);
    assert!(check.status.success(), "{check:#?}");
    assert!(
        shown.contains("consumer billing (store from environment)"),
        "{shown}"
    );
    assert!(!shown.contains("hunter2") && !text(&check.stderr).contains("hunter2"));
}

/// One `http-addr` for the process: `/readyz` names each consumer's
/// checks, and `/metrics` counts both consumers.
#[test]
fn the_process_serves_one_endpoint_for_every_job() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.jsonl"), "{\"id\":\"a-1\"}\n").unwrap();
    let port = common::free_port();
    let config = dir.path().join("idemq.toml");
    std::fs::write(
        &config,
        format!(
            "store = \"{}\"\nhttp-addr = \"127.0.0.1:{port}\"\n\
             [[consumer]]\nconsumer = \"files\"\nsource = \"{}\"\nkey = \"json:/id\"\nprint = true\n\
             [[consumer]]\nconsumer = \"piped\"\nsource = \"-\"\nkey = \"json:/id\"\nprint = true\n",
            sqlite(dir.path(), "idemq.db"),
            dir.path().join("a.jsonl").display()
        ),
    )
    .unwrap();
    let mut child = idemq()
        .args(["run", "--config"])
        .arg(&config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"{\"id\":\"p-1\"}\n").unwrap();
    stdin.flush().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    while !seen.contains("\"p-1\"") {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "stdout ended: {seen}"
        );
        seen.push_str(&line);
    }
    let get = |path: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                write!(stream, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
                let mut response = String::new();
                stream.read_to_string(&mut response).unwrap();
                break response;
            }
            assert!(Instant::now() < deadline, "nothing listens on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    // Each job adds its checks when it starts; the jobs start concurrently
    // (the file job may still be opening the shared SQLite file).
    let deadline = Instant::now() + Duration::from_secs(10);
    let ready = loop {
        let ready = get("/readyz");
        if ready.contains("consumer files store: ok") || Instant::now() >= deadline {
            break ready;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(ready.starts_with("HTTP/1.0 200"), "{ready}");
    assert!(ready.contains("consumer files store: ok"), "{ready}");
    assert!(ready.contains("consumer piped store: ok"), "{ready}");
    // The two consumers share one SQLite file: the other may finish later.
    let deadline = Instant::now() + Duration::from_secs(10);
    for consumer in ["files", "piped"] {
        let series =
            format!("idemq_messages_total{{consumer=\"{consumer}\",outcome=\"processed\"}} 1");
        loop {
            let metrics = get("/metrics");
            if metrics.contains(&series) {
                break;
            }
            assert!(Instant::now() < deadline, "{series} in {metrics}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    drop(stdin);
    let status = child.wait().unwrap();
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    assert!(status.success(), "{seen}{rest}");
    assert!(rest.contains("consumer piped: processed=1"), "{rest}");
}

#[test]
fn a_bad_file_is_a_usage_error_naming_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("bad.toml");
    std::fs::write(
        &config,
        "[[consumer]]\nconsumer = \"billing\"\nsource = \"-\"\nprint = true\nconcurency = 4\n",
    )
    .unwrap();
    for args in [
        &["run", "--config"][..],
        &["config", "check", "--config"][..],
    ] {
        let out: Output = idemq().args(args).arg(&config).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{out:#?}");
        let err = text(&out.stderr);
        assert!(
            err.contains("consumer billing: unknown key \"concurency\""),
            "{err}"
        );
    }
}
