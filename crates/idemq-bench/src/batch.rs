//! Set-based batches on PostgreSQL (`--only batch`): what batch mode
//! reaches against what the database can do for the same work.
//!
//! - **raw multi-row limit**: per 100 messages one transaction with one
//!   multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING` of the claims
//!   into an inbox-shaped table and one multi-row ledger `INSERT`, the same
//!   pool and concurrency, no engine (what pgbench measured in issue 16);
//! - the library's batch mode with a per-message handler (one ledger
//!   `INSERT` per message) and with a set-based handler
//!   ([`Handler::handle_batch`]: one multi-row `INSERT` per batch);
//! - the CLI as a new user runs it, whole process, on a JSON-lines file:
//!   `idemq consume FILE --apply-sql 'INSERT …'` per message and with
//!   `--batch 100` (a merged statement per batch).
//!
//! Every run checks its ledger: one row per payment.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use futures_util::future::BoxFuture;
use idemq::engine::BatchResult;
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::{Consumer, Context, Handler, HandlerError, HandlerResult, KeySpec};
use sqlx::{PgPool, Postgres, QueryBuilder, Transaction};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::report::{median, paired, Row};
use crate::sql::{ledger_ddl, postgres, prefix, CONSUMER};
use crate::{payments, progress, rate, round_order, Config, Payment};

/// Messages per batch in every row of this section.
const BATCH: usize = 100;

/// CLI `--batch 100` against CLI per-message: the target.
const CLI_TARGET: f64 = 10.0;
/// CLI `--batch 100` against the raw multi-row limit: the target.
const RAW_TARGET: f64 = 0.5;

/// The ledger writer of the set-based rows: one multi-row `INSERT` per
/// batch, one single-row `INSERT` per message on the per-message path.
struct SetBasedLedger {
    ledger: String,
}

impl SetBasedLedger {
    async fn write(
        &self,
        batch: &[Context<'_>],
        tx: &mut Transaction<'static, Postgres>,
    ) -> Result<(), HandlerError> {
        let rows = batch
            .iter()
            .map(|ctx| Payment::parse(&ctx.message.payload).map(|p| (ctx.key.to_owned(), p)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(HandlerError::permanent)?;
        let mut insert = QueryBuilder::<Postgres>::new(format!(
            "INSERT INTO {} (msg_key, account, amount) ",
            self.ledger
        ));
        insert.push_values(rows, |mut row, (key, p)| {
            row.push_bind(key).push_bind(p.account).push_bind(p.amount);
        });
        insert.build().execute(&mut **tx).await?;
        Ok(())
    }
}

impl Handler<Transaction<'static, Postgres>> for SetBasedLedger {
    fn handle<'a>(
        &'a self,
        ctx: &'a Context<'a>,
        tx: &'a mut Transaction<'static, Postgres>,
    ) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            self.write(std::slice::from_ref(ctx), tx).await?;
            Ok(None)
        })
    }

    fn handles_batches(&self) -> bool {
        true
    }

    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Transaction<'static, Postgres>,
    ) -> BoxFuture<'a, BatchResult> {
        Box::pin(async move {
            self.write(batch, tx).await?;
            Ok(vec![None; batch.len()])
        })
    }
}

/// The raw limit: batches of [`BATCH`] payments, `concurrency` at once, each
/// one transaction of two multi-row statements.
async fn raw(
    pool: &PgPool,
    inbox: &str,
    ledger: &str,
    n: u64,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let messages = payments(n);
    let chunks: Vec<Vec<Payment>> = messages
        .chunks(BATCH)
        .map(|c| {
            c.iter()
                .map(|m| Payment::parse(&m.payload))
                .collect::<Result<_, _>>()
        })
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks: JoinSet<anyhow::Result<u64>> = JoinSet::new();
    let (inbox, ledger): (Arc<str>, Arc<str>) = (inbox.into(), ledger.into());
    let started = Instant::now();
    for chunk in chunks {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let (pool, inbox, ledger) = (pool.clone(), Arc::clone(&inbox), Arc::clone(&ledger));
        tasks.spawn(async move {
            let now = 0i64;
            let mut tx = pool.begin().await?;
            let mut claim = QueryBuilder::<Postgres>::new(format!(
                "INSERT INTO {inbox} (consumer, msg_key, fingerprint, first_seen_ms) "
            ));
            claim.push_values(&chunk, |mut row, p| {
                row.push_bind(CONSUMER)
                    .push_bind(&p.id)
                    .push_bind(&p.id)
                    .push_bind(now);
            });
            claim.push(" ON CONFLICT DO NOTHING RETURNING msg_key");
            let claimed = claim.build().fetch_all(&mut *tx).await?.len() as u64;
            let mut insert = QueryBuilder::<Postgres>::new(format!(
                "INSERT INTO {ledger} (msg_key, account, amount) "
            ));
            insert.push_values(&chunk, |mut row, p| {
                row.push_bind(&p.id)
                    .push_bind(&p.account)
                    .push_bind(p.amount);
            });
            insert.build().execute(&mut *tx).await?;
            tx.commit().await?;
            drop(permit);
            Ok(claimed)
        });
    }
    let mut claimed = 0;
    while let Some(done) = tasks.join_next().await {
        claimed += done??;
    }
    let elapsed = started.elapsed();
    anyhow::ensure!(claimed == n, "raw batches claimed {claimed} of {n}");
    Ok(rate(n, elapsed))
}

