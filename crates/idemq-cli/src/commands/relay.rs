//! `idemq relay`: publish the rows of a transactional outbox table to a
//! broker (or a JSON-lines file), in order per key, at least once, with the
//! row id as the message id and `event_id` header.

use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use idemq::outbox::{Outbox, OutboxDatabase, OutboxError, Relay, RelayOptions};
use idemq::source::Publisher;

use crate::backend::{Kind, StoreUrl};
use crate::endpoint::Endpoint;
use crate::interrupt::Interrupt;
use crate::ops;
use crate::{exit, GlobalArgs};

/// `idemq relay`.
#[derive(Debug, Args)]
pub struct RelayArgs {
    /// Where to publish: a broker URL (as for `consume`: kafka://, amqp://,
    /// sqs://, nats://, redis-stream://, mqtt://, rocketmq://), a JSON-lines
    /// file (appended), or `-` for stdout.
    #[arg(long, value_name = "URL", value_parser = Endpoint::from_str)]
    pub to: Endpoint,

    /// Relay only rows of this destination (`aggregatetype`); repeatable.
    /// Default: every destination.
    #[arg(long = "destination", value_name = "NAME")]
    pub destinations: Vec<String>,

    /// Rows per batch (one transaction; the batch's keys are held meanwhile).
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = crate::parse_positive)]
    pub batch: usize,

    /// Most messages awaiting the broker's confirmation at once. Only rows
    /// of different keys are in flight together: a key's next row is
    /// published after the broker confirmed its previous one, so the order
    /// per key holds whatever this is; 1 publishes one row at a time.
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = crate::parse_positive)]
    pub max_in_flight: usize,

    /// How long to wait between polls of an empty outbox (PostgreSQL relays
    /// are also woken by NOTIFY at every insert).
    #[arg(long, default_value = "1s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub poll_interval: Duration,

    /// Stop when nothing was published for this long (e.g. `5s`).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub idle_exit: Option<Duration>,

    /// How long the broker may take to confirm one message before the
    /// publish counts as failed (the row is retried with backoff).
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub publish_timeout: Duration,

    /// Failed publishes of one row after which it is moved to the
    /// dead-letter table `{prefix}outbox_dead` (with the reason; its key's
    /// later rows then go on); 0 (the default) retries forever, the key
    /// waiting. Every failure counts, a broker outage too (10 attempts span
    /// about 80 s of backoff). Errors a retry cannot cure dead-letter a row
    /// at once.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub max_attempts: u32,

    /// Create the outbox table `{prefix}outbox` and the dead-letter table
    /// `{prefix}outbox_dead` first if they are missing (the producers'
    /// `Outbox::migrate` does the same).
    #[arg(long)]
    pub migrate: bool,

    /// Serve `/metrics` (Prometheus, with the outbox backlog and its lag read
    /// at each scrape), `/healthz` and `/readyz` (the database and the
    /// destination answer) on this address while relaying.
    #[arg(long, value_name = "ADDR")]
    pub http_addr: Option<std::net::SocketAddr>,

    /// The process's shared endpoint (`idemq run`), when it has one.
    #[arg(skip)]
    pub ops: Option<ops::Ops>,
}

/// Connects to the store and the destination and relays until Ctrl-C or
/// `--idle-exit`.
pub async fn run(args: RelayArgs, global: &GlobalArgs) -> Result<ExitCode> {
    let url: StoreUrl = global.store.parse().map_err(exit::usage)?;
    // Validate the prefix before connecting anywhere.
    idemq::store::sql::Tables::new(&global.table_prefix).map_err(exit::usage)?;
    let publisher: Arc<dyn Publisher> = Arc::from(args.to.open_publisher().await?);
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    let options = idemq::store::sql::SqlOptions::default().table_prefix(&global.table_prefix);
    match url.kind {
        #[cfg(feature = "sqlite")]
        Kind::Sqlite => {
            let store = crate::backend::connect_sql!(
                idemq::store::sql::sqlite::SqliteStore,
                &url,
                options
            )?;
            relay(store.pool().clone(), &args, global, &url, publisher).await
        }
        #[cfg(feature = "postgres")]
        Kind::Postgres => {
            let store = crate::backend::connect_sql!(
                idemq::store::sql::postgres::PostgresStore,
                &url,
                options
            )?;
            relay(store.pool().clone(), &args, global, &url, publisher).await
        }
        #[cfg(feature = "mysql")]
        Kind::MySql => {
            let store =
                crate::backend::connect_sql!(idemq::store::sql::mysql::MySqlStore, &url, options)?;
            relay(store.pool().clone(), &args, global, &url, publisher).await
        }
        #[cfg(feature = "redis")]
        Kind::Redis => Err(not_sql(&url)),
        #[cfg(feature = "mongodb")]
        Kind::Mongo => Err(not_sql(&url)),
    }
}

