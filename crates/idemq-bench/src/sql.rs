//! The SQL rows: the bare effect beside idemq per-message, on PostgreSQL,
//! MariaDB and SQLite.
//!
//! The effect is one INSERT into a ledger table without indexes (like the
//! test suite's ledger). The bare effect runs it as `BEGIN; INSERT; COMMIT`
//! through the same sqlx pool (the store's own pool), the same concurrency
//! and the same queue and run-loop shape as the engine; idemq runs the same
//! INSERT inside the claim's transaction
//! (`BEGIN; INSERT inbox … ON CONFLICT DO NOTHING; INSERT ledger; DELETE attempts; COMMIT`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::engine::BatchOptions;
use idemq::store::sql::SqlOptions;
use idemq::store::StoreAdmin;
use idemq::{handler_fn, Consumer, HandlerError, KeySpec, Message, OutcomeKind};

use crate::report::{median, paired, Row};
use crate::{a_first, drain, progress, queue_of, rate, Config, Payment};

/// The consumer name every SQL row uses.
pub const CONSUMER: &str = "bench";

/// A unique table prefix for this process.
pub fn prefix(tag: &str) -> String {
    format!("bench_{}_{tag}_", std::process::id())
}

/// The ledger table's DDL (the same on all three databases).
pub fn ledger_ddl(table: &str) -> String {
    format!(
        "CREATE TABLE {table} (msg_key VARCHAR(512) NOT NULL, account VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
    )
}

