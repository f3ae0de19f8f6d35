//! End to end into PostgreSQL: a JSON-lines file, and each reachable broker
//! (RabbitMQ, Kafka, NATS JetStream, Redis Streams, MQTT, SQS, RocketMQ),
//! through the real sources and the same ledger consumer as the PostgreSQL
//! per-message row.
//!
//! The JSON-lines rows are timed from the start of the run to the end of the
//! file. Broker rows publish all messages first (untimed) and are timed from
//! the first processed message to the last, so that connecting and a
//! consumer-group join are not counted: they are the steady-state rate. Every
//! broker is opened through the broker registry, from a URL of
//! [`BROKER_ROWS`]: a broker differs only in its URL and its row's words.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::source::jsonl::JsonLinesSource;
use idemq::source::registry::{self, Broker};
use idemq::source::{Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::{Outcome, OutcomeKind};
use tokio::sync::Notify;

use crate::report::{median, paired, Row};
use crate::sql::{postgres, prefix};
use crate::{payments, progress, rate, Config};

const SECTION: &str = "End to end → PostgreSQL";
/// The longest one broker measurement may take before the row is given up.
const BROKER_LIMIT: Duration = Duration::from_secs(180);
/// The longest connecting a publisher or a source may take.
pub(crate) const CONNECT_LIMIT: Duration = Duration::from_secs(30);
/// How long the first publish of a round is retried: a broker may still be
/// registering a topic it creates on first use (RocketMQ).
const FIRST_PUBLISH_LIMIT: Duration = Duration::from_secs(30);
/// Mosquitto keeps at most 1 000 queued messages per session by default
/// (`max_queued_messages`) and drops the rest, so the MQTT rows publish at most this many.
const MQTT_QUEUE: u64 = 1_000;

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

/// The ledger every end-to-end row writes, with the run's settings.
struct Ledger<'a> {
    cfg: &'a Config,
    store: &'a PostgresStore,
    table: &'a str,
}

/// Awaits `step` for at most `limit`; an error or the timeout names `what`.
pub(crate) async fn within<T, E: Into<anyhow::Error>>(
    limit: Duration,
    what: &str,
    step: impl Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(limit, step)
        .await
        .map_err(|_| anyhow::anyhow!("{what} timed out after {limit:?}"))?
        .map_err(|e| e.into().context(what.to_owned()))
}

