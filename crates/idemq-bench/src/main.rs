//! `idemq-bench`: the idemq benchmark suite. One run prints one Markdown
//! table; every row in it is measured in that same run, and every ratio is
//! taken against a baseline measured in the same run, alternately with the
//! row it is compared to (A/B, then B/A, …) so that machine drift hits both.
//!
//! Sections:
//! - SQL (PostgreSQL, MariaDB, SQLite): the bare effect (the ledger INSERT in
//!   its own transaction, no inbox) beside idemq per-message; and
//!   (`sql-partitioned`) the same on PostgreSQL's and MariaDB's
//!   time-partitioned inbox;
//! - set-based batches (PostgreSQL): the raw multi-row limit beside the
//!   library's batch mode (per-message and set-based handlers) and the CLI
//!   per message and with `--batch 100`, whole process;
//! - claim cost with 0 / small / large key counts already stored (PostgreSQL),
//!   and prune rows/s;
//! - the time-partitioned inbox (PostgreSQL): claim cost with 10 M (100 M
//!   with `--full`) keys over ten daily partitions beside an empty one, the
//!   drop of a day, and the inbox's size over a simulated week beside the
//!   one-table layout;
//! - Redis: the lease store beside raw `SET NX PX`;
//! - the in-memory store beside a bare queue drain;
//! - end to end: JSON lines and each reachable broker (RabbitMQ, Kafka, NATS
//!   JetStream, Redis Streams, MQTT, SQS, RocketMQ) → PostgreSQL;
//! - the outbox relay: a PostgreSQL outbox → each reachable broker, one row
//!   at a time and pipelined, beside the broker's raw publish rate;
//! - peers (`--only peers`): AWS Lambda Powertools' idempotency utility
//!   (Python, its Redis layer) beside idemq's Redis store, and a hand-written
//!   sqlx inbox (check-then-insert, insert-first) beside idemq per-message
//!   and batch mode on PostgreSQL, on the same messages with redeliveries.
//!
//! Run `scripts/bench.sh` (release build); `--help` lists the knobs.

mod batch;
mod claim;
mod e2e;
mod lease;
mod partitioned;
mod peers;
mod relay;
mod report;
mod sql;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use idemq::source::queue::{MemoryQueue, QueueSource};
use idemq::source::Source;
use idemq::Message;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use report::Row;

