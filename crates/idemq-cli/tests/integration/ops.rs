//! `consume --http-addr`: `/metrics` counts what the summary counts,
//! `/healthz` answers, and `/readyz` follows the store: unready while the
//! PostgreSQL connection is cut (a proxy in front of the real server stops
//! passing bytes), ready again once it passes them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{free_port, get, idemq, series, wait_listening, watch_series};

/// A TCP proxy to `upstream` that can be cut (every connection closed,
/// new ones refused) and restored.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(upstream: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (accept_up, accept_open) = (Arc::clone(&up), Arc::clone(&open));
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                if !accept_up.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let mut open = accept_open.lock().unwrap();
                open.push(client.try_clone().unwrap());
                open.push(server.try_clone().unwrap());
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, up, open }
    }

    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// Polls `check` every 100 ms until it holds, for at most `limit`.
fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(feature = "postgres")]
#[test]
fn metrics_count_what_the_summary_counts_and_readiness_follows_the_store() {
    let proxy = Proxy::start("127.0.0.1:5432");
    let store = format!("postgres://postgres@127.0.0.1:{}/test", proxy.port);
    let consumer = format!("ops-{}-{}", std::process::id(), free_port());
    let port = free_port();
    let mut child = idemq()
        .args(["--store", &store, "--table-prefix", "idemq_ops_"])
        .args(["consume", "--consumer", &consumer, "--key", "json:/id"])
        .args(["--print", "--http-addr", &format!("127.0.0.1:{port}"), "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn idemq");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    // 40 messages, 10 of them again (duplicates) and one not JSON.
    let mut lines = String::new();
    for n in (0..40).chain(0..10) {
        lines.push_str(&format!("{{\"id\":\"m-{n}\",\"amount\":{n}}}\n"));
    }
    lines.push_str("not json\n");
    stdin.write_all(lines.as_bytes()).unwrap();
    stdin.flush().unwrap();
    for _ in 0..40 {
        let mut line = String::new();
        stdout.read_line(&mut line).expect("a printed message");
    }

    let outcome = |metrics: &str, outcome: &str| {
        series(
            metrics,
            &format!("idemq_messages_total{{consumer=\"{consumer}\",outcome=\"{outcome}\"}}"),
        )
    };
    let mut metrics = String::new();
    eventually(Duration::from_secs(20), "51 outcomes counted", || {
        metrics = get(port, "/metrics").1;
        ["processed", "duplicate", "dead_lettered"]
            .iter()
            .map(|o| outcome(&metrics, o))
            .sum::<f64>()
            == 51.0
    });
    assert_eq!(outcome(&metrics, "processed"), 40.0, "{metrics}");
    assert_eq!(outcome(&metrics, "duplicate"), 10.0, "{metrics}");
    assert_eq!(outcome(&metrics, "dead_lettered"), 1.0, "{metrics}");
    let letters =
        format!("idemq_dead_letters_total{{consumer=\"{consumer}\",reason=\"malformed_record\"}}");
    assert_eq!(series(&metrics, &letters), 1.0, "{metrics}");
    for histogram in [
        "idemq_claim_seconds",
        "idemq_commit_seconds",
        "idemq_handler_seconds",
    ] {
        let count = format!("{histogram}_count{{consumer=\"{consumer}\"}}");
        assert!(series(&metrics, &count) >= 40.0, "{count} in {metrics}");
    }
    assert_eq!(
        series(
            &metrics,
            &format!("idemq_in_flight{{consumer=\"{consumer}\"}}")
        ),
        0.0,
        "{metrics}"
    );

    assert_eq!(get(port, "/healthz"), (200, "ok\n".to_owned()));
    assert_eq!(get(port, "/readyz"), (200, "store: ok\n".to_owned()));
    proxy.cut();
    eventually(Duration::from_secs(10), "/readyz answering 503", || {
        get(port, "/readyz").0 == 503
    });
    assert!(get(port, "/readyz").1.starts_with("store: "));
    assert_eq!(get(port, "/healthz").0, 200, "alive while unready");
    proxy.restore();
    eventually(
        Duration::from_secs(20),
        "/readyz answering 200 again",
        || get(port, "/readyz").0 == 200,
    );

    // Close stdin: the run ends, and its summary says what /metrics said.
    drop(stdin);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{rest}");
    assert!(
        rest.contains(&format!(
            "consumer {consumer}: processed=40 duplicate=10 conflict=0 retry_later=0 dead_lettered=1"
        )),
        "{rest}"
    );
}

/// A busy `--http-addr` is a usage error (exit 2), before anything is consumed.
#[test]
fn an_address_in_use_is_a_usage_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
    let out = idemq()
        .args(["--store", &store, "consume", "--consumer", "c", "--print"])
        .args(["--http-addr", &addr, "-"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:#?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&addr),
        "{out:#?}"
    );
}

/// `--http-linger`: a run that ends keeps serving until one `/metrics`
/// scrape has read its final counts (those of its summary line), then
/// exits at once; unscraped, it exits when the linger time is up.
#[test]
fn a_lingering_run_serves_its_final_counts_to_one_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
    let input = dir.path().join("in.jsonl");
    let mut lines = String::new();
    for n in (0..25).chain(0..5) {
        lines.push_str(&format!("{{\"id\":\"m-{n}\"}}\n"));
    }
    lines.push_str("not json\n");
    std::fs::write(&input, lines).unwrap();
    let run = |consumer: &str, linger: &str| {
        let port = free_port();
        let mut child = idemq()
            .args(["--store", &store, "consume", "--consumer", consumer])
            .args(["--key", "json:/id", "--no-checkpoint", "--print"])
            .args(["--http-addr", &format!("127.0.0.1:{port}")])
            .args(["--http-linger", linger])
            .arg(&input)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn idemq");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut summary = String::new();
        while !summary.starts_with(&format!("consumer {consumer}:")) {
            summary.clear();
            assert!(
                stdout.read_line(&mut summary).unwrap() > 0,
                "no summary line"
            );
        }
        // The rest of stdout (the dead-letter hint) goes on being read.
        let rest = std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        (child, port, summary, Instant::now(), rest)
    };
    let wait = |child: &mut std::process::Child, limit: Duration| {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    let (mut child, port, summary, _, _) = run("linger-scraped", "60s");
    assert_eq!(
        summary.trim(),
        "consumer linger-scraped: processed=25 duplicate=5 conflict=0 retry_later=0 dead_lettered=1"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "exited unscraped");
    let (status, metrics) = get(port, "/metrics");
    assert_eq!(status, 200);
    for (outcome, count) in [
        ("processed", 25.0),
        ("duplicate", 5.0),
        ("dead_lettered", 1.0),
    ] {
        let name =
            format!("idemq_messages_total{{consumer=\"linger-scraped\",outcome=\"{outcome}\"}}");
        assert_eq!(series(&metrics, &name), count, "{metrics}");
    }
    assert!(wait(&mut child, Duration::from_secs(20)).success());

    let (mut child, _, _, ended, _) = run("linger-unscraped", "1s");
    assert!(wait(&mut child, Duration::from_secs(20)).success());
    assert!(
        ended.elapsed() >= Duration::from_millis(900),
        "{:?}",
        ended.elapsed()
    );

    let out = idemq()
        .args(["--store", &store, "consume", "--consumer", "c", "--print"])
        .args(["--http-linger", "1s"])
        .arg(&input)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "--http-linger needs --http-addr: {out:#?}"
    );
}