/// The library in batch mode over `n` fresh payments.
async fn library(consumer: &Consumer<PostgresStore>, n: u64) -> anyhow::Result<f64> {
    postgres::batched(consumer, n, BATCH).await
}

/// The `idemq` binary next to this one (a release build of idemq-cli).
fn cli_binary(cfg: &Config) -> PathBuf {
    cfg.cli.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join("idemq")))
            .unwrap_or_else(|| PathBuf::from("idemq"))
    })
}

/// `idemq consume` of `n` fresh payments written to `file`, whole process;
/// `batch`: with `--batch 100`.
async fn cli(
    cfg: &Config,
    file: &Path,
    table_prefix: &str,
    ledger: &str,
    n: u64,
    batch: bool,
) -> anyhow::Result<f64> {
    let mut text = String::new();
    for m in payments(n) {
        text.push_str(std::str::from_utf8(&m.payload)?);
        text.push('\n');
    }
    std::fs::write(file, text)?;
    let apply = format!(
        "INSERT INTO {ledger} (msg_key, account, amount) VALUES (:idemq_key, :account, :amount)"
    );
    let concurrency = cfg.concurrency.to_string();
    let mut args = vec![
        "--store",
        cfg.postgres.as_str(),
        "--table-prefix",
        table_prefix,
        "consume",
        file.to_str().unwrap_or_default(),
        "--no-checkpoint",
        "--consumer",
        CONSUMER,
        "--key",
        "json:/payment_id",
        "--concurrency",
        concurrency.as_str(),
        "--apply-sql",
        apply.as_str(),
    ];
    let size = BATCH.to_string();
    if batch {
        args.extend(["--batch", size.as_str()]);
    }
    let started = Instant::now();
    let out = tokio::process::Command::new(cli_binary(cfg))
        .args(&args)
        .env_remove("IDEMQ_STORE")
        .env_remove("IDEMQ_CONFIG")
        .output()
        .await?;
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success() && stdout.contains(&format!("processed={n} ")),
        "idemq consume{}: {}\n{stdout}{}",
        if batch { " --batch" } else { "" },
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(rate(n, elapsed))
}