/// The idemq benchmark suite: prints one Markdown table per run.
#[derive(Debug, Clone, Parser)]
#[command(name = "idemq-bench", version)]
pub struct Config {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "IDEMQ_BENCH_POSTGRES",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub postgres: String,
    /// MySQL / MariaDB URL.
    #[arg(
        long,
        env = "IDEMQ_BENCH_MYSQL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    pub mysql: String,
    /// Folder for the SQLite database file (on the disk being measured).
    #[arg(long, env = "IDEMQ_BENCH_SQLITE_DIR")]
    pub sqlite_dir: Option<std::path::PathBuf>,
    /// Redis URL.
    #[arg(
        long,
        env = "IDEMQ_BENCH_REDIS",
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis: String,
    /// Redis Cluster nodes (comma-separated), for the `cluster` section.
    #[arg(
        long,
        env = "IDEMQ_BENCH_REDIS_CLUSTER",
        default_value = "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002"
    )]
    pub redis_cluster: String,
    /// RabbitMQ URL (without `?queue=`); unreachable → the row is skipped.
    #[arg(
        long,
        env = "IDEMQ_BENCH_AMQP",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp: String,
    /// Kafka bootstrap servers; unreachable → the row is skipped.
    #[arg(long, env = "IDEMQ_BENCH_KAFKA", default_value = "127.0.0.1:9092")]
    pub kafka: String,
    /// NATS server with JetStream; unreachable → the row is skipped.
    #[arg(
        long,
        env = "IDEMQ_BENCH_NATS",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats: String,
    /// MQTT 5 broker, `mqtt://host:port` (no topic); unreachable → the row is skipped.
    #[arg(
        long,
        env = "IDEMQ_BENCH_MQTT",
        default_value = "mqtt://127.0.0.1:1883"
    )]
    pub mqtt: String,
    /// SQS endpoint (an SQS-compatible server such as moto); unreachable → the row is skipped.
    #[arg(long, env = "IDEMQ_BENCH_SQS", default_value = "http://127.0.0.1:5000")]
    pub sqs: String,
    /// RocketMQ name server(s); unreachable → the row is skipped.
    #[arg(long, env = "IDEMQ_BENCH_ROCKETMQ", default_value = "127.0.0.1:9876")]
    pub rocketmq: String,

    /// Measured rounds per row; each row reports the median. Baseline and
    /// idemq alternate within every round (A/B, then B/A).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Messages per SQL measurement (bare effect and idemq per-message).
    #[arg(long, default_value_t = 2000)]
    pub messages: u64,
    /// Messages in flight in the SQL and memory rows (the bare effect uses the same).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Pool size of PostgreSQL and MariaDB (shared by the bare effect and idemq).
    /// SQLite always uses the store's single connection.
    #[arg(long, default_value_t = 8)]
    pub pool: u32,

    /// Messages per Redis measurement with many in flight.
    #[arg(long, default_value_t = 20_000)]
    pub redis_messages: u64,
    /// Messages per sequential Redis measurement.
    #[arg(long, default_value_t = 3_000)]
    pub redis_sequential_messages: u64,
    /// In-flight count of the concurrent Redis rows (tasks, or pipeline depth).
    #[arg(long, default_value_t = 64)]
    pub in_flight: usize,
    /// Messages per in-memory measurement.
    #[arg(long, default_value_t = 50_000)]
    pub memory_messages: u64,

    /// Claims per claim-cost measurement (sequential claim + rollback).
    #[arg(long, default_value_t = 2_000)]
    pub claims: u64,
    /// The smaller preload of the claim-cost rows (keys already in the inbox).
    #[arg(long, default_value_t = 100_000)]
    pub preload_small: u64,
    /// The larger preload of the claim-cost rows; it is also what prune deletes.
    #[arg(long, default_value_t = 1_000_000)]
    pub preload_large: u64,
    /// The full run: preloads of 1 M and 10 M keys (overrides the two
    /// above), 100 M keys in the partitioned inbox.
    #[arg(long)]
    pub full: bool,
    /// Keys preloaded into the partitioned inbox's claim-cost row, over ten
    /// daily partitions.
    #[arg(long, default_value_t = 10_000_000)]
    pub partitioned_keys: u64,
    /// Claims per simulated day of the partitioned inbox's week.
    #[arg(long, default_value_t = 100_000)]
    pub week_rows_per_day: u64,
    /// Rows per prune batch.
    #[arg(long, default_value_t = 10_000)]
    pub prune_batch: u32,

    /// Messages per end-to-end measurement.
    #[arg(long, default_value_t = 2_000)]
    pub e2e_messages: u64,
    /// Messages per SQS end-to-end measurement: moto, the local SQS, answers
    /// tens of requests per second.
    #[arg(long, default_value_t = 200)]
    pub sqs_messages: u64,

    /// Rows per relay measurement (written to the outbox untimed first).
    #[arg(long, default_value_t = 2_000)]
    pub relay_messages: u64,
    /// Keys the relay rows are spread over, round robin.
    #[arg(long, default_value_t = 1_000)]
    pub relay_keys: u64,
    /// Rows per relay batch (`RelayOptions::batch_size`).
    #[arg(long, default_value_t = 100)]
    pub relay_batch: usize,
    /// `max_in_flight` of the pipelined relay rows, and the in-flight count
    /// of their raw-publish baseline.
    #[arg(long, default_value_t = 64)]
    pub relay_in_flight: usize,
    /// Destinations of the relay rows, comma-separated broker ids
    /// (`redis-stream`, `nats`, `amqp`, `kafka`, `mqtt`, `rocketmq`, `sqs`),
    /// `none` for a publisher that accepts at once.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "none,redis-stream,nats,amqp,kafka"
    )]
    pub relay_brokers: Vec<String>,

    /// Python of the virtual environment holding AWS Lambda Powertools for
    /// the peer rows (default: target/bench-venv/bin/python of this
    /// checkout, which scripts/bench.sh installs); missing → those rows are skipped.
    #[arg(long, env = "IDEMQ_BENCH_PYTHON")]
    pub peer_python: Option<std::path::PathBuf>,

    /// Messages per measurement of the set-based batch rows (`batch`).
    #[arg(long, default_value_t = 20_000)]
    pub batch_messages: u64,
    /// The `idemq` binary the CLI rows run (default: the one next to this
    /// binary, which scripts/bench.sh builds in release).
    #[arg(long, env = "IDEMQ_BENCH_CLI")]
    pub cli: Option<std::path::PathBuf>,

    /// Sections to run, comma-separated: sql, sql-partitioned, batch,
    /// claim, partitioned, redis, cluster, memory, e2e, relay, peers.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "sql,sql-partitioned,batch,claim,partitioned,redis,memory,e2e,relay,peers"
    )]
    pub only: Vec<String>,
}

