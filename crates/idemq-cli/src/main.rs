//! `idemq`: consume JSON-lines messages exactly once into a database, and
//! administer the inbox (migrate, prune, stats, inspect, dead letters).
//!
//! This file holds the argument definitions and the dispatch: the store URL
//! picks a backend, and every subcommand runs as one generic function over
//! [`backend::Backend`].

mod backend;
mod commands;
mod exit;
mod interrupt;
mod output;
mod progress;
mod sink;

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use idemq::template::{SqlTemplate, ValueSpec};
use idemq::{ConflictPolicy, FingerprintSpec, KeySpec};

use crate::backend::StoreUrl;

/// Help text shared by every command that can fail at run time.
const EXIT_CODES: &str = "EXIT CODES:
  0    the command ran to the end (dead letters are outcomes, not failures)
  1    runtime error: the store or the source is unreachable or failed
  2    usage or configuration error: bad flag, key spec, template, URL or table prefix
  3    not found: `inspect` found nothing for the key; `dlq replay --id` named a missing dead letter
  130  interrupted (Ctrl-C): in-flight messages were finished, the summary covers them";

/// Exactly-once effects from at-least-once messages: the idempotent-consumer
/// (inbox) pattern on SQLite, PostgreSQL and MySQL/MariaDB.
#[derive(Debug, Parser)]
#[command(
    name = "idemq",
    version,
    about = "Consume messages exactly once into a database; prune, inspect and replay the inbox.",
    long_about = "Consume messages exactly once into a database; prune, inspect and replay the inbox.\n\n\
        Every message's business key is claimed in the inbox table in the same database \
        transaction as its effects, so a redelivered or re-sent message is applied once.\n\n\
        Logging goes to stderr; set IDEMQ_LOG (or RUST_LOG) to e.g. `info` or `debug` \
        (default: warnings only).",
    after_long_help = EXIT_CODES,
    propagate_version = true
)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

/// Options every subcommand takes.
#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
struct GlobalArgs {
    /// The store: `sqlite:PATH` (e.g. `sqlite://idemq.db`), `postgres://…`
    /// (or `postgresql://`), `mysql://…` (or `mariadb://`).
    #[arg(
        long = "store",
        env = "IDEMQ_STORE",
        default_value = "sqlite://idemq.db",
        global = true,
        value_name = "URL"
    )]
    store: String,

    /// Prefix of the idemq tables (letters, digits, `_`; at most 40 bytes).
    #[arg(
        long = "table-prefix",
        env = "IDEMQ_TABLE_PREFIX",
        default_value = "idemq_",
        global = true,
        value_name = "P"
    )]
    table_prefix: String,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Consume a JSON-lines file (or stdin) exactly once into the store.
    #[command(
        long_about = "Consume a JSON-lines file (or stdin) exactly once into the store.\n\n\
            Each line is a message: either an envelope {\"id\",\"key\",\"headers\",\"payload\"} \
            or a bare JSON payload. Each message's business key (--key) is claimed in the inbox \
            in the same transaction as the sink's effects (--apply-sql), so re-running a file, \
            a redelivery or a producer retry applies nothing twice. Undecodable messages, \
            missing keys, permanent failures and conflicts are written to the dead-letter table \
            and the run goes on.\n\n\
            At the end a summary is printed to stdout:\n  \
            consumer NAME: processed=N duplicate=N conflict=N retry_later=N dead_lettered=N\n\n\
            The exit status is 0 when the input was read to its end, even if messages were \
            dead-lettered (they are outcomes, listed by `idemq dlq list`); 1 when the store or \
            the input failed; 2 for a usage or configuration error; 130 after Ctrl-C.",
        after_long_help = EXIT_CODES
    )]
    Consume(ConsumeArgs),

    /// Create or upgrade the idemq tables (idempotent).
    #[command(after_long_help = EXIT_CODES)]
    Migrate,

    /// Delete inbox rows older than a retention period.
    #[command(
        long_about = "Delete inbox rows older than a retention period, in batches.\n\n\
            Keep rows longer than the longest time a duplicate can still arrive (broker \
            retention, producer retries, replays): a key pruned too early is applied again \
            by a late duplicate. Dead letters are not pruned.",
        after_long_help = EXIT_CODES
    )]
    Prune(PruneArgs),

    /// Show per-consumer numbers: processed keys, oldest/newest, dead letters, failing keys.
    #[command(after_long_help = EXIT_CODES)]
    Stats(StatsArgs),

    /// Show everything the store knows about one key of one consumer.
    #[command(
        long_about = "Show everything the store knows about one key of one consumer: when it \
            was processed, its fingerprint and stored result, failed attempts and dead letters.\n\n\
            Exits with 3 when the store knows nothing about the key.",
        after_long_help = EXIT_CODES
    )]
    Inspect(InspectArgs),

    /// List or replay dead letters.
    #[command(subcommand)]
    Dlq(DlqCommand),
}

