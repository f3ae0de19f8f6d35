//! `idemq relay` end to end: outbox rows inserted with plain SQL (as any
//! producer, in any language, can write them) are relayed to a JSON-lines
//! file (SQLite), a Redis stream (PostgreSQL, MariaDB), RabbitMQ, NATS
//! JetStream and Kafka (PostgreSQL), then consumed from there with `idemq
//! consume --key header:event_id`: every event applied exactly once, even
//! when rows are relayed twice with the same ids (as after a relay died
//! between the broker's confirmation and its delete), and the outbox is
//! empty. Every destination runs through the one [`relay_round_trip`].
#![cfg(all(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis-streams"
))]

use std::process::{Command, Stdio};
use std::str::FromStr;
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

    /// `NAME=N` of the summary line on stdout.
    #[track_caller]
    fn count(&self, name: &str) -> u64 {
        let prefix = format!("{name}=");
        self.stdout
            .split_whitespace()
            .find_map(|w| w.strip_prefix(prefix.as_str()))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {name}= in the summary: {self:#?}"))
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

/// One payment event: its id, account (the key), payment id, amount and
/// its number within the account.
type Event = (String, String, String, i64, u32);

/// Six payment events over two accounts, in order per account.
fn events() -> Vec<Event> {
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

fn payload(account: &str, payment_id: &str, amount: i64, n: u32) -> Vec<u8> {
    serde_json::json!({ "payment_id": payment_id, "account": account, "amount": amount, "n": n })
        .to_string()
        .into_bytes()
}

/// The ledger every consume must end with: each payment once.
fn expected_ledger() -> Vec<(String, i64)> {
    events().into_iter().map(|e| (e.2, e.3)).collect()
}

/// A connection pool of one of the SQL databases.
enum Pool {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

/// Evaluates `$body` with `$p` bound to the pool inside `$pool`, whichever
/// database it is.
macro_rules! with_pool {
    ($pool:expr, $p:ident => $body:expr) => {
        match $pool {
            Pool::Sqlite($p) => $body,
            Pool::Postgres($p) => $body,
            Pool::MySql($p) => $body,
        }
    };
}

/// The application's database (its outbox) and the consumer's (inbox and
/// ledger): one database, one table prefix of its own per test.
struct Db {
    store: String,
    prefix: String,
    pool: Pool,
    dir: Option<tempfile::TempDir>,
}

impl Db {
    /// A new SQLite file.
    async fn sqlite() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("sqlite://{}", dir.path().join("app.db").display());
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(&store)
            .unwrap()
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        Self::new(store, Pool::Sqlite(pool), Some(dir))
    }

    async fn postgres() -> Self {
        let store = std::env::var("IDEMQ_TEST_POSTGRES")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let pool = Pool::Postgres(sqlx::PgPool::connect(&store).await.unwrap());
        Self::new(store, pool, None)
    }

    async fn mariadb() -> Self {
        let store = std::env::var("IDEMQ_TEST_MYSQL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let pool = Pool::MySql(sqlx::MySqlPool::connect(&store).await.unwrap());
        Self::new(store, pool, None)
    }

    /// With a table prefix of its own, and the outbox created by `relay
    /// --migrate` (an empty outbox with `--idle-exit 0s` ends at once).
    fn new(store: String, pool: Pool, dir: Option<tempfile::TempDir>) -> Self {
        let db = Self {
            store,
            prefix: format!("{}_", unique("relaycli")),
            pool,
            dir,
        };
        let run = db
            .idemq(&["relay", "--to", "-", "--migrate", "--idle-exit", "0s"])
            .ok();
        assert!(run.stderr.contains("published=0 dead=0"), "{run:#?}");
        db
    }

    fn table(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// `idemq --store … --table-prefix … ARGS…`.
    fn idemq(&self, args: &[&str]) -> Run {
        let mut all = vec!["--store", &self.store, "--table-prefix", &self.prefix];
        all.extend_from_slice(args);
        idemq(&all)
    }

    /// Inserts `events` into the outbox with plain SQL, then one more in a
    /// transaction that rolls back.
    async fn insert(&self, events: &[Event]) {
        let marks = match self.pool {
            Pool::Postgres(_) => "($1, $2, $3, $4, $5, $6)",
            _ => "(?, ?, ?, ?, ?, ?)",
        };
        let sql = format!(
            "INSERT INTO {} (id, aggregatetype, aggregateid, type, payload, headers) VALUES {marks}",
            self.table("outbox")
        );
        let rolled_back: Event = (
            "evt-rolled-back".into(),
            "acc-0".into(),
            "p-x".into(),
            1,
            99,
        );
        let all = events
            .iter()
            .map(|e| (e, true))
            .chain([(&rolled_back, false)]);
        with_pool!(&self.pool, pool => {
            for ((id, account, payment_id, amount, n), commit) in all {
                let mut tx = pool.begin().await.unwrap();
                sqlx::query(&sql)
                    .bind(id)
                    .bind("payments")
                    .bind(account)
                    .bind("PaymentCaptured")
                    .bind(payload(account, payment_id, *amount, *n))
                    .bind(r#"{"source":"sql"}"#)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                if commit {
                    tx.commit().await.unwrap();
                } else {
                    tx.rollback().await.unwrap();
                }
            }
        })
    }

    async fn count(&self, table: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.table(table));
        with_pool!(&self.pool, pool => {
            sqlx::query_scalar::<_, i64>(&sql).fetch_one(pool).await.unwrap()
        })
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        let sql = format!(
            "SELECT payment_id, amount FROM {} ORDER BY payment_id",
            self.table("ledger")
        );
        with_pool!(&self.pool, pool => {
            sqlx::query_as::<_, (String, i64)>(&sql).fetch_all(pool).await.unwrap()
        })
    }

    /// `idemq consume FROM` into the ledger, keyed by `header:event_id`.
    fn consume(&self, from: &str, consumer: &str) -> Run {
        let ledger = self.table("ledger");
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {ledger} (payment_id VARCHAR(64), account VARCHAR(64), amount BIGINT)"
        );
        let insert = format!("INSERT INTO {ledger} VALUES (:payment_id, :account, :amount)");
        self.idemq(&[
            "consume",
            from,
            "--consumer",
            consumer,
            "--key",
            "header:event_id",
            "--idle-exit",
            // The idle clock runs from the start: on Kafka it must also
            // cover joining the group on a loaded machine.
            if from.starts_with("kafka://") {
                "15s"
            } else {
                "3s"
            },
            "--init-sql",
            &create,
            "--apply-sql",
            &insert,
        ])
        .ok()
    }

    async fn drop_tables(&self) {
        let tables = [
            "ledger",
            "outbox",
            "outbox_dead",
            "inbox",
            "attempts",
            "dead_letters",
            "schema_migrations",
            "offsets",
            "effects",
        ];
        for t in tables {
            let sql = format!("DROP TABLE IF EXISTS {}", self.table(t));
            with_pool!(&self.pool, pool => {
                let _ = sqlx::query(&sql).execute(pool).await;
            });
        }
        if let Pool::Postgres(pool) = &self.pool {
            let sql = format!("DROP FUNCTION IF EXISTS {}()", self.table("outbox_notify"));
            let _ = sqlx::query(&sql).execute(pool).await;
        }
    }
}

/// Where `idemq relay --to` publishes and where `idemq consume` reads it back.
struct Destination {
    /// The `--to` URL or file.
    to: String,
    /// The source `consume` reads (the consumer `billing`).
    from: String,
    /// Another consumer group of the same messages, which reads all of them
    /// again (where the broker keeps messages after their ack).
    replay: Option<String>,
    /// The broker drops a message whose id it has stored already (JetStream
    /// `Nats-Msg-Id` within its duplicate window), so the republished
    /// copies never reach the consumer.
    drops_repeated_ids: bool,
}

/// The whole path, for any database and destination: six events (and one
/// rolled back) are relayed; two of them are enqueued and relayed again
/// with the same ids; `consume` applies each event once and counts the
/// copies as duplicates; a second consume finds nothing (everything was
/// acknowledged); a replay group finds only duplicates; the outbox and its
/// dead-letter table are empty.
async fn relay_round_trip(db: &Db, dest: &Destination) {
    let relay = || {
        db.idemq(&[
            "relay",
            "--to",
            &dest.to,
            "--batch",
            "4",
            "--max-attempts",
            "3",
            "--max-in-flight",
            "8",
            "--idle-exit",
            "2s",
        ])
        .ok()
    };
    db.insert(&events()).await;
    let first = relay();
    assert_eq!(
        (first.count("published"), first.count("dead")),
        (6, 0),
        "{first:#?}"
    );
    assert_eq!(db.count("outbox").await, 0, "the outbox is empty");

    // As after a relay that died between the broker's confirmation and its
    // delete: the same rows, the same ids, published again.
    db.insert(&events()[..2]).await;
    let again = relay();
    assert_eq!(again.count("published"), 2, "{again:#?}");
    assert_eq!(db.count("outbox").await, 0);

    let copies = if dest.drops_repeated_ids { 0 } else { 2 };
    let consumed = db.consume(&dest.from, "billing");
    assert!(
        consumed
            .stdout
            .contains(&format!("processed=6 duplicate={copies} conflict=0")),
        "{consumed:#?}"
    );
    assert_eq!(db.ledger().await, expected_ledger(), "each payment once");
    let rerun = db.consume(&dest.from, "billing");
    assert!(
        rerun.stdout.contains("processed=0 duplicate=0 conflict=0"),
        "everything was acknowledged: {rerun:#?}"
    );
    if let Some(replay) = &dest.replay {
        let replayed = db.consume(replay, "billing");
        assert!(
            replayed
                .stdout
                .contains(&format!("processed=0 duplicate={} ", 6 + copies)),
            "{replayed:#?}"
        );
    }
    assert_eq!(db.ledger().await, expected_ledger());
    assert_eq!(db.count("outbox").await, 0);
    assert_eq!(db.count("outbox_dead").await, 0);
}

/// A fresh Redis stream: `to`, and the groups `billing` and `replay`.
fn redis_stream() -> Destination {
    let stream = unique("relay_cli");
    let url = format!("redis-stream://127.0.0.1:6379/{stream}");
    Destination {
        from: format!("{url}?group=billing&block=200ms"),
        replay: Some(format!("{url}?group=replay&block=200ms")),
        to: url,
        drops_repeated_ids: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rows_are_relayed_to_a_file_and_consumed_exactly_once() {
    let db = Db::sqlite().await;
    let out = db.dir.as_ref().unwrap().path().join("relayed.jsonl");
    let out = out.to_str().unwrap().to_owned();
    let dest = Destination {
        to: out.clone(),
        from: out.clone(),
        replay: None,
        drops_repeated_ids: false,
    };
    relay_round_trip(&db, &dest).await;

    // The file holds the envelopes: id = event_id header = the row id,
    // key = the account, the row's headers, in order per account; then the
    // two copies.
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8, "{text}");
    let mut last_n = std::collections::HashMap::new();
    for line in &lines[..6] {
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
    // The relay publishes the two accounts concurrently, so the copies of
    // evt-0 (acc-0) and evt-1 (acc-1) may be in either order.
    let first_of = |id: &str| lines[..6].iter().find(|l| l["id"] == id).cloned();
    let mut copies = lines[6..].to_vec();
    copies.sort_by_key(|l| l["id"].to_string());
    assert_eq!(
        copies,
        [first_of("evt-0").unwrap(), first_of("evt-1").unwrap()],
        "the copies carry the same ids"
    );
    assert!(!text.contains("rolled-back"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_are_relayed_to_redis_and_consumed_exactly_once() {
    let db = Db::postgres().await;
    relay_round_trip(&db, &redis_stream()).await;
    db.drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_rows_are_relayed_to_redis_and_consumed_exactly_once() {
    let db = Db::mariadb().await;
    relay_round_trip(&db, &redis_stream()).await;
    db.drop_tables().await;
}

/// RabbitMQ: the relay's publisher declares the queue; an acked message is
/// gone, so there is no replay.
#[cfg(feature = "amqp")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_are_relayed_to_rabbitmq_and_consumed_exactly_once() {
    let db = Db::postgres().await;
    let url = format!(
        "amqp://guest:guest@127.0.0.1:5672/%2f?queue={}",
        unique("relay_cli")
    );
    let dest = Destination {
        to: url.clone(),
        from: url,
        replay: None,
        drops_repeated_ids: false,
    };
    relay_round_trip(&db, &dest).await;
    db.drop_tables().await;
}

/// NATS JetStream: `create=true` makes the stream; the relay's message id
/// is the `Nats-Msg-Id`, so JetStream itself drops the republished copies,
/// and a second durable consumer reads the six again.
#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_are_relayed_to_nats_and_consumed_exactly_once() {
    let db = Db::postgres().await;
    let name = unique("relay_cli");
    let url = |consumer: &str| {
        format!(
            "nats://127.0.0.1:4222/{name}/{consumer}?subject={name}.payments&create=true&ack_wait=5s&wait=1s"
        )
    };
    let dest = Destination {
        to: url("relay"),
        from: url("billing"),
        replay: Some(url("replay")),
        drops_repeated_ids: true,
    };
    relay_round_trip(&db, &dest).await;
    db.drop_tables().await;
}

/// Kafka (Apache Kafka on 127.0.0.1:9092): the relay creates the topic with three
/// partitions (the account is the record key, so each account's events
/// stay in order); a second group reads everything again.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_are_relayed_to_kafka_and_consumed_exactly_once() {
    let db = Db::postgres().await;
    let topic = unique("relay_cli");
    let url = format!("kafka://127.0.0.1:9092/{topic}");
    // Groups of this test's own: a Kafka group is shared across topics.
    let dest = Destination {
        to: format!("{url}?create_partitions=3"),
        from: format!("{url}?group={topic}_billing"),
        replay: Some(format!("{url}?group={topic}_replay")),
        drops_repeated_ids: false,
    };
    relay_round_trip(&db, &dest).await;
    db.drop_tables().await;
}

/// A row whose `headers` is not a JSON object can never be published: the
/// relay moves it to the dead-letter table with the reason and publishes
/// the later row of its key; `--max-attempts 0` would have kept retrying,
/// but a permanent error does not wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_cannot_be_published_goes_to_the_dead_table() {
    let db = Db::sqlite().await;
    let Pool::Sqlite(pool) = &db.pool else {
        unreachable!()
    };
    let sql = format!(
        "INSERT INTO {} (id, aggregatetype, aggregateid, payload, headers) VALUES \
         ('evt-bad', 'payments', 'acc-0', X'7B7D', '[1]'), ('evt-next', 'payments', 'acc-0', X'7B7D', NULL)",
        db.table("outbox")
    );
    sqlx::query(&sql).execute(pool).await.unwrap();
    let out = db.dir.as_ref().unwrap().path().join("relayed.jsonl");
    let out = out.to_str().unwrap();
    let run = db
        .idemq(&[
            "relay",
            "--to",
            out,
            "--max-attempts",
            "0",
            "--idle-exit",
            "1s",
        ])
        .ok();
    assert_eq!(
        (run.count("published"), run.count("dead")),
        (1, 1),
        "{run:#?}"
    );
    assert!(run.stderr.contains("dead-letter table"), "logged: {run:#?}");
    let dead: Vec<(String, String, i64)> = sqlx::query_as(&format!(
        "SELECT id, reason, attempts FROM {}",
        db.table("outbox_dead")
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!((dead[0].0.as_str(), dead[0].2), ("evt-bad", 1));
    assert!(dead[0].1.contains("not a JSON object"), "{dead:?}");
    let text = std::fs::read_to_string(out).unwrap();
    assert!(
        text.contains("evt-next") && !text.contains("evt-bad"),
        "{text}"
    );
    assert_eq!(db.count("outbox").await, 0);
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
    let none_in_flight = idemq(&[
        "--store",
        &store,
        "relay",
        "--to",
        "-",
        "--max-in-flight",
        "0",
    ]);
    assert_eq!(none_in_flight.code, 2, "{none_in_flight:#?}");
    assert!(
        none_in_flight.stderr.contains("--max-in-flight"),
        "{none_in_flight:#?}"
    );
}