/// The usage error for an outbox on a store that is not a SQL database.
#[allow(dead_code)] // unused when no lease store is compiled in
fn not_sql(url: &StoreUrl) -> anyhow::Error {
    exit::usage(format!(
        "{url} is not a SQL database: the outbox lives in the application's SQL database"
    ))
}

async fn relay<DB: OutboxDatabase>(
    pool: sqlx::Pool<DB>,
    args: &RelayArgs,
    global: &GlobalArgs,
    url: &StoreUrl,
    publisher: Arc<dyn Publisher>,
) -> Result<ExitCode> {
    let outbox = Outbox::<DB>::new(&global.table_prefix).map_err(exit::usage)?;
    if args.migrate {
        outbox
            .migrate(&pool)
            .await
            .with_context(|| format!("creating {} in {url}", outbox.table()))?;
    }
    let table = outbox.table().to_owned();
    let mut options = RelayOptions::default();
    options.batch_size = args.batch;
    options.max_in_flight = args.max_in_flight;
    options.poll_interval = args.poll_interval;
    options.idle_exit = args.idle_exit;
    options.publish_timeout = args.publish_timeout;
    options.max_attempts = (args.max_attempts > 0).then_some(args.max_attempts);
    options.name = format!("relay-{}", std::process::id());
    if let Some(ops) = ops::for_run(args.http_addr, args.ops.as_ref()).await? {
        add_checks(&ops, &pool, &outbox, &args.to);
    }
    let relay = Relay::new(pool, outbox, publisher, options).only(args.destinations.clone());
    let interrupt = Interrupt::listen();
    let stats = relay
        .run({
            let interrupt = interrupt.clone();
            async move { interrupt.wait().await }
        })
        .await
        .map_err(|e| relay_error(e, &table, url))?;
    let line = format!("relayed from {table}: {stats}");
    if matches!(args.to, Endpoint::Std) {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
    Ok(if interrupt.is_set() {
        ExitCode::from(exit::INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// `--http-addr`: readiness is the database answering and the destination
/// accepting a connection; each scrape first reads the outbox backlog.
fn add_checks<DB: OutboxDatabase>(
    ops: &ops::Ops,
    pool: &sqlx::Pool<DB>,
    outbox: &Outbox<DB>,
    to: &Endpoint,
) {
    let backlog: ops::Probe = {
        let (pool, outbox) = (pool.clone(), outbox.clone());
        Arc::new(move || {
            let (pool, outbox) = (pool.clone(), outbox.clone());
            Box::pin(async move {
                let backlog = outbox.backlog(&pool).await.map_err(|e| e.to_string())?;
                backlog.record(outbox.table());
                Ok(())
            })
        })
    };
    let database: ops::Probe = {
        let pool = pool.clone();
        Arc::new(move || {
            let pool = pool.clone();
            // A round trip, not just a pooled connection that may be dead.
            Box::pin(async move {
                let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
                sqlx::Connection::ping(&mut *conn)
                    .await
                    .map_err(|e| e.to_string())
            })
        })
    };
    ops.ready("database", database);
    if let Some(addresses) = to.probe_addresses() {
        ops.ready("destination", ops::reachable(addresses));
    }
    ops.on_scrape(backlog);
}

/// Adds a hint to a missing table.
fn relay_error(err: OutboxError, table: &str, url: &StoreUrl) -> anyhow::Error {
    let context = if err.is_missing_table() {
        format!("relaying {table} in {url} (is the table missing? pass --migrate)")
    } else {
        format!("relaying {table} in {url}")
    };
    anyhow::Error::new(err).context(context)
}