/// `idemq dlq …`.
#[derive(Debug, Subcommand)]
enum DlqCommand {
    /// List dead letters, oldest first.
    #[command(after_long_help = EXIT_CODES)]
    List(DlqListArgs),

    /// Run dead letters through a consumer again; resolved ones are deleted.
    #[command(
        long_about = "Run dead letters through a consumer again, one at a time, with the same \
            sink and retry options as `consume`. Pass the same --key and --fingerprint as the \
            consume run did, so that keys and fingerprints match the inbox.\n\n\
            A dead letter that is now processed (or turns out to be a duplicate) is deleted. \
            One that fails again is written as a new dead letter (with the new reason) and the \
            old one is deleted, so the queue does not hold it twice. A conflict ignored with \
            `--on-conflict ignore` keeps its dead letter. One line per dead letter is printed.",
        after_long_help = EXIT_CODES
    )]
    Replay(DlqReplayArgs),
}

/// `idemq consume`.
#[derive(Debug, Args)]
struct ConsumeArgs {
    /// The JSON-lines file to read; `-` reads stdin.
    #[arg(value_name = "FILE", default_value = "-")]
    input: PathBuf,

    /// The consumer name: the scope of the keys in the inbox.
    #[arg(long, env = "IDEMQ_CONSUMER", value_name = "NAME")]
    consumer: String,

    /// Do not keep a checkpoint file (`<FILE>.<consumer>.checkpoint`) next to the
    /// input; every run then reads the whole file (re-read lines are duplicates).
    #[arg(long)]
    no_checkpoint: bool,

    /// Messages in flight at once.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = parse_positive)]
    concurrency: usize,

    /// Do not create or upgrade the idemq tables before consuming.
    #[arg(long)]
    no_migrate: bool,

    #[command(flatten)]
    processing: ProcessingArgs,

    #[command(flatten)]
    sink: SinkArgs,
}

/// How messages are keyed, retried and treated on conflict (consume and replay).
#[derive(Debug, Args)]
struct ProcessingArgs {
    /// How the business key is read: `json:/pointer`, `header:NAME`, `key` (envelope
    /// key), `id` (envelope id), `hash` (of the payload); `A+B` joins parts, `A|B` takes
    /// the first present.
    #[arg(long, default_value = "key|id", value_name = "SPEC", value_parser = KeySpec::from_str)]
    key: KeySpec,

    /// What tells a duplicate from a conflicting reuse of a key: `payload` (the
    /// whole payload) or `json:/a,json:/b` (only these fields).
    #[arg(long, default_value = "payload", value_name = "SPEC", value_parser = FingerprintSpec::from_str)]
    fingerprint: FingerprintSpec,

    /// Attempts of a retryable failure before the message is dead-lettered.
    #[arg(long, default_value_t = 5, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,

    /// Delay before the second attempt; it doubles per attempt (e.g. `200ms`, `2s`).
    #[arg(long, default_value = "200ms", value_name = "DURATION", value_parser = humantime::parse_duration)]
    backoff: Duration,

    /// What to do with a key processed before with a different payload.
    #[arg(long, value_enum, default_value_t = OnConflict::DeadLetter, value_name = "POLICY")]
    on_conflict: OnConflict,
}

/// `--on-conflict`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnConflict {
    /// Write a dead letter with reason `conflict`.
    DeadLetter,
    /// Skip it like a duplicate (logged as a warning).
    Ignore,
}

impl From<OnConflict> for ConflictPolicy {
    fn from(value: OnConflict) -> Self {
        match value {
            OnConflict::DeadLetter => ConflictPolicy::DeadLetter,
            OnConflict::Ignore => ConflictPolicy::Ignore,
        }
    }
}

/// Where processed messages go (consume and replay).
#[derive(Debug, Args)]
struct SinkArgs {
    #[command(flatten)]
    target: SinkTarget,

    /// Where template parameter `:name` comes from: `name=json:/pointer`,
    /// `name=header:NAME`, `name=key`, `name=consumer`, `name=id` or `name=payload`.
    /// Default: the built-ins `:idemq_key`, `:idemq_consumer`, `:idemq_id`,
    /// `:idemq_payload`, else the payload field `/name`. Repeatable.
    #[arg(long = "param", value_name = "NAME=SPEC", value_parser = parse_param)]
    params: Vec<(String, ValueSpec)>,

    /// A statement run once before consuming (e.g. `CREATE TABLE IF NOT EXISTS …`).
    /// Repeatable; each flag is one statement.
    #[arg(long = "init-sql", value_name = "SQL")]
    init_sql: Vec<String>,
}

/// Exactly one sink.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct SinkTarget {
    /// Apply each message as this SQL statement, in the inbox transaction.
    /// `:name` parameters are bound (never interpolated); see --param.
    #[arg(long = "apply-sql", value_name = "SQL", value_parser = SqlTemplate::from_str)]
    apply_sql: Option<SqlTemplate>,

    /// Print each newly processed message to stdout as a JSON line
    /// `{"key":…,"payload":…}` (the inbox still drops duplicates).
    #[arg(long)]
    print: bool,
}