/// `relay --http-addr`: each scrape reads the outbox backlog — three rows
/// of a destination this relay does not serve wait, the oldest written 5 s
/// ago — and `/readyz` checks the database.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn relay_metrics_show_the_outbox_backlog_and_its_lag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let store = format!("sqlite://{}", path.display());
    let out = dir.path().join("out.jsonl");
    let out = out.to_str().unwrap();
    let created = idemq()
        .args(["--store", &store, "relay", "--migrate", "--to", out])
        .args(["--idle-exit", "100ms"])
        .output()
        .unwrap();
    assert!(created.status.success(), "{created:#?}");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
        .await
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for n in 0..3 {
        sqlx::query(
            "INSERT INTO idemq_outbox (id, aggregatetype, aggregateid, type, payload, created_at) \
             VALUES (?, 'payments', 'acc-1', 'PaymentCaptured', '{}', ?)",
        )
        .bind(format!("e-{n}"))
        .bind(now_ms - 5_000 + n)
        .execute(&pool)
        .await
        .unwrap();
    }
    pool.close().await;

    let port = free_port();
    let mut child = idemq()
        .args([
            "--store",
            &store,
            "relay",
            "--to",
            out,
            "--destination",
            "refunds",
        ])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let scrape = move || {
        wait_listening(port, "the relay's --http-addr");
        get(port, "/metrics").1
    };
    let metrics = tokio::task::spawn_blocking(scrape).await.unwrap();
    let ready = tokio::task::spawn_blocking(move || get(port, "/readyz")).await;
    let _ = child.kill();
    let _ = child.wait();
    let table = "{table=\"idemq_outbox\"}";
    assert_eq!(
        series(&metrics, &format!("idemq_outbox_backlog_rows{table}")),
        3.0,
        "{metrics}"
    );
    let lag = series(&metrics, &format!("idemq_outbox_lag_seconds{table}"));
    assert!((5.0..60.0).contains(&lag), "lag {lag}: {metrics}");
    assert_eq!(
        series(&metrics, &format!("idemq_outbox_dead_rows{table}")),
        0.0,
        "{metrics}"
    );
    assert_eq!(ready.unwrap(), (200, "database: ok\n".to_owned()));
}

