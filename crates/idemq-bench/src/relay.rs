//! The outbox relay: rows of a PostgreSQL outbox published to each
//! reachable broker (Redis Streams, NATS JetStream, RabbitMQ, Kafka, and
//! on request MQTT, RocketMQ, SQS), one row at a time (`max_in_flight` 1)
//! and pipelined (several keys in flight, one message per key), each beside
//! the broker's raw publish rate through the same publisher with the same
//! number in flight — what the broker can take.
//!
//! A relay round writes the rows first (untimed, one `INSERT … SELECT
//! generate_series`, then `VACUUM ANALYZE`), then times `Relay::relay_once`
//! from the first batch until every row was published, confirmed and
//! deleted. A raw round publishes the same shape of message (id, key,
//! `event_id` and `event_type` headers, the payment payload) with a bounded
//! number in flight, then flushes. In every round the raw and the relay
//! measurement of one concurrency run back to back, in alternating order,
//! and the row's ratio is the median of the per-round ratios. The row
//! "no broker" publishes to a publisher that accepts at once: the relay's
//! own ceiling on this database.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures_util::stream::{FuturesUnordered, StreamExt};
use idemq::outbox::{Outbox, Relay, RelayOptions};
use idemq::source::registry::{self, Broker};
use idemq::source::Publisher;
use idemq::{Headers, Message, SourceError};

use crate::e2e::{broker_url, within, CONNECT_LIMIT};
use crate::report::{median, paired, Row};
use crate::sql::prefix;
use crate::{a_first, payments, progress, rate, Config};

/// The destination (`aggregatetype`) of the bench's rows.
const DESTINATION: &str = "payments";
/// The event type of the bench's rows.
const EVENT_TYPE: &str = "PaymentCaptured";
/// The longest one measurement may take before the broker is given up.
const MEASURE_LIMIT: Duration = Duration::from_secs(300);

/// A publisher that accepts every message at once: the relay's ceiling.
struct Accepting;

#[async_trait]
impl Publisher for Accepting {
    async fn publish(&self, _message: &Message) -> Result<(), SourceError> {
        Ok(())
    }
}

/// The outbox the relay rows read, on its own table prefix.
struct Table {
    pool: sqlx::PgPool,
    outbox: Outbox<sqlx::Postgres>,
}

impl Table {
    async fn open(cfg: &Config) -> anyhow::Result<Self> {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(cfg.pool)
            .connect(&cfg.postgres)
            .await?;
        let outbox = Outbox::<sqlx::Postgres>::new(&prefix("relay"))?;
        outbox.migrate(&pool).await?;
        Ok(Self { pool, outbox })
    }

    /// Writes `n` rows over `keys` keys, round robin (row `i` has key
    /// `k-{i % keys}`), in one statement, and tidies the table up.
    async fn fill(&self, n: u64, keys: u64) -> anyhow::Result<()> {
        let table = self.outbox.table();
        let sql = format!(
            "INSERT INTO {table} (id, aggregatetype, aggregateid, type, payload, created_at) \
             SELECT gen_random_uuid()::text, $1, 'k-' || (i % $2), $3, \
             convert_to(json_build_object('payment_id', 'pay-' || md5(random()::text), \
             'account', 'acct-' || (i % 100), 'amount', 1 + i % 1000)::text, 'UTF8'), \
             (extract(epoch from clock_timestamp()) * 1000)::bigint \
             FROM generate_series(0, $4 - 1) AS i"
        );
        sqlx::query(&sql)
            .bind(DESTINATION)
            .bind(i64::try_from(keys.max(1))?)
            .bind(EVENT_TYPE)
            .bind(i64::try_from(n)?)
            .execute(&self.pool)
            .await?;
        sqlx::query(&format!("VACUUM ANALYZE {table}"))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn drop(&self) {
        let table = self.outbox.table().to_owned();
        for sql in [
            format!("DROP TABLE IF EXISTS {table}"),
            format!("DROP TABLE IF EXISTS {}", self.outbox.dead_table()),
            format!("DROP FUNCTION IF EXISTS {table}_notify()"),
            format!("DROP TABLE IF EXISTS {}schema_migrations", prefix("relay")),
        ] {
            let _ = sqlx::query(&sql).execute(&self.pool).await;
        }
        self.pool.close().await;
    }
}

/// Relays `n` fresh rows through `publisher` with `max_in_flight`; rows/s
/// from the first batch to the last row deleted.
async fn relay_round(
    cfg: &Config,
    table: &Table,
    publisher: Arc<dyn Publisher>,
    max_in_flight: usize,
) -> anyhow::Result<f64> {
    let n = cfg.relay_messages;
    table.fill(n, cfg.relay_keys).await?;
    let mut options = RelayOptions::default();
    options.batch_size = cfg.relay_batch;
    options.max_in_flight = max_in_flight;
    options.listen = false;
    options.name = format!("bench-{max_in_flight}");
    let relay = Relay::new(table.pool.clone(), table.outbox.clone(), publisher, options);
    let started = Instant::now();
    let mut published = 0u64;
    while published < n {
        let report = relay.relay_once().await?;
        anyhow::ensure!(
            !report.failed && report.dead == 0,
            "a publish failed: {report:?}"
        );
        anyhow::ensure!(report.published > 0, "the relay stalled: {report:?}");
        published += report.published as u64;
    }
    let elapsed = started.elapsed();
    let left = table.outbox.pending(&table.pool).await?;
    anyhow::ensure!(
        published == n && left == 0,
        "{published} of {n} rows relayed, {left} left"
    );
    Ok(rate(n, elapsed))
}

/// `n` messages shaped as the relay sends them: id, key, `event_id` and
/// `event_type` headers, the payment payload.
fn messages(n: u64, keys: u64) -> Vec<Message> {
    payments(n)
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let id = uuid::Uuid::new_v4().to_string();
            Message {
                id: Some(id.clone()),
                key: Some(format!("k-{}", i as u64 % keys.max(1))),
                headers: Headers::new()
                    .with("event_id", id.into_bytes())
                    .with("event_type", EVENT_TYPE),
                payload: m.payload,
            }
        })
        .collect()
}