macro_rules! backend {
    ($m:ident, $Store:ty, $Db:ty, $insert:literal, $clear:literal) => {
        /// One SQL backend's consumer, bare effect and housekeeping.
        pub mod $m {
            use super::*;

            /// The store's transaction.
            pub type Tx = sqlx::Transaction<'static, $Db>;

            /// The ledger INSERT.
            pub fn insert_sql(ledger: &str) -> String {
                format!($insert, ledger)
            }

            /// The idemq consumer writing the ledger through the claim's transaction.
            pub fn consumer(
                store: &$Store,
                ledger: &str,
                concurrency: usize,
            ) -> anyhow::Result<Consumer<$Store>> {
                consumer_with(store, ledger, concurrency, |_| {})
            }

            /// [`consumer`] calling `hook` with every outcome.
            pub fn consumer_with(
                store: &$Store,
                ledger: &str,
                concurrency: usize,
                hook: impl Fn(&idemq::Outcome) + Send + Sync + 'static,
            ) -> anyhow::Result<Consumer<$Store>> {
                let insert: Arc<str> = insert_sql(ledger).into();
                Ok(Consumer::builder(CONSUMER, store.clone())
                    .key(KeySpec::json("/payment_id"))
                    .concurrency(concurrency)
                    .on_outcome(hook)
                    .handler(handler_fn(move |ctx, tx: &mut Tx| {
                        let insert = Arc::clone(&insert);
                        Box::pin(async move {
                            let p = Payment::parse(&ctx.message.payload)
                                .map_err(HandlerError::permanent)?;
                            sqlx::query(&insert)
                                .bind(ctx.key)
                                .bind(p.account)
                                .bind(p.amount)
                                .execute(&mut **tx)
                                .await?;
                            Ok(None)
                        })
                    }))
                    .build()?)
            }

            /// The bare effect: the same INSERT in its own transaction per
            /// message, same pool, same concurrency, no inbox.
            pub async fn bare(
                pool: &sqlx::Pool<$Db>,
                ledger: &str,
                n: u64,
                concurrency: usize,
            ) -> anyhow::Result<f64> {
                let insert: Arc<str> = insert_sql(ledger).into();
                let pool = pool.clone();
                let queue = queue_of(n);
                let started = Instant::now();
                let done = drain(queue.source(), concurrency, move |message: Message| {
                    let pool = pool.clone();
                    let insert = Arc::clone(&insert);
                    async move {
                        let p = Payment::parse(&message.payload).map_err(anyhow::Error::msg)?;
                        let mut tx = pool.begin().await?;
                        sqlx::query(&insert)
                            .bind(&p.id)
                            .bind(&p.account)
                            .bind(p.amount)
                            .execute(&mut *tx)
                            .await?;
                        tx.commit().await?;
                        Ok(())
                    }
                })
                .await?;
                let elapsed = started.elapsed();
                anyhow::ensure!(done == n, "bare effect handled {done} of {n}");
                Ok(rate(n, elapsed))
            }

            /// idemq per-message over `n` fresh payments; checks every one was processed.
            pub async fn idemq(consumer: &Consumer<$Store>, n: u64) -> anyhow::Result<f64> {
                let queue = queue_of(n);
                let started = Instant::now();
                let summary = consumer.run(queue.source()).await?;
                let elapsed = started.elapsed();
                anyhow::ensure!(
                    summary.count(OutcomeKind::Processed) == n,
                    "idemq processed {summary}, expected {n}"
                );
                Ok(rate(n, elapsed))
            }

            /// Ledger rows.
            pub async fn ledger_rows(pool: &sqlx::Pool<$Db>, ledger: &str) -> anyhow::Result<i64> {
                let (n,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {ledger}"))
                    .fetch_one(pool)
                    .await?;
                Ok(n)
            }

            /// Empties the ledger, the inbox and the attempts.
            pub async fn clear(store: &$Store, ledger: &str) -> anyhow::Result<()> {
                let t = store.tables();
                for table in [ledger, &t.inbox, &t.attempts] {
                    sqlx::query(&format!("{} {table}", $clear))
                        .execute(store.pool())
                        .await?;
                }
                Ok(())
            }

            /// Migrated tables with `prefix` and an empty ledger.
            pub async fn setup(store: &$Store) -> anyhow::Result<String> {
                store.migrate().await?;
                let ledger = format!("{}ledger", store.tables().prefix);
                sqlx::query(&format!("DROP TABLE IF EXISTS {ledger}"))
                    .execute(store.pool())
                    .await?;
                sqlx::query(&ledger_ddl(&ledger))
                    .execute(store.pool())
                    .await?;
                Ok(ledger)
            }

            /// Drops the tables of `store` (a partitioned layout's too) and
            /// the ledger.
            pub async fn teardown(store: &$Store, ledger: &str) {
                let t = store.tables();
                let tables = [
                    ledger,
                    &t.inbox,
                    &t.attempts,
                    &t.dead_letters,
                    &t.migrations,
                    &t.offsets,
                    &t.effects,
                ]
                .map(str::to_owned);
                for table in tables.into_iter().chain(t.partition_tables()) {
                    let _ = sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}"))
                        .execute(store.pool())
                        .await;
                }
                for function in t.partition_functions() {
                    let _ = sqlx::raw_sql(&format!("DROP FUNCTION IF EXISTS {function}"))
                        .execute(store.pool())
                        .await;
                }
            }

            /// idemq batch mode (batches of `size`, one transaction each)
            /// over `n` fresh payments; checks every one was processed.
            pub async fn batched(
                consumer: &Consumer<$Store>,
                n: u64,
                size: usize,
            ) -> anyhow::Result<f64> {
                let queue = queue_of(n);
                let options = BatchOptions::new(size, Duration::from_millis(5));
                let started = Instant::now();
                let summary = consumer.run_batched(queue.source(), options).await?;
                let elapsed = started.elapsed();
                anyhow::ensure!(
                    summary.count(OutcomeKind::Processed) == n,
                    "idemq batch {size} processed {summary}, expected {n}"
                );
                Ok(rate(n, elapsed))
            }

            /// Warm-up, then `rounds` rounds: bare and per-message in A/B
            /// order, then each batch size.
            pub async fn measure(
                cfg: &Config,
                store: &$Store,
                concurrency: usize,
                label: &str,
            ) -> anyhow::Result<Measured> {
                let ledger = setup(store).await?;
                let consumer = consumer(store, &ledger, concurrency)?;
                let result = async {
                    let warm = cfg.messages.min(200);
                    clear(store, &ledger).await?;
                    bare(store.pool(), &ledger, warm, concurrency).await?;
                    clear(store, &ledger).await?;
                    idemq(&consumer, warm).await?;
                    let (mut b, mut i) = (Vec::new(), Vec::new());
                    let mut batches: Vec<Vec<f64>> =
                        BATCH_SIZES.iter().map(|_| Vec::new()).collect();
                    for r in 0..cfg.rounds {
                        for bare_turn in if a_first(r) {
                            [true, false]
                        } else {
                            [false, true]
                        } {
                            clear(store, &ledger).await?;
                            let v = if bare_turn {
                                bare(store.pool(), &ledger, cfg.messages, concurrency).await?
                            } else {
                                idemq(&consumer, cfg.messages).await?
                            };
                            let rows = ledger_rows(store.pool(), &ledger).await?;
                            anyhow::ensure!(
                                rows == cfg.messages as i64,
                                "{label}: {rows} ledger rows after {} messages",
                                cfg.messages
                            );
                            progress!(
                                "{label} round {}: {} {v:.0} msg/s",
                                r + 1,
                                if bare_turn { "bare" } else { "idemq" }
                            );
                            if bare_turn {
                                b.push(v)
                            } else {
                                i.push(v)
                            }
                        }
                        for (k, size) in BATCH_SIZES.iter().enumerate() {
                            clear(store, &ledger).await?;
                            let v = batched(&consumer, cfg.messages, *size).await?;
                            let rows = ledger_rows(store.pool(), &ledger).await?;
                            anyhow::ensure!(
                                rows == cfg.messages as i64,
                                "{label} batch {size}: {rows} ledger rows after {} messages",
                                cfg.messages
                            );
                            progress!("{label} round {}: batch {size} {v:.0} msg/s", r + 1);
                            batches[k].push(v);
                        }
                    }
                    Ok(Measured {
                        bare: b,
                        per_message: i,
                        batches,
                    })
                }
                .await;
                teardown(store, &ledger).await;
                result
            }
        }
    };
}

