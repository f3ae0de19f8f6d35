//! End to end into PostgreSQL: a JSON-lines file, and each reachable broker
//! (RabbitMQ, Kafka), through the real sources and the same ledger consumer
//! as the PostgreSQL per-message row.
//!
//! The JSON-lines rows are timed from the start of the run to the end of the
//! file. Broker rows publish all messages first (untimed) and are timed from
//! the first processed message to the last, so that connecting and a
//! consumer-group join are not counted: they are the steady-state rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::source::amqp::{AmqpConfig, AmqpPublisher, AmqpSource};
use idemq::source::jsonl::JsonLinesSource;
use idemq::source::kafka::{create_topic, KafkaConfig, KafkaPublisher, KafkaSource};
use idemq::source::{Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::{Outcome, OutcomeKind};
use tokio::sync::Notify;

use crate::report::{median, Row};
use crate::sql::{postgres, prefix};
use crate::{payments, progress, rate, Config};

const SECTION: &str = "End to end → PostgreSQL";
/// The longest one broker measurement may take before the row is given up.
const BROKER_LIMIT: Duration = Duration::from_secs(180);

/// Counts processed outcomes; marks the first and the `n`-th.
struct Clock {
    n: u64,
    processed: AtomicU64,
    first: Mutex<Option<Instant>>,
    last: Mutex<Option<Instant>>,
    done: Notify,
}

impl Clock {
    fn new(n: u64) -> Arc<Self> {
        Arc::new(Self {
            n,
            processed: AtomicU64::new(0),
            first: Mutex::new(None),
            last: Mutex::new(None),
            done: Notify::new(),
        })
    }

    fn observe(&self, outcome: &Outcome) {
        if outcome.kind() != OutcomeKind::Processed {
            return;
        }
        let count = self.processed.fetch_add(1, Ordering::SeqCst) + 1;
        let now = Instant::now();
        if count == 1 {
            *self.first.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        }
        if count == self.n {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
            self.done.notify_one();
        }
    }

    /// Messages/s between the first and the last processed message.
    fn steady_rate(&self) -> Option<f64> {
        let first = (*self.first.lock().unwrap_or_else(|p| p.into_inner()))?;
        let last = (*self.last.lock().unwrap_or_else(|p| p.into_inner()))?;
        Some(rate(self.n.saturating_sub(1), last.duration_since(first)))
    }
}

/// Publishes `n` fresh payments, up to 64 at once, and flushes.
async fn publish_all<P: Publisher + 'static>(publisher: Arc<P>, n: u64) -> anyhow::Result<()> {
    let mut set = tokio::task::JoinSet::new();
    for message in payments(n) {
        if set.len() >= 64 {
            if let Some(r) = set.join_next().await {
                r??;
            }
        }
        let publisher = Arc::clone(&publisher);
        set.spawn(async move { publisher.publish(&message).await });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    publisher.flush().await?;
    Ok(())
}

/// Runs the ledger consumer over `source` until `n` messages are processed.
async fn consume(
    cfg: &Config,
    store: &PostgresStore,
    ledger: &str,
    source: impl Source,
    n: u64,
) -> anyhow::Result<f64> {
    let clock = Clock::new(n);
    let observer = Arc::clone(&clock);
    let consumer =
        postgres::consumer_with(store, ledger, cfg.concurrency, move |o| observer.observe(o))?;
    let waiter = Arc::clone(&clock);
    let run = consumer.run_until(source, async move { waiter.done.notified().await });
    tokio::time::timeout(BROKER_LIMIT, run)
        .await
        .map_err(|_| anyhow::anyhow!("timed out after {BROKER_LIMIT:?}"))??;
    let rows = postgres::ledger_rows(store.pool(), ledger).await?;
    anyhow::ensure!(rows == n as i64, "{rows} ledger rows after {n} messages");
    clock
        .steady_rate()
        .ok_or_else(|| anyhow::anyhow!("fewer than {n} messages were processed"))
}

async fn jsonl_round(
    cfg: &Config,
    store: &PostgresStore,
    ledger: &str,
    path: &std::path::Path,
) -> anyhow::Result<f64> {
    let n = cfg.e2e_messages;
    let consumer = postgres::consumer(store, ledger, cfg.concurrency)?;
    let started = Instant::now();
    let summary = consumer.run(JsonLinesSource::open(path).await?).await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        summary.count(OutcomeKind::Processed) == n,
        "JSON lines: {summary}"
    );
    Ok(rate(n, elapsed))
}

async fn amqp_round(
    cfg: &Config,
    store: &PostgresStore,
    ledger: &str,
    round: usize,
) -> anyhow::Result<f64> {
    let queue = format!("idemq_bench_{}_{round}", std::process::id());
    let config = AmqpConfig::from_url(&format!("{}?queue={queue}", cfg.amqp))?;
    let publisher = Arc::new(
        tokio::time::timeout(
            Duration::from_secs(5),
            AmqpPublisher::connect(config.clone()),
        )
        .await
        .map_err(|_| anyhow::anyhow!("connecting timed out"))??,
    );
    let result = async {
        publish_all(Arc::clone(&publisher), cfg.e2e_messages).await?;
        let source = AmqpSource::connect(config.clone()).await?;
        consume(cfg, store, ledger, source, cfg.e2e_messages).await
    }
    .await;
    let _ = publisher.delete_topology().await;
    result
}