/// Publishes `n` messages through `publisher`, `in_flight` at a time from
/// one task (as the relay does), then flushes; messages/s.
async fn raw_round(
    cfg: &Config,
    publisher: &Arc<dyn Publisher>,
    in_flight: usize,
) -> anyhow::Result<f64> {
    let all = messages(cfg.relay_messages, cfg.relay_keys);
    let started = Instant::now();
    let mut pending = FuturesUnordered::new();
    for message in &all {
        if pending.len() >= in_flight.max(1) {
            if let Some(r) = pending.next().await {
                r?;
            }
        }
        pending.push(publisher.publish(message));
    }
    while let Some(r) = pending.next().await {
        r?;
    }
    publisher.flush().await?;
    Ok(rate(all.len() as u64, started.elapsed()))
}

/// Publishes one message, retrying for up to 30 s: a broker may still be
/// registering what the publisher created (a RocketMQ topic), and the
/// connection warms up outside the timings.
async fn warm_up(publisher: &Arc<dyn Publisher>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    for message in messages(1, 1) {
        while let Err(e) = publisher.publish(&message).await {
            anyhow::ensure!(Instant::now() < deadline, "the first publish failed: {e}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    publisher.flush().await?;
    Ok(())
}

/// What one broker's rounds measured.
#[derive(Default)]
struct Measured {
    raw_one: Vec<f64>,
    relay_one: Vec<f64>,
    raw_many: Vec<f64>,
    relay_many: Vec<f64>,
}

/// One round on `publisher`: raw and relay at 1 in flight, then at
/// `--relay-in-flight`, each pair in the round's order.
async fn round(
    cfg: &Config,
    table: &Table,
    publisher: &Arc<dyn Publisher>,
    raw: bool,
    r: usize,
    measured: &mut Measured,
) -> anyhow::Result<()> {
    for in_flight in [1, cfg.relay_in_flight] {
        let mut raw_rate = None;
        if raw && a_first(r) {
            raw_rate = Some(raw_round(cfg, publisher, in_flight).await?);
        }
        let relay_rate = relay_round(cfg, table, Arc::clone(publisher), in_flight).await?;
        if raw && !a_first(r) {
            raw_rate = Some(raw_round(cfg, publisher, in_flight).await?);
        }
        let (raws, relays) = if in_flight == 1 {
            (&mut measured.raw_one, &mut measured.relay_one)
        } else {
            (&mut measured.raw_many, &mut measured.relay_many)
        };
        relays.push(relay_rate);
        if let Some(v) = raw_rate {
            raws.push(v);
        }
        progress!(
            "relay round {}: {in_flight} in flight: relay {relay_rate:.0} msg/s{}",
            r + 1,
            raw_rate.map_or_else(String::new, |v| format!(", raw publish {v:.0} msg/s"))
        );
    }
    Ok(())
}

/// A broker's publisher on fresh objects called `name`.
async fn open(
    cfg: &Config,
    broker: &'static Broker,
    name: &str,
) -> anyhow::Result<(Arc<dyn Publisher>, String)> {
    let url = broker_url(broker.id, cfg, name)
        .ok_or_else(|| anyhow::anyhow!("no URL for broker {}", broker.id))?;
    let publisher = within(
        CONNECT_LIMIT,
        "connecting the publisher",
        (broker.open_publisher)(&url),
    )
    .await?;
    Ok((Arc::from(publisher), url))
}

/// One broker's rounds (`None`: the accepting publisher).
async fn measure(
    cfg: &Config,
    table: &Table,
    broker: Option<&'static Broker>,
) -> anyhow::Result<Measured> {
    let mut measured = Measured::default();
    for r in 0..cfg.rounds {
        match broker {
            None => {
                let publisher: Arc<dyn Publisher> = Arc::new(Accepting);
                round(cfg, table, &publisher, false, r, &mut measured).await?;
            }
            Some(broker) => {
                let name = format!(
                    "idemq_bench_relay_{}_{r}_{}",
                    std::process::id(),
                    &uuid::Uuid::new_v4().simple().to_string()[..8]
                );
                let (publisher, url) = open(cfg, broker, &name).await?;
                let result = within(MEASURE_LIMIT, "measuring", async {
                    warm_up(&publisher).await?;
                    round(cfg, table, &publisher, true, r, &mut measured).await
                })
                .await;
                drop(publisher);
                if let Err(e) = (broker.remove)(&url).await {
                    progress!("relay: could not remove the {} objects: {e}", broker.name);
                }
                // Rows a failed round left behind must not count in the next.
                if result.is_err() {
                    let _ = sqlx::query(&format!("DELETE FROM {}", table.outbox.table()))
                        .execute(&table.pool)
                        .await;
                }
                result?;
            }
        }
    }
    Ok(measured)
}

/// The rows of one broker (`None`: no broker).
fn broker_rows(cfg: &Config, name: &str, m: &Measured) -> Vec<Row> {
    let section = format!("Relay: PostgreSQL outbox → {name}");
    let n = cfg.relay_messages;
    let many = cfg.relay_in_flight;
    let speedup = paired(&m.relay_many, &m.relay_one);
    let mut rows = Vec::new();
    if m.raw_one.is_empty() {
        rows.push(Row::new(
            &section,
            "relay, max_in_flight 1 (one row at a time)",
            n,
            median(&m.relay_one),
            "msg/s",
        ));
        rows.push(
            Row::new(
                &section,
                format!("relay, max_in_flight {many}"),
                n,
                median(&m.relay_many),
                "msg/s",
            )
            .ratio_of(speedup, "max_in_flight 1"),
        );
        return rows;
    }
    rows.push(Row::new(
        &section,
        "raw publish, 1 in flight",
        n,
        median(&m.raw_one),
        "msg/s",
    ));
    rows.push(
        Row::new(
            &section,
            "relay, max_in_flight 1 (one row at a time)",
            n,
            median(&m.relay_one),
            "msg/s",
        )
        .ratio_of(paired(&m.relay_one, &m.raw_one), "raw, 1 in flight"),
    );
    rows.push(Row::new(
        &section,
        format!("raw publish, {many} in flight"),
        n,
        median(&m.raw_many),
        "msg/s",
    ));
    rows.push(
        Row::new(
            &section,
            format!("relay, max_in_flight {many} ({speedup:.2}× max_in_flight 1)"),
            n,
            median(&m.relay_many),
            "msg/s",
        )
        .ratio_of(
            paired(&m.relay_many, &m.raw_many),
            &format!("raw, {many} in flight"),
        ),
    );
    rows
}

/// The relay rows, and notes on brokers that were not measured.
pub async fn rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, Vec<String>)> {
    let table = Table::open(cfg).await?;
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let result = async {
        for id in &cfg.relay_brokers {
            let broker = if id == "none" {
                None
            } else {
                match registry::brokers().find(|b| b.id == id.as_str()) {
                    Some(b) => Some(b),
                    None => {
                        notes.push(format!("- Relay → {id}: not a broker of this build."));
                        continue;
                    }
                }
            };
            let name = broker.map_or("no broker (a publisher that accepts at once)", |b| b.name);
            match measure(cfg, &table, broker).await {
                Ok(m) => rows.extend(broker_rows(cfg, name, &m)),
                Err(e) if broker.is_some() => {
                    progress!("relay: {name} failed: {e:#}");
                    notes.push(format!("- Relay → {name}: not measured ({e:#})."));
                }
                Err(e) => return Err(e),
            }
        }
        anyhow::Ok(())
    }
    .await;
    table.drop().await;
    result?;
    notes.push(format!(
        "- Relay rows: {} rows per measurement over {} keys (round robin), batches of {}, \
         PostgreSQL outbox; the ratio of a relay row is to the raw publish rate of the same \
         publisher with the same number in flight, paired per round.",
        cfg.relay_messages, cfg.relay_keys, cfg.relay_batch
    ));
    Ok((rows, notes))
}