backend!(
    postgres,
    idemq::store::sql::postgres::PostgresStore,
    sqlx::Postgres,
    "INSERT INTO {} (msg_key, account, amount) VALUES ($1, $2, $3)",
    "TRUNCATE TABLE"
);
backend!(
    mysql,
    idemq::store::sql::mysql::MySqlStore,
    sqlx::MySql,
    "INSERT INTO {} (msg_key, account, amount) VALUES (?, ?, ?)",
    "TRUNCATE TABLE"
);
backend!(
    sqlite,
    idemq::store::sql::sqlite::SqliteStore,
    sqlx::Sqlite,
    "INSERT INTO {} (msg_key, account, amount) VALUES (?, ?, ?)",
    "DELETE FROM"
);

/// The target of the per-message rows: idemq ≥ 90 % of the bare effect.
pub const PER_MESSAGE_TARGET: f64 = 0.90;

/// Batch sizes measured in batch mode.
pub const BATCH_SIZES: [usize; 3] = [10, 100, 1000];

/// The target of batch mode on PostgreSQL: ≥ 10× per-message.
pub const BATCH_TARGET: f64 = 10.0;

/// One backend's measurements, one value per round.
pub struct Measured {
    /// The bare effect.
    pub bare: Vec<f64>,
    /// idemq per-message.
    pub per_message: Vec<f64>,
    /// idemq batch mode, per [`BATCH_SIZES`] entry.
    pub batches: Vec<Vec<f64>>,
}

fn pair_rows(section: &str, shape: &str, n: u64, m: &Measured) -> (Vec<Row>, f64) {
    let (bare, idemq) = (&m.bare, &m.per_message);
    let b = median(bare);
    let ratio = paired(idemq, bare);
    let mut rows = vec![
        Row::new(section, format!("bare effect ({shape})"), n, b, "msg/s"),
        Row::new(
            section,
            "idemq per-message (claim + same INSERT, one transaction)",
            n,
            median(idemq),
            "msg/s",
        )
        .ratio_of(ratio, "bare")
        .target(
            format!("≥ {:.0} % of bare", PER_MESSAGE_TARGET * 100.0),
            ratio >= PER_MESSAGE_TARGET,
        ),
    ];
    for (size, values) in BATCH_SIZES.iter().zip(&m.batches) {
        let vs_per_message = paired(values, idemq);
        let mut row = Row::new(
            section,
            format!("idemq batch of {size} (one claim statement, one commit)"),
            n,
            median(values),
            "msg/s",
        )
        .ratio_of(vs_per_message, "per-message");
        // The target is stated for PostgreSQL.
        if section == "PostgreSQL" && *size == 100 {
            row = row.target(
                format!("≥ {BATCH_TARGET:.0}× per-message"),
                vs_per_message >= BATCH_TARGET,
            );
        }
        rows.push(row);
    }
    (rows, b)
}

