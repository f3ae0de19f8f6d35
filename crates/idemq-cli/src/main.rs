//! `idemq`: consume JSON-lines messages exactly once into a database, and
//! administer the inbox (migrate, prune, stats, inspect, dead letters).
//!
//! This file holds the argument definitions and the dispatch: the store URL
//! picks a backend, and every subcommand runs as one generic function over
//! [`backend::Backend`].

mod backend;
mod commands;
mod config;
mod console;
mod endpoint;
mod exit;
mod interrupt;
mod ops;
mod output;
mod progress;
mod sink;
mod size;
mod sync;

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use idemq::template::{SqlTemplate, ValueSpec};
use idemq::{ConflictPolicy, FingerprintSpec, KeySpec};

use crate::backend::StoreUrl;
use crate::endpoint::Endpoint;

/// Help text shared by every command that can fail at run time.
const EXIT_CODES: &str = "EXIT CODES:
  0    the command ran to the end (dead letters are outcomes, not failures), or
       stopped by SIGTERM after finishing its in-flight messages (or abandoning,
       at --shutdown-timeout, those still running, for their source to redeliver)
  1    runtime error: the store or the source is unreachable or failed
  2    usage or configuration error: bad flag, key spec, template, URL or table prefix
  3    not found: `inspect` found nothing for the key; `dlq replay --id` named a missing dead letter
  130  interrupted (Ctrl-C): in-flight messages were finished, the summary covers them";

const EXIT_CODES_DOCTOR: &str = "EXIT CODES:
  0    every consumer is ok or check
  1    runtime error: the store is unreachable or failed
  2    usage or configuration error
  4    a consumer's verdict is PROBLEM";

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

    /// The global flags given on the command line (not by the environment
    /// or a default): they override a configuration file's values.
    #[arg(skip)]
    given: config::Overrides,
}

