//! Peers in the same run (`--only peers`): what a team would use instead of
//! idemq, on the same service and the same messages, rounds alternating with
//! idemq's rows.
//!
//! - **Redis: AWS Lambda Powertools for Python's idempotency utility**
//!   (`@idempotent_function` over `RedisCachePersistenceLayer`, outside
//!   Lambda), run by `peers/powertools_bench.py` in the virtual environment
//!   that `scripts/bench.sh` installs (`target/bench-venv`, pinned in
//!   `peers/requirements.txt`), sequentially and with a thread pool, beside
//!   idemq's `RedisStore` per message through the engine. Both sides do the
//!   same trivial work per message (count the payment's effect) and keep
//!   their records for the same 600 s. Without the virtual environment the
//!   Redis rows are left out with a note.
//! - **PostgreSQL: a hand-written sqlx inbox**, per message: check-then-insert
//!   (`SELECT` the processed row; if absent, one transaction inserting the
//!   processed row and the ledger row) and insert-first (`INSERT … ON
//!   CONFLICT DO NOTHING` into the processed table in the ledger insert's
//!   transaction; no row → duplicate, roll back), beside idemq per-message
//!   and batch mode (batches of 100) with the ledger consumer of the SQL
//!   section, on the store's own pool and with the same concurrency.
//!
//! Every message set holds about 10 % redeliveries: from position
//! [`REDELIVERY_GAP`] on, every tenth message repeats the payload of the
//! message that many positions earlier (further back than anything in
//! flight, so no side sees a copy while its first is still running). Every
//! measurement checks that each payment's effect ran exactly once and that
//! every redelivery was answered as a duplicate.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use idemq::engine::BatchOptions;
use idemq::source::queue::MemoryQueue;
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::{handler_fn, Consumer, KeySpec, Message, OutcomeKind, Summary};

use crate::report::{median, paired, Row};
use crate::sql::{postgres, prefix, CONSUMER};
use crate::{drain, payment_key, progress, rate, Config, Payment};

/// idemq per-message on Redis ≥ this many times Powertools sequential (issue 16).
pub const POWERTOOLS_TARGET: f64 = 10.0;

/// A redelivery repeats the message this many positions before it.
pub const REDELIVERY_GAP: usize = 256;

/// The batch size of the idemq batch-mode row.
const BATCH: usize = 100;

/// Record TTL on both Redis sides, as in the Redis section.
const TTL: Duration = Duration::from_secs(600);

/// The Powertools driver, written next to the run's message files.
const DRIVER: &str = include_str!("../peers/powertools_bench.py");

/// One message set: payloads in delivery order and the count of distinct payments.
struct MessageSet {
    payloads: Vec<String>,
    distinct: u64,
}

impl MessageSet {
    /// `n` payment payloads, about one in ten a redelivery of an earlier one.
    fn new(n: u64) -> Self {
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let mut payloads: Vec<String> = Vec::with_capacity(n);
        let mut distinct = 0u64;
        while payloads.len() < n {
            let at = payloads.len();
            if at >= REDELIVERY_GAP && at % 10 == 9 {
                payloads.push(payloads[at - REDELIVERY_GAP].clone());
            } else {
                payloads.push(format!(
                    r#"{{"payment_id":"{}","account":"acct-{}","amount":{}}}"#,
                    payment_key(),
                    distinct % 100,
                    1 + distinct % 1000
                ));
                distinct += 1;
            }
        }
        Self { payloads, distinct }
    }

    fn len(&self) -> u64 {
        self.payloads.len() as u64
    }

    fn redeliveries(&self) -> u64 {
        self.len() - self.distinct
    }

    /// A closed queue holding the set, in order.
    fn queue(&self) -> MemoryQueue {
        let queue = MemoryQueue::new("bench");
        for p in &self.payloads {
            queue.push(Message::new(p.clone()));
        }
        queue.close();
        queue
    }