/// `("PostgreSQL", version + durability settings)`.
pub async fn postgres_version(url: &str) -> anyhow::Result<(String, String)> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await?;
    let (v,): (String,) = sqlx::query_as("SHOW server_version")
        .fetch_one(&pool)
        .await?;
    let (f,): (String,) = sqlx::query_as("SHOW fsync").fetch_one(&pool).await?;
    let (s,): (String,) = sqlx::query_as("SHOW synchronous_commit")
        .fetch_one(&pool)
        .await?;
    let (b,): (String,) = sqlx::query_as("SHOW shared_buffers")
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok((
        "PostgreSQL".into(),
        format!("{v} (fsync={f}, synchronous_commit={s}, shared_buffers={b})"),
    ))
}

/// PostgreSQL: rows, the bare-effect median, the version line.
pub async fn postgres_rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, f64, (String, String))> {
    use idemq::store::sql::postgres::PostgresStore;
    progress!("PostgreSQL: bare effect vs idemq per-message");
    let version = postgres_version(&cfg.postgres).await?;
    let store = PostgresStore::connect_with(
        &cfg.postgres,
        SqlOptions::default()
            .table_prefix(prefix("pg"))
            .max_connections(cfg.pool),
    )
    .await?;
    let m = postgres::measure(cfg, &store, cfg.concurrency, "PostgreSQL").await?;
    store.pool().close().await;
    let (rows, base) = pair_rows("PostgreSQL", "BEGIN; INSERT; COMMIT", cfg.messages, &m);
    Ok((rows, base, version))
}

/// MariaDB: rows, the bare-effect median, the version line, and the note
/// of the server's counters per message ([`mysql_profile`]).
pub async fn mysql_rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, f64, (String, String), String)> {
    use idemq::store::sql::mysql::MySqlStore;
    progress!("MariaDB: bare effect vs idemq per-message");
    let store = MySqlStore::connect_with(
        &cfg.mysql,
        SqlOptions::default()
            .table_prefix(prefix("my"))
            .max_connections(cfg.pool),
    )
    .await?;
    let (v,): (String,) = sqlx::query_as("SELECT VERSION()")
        .fetch_one(store.pool())
        .await?;
    let (flush,): (i64,) =
        sqlx::query_as("SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED)")
            .fetch_one(store.pool())
            .await?;
    let m = mysql::measure(cfg, &store, cfg.concurrency, "MariaDB").await?;
    let profile = mysql_profile(cfg, &store).await;
    store.pool().close().await;
    let (rows, base) = pair_rows("MariaDB", "BEGIN; INSERT; COMMIT", cfg.messages, &m);
    Ok((
        rows,
        base,
        (
            "MariaDB".into(),
            format!("{v} (innodb_flush_log_at_trx_commit={flush})"),
        ),
        anyhow::Context::context(profile, "MariaDB server counters")?,
    ))
}

/// The same pairs on a time-partitioned inbox (daily partitions, so one
/// populated partition: the layout's own cost, not a long retention's),
/// PostgreSQL and MariaDB, each against its own bare effect.
pub async fn partitioned_rows(cfg: &Config) -> anyhow::Result<Vec<Row>> {
    use idemq::store::sql::mysql::MySqlStore;
    use idemq::store::sql::postgres::PostgresStore;
    use idemq::store::sql::InboxPartitions;
    let options = |tag: &str| {
        SqlOptions::default()
            .table_prefix(prefix(tag))
            .max_connections(cfg.pool)
            .partitioned_inbox(InboxPartitions::daily())
    };
    progress!("PostgreSQL, partitioned inbox: bare effect vs idemq per-message");
    let store = PostgresStore::connect_with(&cfg.postgres, options("pgpart")).await?;
    let m = postgres::measure(cfg, &store, cfg.concurrency, "PostgreSQL partitioned").await?;
    store.pool().close().await;
    let (mut rows, _) = pair_rows(
        "PostgreSQL, partitioned inbox",
        "BEGIN; INSERT; COMMIT",
        cfg.messages,
        &m,
    );
    progress!("MariaDB, partitioned inbox: bare effect vs idemq per-message");
    let store = MySqlStore::connect_with(&cfg.mysql, options("mypart")).await?;
    let m = mysql::measure(cfg, &store, cfg.concurrency, "MariaDB partitioned").await?;
    store.pool().close().await;
    rows.extend(
        pair_rows(
            "MariaDB, partitioned inbox",
            "BEGIN; INSERT; COMMIT",
            cfg.messages,
            &m,
        )
        .0,
    );
    Ok(rows)
}