/// The subcommands.
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
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
            the input failed; 2 for a usage or configuration error; 130 after Ctrl-C. \
            Ctrl-C and SIGTERM drain: no new message is taken, the messages in flight get \
            --shutdown-timeout to finish and be settled, those still running then are \
            abandoned (rolled back, redelivered by their source; `abandoned=N` in the \
            summary), and the summary is printed; after SIGTERM the exit status is 0. A \
            second signal exits at once.",
        after_long_help = EXIT_CODES
    )]
    Consume(ConsumeArgs),

    /// Publish a JSON-lines file to a broker (or a file), optionally with duplicates.
    #[command(
        long_about = "Publish a JSON-lines file to a broker, a JSON-lines file or stdout, for \
            demos and tests.\n\n\
            Each line is read as `consume` reads it (an envelope {\"id\",\"key\",\"headers\",\
            \"payload\"} or a bare payload) and published with its id and key in the broker's \
            native places, so that `consume` reads back the same message. A missing id becomes \
            a new UUID; --key fills in a missing key. A line that is not JSON is published as a \
            raw payload (the consumer dead-letters it).\n\n\
            --duplicates publishes some messages twice with the same id (an at-least-once \
            producer); --producer-retries publishes some again with a new id and the same key \
            and payload (a producer that retried a send it thought had failed). At the end a \
            line is printed (to stderr when publishing to stdout):\n  \
            published=N duplicates=N producer_retries=N raw=N",
        after_long_help = EXIT_CODES
    )]
    Produce(ProduceArgs),

    /// Publish the rows of a transactional outbox table to a broker, in order per key.
    #[command(
        long_about = "Publish the rows of the transactional outbox table `{prefix}outbox` \
            (written by applications with idemq's `Outbox::enqueue` in their own transactions, \
            or by any SQL insert) to a broker, a JSON-lines file or stdout.\n\n\
            Each row becomes a message with id = the row's `id`, the header `event_id` = the \
            same id, key = `aggregateid` and the row's headers; it is deleted only after the \
            broker confirmed it. Several relays may run at once: each holds the keys it \
            publishes (FOR UPDATE SKIP LOCKED on PostgreSQL and MariaDB; SQLite relays take \
            turns), so the rows of one key go out in order. A relay that dies after a publish \
            and before its delete publishes the row again with the same id: consume with \
            `--key header:event_id` and the inbox drops the copy. The table is created by \
            --migrate. A row that can never be published (or fails --max-attempts times, when \
            set) moves to {prefix}outbox_dead with the reason; its key's later rows go on. At \
            the end a line is printed:\n  \
            relayed from TABLE: published=N dead=N failures=N batches=N",
        after_long_help = EXIT_CODES
    )]
    Relay(commands::RelayArgs),

    /// Create or upgrade the idemq tables (idempotent).
    #[command(after_long_help = EXIT_CODES)]
    Migrate(commands::MigrateArgs),

    /// Delete inbox rows older than a retention period.
    #[command(
        long_about = "Delete inbox rows older than a retention period, in batches.\n\n\
            Keep rows longer than the longest time a duplicate can still arrive (broker \
            retention, producer retries, replays): a key pruned too early is applied again \
            by a late duplicate. Dead letters are not pruned.\n\n\
            With --source URL (repeatable) or --config FILE (its consumers' sources), the \
            brokers' redelivery horizons are read first (Kafka retention.ms, SQS \
            MessageRetentionPeriod, NATS max_age, RabbitMQ message-ttl; see `idemq doctor`) \
            and an --older-than under the longest one is refused (exit 2), as is one under \
            --floor, the operator's floor for brokers whose horizon cannot be read. --force \
            prunes anyway, with a warning.",
        after_long_help = EXIT_CODES
    )]
    Prune(PruneArgs),

    /// Check each consumer's broker settings and inbox retention: loss risks, redelivery horizon, a verdict.
    #[command(
        long_about = "Check, per consumer, what its broker says beside what its inbox holds, \
            consuming and creating nothing: the broker settings that can drop messages before \
            any consumer processed them (the checks each source makes when it connects: stream \
            and queue limits, retention, compaction, redrive and delivery limits…), the broker's \
            redelivery horizon (how long after publication it can still deliver a message: \
            Kafka retention.ms, SQS MessageRetentionPeriod, NATS max_age, RabbitMQ \
            message-ttl; unbounded for queues that keep a message until it is acknowledged), \
            and the inbox's keys and oldest row.\n\n\
            With --older-than (the retention `idemq prune` runs with), a retention shorter than \
            the horizon is a problem: a duplicate delivered after its row was pruned is applied \
            again. The consumers are those of --config (as `idemq run` runs them), or the one \
            of --source and --consumer. Verdicts: ok; check (nothing wrong found, but \
            something could not be read or proven); PROBLEM. Exits with 4 when a verdict is \
            PROBLEM.",
        after_long_help = EXIT_CODES_DOCTOR
    )]
    Doctor(DoctorArgs),

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

    /// Free a stuck in-flight lease of one key (lease stores), after a confirmation.
    #[command(
        long_about = "Free the in-flight lease of one key of one consumer in a lease store \
            (redis://), so that the next delivery claims the key at once instead of waiting \
            for the lease to expire. The old holder, if it is still running, then fails to \
            complete (its token no longer holds the key); its effects outside the store are \
            not undone.\n\n\
            Asks for a confirmation on the terminal; --yes skips it. Exits with 3 when no \
            lease is held (and for SQL stores, which hold none).",
        after_long_help = EXIT_CODES
    )]
    Release(ReleaseArgs),

    /// List or replay dead letters.
    #[command(subcommand)]
    Dlq(DlqCommand),

    /// Fault injection: publish duplicates and poison, kill the consumers, check exactly-once.
    #[command(
        long_about = commands::chaos::LONG_ABOUT,
        after_long_help = commands::chaos::EXIT_CODES
    )]
    Chaos(commands::chaos::ChaosArgs),

    /// A chaos worker for lease stores (started by `idemq chaos`).
    #[command(hide = true)]
    ChaosWorker(commands::chaos::WorkerArgs),

    /// Run every consumer and relay of a configuration file in this process.
    #[command(
        long_about = "Run every consumer and relay of a configuration file in this process.\n\n\
            The file is TOML: top-level `store`, `table-prefix` and `http-addr` (one \
            /metrics, /healthz, /readyz for the process), then [[consumer]] tables (each \
            an `idemq consume`: `consumer = NAME`, `source = FILE|URL`, and any flag of \
            `consume` as a key: `key`, `apply-sql`, `concurrency`, `batch`…) and [[relay]] \
            tables (each an `idemq relay`). A flag given here beats the environment \
            (IDEMQ_STORE, IDEMQ_TABLE_PREFIX), which beats the file. Ctrl-C and SIGTERM \
            drain every job; if one fails, the others stop and the process exits with \
            its code. See docs/operations.md.",
        after_long_help = EXIT_CODES
    )]
    Run(commands::config::RunArgs),

    /// Check a configuration file: print every job's effective command line (secrets hidden).
    #[command(subcommand)]
    Config(commands::config::ConfigCommand),

    /// Print a shell completion script: `idemq completions bash > /etc/bash_completion.d/idemq`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },

    /// Print the man page (roff): `idemq man > /usr/local/share/man/man1/idemq.1`.
    Man,

    /// Serve a web console over the store: consumers, dead letters, keys, the outbox.
    #[command(
        long_about = "Serve a web console over the store (--http-addr, default \
            127.0.0.1:9466) for operators: each consumer's processed keys, dead letters and \
            failing keys, with charts sampled every --sample-every (duplicates and conflicts \
            from running consumers' /metrics: --scrape, or the http-addr of --config); dead \
            letters grouped by reason with their payload, headers, error and attempts; a \
            key's inbox row, journaled effects, attempts and letters; the outbox backlog and \
            its dead rows.\n\n\
            Read-only unless started with --allow-changes: then dead letters can be deleted \
            (one, a selection or a whole reason) and replayed through the consumer's handler \
            as `idemq dlq replay` does, for the consumers of --config (the file `idemq run` \
            runs). The console has no login: keep it on loopback or behind an authenticating \
            proxy. Ctrl-C or SIGTERM stops it.",
        after_long_help = EXIT_CODES
    )]
    Console(console::ConsoleArgs),

    /// Make any HTTP API idempotent: a reverse proxy applying Idempotency-Key over the store.
    #[cfg(feature = "proxy")]
    #[command(
        long_about = "A reverse proxy in front of an HTTP API (--upstream http://host:port) that \
            makes its non-idempotent requests idempotent by their Idempotency-Key header \
            (draft-ietf-httpapi-idempotency-key-header), over the store (--store).\n\n\
            A covered request (--methods, default POST and PATCH, under --path-prefix, default \
            every path) is read whole (up to --max-body), its key claimed in the store, scoped \
            by --scope-header (hashed) if given, and forwarded; the upstream's status, headers \
            and body are stored with the key, and a retry gets them back without reaching the \
            upstream (Idempotent-Replayed: true). The same key while the first is in flight: \
            409; with another body: 422; a covered request without a key: 400 (unless \
            --optional-key); as RFC 9457 problem details. 5xx answers and dropped connections \
            release the key. Other requests stream through untouched. If the proxy dies \
            between forwarding and storing, the retry is forwarded again: the upstream sees \
            the same Idempotency-Key header and should deduplicate by it. Ctrl-C or SIGTERM \
            stops it after the requests in flight.",
        after_long_help = EXIT_CODES
    )]
    Proxy(commands::proxy::ProxyArgs),
}

