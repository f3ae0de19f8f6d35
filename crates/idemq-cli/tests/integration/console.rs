//! `idemq console` in a real browser: Debian's chromium, headless, driven
//! through chromedriver (WebDriver). A consumer dead-letters a payment its
//! ledger refused; the rule is fixed; an operator opens the console, finds
//! the letter under its reason, ticks it and presses "Replay selected": the
//! ledger then holds the payment exactly once and the letter is gone. A
//! whole reason is deleted with its button; a read-only console and a
//! forged form are refused.
//!
//! `scripts/chromium.sh` installs chromium and chromedriver (the test
//! fails, naming it, when they are missing). With `IDEMQ_SCREENSHOTS=DIR`
//! the pages are saved there as PNG (docs/console-*.png were made so).
#![cfg(all(feature = "sqlite", feature = "exec"))]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use sqlx::sqlite::SqlitePoolOptions;
use sqlx::Row;

use crate::common::{free_port, idemq, wait_listening};

/// A child process killed when the test ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `POST path` with a form body; the status code.
fn post(port: u16, path: &str, body: &str) -> u16 {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The configuration of the consumer: a ledger whose trigger refuses
/// amounts under a floor kept in a table (too high a floor is the bug an
/// operator fixes before replaying).
fn write_config(dir: &Path, store: &str) -> std::path::PathBuf {
    let input = dir.join("payments.jsonl");
    std::fs::write(
        &input,
        "{\"id\":\"p1\",\"amount\":10}\n\
         {\"id\":\"p2\",\"amount\":-5}\n\
         not json\n\
         {\"id\":\"p3\",\"amount\":7}\n\
         {\"id\":\"p1\",\"amount\":10}\n",
    )
    .unwrap();
    let config = dir.join("idemq.toml");
    std::fs::write(
        &config,
        format!(
            r#"store = "{store}"
[[consumer]]
consumer = "payments"
source = "{input}"
key = "json:/id"
max-attempts = 1
init-sql = [
  "CREATE TABLE IF NOT EXISTS ledger (id TEXT PRIMARY KEY, amount INT NOT NULL)",
  "CREATE TABLE IF NOT EXISTS floor (amount INT NOT NULL)",
  "INSERT INTO floor SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM floor)",
  "CREATE TRIGGER IF NOT EXISTS refuse_refunds BEFORE INSERT ON ledger WHEN NEW.amount < (SELECT amount FROM floor) BEGIN SELECT RAISE(ABORT, 'negative amount'); END",
]
apply-sql = "INSERT INTO ledger (id, amount) VALUES (:idemq_key, :amount)"
"#,
            input = input.display()
        ),
    )
    .unwrap();
    config
}

/// Starts chromedriver and a headless chromium session.
async fn browser() -> (Killed, Client) {
    let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("chromedriver is missing: run scripts/chromium.sh (Debian's chromium and chromium-driver)");
    let port = free_port();
    let driver = Killed(
        Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_listening(port, "chromedriver");
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,900"],
        }),
    );
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a chromium session through chromedriver");
    (driver, client)
}

/// Saves the page as `DIR/console-NAME.png` when `IDEMQ_SCREENSHOTS` is set.
async fn screenshot(client: &Client, name: &str) {
    if let Some(dir) = std::env::var_os("IDEMQ_SCREENSHOTS") {
        let png = client.screenshot().await.unwrap();
        std::fs::write(Path::new(&dir).join(format!("console-{name}.png")), png).unwrap();
    }
}