impl Config {
    fn runs(&self, section: &str) -> bool {
        self.only.iter().any(|s| s == section)
    }
}

/// One payment as the ledger handler and the bare effect both decode it.
pub struct Payment {
    /// The business key.
    pub id: String,
    /// The account.
    pub account: String,
    /// The amount.
    pub amount: i64,
}

impl Payment {
    /// Decodes a payment payload.
    pub fn parse(payload: &[u8]) -> Result<Self, String> {
        let v: serde_json::Value = serde_json::from_slice(payload).map_err(|e| e.to_string())?;
        Ok(Self {
            id: v["payment_id"].as_str().ok_or("no payment_id")?.to_owned(),
            account: v["account"].as_str().unwrap_or_default().to_owned(),
            amount: v["amount"].as_i64().unwrap_or(0),
        })
    }
}

/// A fresh random payment key, shaped like the preloaded ones (`pay-` + 32 hex).
pub fn payment_key() -> String {
    format!("pay-{}", uuid::Uuid::new_v4().simple())
}

/// `n` payments with fresh random keys, as JSON payloads.
pub fn payments(n: u64) -> Vec<Message> {
    (0..n)
        .map(|i| {
            Message::new(format!(
                r#"{{"payment_id":"{}","account":"acct-{}","amount":{}}}"#,
                payment_key(),
                i % 100,
                1 + i % 1000
            ))
        })
        .collect()
}

/// A closed queue holding `n` fresh payments (filled before any timer starts).
pub fn queue_of(n: u64) -> MemoryQueue {
    let queue = MemoryQueue::new("bench");
    for m in payments(n) {
        queue.push(m);
    }
    queue.close();
    queue
}