/// `idemq dlq …`.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per run; boxing buys nothing
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
    /// What to consume: a JSON-lines file, `-` for stdin, or a broker URL:
    /// `kafka://HOST:PORT/TOPIC?group=NAME`, `amqp://USER:PASS@HOST:PORT/VHOST?queue=NAME`,
    /// `sqs://QUEUE?endpoint=URL&region=R` (broker sources run until Ctrl-C or --idle-exit).
    #[arg(value_name = "SOURCE", default_value = "-", value_parser = Endpoint::from_str)]
    input: Endpoint,

    /// Stop when no message has arrived for this long (e.g. `5s`): for scripts
    /// that drain a broker queue and exit. Files and stdin end by themselves.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    idle_exit: Option<Duration>,

    /// The consumer name: the scope of the keys in the inbox.
    #[arg(long, env = "IDEMQ_CONSUMER", value_name = "NAME")]
    consumer: String,

    /// Do not keep a checkpoint file (`<FILE>.<consumer>.checkpoint`) next to the
    /// input; every run then reads the whole file (re-read lines are duplicates).
    #[arg(long)]
    no_checkpoint: bool,

    /// The largest message handled, headers and payload together, from any
    /// source (e.g. `64KiB`, `16MiB`): a larger one becomes a `too_large`
    /// dead letter holding its first this-many bytes. A JSON line over it is not even held whole.
    #[arg(long, alias = "max-line-bytes", value_name = "SIZE", default_value = "4MiB", value_parser = size::parse_byte_size)]
    max_message_bytes: usize,

    /// Messages in flight at once.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = parse_positive)]
    concurrency: usize,

    /// After Ctrl-C or SIGTERM, how long the messages in flight may take to
    /// finish and be settled; those still running then are abandoned: their
    /// transactions roll back and their source redelivers them. Keep it
    /// below the platform's own grace (Kubernetes and `docker stop`: 30s).
    #[arg(long, default_value = "20s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    shutdown_timeout: Duration,

    /// Serve `/metrics` (Prometheus), `/healthz` and `/readyz` (the store
    /// answers, the source's broker accepts a connection) on this address
    /// while consuming, e.g. `127.0.0.1:9464` or `0.0.0.0:9464`.
    #[arg(long, value_name = "ADDR")]
    http_addr: Option<std::net::SocketAddr>,

    /// After the run ends, keep serving `--http-addr` until one `/metrics`
    /// scrape has read the final counts, at most this long (e.g. `30s`): a
    /// run that drains and exits (`--idle-exit`, a file) still reaches
    /// Prometheus with its last counts.
    #[arg(long, value_name = "DURATION", requires = "http_addr", value_parser = humantime::parse_duration)]
    http_linger: Option<Duration>,

    /// The process's shared endpoint (`idemq run`), when it has one.
    #[arg(skip)]
    ops: Option<ops::Ops>,

    /// Do not create or upgrade the idemq tables before consuming.
    #[arg(long)]
    no_migrate: bool,

    /// Batch mode: up to N messages share one transaction (SQL stores: one
    /// claim statement, a savepoint per message after a failure, one commit)
    /// or one claim and one completion round trip (redis://). Faster; a
    /// batch is settled only after its commit.
    #[arg(long, value_name = "N", value_parser = parse_positive)]
    batch: Option<usize>,

    /// Batch mode: how long to wait for a batch to fill after its first message.
    #[arg(long, default_value = "20ms", value_name = "DURATION", value_parser = humantime::parse_duration)]
    batch_wait: Duration,

    /// Offset-watermark mode (kafka:// into a SQL store): instead of one inbox
    /// row per message, the store keeps the next offset to apply per
    /// partition, moved in the same transaction as the effects, and the
    /// source resumes each partition there. Catches redeliveries of the same
    /// record; add --dedup-keys to catch producer retries (a new record with
    /// the same key) as well.
    #[arg(long, conflicts_with = "batch")]
    watermark: bool,

    /// Offset-watermark mode: also claim the business key in the same
    /// transaction (one inbox row per key again; prune it as usual).
    #[arg(long, requires = "watermark")]
    dedup_keys: bool,

    /// Offset-watermark mode: apply up to --concurrency records of one
    /// partition at once (records of one record key still in order); the
    /// watermark moves only to the highest contiguous settled offset, and
    /// each record also leaves an inbox row of its position (prune it as
    /// usual).
    #[arg(long, requires = "watermark")]
    concurrent_records: bool,

    /// Keep up to N recently completed keys in memory and answer their
    /// duplicates without a store round trip (0: off).
    #[arg(long, default_value_t = 0, value_name = "N")]
    local_cache: usize,

    /// Redis as a duplicate filter in front of the store, shared by every
    /// consumer process (`redis://HOST:PORT`); keys are marked after their
    /// commit, and a Redis outage falls back to the store alone.
    #[arg(long, value_name = "URL")]
    cache: Option<String>,

    /// Lease stores (redis://, mongodb://): how long a claim lives without completion;
    /// a heartbeat extends it while the handler runs.
    #[arg(long, default_value = "30s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Duration,

    /// Lease stores: what a duplicate does while its first copy is in flight
    /// in another worker: `reject` (retry it later) or `wait` (wait for the
    /// first copy's result, or take over its expired lease).
    #[arg(long, value_enum, default_value_t = InFlight::Reject, value_name = "POLICY")]
    in_flight: InFlight,

    #[command(flatten)]
    processing: ProcessingArgs,

    #[command(flatten)]
    sink: SinkArgs,
}