    /// Checks an idemq run: every payment processed once, every redelivery a duplicate.
    fn check_summary(&self, what: &str, summary: &Summary) -> anyhow::Result<()> {
        anyhow::ensure!(
            summary.count(OutcomeKind::Processed) == self.distinct
                && summary.count(OutcomeKind::Duplicate) == self.redeliveries(),
            "{what}: {summary}, expected processed={} duplicate={}",
            self.distinct,
            self.redeliveries()
        );
        Ok(())
    }
}

/// Counts how often each payment's effect ran: the trivial work both Redis
/// sides do per message.
#[derive(Clone, Default)]
struct Effects(Arc<Mutex<HashMap<String, u32>>>);

impl Effects {
    fn record(&self, key: &str) {
        if let Ok(mut map) = self.0.lock() {
            *map.entry(key.to_owned()).or_default() += 1;
        }
    }

    /// Checks that `distinct` payments ran, each exactly once.
    fn check(&self, what: &str, distinct: u64) -> anyhow::Result<()> {
        let map = self
            .0
            .lock()
            .map_err(|_| anyhow::anyhow!("effects lock poisoned"))?;
        let total: u64 = map.values().map(|&v| u64::from(v)).sum();
        anyhow::ensure!(
            map.len() as u64 == distinct && total == distinct,
            "{what}: {total} effects over {} payments, expected each of {distinct} once",
            map.len()
        );
        Ok(())
    }
}

/// Both groups of peer rows, their notes and version lines.
pub async fn rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, Vec<String>, Vec<(String, String)>)> {
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut versions = Vec::new();
    match powertools_rows(cfg).await? {
        Ok((r, v)) => {
            rows.extend(r);
            versions.push(v);
        }
        Err(skipped) => {
            progress!("{skipped}");
            notes.push(skipped);
        }
    }
    rows.extend(
        postgres_rows(cfg)
            .await
            .context("hand-written inbox rows")?,
    );
    Ok((rows, notes, versions))
}

// ---------------------------------------------------------------- Redis

/// What one Powertools driver run printed.
struct DriverRun {
    rate: f64,
    versions: String,
}

/// Where the Powertools virtual environment's Python is.
fn python(cfg: &Config) -> PathBuf {
    cfg.peer_python.clone().unwrap_or_else(|| {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../target/bench-venv/bin/python"
        ))
    })
}

/// Runs the driver over `set` with `threads` threads and checks its counts.
async fn powertools(
    python: &std::path::Path,
    dir: &std::path::Path,
    redis_url: &str,
    prefix: &str,
    set: &MessageSet,
    threads: usize,
) -> anyhow::Result<DriverRun> {
    let file = dir.join("messages.jsonl");
    std::fs::write(&file, set.payloads.join("\n") + "\n")?;
    let mut cmd = std::process::Command::new(python);
    cmd.arg(dir.join("powertools_bench.py"))
        .arg("--redis")
        .arg(redis_url)
        .arg("--messages")
        .arg(&file)
        .arg("--prefix")
        .arg(prefix)
        .arg("--threads")
        .arg(threads.to_string());
    let out = tokio::task::spawn_blocking(move || cmd.output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(
        out.status.success(),
        "the Powertools driver failed ({}): {}",
        out.status,
        stderr.trim()
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "the Powertools driver printed {:?}",
            String::from_utf8_lossy(&out.stdout)
        )
    })?;
    let count = |k: &str| v[k].as_u64().unwrap_or(u64::MAX);
    anyhow::ensure!(
        count("messages") == set.len()
            && count("distinct") == set.distinct
            && count("effects") == set.distinct
            && count("effect_keys") == set.distinct
            && count("max_per_key") == 1,
        "Powertools, {threads} threads: expected {} messages, each of {} payments' effect once; driver said {v}",
        set.len(),
        set.distinct
    );
    Ok(DriverRun {
        rate: v["rate"].as_f64().unwrap_or(0.0),
        versions: format!(
            "aws-lambda-powertools {} (`RedisCachePersistenceLayer`, Python {}, redis-py {})",
            v["powertools"].as_str().unwrap_or("?"),
            v["python"].as_str().unwrap_or("?"),
            v["redis_py"].as_str().unwrap_or("?")
        ),
    })
}