/// Kafka's consumer lag reaches `/metrics` from librdkafka's statistics:
/// 300 messages consumed one at a time by a slow effect show a lag above 0
/// (and never above 300) on the way, and 0 once they are all applied.
#[cfg(all(feature = "kafka", feature = "exec", feature = "sqlite"))]
#[test]
fn kafka_consumer_lag_is_exported() {
    let dir = tempfile::tempdir().unwrap();
    let run = format!("{}_{}", std::process::id(), free_port());
    let url = format!("kafka://127.0.0.1:9092/lag_{run}?group=lag_{run}&create_partitions=1");
    // librdkafka's statistics every second (not 5 s): several reports fall
    // between the last commit and the idle exit 8 s later.
    let consume_url = format!("{url}&statistics.interval.ms=1000");
    let input = dir.path().join("in.jsonl");
    let lines: String = (0..300)
        .map(|n| format!("{{\"id\":\"m-{n}\"}}\n"))
        .collect();
    std::fs::write(&input, lines).unwrap();
    let store = format!("sqlite://{}", dir.path().join("idemq.db").display());
    let produced = idemq()
        .args(["produce"])
        .arg(&input)
        .args(["--to", &url, "--key", "json:/id"])
        .output()
        .unwrap();
    assert!(produced.status.success(), "{produced:#?}");
    let port = free_port();
    let mut child = idemq()
        .args([
            "--store",
            &store,
            "consume",
            &consume_url,
            "--consumer",
            "lag",
        ])
        .args(["--key", "json:/id", "--concurrency", "1"])
        .args(["--apply-exec", "sleep 0.03", "--idle-exit", "8s"])
        .args(["--http-addr", &format!("127.0.0.1:{port}")])
        // The run that ended keeps serving until a scrape has read its final
        // values: the last value seen is the one at the end of the run.
        .args(["--http-linger", "60s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lag_series = format!(
        "idemq_source_lag_messages{{source=\"kafka\",group=\"lag_{run}\",topic=\"lag_{run}\",partition=\"0\"}}"
    );
    let seen = watch_series(&mut child, port, &lag_series, Duration::from_secs(90));
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("consumer lag: processed=300"), "{stdout}");
    assert!(seen.iter().any(|lag| *lag > 0.0), "lags seen: {seen:?}");
    assert!(seen.iter().all(|lag| *lag <= 300.0), "lags seen: {seen:?}");
    assert_eq!(seen.last(), Some(&0.0), "lags seen: {seen:?}");
}