/// Publishes `n` fresh payments, up to 64 at once, and flushes. The first
/// one goes alone and is retried for up to [`FIRST_PUBLISH_LIMIT`].
async fn publish_all(publisher: Arc<dyn Publisher>, n: u64) -> anyhow::Result<()> {
    let mut messages = payments(n).into_iter();
    if let Some(first) = messages.next() {
        let deadline = Instant::now() + FIRST_PUBLISH_LIMIT;
        let mut retried = false;
        while let Err(e) = publisher.publish(&first).await {
            anyhow::ensure!(
                Instant::now() < deadline,
                "the first publish failed for {FIRST_PUBLISH_LIMIT:?}: {e}"
            );
            if !retried {
                progress!("e2e: the first publish failed, retrying for up to {FIRST_PUBLISH_LIMIT:?}: {e}");
                retried = true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let mut set = tokio::task::JoinSet::new();
    for message in messages {
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
async fn consume(ledger: &Ledger<'_>, source: impl Source, n: u64) -> anyhow::Result<f64> {
    let clock = Clock::new(n);
    let observer = Arc::clone(&clock);
    let consumer = postgres::consumer_with(
        ledger.store,
        ledger.table,
        ledger.cfg.concurrency,
        move |o| observer.observe(o),
    )?;
    let waiter = Arc::clone(&clock);
    let run = consumer.run_until(source, async move { waiter.done.notified().await });
    if let Err(e) = within(BROKER_LIMIT, "consuming", run).await {
        let processed = clock.processed.load(Ordering::SeqCst);
        return Err(e.context(format!("{processed} of {n} messages processed")));
    }
    let rows = postgres::ledger_rows(ledger.store.pool(), ledger.table).await?;
    anyhow::ensure!(rows == n as i64, "{rows} ledger rows after {n} messages");
    clock
        .steady_rate()
        .ok_or_else(|| anyhow::anyhow!("fewer than {n} messages were processed"))
}

async fn jsonl_round(ledger: &Ledger<'_>, path: &std::path::Path) -> anyhow::Result<f64> {
    let n = ledger.cfg.e2e_messages;
    let consumer = postgres::consumer(ledger.store, ledger.table, ledger.cfg.concurrency)?;
    let started = Instant::now();
    let summary = consumer.run(JsonLinesSource::open(path).await?).await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(
        summary.count(OutcomeKind::Processed) == n,
        "JSON lines: {summary}"
    );
    Ok(rate(n, elapsed))
}

/// One steady-state broker round on `url`: connects the publisher, publishes
/// `n` fresh payments (untimed), connects the source (before publishing
/// where the broker keeps only what arrives once a subscription exists, else
/// after), and times the ledger consumer from the first processed message to
/// the last. What the URL created is removed afterwards, whatever happened.
async fn broker_round(
    ledger: &Ledger<'_>,
    broker: &'static Broker,
    url: &str,
    n: u64,
) -> anyhow::Result<f64> {
    let publisher: Arc<dyn Publisher> = Arc::from(
        within(
            CONNECT_LIMIT,
            "connecting the publisher",
            (broker.open_publisher)(url),
        )
        .await?,
    );
    let result = async {
        let publish = within(
            BROKER_LIMIT,
            "publishing",
            publish_all(Arc::clone(&publisher), n),
        );
        let source = (broker.open_source)(url);
        let source = if broker.subscribe_before_publish {
            let source = within(CONNECT_LIMIT, "connecting the source", source).await?;
            publish.await?;
            source
        } else {
            publish.await?;
            within(CONNECT_LIMIT, "connecting the source", source).await?
        };
        consume(ledger, source, n).await
    }
    .await;
    drop(publisher);
    if let Err(e) = (broker.remove)(url).await {
        progress!(
            "e2e: could not remove the {} objects of this round: {e}",
            broker.name
        );
    }
    result
}

/// How the benchmark runs one broker of the registry: its URL on the
/// servers of the run's [`Config`], and what its row says.
struct BrokerRow {
    /// [`Broker::id`].
    id: &'static str,
    /// What the row measures, and the source's setting worth naming.
    what: &'static str,
    setting: Option<&'static str>,
    /// A fresh round's URL for objects called `name`.
    url: fn(&Config, &str) -> String,
}

/// The brokers measured, in the order of the table.
const BROKER_ROWS: &[BrokerRow] = &[
    BrokerRow {
        id: "amqp",
        what: "RabbitMQ queue",
        setting: Some("prefetch 32"),
        url: |cfg, name| format!("{}?queue={name}", cfg.amqp),
    },
    BrokerRow {
        id: "kafka",
        what: "Kafka topic (3 partitions)",
        setting: None,
        url: |cfg, name| {
            format!(
                "kafka://{}/{name}?group={name}_g&create_partitions=3",
                cfg.kafka
            )
        },
    },
    BrokerRow {
        id: "nats",
        what: "NATS JetStream pull consumer",
        setting: Some("batch 10"),
        url: |cfg, name| format!("{}/{name}/{name}_g?subject={name}.in&create=true", cfg.nats),
    },
    BrokerRow {
        id: "redis-stream",
        what: "Redis stream, consumer group",
        setting: Some("count 10"),
        url: |cfg, name| {
            let server = cfg.redis.strip_prefix("redis://").unwrap_or(&cfg.redis);
            format!("redis-stream://{server}/{name}?group={name}_g")
        },
    },
    BrokerRow {
        id: "mqtt",
        what: "MQTT 5 topic, QoS 1",
        setting: None,
        // A persistent session that expires a minute after the round.
        url: |cfg, name| {
            format!(
                "{}/idemq_bench/{name}?client_id={name}&session_expiry=60s&min_retention=60s",
                cfg.mqtt
            )
        },
    },
    BrokerRow {
        id: "sqs",
        what: "SQS queue on moto",
        setting: Some("batch 10"),
        url: |cfg, name| {
            format!(
                "sqs://{name}?endpoint={}&region=us-east-1&create=true",
                cfg.sqs
            )
        },
    },
    BrokerRow {
        id: "rocketmq",
        what: "RocketMQ topic, push consumer",
        setting: None,
        url: |cfg, name| format!("rocketmq://{}/{name}?group={name}_g", cfg.rocketmq),
    },
];

/// The URL of fresh objects called `name` on the broker `id` (as
/// [`Broker::id`]) at the run's servers, as the end-to-end rows use them.
pub(crate) fn broker_url(id: &str, cfg: &Config, name: &str) -> Option<String> {
    BROKER_ROWS
        .iter()
        .find(|row| row.id == id)
        .map(|row| (row.url)(cfg, name))
}

impl BrokerRow {
    /// The registered broker.
    fn broker(&self) -> anyhow::Result<&'static Broker> {
        registry::brokers()
            .find(|b| b.id == self.id)
            .ok_or_else(|| anyhow::anyhow!("broker {} is not registered", self.id))
    }

    /// Messages per measurement.
    fn messages(&self, cfg: &Config) -> u64 {
        match self.id {
            "mqtt" => cfg.e2e_messages.min(MQTT_QUEUE),
            "sqs" => cfg.sqs_messages,
            _ => cfg.e2e_messages,
        }
    }

    /// The row's measurement column.
    fn label(&self, cfg: &Config) -> String {
        let setting = self.setting.map_or_else(String::new, |s| format!("{s}, "));
        format!(
            "{} → PostgreSQL ({setting}concurrency {}), steady state",
            self.what, cfg.concurrency
        )
    }

    /// A note printed under the table when the row is measured.
    fn note(&self, cfg: &Config) -> Option<String> {
        match self.id {
            "sqs" => Some(format!(
                "- SQS → PostgreSQL: {} messages per round (`--sqs-messages`), not {}: moto, \
                 the local SQS used here, answers tens of requests per second, so the row \
                 measures moto more than idemq.",
                cfg.sqs_messages, cfg.e2e_messages
            )),
            "mqtt" if cfg.e2e_messages > MQTT_QUEUE => Some(format!(
                "- MQTT → PostgreSQL: {MQTT_QUEUE} messages per round, not {}: Mosquitto \
                 queues at most {MQTT_QUEUE} messages per session by default \
                 (`max_queued_messages`) and drops the rest.",
                cfg.e2e_messages
            )),
            _ => None,
        }
    }

    /// One round over fresh broker objects called `name`.
    async fn round(&self, ledger: &Ledger<'_>, name: &str) -> anyhow::Result<f64> {
        let url = (self.url)(ledger.cfg, name);
        broker_round(ledger, self.broker()?, &url, self.messages(ledger.cfg)).await
    }
}

/// The rows of every broker that answers; a round that fails on its first
/// try marks the broker unavailable (a note instead of a row).
///
/// Each broker round is paired with a JSON-lines round run right before it
/// (odd rounds) or right after it (even rounds), and the row's ratio is the
/// median of those paired ratios, which cancels this shared machine's drift
/// between rounds.
async fn broker_rows(
    ledger: &Ledger<'_>,
    jsonl_path: &std::path::Path,
    rows: &mut Vec<Row>,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    let cfg = ledger.cfg;
    for broker in BROKER_ROWS {
        let name = broker.broker().map_or(broker.id, |b| b.name);
        let mut values = Vec::new();
        let mut paired_jsonl = Vec::new();
        let mut skipped = None;
        for r in 0..cfg.rounds {
            let unique = format!(
                "idemq_bench_{}_{r}_{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            );
            let jsonl_first = r % 2 == 0;
            let mut jsonl = None;
            if jsonl_first {
                postgres::clear(ledger.store, ledger.table).await?;
                jsonl = Some(jsonl_round(ledger, jsonl_path).await?);
            }
            postgres::clear(ledger.store, ledger.table).await?;
            let round = broker.round(ledger, &unique).await;
            if round.is_ok() && !jsonl_first {
                postgres::clear(ledger.store, ledger.table).await?;
                jsonl = Some(jsonl_round(ledger, jsonl_path).await?);
            }
            match round {
                Ok(v) => {
                    let j = jsonl.unwrap_or_default();
                    progress!(
                        "e2e round {}: {name} {v:.0} msg/s, paired JSON lines {j:.0} msg/s",
                        r + 1
                    );
                    values.push(v);
                    paired_jsonl.push(j);
                }
                Err(e) => {
                    progress!("e2e: {name} failed: {e:#}");
                    skipped = Some(format!("{e:#}"));
                    break;
                }
            }
        }
        match skipped {
            Some(why) if values.is_empty() => {
                notes.push(format!("- {name} → PostgreSQL: not measured ({why})."));
                continue;
            }
            Some(why) => notes.push(format!(
                "- {name} → PostgreSQL: a later round failed ({why}); median of {} rounds.",
                values.len()
            )),
            None => {}
        }
        notes.extend(broker.note(cfg));
        let ratio = paired(&values, &paired_jsonl);
        let mut row = Row::new(
            SECTION,
            broker.label(cfg),
            broker.messages(cfg),
            median(&values),
            "msg/s",
        )
        .ratio_of(ratio, "JSON lines (paired)");
        if broker.id == "kafka" {
            row = row.target("≥ 0.5× JSON lines (issue 12)", ratio >= 0.5);
        }
        rows.push(row);
    }
    Ok(())
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
    let table = postgres::setup(&store).await?;
    let ledger = Ledger {
        cfg,
        store: &store,
        table: &table,
    };
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
            postgres::clear(&store, &table).await?;
            let v = jsonl_round(&ledger, &path).await?;
            progress!("e2e round {}: JSON lines {v:.0} msg/s", r + 1);
            jsonl.push(v);
        }
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
        broker_rows(&ledger, &path, &mut rows, &mut notes).await?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(rows)
    }
    .await;
    postgres::teardown(&store, &table).await;
    store.pool().close().await;
    result.map(|rows| (rows, notes))
}