/// idemq's `RedisStore` per message through the engine over `set`,
/// `concurrency` in flight, the handler counting effects.
async fn idemq_redis(
    store: &RedisStore,
    set: &MessageSet,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let effects = Effects::default();
    let counted = effects.clone();
    let consumer = Consumer::builder("bench", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(concurrency)
        .lease(Duration::from_secs(30))
        .handler(handler_fn(move |ctx, _lease: &mut RedisLease| {
            counted.record(ctx.key);
            Box::pin(async { Ok(None) })
        }))
        .build()?;
    let queue = set.queue();
    let started = Instant::now();
    let summary = consumer.run(queue.source()).await?;
    let elapsed = started.elapsed();
    set.check_summary("idemq Redis", &summary)?;
    effects.check("idemq Redis", set.distinct)?;
    Ok(rate(set.len(), elapsed))
}

/// The Powertools rows beside idemq's Redis rows; `Ok(Err(note))` when the
/// virtual environment is missing or its driver does not run.
async fn powertools_rows(
    cfg: &Config,
) -> anyhow::Result<Result<(Vec<Row>, (String, String)), String>> {
    let python = python(cfg);
    if !python.exists() {
        return Ok(Err(format!(
            "Peers: the Powertools rows are left out: no Python at {} \
             (scripts/bench.sh installs target/bench-venv from crates/idemq-bench/peers/requirements.txt; \
             or pass --peer-python)",
            python.display()
        )));
    }
    let dir = std::env::temp_dir().join(format!("idemq-bench-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("powertools_bench.py"), DRIVER)?;
    let prefix = format!("idemq-bench-p{}", std::process::id());
    let raw = redis::Client::open(cfg.redis.as_str())?
        .get_connection_manager()
        .await?;
    let result = measure_redis(cfg, &python, &dir, &prefix).await;
    let cleaned = crate::lease::cleanup(&raw, &prefix).await;
    let _ = std::fs::remove_dir_all(&dir);
    cleaned?;
    result
}

async fn measure_redis(
    cfg: &Config,
    python: &std::path::Path,
    dir: &std::path::Path,
    prefix: &str,
) -> anyhow::Result<Result<(Vec<Row>, (String, String)), String>> {
    let section = "Peers: Redis idempotency";
    let (n, threads) = (cfg.redis_sequential_messages, cfg.concurrency);
    progress!("Peers: Powertools idempotency (Python) vs idemq RedisStore, same Redis");
    let store = RedisStore::connect_with(
        &cfg.redis,
        RedisOptions::default()
            .prefix(prefix.to_owned())
            .retention(TTL),
    )
    .await?;
    // Warm-up: the interpreter's imports, connections, the script cache. A
    // driver that does not run at all leaves its rows out.
    let warm = MessageSet::new(n.min(300));
    let versions = match powertools(python, dir, &cfg.redis, prefix, &warm, 1).await {
        Ok(run) => run.versions,
        Err(e) => {
            return Ok(Err(format!(
                "Peers: the Powertools rows are left out: {e:#}"
            )))
        }
    };
    idemq_redis(&store, &MessageSet::new(n.min(300)), threads).await?;
    let mut m: [Vec<f64>; 4] = Default::default();
    for r in 0..cfg.rounds {
        for which in crate::round_order(r, 4) {
            let set = MessageSet::new(n);
            let v = match which {
                0 => {
                    powertools(python, dir, &cfg.redis, prefix, &set, 1)
                        .await?
                        .rate
                }
                1 => {
                    powertools(python, dir, &cfg.redis, prefix, &set, threads)
                        .await?
                        .rate
                }
                2 => idemq_redis(&store, &set, 1).await?,
                _ => idemq_redis(&store, &set, threads).await?,
            };
            m[which].push(v);
        }
        progress!(
            "Peers Redis round {}: Powertools sequential {:.0}, Powertools {threads} threads {:.0}, idemq concurrency 1 {:.0}, idemq concurrency {threads} {:.0} msg/s",
            r + 1,
            m[0][r],
            m[1][r],
            m[2][r],
            m[3][r]
        );
    }
    let threads_ratio = paired(&m[1], &m[0]);
    let seq_ratio = paired(&m[2], &m[0]);
    let many_ratio = paired(&m[3], &m[0]);
    let many_vs_threads = paired(&m[3], &m[1]);
    let [pt_seq, pt_threads, idemq_seq, idemq_many] = m.map(|v| median(&v));
    let redeliveries = MessageSet::new(n).redeliveries();
    let rows = vec![
        Row::new(
            section,
            format!(
                "AWS Lambda Powertools idempotency (Python, `@idempotent_function`, Redis layer), sequential; {redeliveries} of the messages are redeliveries"
            ),
            n,
            pt_seq,
            "msg/s",
        ),
        Row::new(
            section,
            format!("Powertools idempotency, {threads} threads"),
            n,
            pt_threads,
            "msg/s",
        )
        .ratio_of(threads_ratio, "Powertools sequential"),
        Row::new(
            section,
            "idemq RedisStore per-message, concurrency 1",
            n,
            idemq_seq,
            "msg/s",
        )
        .ratio_of(seq_ratio, "Powertools sequential"),
        Row::new(
            section,
            format!(
                "idemq RedisStore per-message, concurrency {threads} ({many_vs_threads:.2}× Powertools {threads} threads)"
            ),
            n,
            idemq_many,
            "msg/s",
        )
        .ratio_of(many_ratio, "Powertools sequential")
        .target(
            format!("≥ {POWERTOOLS_TARGET:.0}× Powertools sequential"),
            many_ratio >= POWERTOOLS_TARGET,
        ),
    ];
    Ok(Ok((rows, ("Powertools".into(), versions))))
}

// ----------------------------------------------------------- PostgreSQL

/// The hand-written inbox's statements.
struct Statements {
    /// `SELECT 1 FROM processed WHERE consumer = $1 AND message_key = $2`.
    seen: String,
    /// The processed row, plain (check-then-insert).
    mark: String,
    /// The processed row, `ON CONFLICT DO NOTHING` (insert-first).
    mark_first: String,
    /// The ledger row, as in the SQL section.
    ledger: String,
}

impl Statements {
    fn new(processed: &str, ledger: &str) -> Self {
        Self {
            seen: format!("SELECT 1 FROM {processed} WHERE consumer = $1 AND message_key = $2"),
            mark: format!("INSERT INTO {processed} (consumer, message_key) VALUES ($1, $2)"),
            mark_first: format!(
                "INSERT INTO {processed} (consumer, message_key) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            ),
            ledger: postgres::insert_sql(ledger),
        }
    }
}

/// The processed table a team would write: the consumer and the key as the
/// primary key, and when (no fingerprint, no index for pruning).
fn processed_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE {table} (consumer TEXT NOT NULL, message_key TEXT NOT NULL, \
         processed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, message_key))"
    )
}

fn unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "23505")
}