/// How messages are keyed, retried and treated on conflict (consume and replay).
#[derive(Debug, Args)]
struct ProcessingArgs {
    /// How the business key is read: `json:/pointer`, `header:NAME`, `key` (envelope
    /// key / broker message key), `id` (message id), `hash` (of the payload); `A+B` joins
    /// parts, `A|B` takes the first present. Default: `key|id`; for Kafka `header:event_id|key`.
    #[arg(long, value_name = "SPEC", value_parser = KeySpec::from_str)]
    key: Option<KeySpec>,

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

/// `--in-flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum InFlight {
    /// Retry the duplicate later.
    Reject,
    /// Wait for the first copy (up to twice the lease).
    Wait,
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

    /// --apply-http: how long one request may take (connecting, sending and
    /// reading the answer; default 30s); a request that takes longer is retried.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    http_timeout: Option<Duration>,

    /// --apply-http: an extra request header `Name: value` (e.g.
    /// `Authorization: Bearer …`). Repeatable.
    #[arg(long = "http-header", value_name = "NAME: VALUE")]
    http_headers: Vec<String>,

    /// --apply-exec: how long the command may run (default 30s); then its
    /// process group is killed and the message retried.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    exec_timeout: Option<Duration>,
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

    /// POST each newly processed message's payload to this http(s) URL, at
    /// most once per key: with `Idempotency-Key: "<uuid>"` (derived from
    /// consumer, key and step `http`), `X-Idemq-Key`, `X-Idemq-Consumer`,
    /// `X-Idemq-Message-Id`; JSON payloads as `application/json`. 2xx:
    /// processed, `{"status","body"}` stored; 409, 408, 429, 5xx, timeouts,
    /// connection errors: retried; 422: conflict, dead letter; other
    /// statuses: dead letter with the status and body. A 2xx answer is
    /// journaled, so a redelivery does not call again (docs/http.md).
    #[arg(long = "apply-http", value_name = "URL")]
    apply_http: Option<String>,