/// Empties `tables`.
async fn truncate(pool: &PgPool, tables: &[&str]) -> anyhow::Result<()> {
    for table in tables {
        sqlx::query(&format!("TRUNCATE TABLE {table}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}

async fn ledger_rows(pool: &PgPool, ledger: &str) -> anyhow::Result<u64> {
    let (n,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {ledger}"))
        .fetch_one(pool)
        .await?;
    Ok(u64::try_from(n)?)
}

/// The five alternatives of a round, in [`round_order`].
const ALTERNATIVES: [&str; 5] = [
    "raw",
    "library per-message handler",
    "library set-based handler",
    "CLI per-message",
    "CLI --batch",
];

/// The section's rows and notes.
pub async fn rows(cfg: &Config) -> anyhow::Result<(Vec<Row>, Vec<String>)> {
    progress!("batch: PostgreSQL set-based batches");
    let n = cfg.batch_messages;
    let store = PostgresStore::connect_with(
        &cfg.postgres,
        SqlOptions::default()
            .table_prefix(prefix("setb"))
            .max_connections(cfg.pool),
    )
    .await?;
    let ledger = postgres::setup(&store).await?;
    let pool = store.pool().clone();
    let raw_inbox = format!("{}raw_inbox", prefix("setb"));
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {raw_inbox} (consumer VARCHAR(128) NOT NULL, msg_key VARCHAR(512) NOT NULL, \
         fingerprint VARCHAR(64) NOT NULL, first_seen_ms BIGINT NOT NULL, result TEXT NULL, PRIMARY KEY (consumer, msg_key))"
    ))
    .execute(&pool)
    .await?;
    let cli_prefix = prefix("setcli");
    let cli_ledger = format!("{cli_prefix}ledger");
    sqlx::query(&format!("DROP TABLE IF EXISTS {cli_ledger}"))
        .execute(&pool)
        .await?;
    sqlx::query(&ledger_ddl(&cli_ledger)).execute(&pool).await?;
    let file = std::env::temp_dir().join(format!("idemq-bench-{}.jsonl", std::process::id()));

    let per_message = postgres::consumer(&store, &ledger, cfg.concurrency)?;
    let set_based = Consumer::builder(CONSUMER, store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(cfg.concurrency)
        .handler(SetBasedLedger {
            ledger: ledger.clone(),
        })
        .build()?;
    let t = store.tables();
    let (inbox, attempts) = (t.inbox.clone(), t.attempts.clone());
    let (cli_inbox, cli_attempts) = (
        format!("{cli_prefix}inbox"),
        format!("{cli_prefix}attempts"),
    );

    let result = async {
        // The CLI migrates its tables on its first run: a warm-up run.
        cli(cfg, &file, &cli_prefix, &cli_ledger, 200, true).await?;
        let mut values: Vec<Vec<f64>> = ALTERNATIVES.iter().map(|_| Vec::new()).collect();
        for r in 0..cfg.rounds {
            for k in round_order(r, ALTERNATIVES.len()) {
                let cli_tables = [cli_ledger.as_str(), &cli_inbox, &cli_attempts];
                let lib_tables = [ledger.as_str(), &inbox, &attempts, &raw_inbox];
                truncate(&pool, &lib_tables).await?;
                truncate(&pool, &cli_tables).await?;
                let v = match k {
                    0 => raw(&pool, &raw_inbox, &ledger, n, cfg.concurrency).await?,
                    1 => library(&per_message, n).await?,
                    2 => library(&set_based, n).await?,
                    3 => cli(cfg, &file, &cli_prefix, &cli_ledger, n, false).await?,
                    _ => cli(cfg, &file, &cli_prefix, &cli_ledger, n, true).await?,
                };
                let written = if k >= 3 {
                    ledger_rows(&pool, &cli_ledger).await?
                } else {
                    ledger_rows(&pool, &ledger).await?
                };
                anyhow::ensure!(
                    written == n,
                    "{}: {written} ledger rows for {n} payments",
                    ALTERNATIVES[k]
                );
                progress!("batch round {}: {} {v:.0} msg/s", r + 1, ALTERNATIVES[k]);
                values[k].push(v);
            }
        }
        Ok::<_, anyhow::Error>(values)
    }
    .await;
    for table in [&cli_ledger, &cli_inbox, &cli_attempts, &raw_inbox]
        .into_iter()
        .chain([
            &format!("{cli_prefix}dead_letters"),
            &format!("{cli_prefix}schema_migrations"),
            &format!("{cli_prefix}offsets"),
        ])
    {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
            .execute(&pool)
            .await;
    }
    postgres::teardown(&store, &ledger).await;
    pool.close().await;
    let _ = std::fs::remove_file(&file);
    let v = result?;
    let m: Vec<f64> = v.iter().map(|x| median(x)).collect();
    let section = "Set-based batches (PostgreSQL)";
    let cli_vs_message = paired(&v[4], &v[3]);
    let cli_vs_raw = paired(&v[4], &v[0]);
    let rows = vec![
        Row::new(
            section,
            format!("raw limit: per {BATCH} messages one multi-row claim INSERT + one multi-row ledger INSERT, one commit"),
            n,
            m[0],
            "msg/s",
        ),
        Row::new(
            section,
            format!("library batch of {BATCH}, per-message handler (one INSERT per message)"),
            n,
            m[1],
            "msg/s",
        )
        .ratio_of(paired(&v[1], &v[0]), "raw"),
        Row::new(
            section,
            format!("library batch of {BATCH}, set-based handler (handle_batch: one INSERT per batch)"),
            n,
            m[2],
            "msg/s",
        )
        .ratio_of(paired(&v[2], &v[0]), "raw"),
        Row::new(
            section,
            "CLI `consume FILE --apply-sql 'INSERT …'`, per message, whole process",
            n,
            m[3],
            "msg/s",
        ),
        Row::new(
            section,
            format!("CLI `--batch {BATCH}` (merged INSERT), whole process: {cli_vs_raw:.2}× raw"),
            n,
            m[4],
            "msg/s",
        )
        .ratio_of(cli_vs_message, "CLI per-message")
        .target(
            format!("≥ {CLI_TARGET:.0}× per-message, ≥ {:.0} % of raw", RAW_TARGET * 100.0),
            cli_vs_message >= CLI_TARGET && cli_vs_raw >= RAW_TARGET,
        ),
    ];
    let note = format!(
        "Set-based batches: {n} fresh payments per measurement, {} in flight, pool {}; the five \
         measurements rotate order every round. The raw limit computes no fingerprint and runs no \
         engine; the CLI rows include process start, migration check and reading the file.",
        cfg.concurrency, cfg.pool
    );
    Ok((rows, vec![note]))
}