/// Check-then-insert for one message; `true` when its effect was applied.
async fn check_then_insert(
    pool: &sqlx::PgPool,
    sql: &Statements,
    message: &Message,
) -> anyhow::Result<bool> {
    let p = Payment::parse(&message.payload).map_err(anyhow::Error::msg)?;
    let seen: Option<(i32,)> = sqlx::query_as(&sql.seen)
        .bind(CONSUMER)
        .bind(&p.id)
        .fetch_optional(pool)
        .await?;
    if seen.is_some() {
        return Ok(false);
    }
    let mut tx = pool.begin().await?;
    match sqlx::query(&sql.mark)
        .bind(CONSUMER)
        .bind(&p.id)
        .execute(&mut *tx)
        .await
    {
        // A concurrent copy got in between the SELECT and the INSERT: the
        // transaction is dropped (rolled back), it is a duplicate.
        Err(e) if unique_violation(&e) => return Ok(false),
        Err(e) => return Err(e.into()),
        Ok(_) => {}
    }
    write_ledger(tx, sql, &p).await
}

/// The payment's ledger row in `tx`, then the commit: the effect applied.
async fn write_ledger(
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    sql: &Statements,
    p: &Payment,
) -> anyhow::Result<bool> {
    sqlx::query(&sql.ledger)
        .bind(&p.id)
        .bind(&p.account)
        .bind(p.amount)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(true)
}