    /// Run this command with `sh -c` per newly processed message, at most
    /// once per key: payload on stdin; IDEMQ_KEY, IDEMQ_IDEMPOTENCY_KEY
    /// (derived, step `exec`), IDEMQ_MESSAGE_ID and IDEMQ_CONSUMER in the
    /// environment. Exit 0: processed, stdout stored (JSON if it parses);
    /// 75 (EX_TEMPFAIL) or 69 (EX_UNAVAILABLE): retried; 65 (EX_DATAERR):
    /// conflict, dead letter; other codes: dead letter with stderr; killed
    /// or timed out: retried. A success is journaled (docs/http.md).
    #[arg(long = "apply-exec", value_name = "CMD")]
    apply_exec: Option<String>,

    /// Insert each newly processed message's payload (a JSON object) into
    /// a MongoDB collection, keyed by the message key, at most once:
    /// `mongodb://[user:password@]HOST:PORT/DATABASE.COLLECTION[?options]`.
    /// An upsert with `$setOnInsert` and `_id` = the key, so a redelivery
    /// after a crash rewrites nothing (any store; docs/mongodb.md). A
    /// payload that is not a JSON object, or whose `_id` is not the key, is
    /// dead-lettered.
    #[arg(long = "apply-mongo", value_name = "URL")]
    apply_mongo: Option<String>,
}