async fn kafka_round(
    cfg: &Config,
    store: &PostgresStore,
    ledger: &str,
    round: usize,
) -> anyhow::Result<f64> {
    let topic = format!("idemq_bench_{}_{round}", std::process::id());
    tokio::time::timeout(Duration::from_secs(15), create_topic(&cfg.kafka, &topic, 3))
        .await
        .map_err(|_| anyhow::anyhow!("creating the topic timed out"))??;
    let publisher = Arc::new(KafkaPublisher::connect(&cfg.kafka, &topic).await?);
    tokio::time::timeout(BROKER_LIMIT, publish_all(publisher, cfg.e2e_messages))
        .await
        .map_err(|_| anyhow::anyhow!("publishing timed out"))??;
    let source =
        KafkaSource::connect(KafkaConfig::new(&cfg.kafka, &topic, format!("{topic}_g"))).await?;
    consume(cfg, store, ledger, source, cfg.e2e_messages).await
}

/// The end-to-end rows, and notes on skipped brokers.
pub async fn rows(cfg: &Config, pg_bare: Option<f64>) -> anyhow::Result<(Vec<Row>, Vec<String>)> {
    let store = PostgresStore::connect_with(
        &cfg.postgres,
        SqlOptions::default()
            .table_prefix(prefix("e2e"))
            .max_connections(cfg.pool),
    )
    .await?;
    let ledger = postgres::setup(&store).await?;
    let mut notes = Vec::new();
    let n = cfg.e2e_messages;
    let result = async {
        let mut rows = Vec::new();
        // JSON lines.
        let dir = std::env::temp_dir().join(format!("idemq-bench-e2e-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("payments.jsonl");
        let mut text = String::new();
        for m in payments(n) {
            text.push_str(std::str::from_utf8(&m.payload)?);
            text.push('\n');
        }
        std::fs::write(&path, text)?;
        let mut jsonl = Vec::new();
        for r in 0..cfg.rounds {
            postgres::clear(&store, &ledger).await?;
            let v = jsonl_round(cfg, &store, &ledger, &path).await?;
            progress!("e2e round {}: JSON lines {v:.0} msg/s", r + 1);
            jsonl.push(v);
        }
        let _ = std::fs::remove_dir_all(&dir);
        let mut row = Row::new(
            SECTION,
            format!(
                "JSON lines file → PostgreSQL, concurrency {}",
                cfg.concurrency
            ),
            n,
            median(&jsonl),
            "msg/s",
        );
        if let Some(b) = pg_bare {
            row = row.ratio(b, "PostgreSQL bare");
        }
        rows.push(row);

        // Brokers: a round that fails on its first try marks the broker unavailable.
        for broker in ["RabbitMQ", "Kafka"] {
            let mut values = Vec::new();
            let mut skipped = None;
            for r in 0..cfg.rounds {
                postgres::clear(&store, &ledger).await?;
                let v = match broker {
                    "RabbitMQ" => amqp_round(cfg, &store, &ledger, r).await,
                    _ => kafka_round(cfg, &store, &ledger, r).await,
                };
                match v {
                    Ok(v) => {
                        progress!("e2e round {}: {broker} {v:.0} msg/s", r + 1);
                        values.push(v);
                    }
                    Err(e) => {
                        progress!("e2e: {broker} failed: {e:#}");
                        skipped = Some(format!("{e:#}"));
                        break;
                    }
                }
            }
            match skipped {
                Some(why) if values.is_empty() => {
                    notes.push(format!("- {broker} → PostgreSQL: not measured ({why})."))
                }
                Some(why) => notes.push(format!(
                    "- {broker} → PostgreSQL: a later round failed ({why}); median of {} rounds.",
                    values.len()
                )),
                None => {}
            }
            if !values.is_empty() {
                let what = match broker {
                    "RabbitMQ" => format!(
                        "RabbitMQ queue → PostgreSQL (prefetch 32, concurrency {}), steady state",
                        cfg.concurrency
                    ),
                    _ => format!(
                        "Kafka topic (3 partitions) → PostgreSQL (concurrency {}), steady state",
                        cfg.concurrency
                    ),
                };
                let mut row = Row::new(SECTION, what, n, median(&values), "msg/s");
                if let Some(b) = pg_bare {
                    row = row.ratio(b, "PostgreSQL bare");
                }
                rows.push(row);
            }
        }
        Ok(rows)
    }
    .await;
    postgres::teardown(&store, &ledger).await;
    store.pool().close().await;
    result.map(|rows| (rows, notes))
}