/// Insert-first for one message; `true` when its effect was applied.
async fn insert_first(
    pool: &sqlx::PgPool,
    sql: &Statements,
    message: &Message,
) -> anyhow::Result<bool> {
    let p = Payment::parse(&message.payload).map_err(anyhow::Error::msg)?;
    let mut tx = pool.begin().await?;
    let marked = sqlx::query(&sql.mark_first)
        .bind(CONSUMER)
        .bind(&p.id)
        .execute(&mut *tx)
        .await?;
    if marked.rows_affected() == 0 {
        tx.rollback().await?;
        return Ok(false);
    }
    write_ledger(tx, sql, &p).await
}

/// One hand-written variant over `set` in the bare effect's run-loop shape.
async fn hand_written(
    pool: &sqlx::PgPool,
    sql: &Arc<Statements>,
    set: &MessageSet,
    concurrency: usize,
    first: bool,
) -> anyhow::Result<f64> {
    let applied = Arc::new(AtomicU64::new(0));
    let (pool, sql, counter) = (pool.clone(), Arc::clone(sql), Arc::clone(&applied));
    let queue = set.queue();
    let started = Instant::now();
    let done = drain(queue.source(), concurrency, move |message: Message| {
        let (pool, sql, counter) = (pool.clone(), Arc::clone(&sql), Arc::clone(&counter));
        async move {
            let applied = if first {
                insert_first(&pool, &sql, &message).await?
            } else {
                check_then_insert(&pool, &sql, &message).await?
            };
            counter.fetch_add(u64::from(applied), Ordering::Relaxed);
            Ok(())
        }
    })
    .await?;
    let elapsed = started.elapsed();
    let applied = applied.load(Ordering::Relaxed);
    anyhow::ensure!(
        done == set.len() && applied == set.distinct,
        "hand-written inbox: {done} messages handled, {applied} applied; expected {} and {}",
        set.len(),
        set.distinct
    );
    Ok(rate(set.len(), elapsed))
}

/// Checks the ledger: each payment exactly once.
async fn check_ledger(
    pool: &sqlx::PgPool,
    ledger: &str,
    set: &MessageSet,
    what: &str,
) -> anyhow::Result<()> {
    let (rows, keys): (i64, i64) = sqlx::query_as(&format!(
        "SELECT COUNT(*), COUNT(DISTINCT msg_key) FROM {ledger}"
    ))
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(
        rows == keys && keys as u64 == set.distinct,
        "{what}: {rows} ledger rows over {keys} payments, expected each of {} once",
        set.distinct
    );
    Ok(())
}

/// The hand-written inbox rows beside idemq per-message and batch mode.
async fn postgres_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    let section = "Peers: PostgreSQL inbox";
    progress!("Peers: hand-written sqlx inbox vs idemq, PostgreSQL");
    let store = PostgresStore::connect_with(
        &cfg.postgres,
        SqlOptions::default()
            .table_prefix(prefix("peer"))
            .max_connections(cfg.pool),
    )
    .await?;
    let ledger = postgres::setup(&store).await?;
    let processed = format!("{}processed", store.tables().prefix);
    let result = async {
        sqlx::query(&format!("DROP TABLE IF EXISTS {processed}"))
            .execute(store.pool())
            .await?;
        sqlx::query(&processed_ddl(&processed))
            .execute(store.pool())
            .await?;
        measure_postgres(cfg, &store, &ledger, &processed).await
    }
    .await;
    postgres::teardown(&store, &ledger).await;
    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {processed}"))
        .execute(store.pool())
        .await;
    store.pool().close().await;
    let m = result?;

    let (n, c) = (cfg.messages, cfg.concurrency);
    let check_ratio = paired(&m[0], &m[1]);
    let per_message_ratio = paired(&m[2], &m[1]);
    let batch_ratio = paired(&m[3], &m[1]);
    let batch_vs_per_message = paired(&m[3], &m[2]);
    let [check, first, per_message, batch] = m.map(|v| median(&v));
    let redeliveries = MessageSet::new(n).redeliveries();
    Ok(vec![
        Row::new(
            section,
            format!(
                "hand-written sqlx inbox, insert-first (`BEGIN; INSERT processed … ON CONFLICT DO NOTHING; INSERT ledger; COMMIT`), concurrency {c}; {redeliveries} of the messages are redeliveries"
            ),
            n,
            first,
            "msg/s",
        ),
        Row::new(
            section,
            "hand-written sqlx inbox, check-then-insert (`SELECT processed`; `BEGIN; INSERT processed; INSERT ledger; COMMIT`)",
            n,
            check,
            "msg/s",
        )
        .ratio_of(check_ratio, "insert-first"),
        Row::new(
            section,
            "idemq per-message (claim + same INSERT, one transaction)",
            n,
            per_message,
            "msg/s",
        )
        .ratio_of(per_message_ratio, "insert-first"),
        Row::new(
            section,
            format!(
                "idemq batch of {BATCH} (one claim statement, one commit; {batch_vs_per_message:.2}× per-message)"
            ),
            n,
            batch,
            "msg/s",
        )
        .ratio_of(batch_ratio, "insert-first"),
    ])
}