/// `idemq produce`.
#[derive(Debug, Args)]
struct ProduceArgs {
    /// The JSON-lines file to publish; `-` reads stdin.
    #[arg(value_name = "FILE", default_value = "-")]
    input: PathBuf,

    /// Where to publish: a broker URL (as for `consume`), a JSON-lines file
    /// (appended), or `-` for stdout.
    #[arg(long, value_name = "URL", value_parser = Endpoint::from_str)]
    to: Endpoint,

    /// Fill in a missing message key from the message (same syntax as `consume --key`),
    /// e.g. `json:/payment_id`; brokers partition and group by it.
    #[arg(long, value_name = "SPEC", value_parser = KeySpec::from_str)]
    key: Option<KeySpec>,

    /// Fraction of messages published twice with the same id (0 to 1).
    #[arg(long, default_value_t = 0.0, value_name = "F", value_parser = commands::parse_fraction)]
    duplicates: f64,

    /// Fraction of messages published again with a new id, same key and payload (0 to 1).
    #[arg(long, default_value_t = 0.0, value_name = "F", value_parser = commands::parse_fraction)]
    producer_retries: f64,

    /// Seed of the random choices, for reproducible runs.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
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

    /// A source whose broker's redelivery horizon --older-than must not be under (repeatable).
    #[arg(long = "source", value_name = "URL", value_parser = Endpoint::from_str)]
    sources: Vec<Endpoint>,

    /// A configuration file whose consumers' sources are checked as --source.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// The shortest --older-than accepted, for brokers whose horizon cannot be read.
    #[arg(long, value_name = "DURATION", value_parser = output::HumanDuration::from_str)]
    floor: Option<output::HumanDuration>,

    /// Prune even when --older-than is under a horizon or the floor (logged as a warning).
    #[arg(long)]
    force: bool,
}

/// `idemq doctor`.
#[derive(Debug, Args)]
struct DoctorArgs {
    /// The configuration file whose consumers to check (its store too, unless --store says otherwise).
    #[arg(long, value_name = "FILE", conflicts_with = "source")]
    config: Option<PathBuf>,

    /// A consumer's source URL to check (with --consumer), instead of --config.
    #[arg(long, value_name = "URL", value_parser = Endpoint::from_str, requires = "consumer")]
    source: Option<Endpoint>,

    /// The consumer name of --source.
    #[arg(long, value_name = "NAME")]
    consumer: Option<String>,

    /// The inbox retention (`idemq prune --older-than`), checked against each broker's horizon.
    #[arg(long, value_name = "DURATION", value_parser = output::HumanDuration::from_str)]
    older_than: Option<output::HumanDuration>,

    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
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

/// `idemq release`.
#[derive(Debug, Args)]
struct ReleaseArgs {
    /// The consumer name.
    #[arg(long, env = "IDEMQ_CONSUMER", value_name = "NAME")]
    consumer: String,

    /// The business key, as stored.
    #[arg(long, value_name = "KEY")]
    key: String,

    /// Release without asking.
    #[arg(long)]
    yes: bool,
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
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let mut cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let given = |id: &str| {
        (matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .then(|| matches.get_one::<String>(id).cloned())
            .flatten()
    };
    cli.global.given = config::Overrides {
        store: given("store"),
        table_prefix: given("table_prefix"),
    };
    if let Err(e) = exit::init_logging() {
        return exit::report(&e);
    }
    #[cfg(feature = "failpoints")]
    commands::chaos::arm_kill_points();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return exit::report(&anyhow::Error::new(e).context("starting the runtime")),
    };
    let result = runtime.block_on(dispatch(cli));
    // A blocking read of a stdin that is still open would hold a plain drop
    // of the runtime (which waits for blocking tasks) forever.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => code,
        Err(e) => exit::report(&e),
    }
}