/// The bare run loop: the engine's shape (up to `concurrency` deliveries in
/// flight, one task each, ack after the work) without key, fingerprint or
/// store. Returns the messages handled.
pub async fn drain<F, Fut>(
    mut source: QueueSource,
    concurrency: usize,
    work: F,
) -> anyhow::Result<u64>
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let work = Arc::new(work);
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let mut done = 0;
    loop {
        while let Some(r) = tasks.try_join_next() {
            r??;
            done += 1;
        }
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let Some(delivery) = source.next().await? else {
            break;
        };
        let work = Arc::clone(&work);
        tasks.spawn(async move {
            let (message, _meta, _defect, acker) = delivery.into_parts();
            work(message).await?;
            acker.ack().await?;
            drop(permit);
            Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
        done += 1;
    }
    Ok(done)
}

/// Items per second.
pub fn rate(n: u64, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// Prints progress to stderr (the table goes to stdout).
#[macro_export]
macro_rules! progress {
    ($($arg:tt)*) => {{
        eprintln!("[{:>7.1}s] {}", $crate::started().elapsed().as_secs_f64(), format!($($arg)*));
    }};
}

/// When the run started.
pub fn started() -> Instant {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The order of A and B in round `r`: A first on even rounds.
pub fn a_first(r: usize) -> bool {
    r % 2 == 0
}

/// The order in which round `r` runs `n` alternatives: forwards on the
/// rounds where the baseline goes first, backwards on the others.
pub fn round_order(r: usize, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if !a_first(r) {
        order.reverse();
    }
    order
}

fn machine(lines: &[(String, String)]) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or_else(String::new, |kb| {
            format!(", {:.0} GiB RAM", kb as f64 / 1_048_576.0)
        });
    let mut out = format!("- Machine: {cores} cores ({cpu}){memory}\n");
    for (what, version) in lines {
        out.push_str(&format!("- {what}: {version}\n"));
    }
    out
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut cfg = Config::parse();
    started();
    if cfg.full {
        cfg.preload_small = 1_000_000;
        cfg.preload_large = 10_000_000;
        cfg.partitioned_keys = 100_000_000;
    }
    anyhow::ensure!(cfg.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(
        cfg.concurrency >= 1 && cfg.in_flight >= 1 && cfg.relay_in_flight >= 1,
        "concurrency must be at least 1"
    );
    let mut rows: Vec<Row> = Vec::new();
    let mut versions: Vec<(String, String)> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut pg_bare = None;

    if cfg.runs("sql") {
        let (r, base, v) = sql::postgres_rows(&cfg).await.context("PostgreSQL rows")?;
        rows.extend(r);
        versions.push(v);
        pg_bare = Some(base);
        let (r, _, v, counters) = sql::mysql_rows(&cfg).await.context("MariaDB rows")?;
        rows.extend(r);
        versions.push(v);
        notes.push(counters);
        let (r, _, v) = sql::sqlite_rows(&cfg).await.context("SQLite rows")?;
        rows.extend(r);
        versions.push(v);
    }
    if cfg.runs("sql-partitioned") {
        let r = sql::partitioned_rows(&cfg)
            .await
            .context("partitioned inbox rows")?;
        rows.extend(r);
    }
    if cfg.runs("batch") {
        let (r, n) = batch::rows(&cfg).await.context("set-based batch rows")?;
        rows.extend(r);
        notes.extend(n);
    }
    if cfg.runs("claim") {
        rows.extend(claim::rows(&cfg).await.context("claim-cost rows")?);
    }
    if cfg.runs("partitioned") {
        rows.extend(
            partitioned::rows(&cfg)
                .await
                .context("partitioned-inbox rows")?,
        );
    }
    if cfg.runs("redis") {
        let (r, v) = lease::redis_rows(&cfg).await.context("Redis rows")?;
        rows.extend(r);
        versions.push(v);
    }
    if cfg.runs("cluster") {
        rows.extend(
            lease::cluster_rows(&cfg)
                .await
                .context("Redis Cluster rows")?,
        );
    }
    if cfg.runs("memory") {
        rows.extend(lease::memory_rows(&cfg).await.context("memory rows")?);
    }
    if cfg.runs("e2e") {
        let (r, n) = e2e::rows(&cfg, pg_bare).await.context("end-to-end rows")?;
        rows.extend(r);
        notes.extend(n);
    }
    if cfg.runs("relay") {
        let (r, n) = relay::rows(&cfg).await.context("relay rows")?;
        rows.extend(r);
        notes.extend(n);
    }
    if cfg.runs("peers") {
        let (r, n, v) = peers::rows(&cfg).await.context("peer rows")?;
        rows.extend(r);
        notes.extend(n);
        versions.extend(v);
    }
    if versions.iter().all(|(w, _)| !w.starts_with("PostgreSQL"))
        && (cfg.runs("claim")
            || cfg.runs("partitioned")
            || cfg.runs("e2e")
            || cfg.runs("relay")
            || cfg.runs("peers"))
    {
        if let Ok(v) = sql::postgres_version(&cfg.postgres).await {
            versions.push(v);
        }
    }

    println!("## idemq benchmark\n");
    print!("{}", machine(&versions));
    println!(
        "- Run: {} rounds per row (median), {} messages per SQL measurement, concurrency {}, pool {}, \
         Redis {} in flight, claim-cost preloads 0 / {} / {} keys{}, {:.0} s in all\n",
        cfg.rounds,
        cfg.messages,
        cfg.concurrency,
        cfg.pool,
        cfg.in_flight,
        report::keys(cfg.preload_small),
        report::keys(cfg.preload_large),
        if cfg.full { " (--full)" } else { "" },
        started().elapsed().as_secs_f64()
    );
    print!("{}", report::table(&rows));
    for note in notes {
        println!("\n{note}");
    }
    Ok(())
}