/// SQLite: rows, the bare-effect median, the version line.
pub async fn sqlite_rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, f64, (String, String))> {
    use idemq::store::sql::sqlite::SqliteStore;
    progress!("SQLite: bare effect vs idemq per-message");
    let dir = cfg
        .sqlite_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("idemq-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite://{}", dir.join("bench.db").display());
    let store =
        SqliteStore::connect_with(&url, SqlOptions::default().table_prefix(prefix("lite"))).await?;
    let (v,): (String,) = sqlx::query_as("SELECT sqlite_version()")
        .fetch_one(store.pool())
        .await?;
    let result = sqlite::measure(cfg, &store, cfg.concurrency, "SQLite").await;
    store.pool().close().await;
    let _ = std::fs::remove_dir_all(&dir);
    let m = result?;
    let (rows, base) = pair_rows(
        "SQLite",
        "BEGIN; INSERT; COMMIT, 1 connection",
        cfg.messages,
        &m,
    );
    Ok((
        rows,
        base,
        (
            "SQLite".into(),
            format!(
                "{v} (WAL, synchronous=FULL, file in {})",
                dir.parent()
                    .map_or(String::new(), |p| p.display().to_string())
            ),
        ),
    ))
}

/// MariaDB's server-side counters (`SHOW GLOBAL STATUS`) read around one
/// bare and one idemq per-message run of `cfg.messages` each: what each side
/// costs the server per message (statements, transactions, redo log writes),
/// and one round trip's time on the same pool. The note says what bounds
/// the per-message ratio.
async fn mysql_profile(
    cfg: &Config,
    store: &idemq::store::sql::mysql::MySqlStore,
) -> anyhow::Result<String> {
    const COUNTERS: [&str; 7] = [
        "Questions",
        "Com_begin",
        "Com_commit",
        "Com_stmt_execute",
        "Com_insert",
        "Com_delete",
        "Innodb_log_writes",
    ];
    async fn status(pool: &sqlx::MySqlPool) -> anyhow::Result<Vec<i64>> {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SHOW GLOBAL STATUS").fetch_all(pool).await?;
        Ok(COUNTERS
            .iter()
            .map(|name| {
                rows.iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(name))
                    .and_then(|(_, v)| v.parse().ok())
                    .unwrap_or(0)
            })
            .collect())
    }
    progress!("MariaDB: server counters per message, bare vs idemq");
    let ledger = mysql::setup(store).await?;
    let consumer = mysql::consumer(store, &ledger, cfg.concurrency)?;
    let n = cfg.messages;
    let result = async {
        let mut conn = store.pool().acquire().await?;
        let trips = 2_000u32;
        let started = Instant::now();
        for _ in 0..trips {
            sqlx::query("SELECT 1").execute(&mut *conn).await?;
        }
        let round_trip = started.elapsed() / trips;
        drop(conn);
        let mut lines = Vec::new();
        for bare_turn in [true, false] {
            mysql::clear(store, &ledger).await?;
            let before = status(store.pool()).await?;
            let rate = if bare_turn {
                mysql::bare(store.pool(), &ledger, n, cfg.concurrency).await?
            } else {
                mysql::idemq(&consumer, n).await?
            };
            let after = status(store.pool()).await?;
            let per: Vec<String> = COUNTERS
                .iter()
                .zip(before.iter().zip(&after))
                .map(|(name, (b, a))| format!("{name} {:.2}", (a - b) as f64 / n as f64))
                .collect();
            lines.push(format!(
                "{} {rate:.0} msg/s: {}",
                if bare_turn { "bare" } else { "idemq" },
                per.join(", ")
            ));
        }
        Ok::<_, anyhow::Error>(format!(
            "MariaDB server counters per message ({n} messages, {} in flight; the two \
             `SHOW GLOBAL STATUS` reads count once each): {}. One `SELECT 1` round trip on \
             this pool, sequential: {:.0} µs.",
            cfg.concurrency,
            lines.join("; "),
            round_trip.as_secs_f64() * 1e6
        ))
    }
    .await;
    mysql::teardown(store, &ledger).await;
    result
}