/// Validates, connects to the store the URL names, and runs the subcommand on it.
pub(crate) async fn dispatch(cli: Cli) -> Result<ExitCode> {
    cli.command.validate()?;
    let Cli { global, command } = cli;
    if let Command::Produce(args) = command {
        return commands::produce(args).await;
    }
    if let Command::Relay(args) = command {
        return commands::relay(args, &global).await;
    }
    if let Command::Chaos(args) = command {
        return commands::chaos::run(args, &global).await;
    }
    if let Command::ChaosWorker(args) = command {
        return commands::chaos::worker::run(args, &global).await;
    }
    if let Command::Completions { shell } = command {
        return commands::generate::completions(shell);
    }
    if let Command::Run(args) = command {
        return commands::config::run(args, &global).await;
    }
    if let Command::Config(config) = command {
        return commands::config::check(config, &global);
    }
    if let Command::Man = command {
        return commands::generate::man();
    }
    let mut global = global;
    // The console and doctor read the store their configuration's consumers use.
    let config_file = match &command {
        Command::Console(console) => console.config.as_deref(),
        Command::Doctor(doctor) => doctor.config.as_deref(),
        _ => None,
    };
    if let Some(path) = config_file {
        if let Some((store, prefix)) = config::shared_store(path, &global.given)? {
            global.store = store;
            global.table_prefix = prefix;
        }
    }
    // Parsed here rather than by clap, which would also parse the default URL
    // of a global flag and fail in builds without SQLite.
    let url: StoreUrl = global.store.parse().map_err(exit::usage)?;
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    let options = commands::migrate::sql_options(&global.table_prefix, &command, &url)?;
    match url.kind {
        #[cfg(feature = "sqlite")]
        backend::Kind::Sqlite => {
            let store =
                backend::connect_sql!(idemq::store::sql::sqlite::SqliteStore, &url, options)?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "postgres")]
        backend::Kind::Postgres => {
            let store =
                backend::connect_sql!(idemq::store::sql::postgres::PostgresStore, &url, options)?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "mysql")]
        backend::Kind::MySql => {
            let store = backend::connect_sql!(idemq::store::sql::mysql::MySqlStore, &url, options)?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "redis")]
        backend::Kind::Redis => {
            use idemq::store::redis::{RedisOptions, RedisStore};
            // `idemq_` → keys `idemq:{consumer/key}:…`.
            let prefix = global.table_prefix.trim_end_matches('_');
            let (options, plain) = RedisOptions::default()
                .prefix(if prefix.is_empty() { "idemq" } else { prefix })
                .with_url_params(&url.url)
                .map_err(|e| backend::connect_error(&url, e))?;
            let connected = match backend::cluster_nodes(&plain) {
                Some(nodes) => {
                    let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
                    RedisStore::connect_cluster(&nodes, options).await
                }
                None => RedisStore::connect_with(&plain, options).await,
            };
            let store = connected.map_err(|e| backend::connect_error(&url, e))?;
            commands::run(store, &url, &global, command).await
        }
        #[cfg(feature = "mongodb")]
        backend::Kind::Mongo => {
            use idemq::store::mongo::{MongoOptions, MongoStore};
            // `--table-prefix idemq_` → collections `idemq_slots`, …
            let (options, plain) = MongoOptions::default()
                .prefix(&global.table_prefix)
                .with_url_params(&url.url)
                .map_err(|e| backend::connect_error(&url, e))?;
            let store = MongoStore::connect_with(&plain, options)
                .await
                .map_err(|e| backend::connect_error(&url, e))?;
            commands::run(store, &url, &global, command).await
        }
    }
}