/// Parses a count of at least 1.
fn parse_positive(text: &str) -> Result<usize, String> {
    match text.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Parses `name=VALUESPEC`.
fn parse_param(text: &str) -> Result<(String, ValueSpec), String> {
    let (name, spec) = text
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=SPEC, got {text:?}"))?;
    let name = name.trim().trim_start_matches(':');
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("invalid parameter name {name:?}"));
    }
    let spec = spec.parse::<ValueSpec>().map_err(|e| e.to_string())?;
    Ok((name.to_owned(), spec))
}

/// `idemq prune`.
#[derive(Debug, Args)]
struct PruneArgs {
    /// Delete inbox rows first seen longer ago than this (e.g. `7d`, `36h`, `0s`).
    #[arg(long, value_name = "DURATION", value_parser = output::HumanDuration::from_str)]
    older_than: output::HumanDuration,

    /// Rows deleted per statement (keeps locks short).
    #[arg(long, default_value_t = 5000, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,

    /// Pause between batches.
    #[arg(long, default_value = "10ms", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pause: Duration,
}

/// `idemq stats`.
#[derive(Debug, Args)]
struct StatsArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// `idemq inspect`.
#[derive(Debug, Args)]
struct InspectArgs {
    /// The consumer name.
    #[arg(long, env = "IDEMQ_CONSUMER", value_name = "NAME")]
    consumer: String,

    /// The business key, as stored (see `consume --key`).
    #[arg(long, value_name = "KEY")]
    key: String,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `idemq dlq list`.
#[derive(Debug, Args)]
struct DlqListArgs {
    /// Only this consumer's dead letters.
    #[arg(long, value_name = "NAME")]
    consumer: Option<String>,

    /// At most this many dead letters.
    #[arg(long, default_value_t = 100, value_name = "N")]
    limit: u32,

    /// Only dead letters with an id greater than this (for paging).
    #[arg(long, default_value_t = 0, value_name = "ID")]
    after_id: i64,

    /// Print JSON (complete payloads) instead of a table (truncated payloads).
    #[arg(long)]
    json: bool,
}

/// `idemq dlq replay`.
#[derive(Debug, Args)]
struct DlqReplayArgs {
    /// The consumer whose dead letters are replayed.
    #[arg(long, env = "IDEMQ_CONSUMER", value_name = "NAME")]
    consumer: String,

    #[command(flatten)]
    selection: ReplaySelection,

    #[command(flatten)]
    processing: ProcessingArgs,

    #[command(flatten)]
    sink: SinkArgs,
}

/// Which dead letters to replay.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
struct ReplaySelection {
    /// Replay these dead-letter ids (repeatable, or comma-separated).
    #[arg(long = "id", value_name = "N", num_args = 1.., value_delimiter = ',')]
    ids: Vec<i64>,

    /// Replay all of the consumer's dead letters (those present at the start).
    #[arg(long)]
    all: bool,
}

impl SinkArgs {
    /// Checks that every `--param` names a parameter of an `--apply-sql` template.
    fn validate(&self) -> Result<()> {
        match &self.target.apply_sql {
            Some(template) => sink::check_params(template, &self.params),
            None if !self.params.is_empty() => Err(exit::usage(
                "--param only applies to an --apply-sql statement",
            )),
            None => Ok(()),
        }
    }
}

impl Command {
    /// Cross-argument checks clap cannot express; usage errors.
    fn validate(&self) -> Result<()> {
        let sink = match self {
            Command::Consume(args) => &args.sink,
            Command::Dlq(DlqCommand::Replay(args)) => &args.sink,
            _ => return Ok(()),
        };
        sink.validate()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = exit::init_logging() {
        return exit::report(&e);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return exit::report(&anyhow::Error::new(e).context("starting the runtime")),
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => exit::report(&e),
    }
}

/// Validates, connects to the store the URL names, and runs the subcommand on it.
async fn dispatch(cli: Cli) -> Result<ExitCode> {
    cli.command.validate()?;
    let Cli { global, command } = cli;
    // Parsed here rather than by clap, which would also parse the default URL
    // of a global flag and fail in builds without SQLite.
    let url: StoreUrl = global.store.parse().map_err(exit::usage)?;
    let options = idemq::store::sql::SqlOptions::default().table_prefix(&global.table_prefix);
    match url.kind {
        #[cfg(feature = "sqlite")]
        backend::Kind::Sqlite => {
            let store =
                backend::connect::<idemq::store::sql::sqlite::SqliteStore>(&url, options).await?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "postgres")]
        backend::Kind::Postgres => {
            let store =
                backend::connect::<idemq::store::sql::postgres::PostgresStore>(&url, options)
                    .await?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "mysql")]
        backend::Kind::MySql => {
            let store =
                backend::connect::<idemq::store::sql::mysql::MySqlStore>(&url, options).await?;
            commands::run(store, &url, &global, command).await
        }
    }
}