/// Rounds of: check-then-insert, insert-first, idemq per-message, idemq
/// batch (reversed in odd rounds), each on a cleared ledger.
async fn measure_postgres(
    cfg: &Config,
    store: &PostgresStore,
    ledger: &str,
    processed: &str,
) -> anyhow::Result<[Vec<f64>; 4]> {
    let (n, c) = (cfg.messages, cfg.concurrency);
    let sql = Arc::new(Statements::new(processed, ledger));
    let consumer = postgres::consumer(store, ledger, c)?;
    let pool = store.pool().clone();
    let clear = || async {
        postgres::clear(store, ledger).await?;
        sqlx::query(&format!("TRUNCATE TABLE {processed}"))
            .execute(&pool)
            .await?;
        Ok::<_, anyhow::Error>(())
    };
    let run = |which: usize, set: MessageSet| {
        let (sql, consumer, pool) = (&sql, &consumer, &pool);
        async move {
            let v = match which {
                0 => hand_written(pool, sql, &set, c, false).await?,
                1 => hand_written(pool, sql, &set, c, true).await?,
                2 => {
                    let queue = set.queue();
                    let started = Instant::now();
                    let summary = consumer.run(queue.source()).await?;
                    let elapsed = started.elapsed();
                    set.check_summary("idemq per-message", &summary)?;
                    rate(set.len(), elapsed)
                }
                _ => {
                    let queue = set.queue();
                    let options = BatchOptions::new(BATCH, Duration::from_millis(5));
                    let started = Instant::now();
                    let summary = consumer.run_batched(queue.source(), options).await?;
                    let elapsed = started.elapsed();
                    set.check_summary("idemq batch", &summary)?;
                    rate(set.len(), elapsed)
                }
            };
            check_ledger(pool, ledger, &set, NAMES[which]).await?;
            Ok::<f64, anyhow::Error>(v)
        }
    };
    // Warm-up: connections and prepared statements on every side.
    for which in 0..4 {
        clear().await?;
        run(which, MessageSet::new(n.min(300))).await?;
    }
    let mut m: [Vec<f64>; 4] = Default::default();
    for r in 0..cfg.rounds {
        for which in crate::round_order(r, 4) {
            clear().await?;
            m[which].push(run(which, MessageSet::new(n)).await?);
        }
        progress!(
            "Peers PostgreSQL round {}: check-then-insert {:.0}, insert-first {:.0}, idemq per-message {:.0}, idemq batch of {BATCH} {:.0} msg/s",
            r + 1,
            m[0][r],
            m[1][r],
            m[2][r],
            m[3][r]
        );
    }
    Ok(m)
}

/// The PostgreSQL peer measurements, in index order.
const NAMES: [&str; 4] = [
    "check-then-insert",
    "insert-first",
    "idemq per-message",
    "idemq batch",
];