/// The visible text of the element `css`, runs of white space as one space.
async fn text(client: &Client, css: &str) -> String {
    let text = client
        .wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
        .text()
        .await
        .unwrap();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_is_replayed_from_the_browser_and_lands_in_the_ledger_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idemq.db");
    let store = format!("sqlite://{}", db.display());
    let config = write_config(dir.path(), &store);

    let run = idemq()
        .args(["run", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{run:#?}");
    assert!(
        stdout.contains("processed=2 duplicate=1 conflict=0 retry_later=0 dead_lettered=2"),
        "{stdout}"
    );

    // The operator fixes the floor that refused p2.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect(&store)
        .await
        .unwrap();
    sqlx::query("UPDATE floor SET amount = -100")
        .execute(&pool)
        .await
        .unwrap();

    // An outbox with two rows waiting and one the relay gave up on.
    let outbox = idemq::outbox::Outbox::<sqlx::Sqlite>::new("idemq_").unwrap();
    outbox.migrate(&pool).await.unwrap();
    for order in ["o-1", "o-2"] {
        let mut tx = pool.begin().await.unwrap();
        outbox
            .enqueue(
                &mut tx,
                "orders",
                order,
                &idemq::Headers::new(),
                b"{\"paid\":true}",
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    sqlx::query(
        "INSERT INTO idemq_outbox_dead (seq, id, aggregatetype, aggregateid, payload, attempts, reason, dead_at) \
         VALUES (7, 'ev-7', 'orders', 'o-0', x'7b7d', 5, 'broker refused: topic is unknown', 1)",
    )
    .execute(&pool)
    .await
    .unwrap();

    // A read-only console refuses changes, whatever the form says.
    let read_only_port = free_port();
    let _read_only = Killed(
        idemq()
            .args(["--store", &store, "console", "--config"])
            .arg(&config)
            .args(["--http-addr", &format!("127.0.0.1:{read_only_port}")])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_listening(read_only_port, "the read-only console");
    assert_eq!(
        post(
            read_only_port,
            "/replay",
            "consumer=payments&reason=permanent_failure"
        ),
        403
    );

    // A consumer running now, whose /metrics the console samples.
    let metrics_port = free_port();
    let mut live = Killed(
        idemq()
            .args(["--store", &store, "consume", "-", "--consumer", "payments"])
            .args([
                "--key",
                "json:/id",
                "--http-addr",
                &format!("127.0.0.1:{metrics_port}"),
            ])
            .args([
                "--apply-sql",
                "INSERT INTO ledger (id, amount) VALUES (:idemq_key, :amount)",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_listening(metrics_port, "the live consumer");
    let port = free_port();
    let _console = Killed(
        idemq()
            // No --store: the console reads the store of the file's consumers.
            .args(["console", "--allow-changes", "--config"])
            .arg(&config)
            .args(["--http-addr", &format!("127.0.0.1:{port}")])
            .args(["--sample-every", "1s"])
            .args([
                "--scrape",
                &format!("http://127.0.0.1:{metrics_port}/metrics"),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_listening(port, "the console");
    // A form without this console's token (another site's page) is refused.
    assert_eq!(
        post(
            port,
            "/delete",
            "token=guess&consumer=payments&reason=permanent_failure"
        ),
        403
    );

    let base = format!("http://127.0.0.1:{port}");
    let (_driver, client) = browser().await;
    let outcome = async {
        client.goto(&base).await.unwrap();
        let overview = text(&client, "main").await;
        assert!(overview.contains("payments"), "{overview}");
        // Traffic while the console samples: 30 new payments in three
        // bursts, each followed by copies of some (redeliveries).
        let stdin = live.0.stdin.as_mut().unwrap();
        for burst in 0..3 {
            for n in 0..10 {
                writeln!(stdin, "{{\"id\":\"q{burst}-{n}\",\"amount\":{n}}}").unwrap();
            }
            for n in 0..4 {
                writeln!(stdin, "{{\"id\":\"q{burst}-{n}\",\"amount\":{n}}}").unwrap();
            }
            stdin.flush().unwrap();
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        // The chart's legend sums what it plots: 30 processed, 12 duplicates.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            client.refresh().await.unwrap();
            let legend = text(&client, ".legend").await;
            if legend.contains("processed 30") && legend.contains("duplicates 12") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the chart never summed the traffic: {legend}"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        screenshot(&client, "overview").await;

        client
            .find(Locator::Css("a.consumer"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let groups = text(&client, "main").await;
        assert!(groups.contains("permanent_failure"), "{groups}");
        assert!(groups.contains("malformed_record"), "{groups}");
        screenshot(&client, "dead-letters").await;

        client
            .find(Locator::LinkText("permanent_failure"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let listed = text(&client, "main").await;
        assert!(listed.contains("negative amount"), "{listed}");
        // The letter's own page: payload, error.
        client
            .find(Locator::Css("table a[href^='/letter?']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let payload = text(&client, "pre.payload").await;
        assert!(payload.contains("\"amount\": -5"), "{payload}");
        screenshot(&client, "letter").await;
        client.back().await.unwrap();

        client
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css("input[type=checkbox][name=id]"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        client
            .find(Locator::Id("replay-selected"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let results = text(&client, "#results").await;
        assert!(
            results.contains("processed; dead letter deleted"),
            "{results}"
        );
        screenshot(&client, "replayed").await;

        // A whole reason deleted with its button.
        client
            .goto(&format!("{base}/consumer?name=payments"))
            .await
            .unwrap();
        client
            .find(Locator::XPath("//button[text()='Delete all 1']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let deleted = text(&client, "#results").await;
        assert!(deleted.contains("deleted"), "{deleted}");

        client
            .goto(&format!("{base}/lookup?consumer=payments&key=p2"))
            .await
            .unwrap();
        let story = text(&client, "main").await;
        assert!(story.contains("Processed at"), "{story}");
        screenshot(&client, "lookup").await;
        client.goto(&format!("{base}/outbox")).await.unwrap();
        let outbox = text(&client, "main").await;
        assert!(outbox.contains("Rows waiting 2"), "{outbox}");
        assert!(outbox.contains("Dead rows 1"), "{outbox}");
        assert!(
            outbox.contains("broker refused: topic is unknown"),
            "{outbox}"
        );
        screenshot(&client, "outbox").await;
    };
    // Bounded: a page that never shows what is awaited fails the test.
    let finished = tokio::time::timeout(Duration::from_secs(180), outcome).await;
    let _ = client.close().await;
    finished.expect("the browser session took over 180 s");

    // The ledger holds p2 once, with its amount, beside p1 and p3 and the
    // live traffic's 30, each once.
    drop(live);
    let live: i64 = sqlx::query("SELECT COUNT(*) FROM ledger WHERE id LIKE 'q%'")
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(live, 30);
    let rows = sqlx::query("SELECT id, amount FROM ledger WHERE id LIKE 'p%' ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    let ledger: Vec<(String, i64)> = rows
        .iter()
        .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)))
        .collect();
    assert_eq!(
        ledger,
        vec![("p1".into(), 10), ("p2".into(), -5), ("p3".into(), 7)]
    );
    // No dead letter is left: one replayed, one deleted.
    let letters: i64 = sqlx::query("SELECT COUNT(*) FROM idemq_dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(letters, 0);
}
