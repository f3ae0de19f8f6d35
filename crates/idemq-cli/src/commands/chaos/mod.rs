//! `idemq chaos`: exactly-once under fire. Publishes orders with duplicates
//! of both kinds and poison to a source, consumes them with several worker
//! processes (this binary's `consume`), kills the workers with SIGKILL at
//! random moments and at the engine's named fail points, restarts them (and
//! optionally the database and the broker), and checks at the end that every
//! order was applied exactly once and every poison message dead-lettered.

mod ledger;
mod observe;
mod plan;
pub mod worker;

use std::collections::{BTreeMap, VecDeque};
use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use self::ledger::CellStore;
use self::plan::Plan;
#[cfg(feature = "failpoints")]
pub use self::worker::arm_kill_points;
pub use self::worker::WorkerArgs;
use crate::backend::StoreUrl;
use crate::endpoint::Endpoint;
use crate::{exit, GlobalArgs};

/// The exit status when a cell found a double effect, a lost message or a
/// poison message that was not dead-lettered.
pub const FAILED: u8 = 4;

/// `idemq chaos --help`.
pub const LONG_ABOUT: &str = "Fault injection against your own broker and database.\n\n\
    For each --source (one cell per source, with the --store): publishes --messages orders \
    {\"order_id\",\"amount\"} with duplicates of both kinds (same message id; a producer retry \
    with a new id and the same order_id) and --poison messages (not JSON; no order_id); runs \
    --workers processes of this binary (`idemq consume --apply-sql 'INSERT INTO <ledger> …'`; \
    for redis:// a fenced, keyed effect instead; for mongodb:// an upsert keyed by the order, as \
    --apply-mongo does), kills them with SIGKILL at random moments \
    (--kills) and, in a build with the `failpoints` feature, at the named points of the protocol \
    (--kill-at), restarts every killed worker, optionally runs --restart-db / --restart-broker \
    mid-run, and when the workers have drained the source checks: every order in the ledger \
    exactly once (the ledger has no unique constraint, so a double effect is a second row) with \
    the right amount, every poison message dead-lettered with its reason, nothing lost.\n\n\
    One row per cell: messages, duplicates sent, poison, kills (random / at each point), \
    restarts, database/broker restarts, double effects, lost, dead letters, seconds. Tables \
    and keys are new per cell (prefix chaos_<run>_) and are left in place for inspection.";

/// Exit codes of `idemq chaos`.
pub const EXIT_CODES: &str = "EXIT CODES:
  0    every cell passed: no double effect, nothing lost, every poison message dead-lettered
  1    runtime error: the store, the broker or a worker could not be started
  2    usage or configuration error
  4    a cell found a double effect, a lost message or a wrong dead letter";

/// Named-point kill probabilities used when `--kill-at` is not given.
const DEFAULT_KILL_AT: &str =
    "after_claim:0.003,after_handler:0.003,before_commit:0.003,after_commit_before_ack:0.003";

/// `idemq chaos`.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// Where the messages go and are consumed from (repeatable: one cell per
    /// source, all with the --store): a JSON-lines file that does not exist
    /// yet, or any broker URL `consume` takes. `{run}` is replaced by a fresh
    /// run id, for a new topic/queue per run (e.g. `kafka://H:9092/chaos_{run}?group=g&create_partitions=3`).
    #[arg(long = "source", value_name = "SOURCE", required = true)]
    sources: Vec<String>,

    /// Distinct orders (business keys) to publish.
    #[arg(long, default_value_t = 2000, value_name = "N")]
    messages: usize,

    /// Fraction of orders published twice with the same message id.
    #[arg(long, default_value_t = 0.1, value_name = "F", value_parser = super::parse_fraction)]
    duplicates: f64,

    /// Fraction of orders published again with a new id and the same key (producer retries).
    #[arg(long, default_value_t = 0.05, value_name = "F", value_parser = super::parse_fraction)]
    producer_retries: f64,

    /// Poison messages: half not JSON, half without `order_id`.
    #[arg(long, default_value_t = 10, value_name = "N")]
    poison: usize,

    /// Worker processes consuming at once.
    #[arg(long, default_value_t = 3, value_name = "K", value_parser = crate::parse_positive)]
    workers: usize,

    /// Workers killed (SIGKILL) by this command at random moments, spread over the run.
    #[arg(long, default_value_t = 20, value_name = "N")]
    kills: usize,

    /// Probabilities of a worker killing itself at each named point, per
    /// passage (`POINT:P,…`; points: after_claim, after_handler,
    /// before_commit, after_commit_before_ack). Needs a build with the
    /// `failpoints` feature; `""` turns them off.
    #[arg(long, default_value = DEFAULT_KILL_AT, value_name = "POINT:P,…")]
    kill_at: String,

    /// A shell command that restarts the database, run once mid-run.
    #[arg(long, value_name = "CMD")]
    restart_db: Option<String>,

    /// A shell command that restarts the broker, run once mid-run.
    #[arg(long, value_name = "CMD")]
    restart_broker: Option<String>,

    /// A worker stops when no message has come for this long.
    #[arg(long, default_value = "3s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    idle_exit: Duration,

    /// Give up on a cell after this long (what is not applied by then is lost).
    #[arg(long, default_value = "600s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    timeout: Duration,

    /// Messages in flight per worker.
    #[arg(long, default_value_t = 8, value_name = "N", value_parser = crate::parse_positive)]
    concurrency: usize,

    /// Workers run in batch mode (SQL stores): N messages per transaction.
    #[arg(long, value_name = "N", value_parser = crate::parse_positive)]
    batch: Option<usize>,

    /// Workers run in offset-watermark mode with key dedup (`consume
    /// --watermark --dedup-keys`; kafka:// sources, SQL stores): the key
    /// claim catches the producer retries the cell publishes, which are new
    /// records a watermark alone cannot tell from new orders.
    #[arg(long, conflicts_with = "batch")]
    watermark: bool,

    /// With --watermark: workers apply several records of a partition at
    /// once (`consume --concurrent-records`), so kills land between
    /// out-of-order commits.
    #[arg(long, requires = "watermark")]
    concurrent_records: bool,

    /// The cell's inbox is time-partitioned, one partition per DURATION
    /// (PostgreSQL, MariaDB; `migrate --partitioned-inbox`): short partitions put
    /// the kills and duplicates across partition boundaries.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    partitioned_inbox: Option<Duration>,

    /// Lease of the lease stores' claims (Redis, MongoDB; short, so a killed holder's keys free up soon).
    #[arg(long, default_value = "2s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    lease: Duration,

    /// Seed of the random choices (messages, kill moments).
    #[arg(long, value_name = "N")]
    seed: Option<u64>,

    /// Where worker logs and kill logs go (default: a new temporary directory).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,

    /// Also append each cell's row to this Markdown table file.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
}

/// Runs every cell (each source × the store) and prints the table.
pub async fn run(args: ChaosArgs, global: &GlobalArgs) -> Result<ExitCode> {
    let store_url: StoreUrl = global.store.parse().map_err(exit::usage)?;
    let points = worker::parse_kill_points(&args.kill_at).map_err(exit::usage)?;
    let points: Vec<(&'static str, f64)> = points.into_iter().filter(|(_, p)| *p > 0.0).collect();
    if !points.is_empty() && !cfg!(feature = "failpoints") {
        eprintln!(
            "idemq chaos: this build has no fail points (cargo feature `failpoints`): \
             only random kills; pass --kill-at '' to silence this"
        );
    }
    let points = if cfg!(feature = "failpoints") {
        points
    } else {
        Vec::new()
    };
    let exe = std::env::current_exe().context("finding this executable")?;
    let work_dir = match &args.work_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("idemq-chaos-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("creating {}", work_dir.display()))?;
    let mut rng = match args.seed {
        Some(seed) => fastrand::Rng::with_seed(seed),
        None => fastrand::Rng::new(),
    };
    println!("{}", Cell::header());
    let mut failed = false;
    for source in &args.sources {
        let cell = CellRun {
            args: &args,
            store_url: &store_url,
            source,
            exe: &exe,
            work_dir: &work_dir,
            points: &points,
        };
        let result = cell.run(&mut rng).await?;
        println!("{}", result.row());
        for note in &result.notes {
            println!("  note: {note}");
        }
        if let Some(path) = &args.report {
            result
                .append_to(path)
                .with_context(|| format!("appending to {}", path.display()))?;
        }
        failed |= !result.passed();
    }
    println!("logs: {}", work_dir.display());
    Ok(if failed {
        ExitCode::from(FAILED)
    } else {
        ExitCode::SUCCESS
    })
}

/// The counts of one cell: the table row.
#[derive(Debug, Default)]
struct Cell {
    source: String,
    store: String,
    messages: usize,
    same_id: u64,
    new_id: u64,
    poison: usize,
    random_kills: u64,
    /// Pids of the workers the runner killed at random.
    randomly_killed: std::collections::HashSet<u32>,
    point_kills: BTreeMap<String, u64>,
    restarts: u64,
    outside_restarts: u64,
    /// Extra rounds of workers started after all had drained the source.
    rounds: u64,
    double: u64,
    lost: u64,
    dead_letters: usize,
    rewrites: Option<u64>,
    seconds: f64,
    /// Failures besides double effects and losses (wrong reason, wrong sum…).
    problems: Vec<String>,
    /// Things worth knowing that are not failures.
    notes: Vec<String>,
    /// Drained workers whose last `/metrics` scrape equalled their summary.
    metrics_checked: u64,
}

impl Cell {
    fn header() -> String {
        format!(
            "{:<18} {:<8} {:>5} {:>6} {:>7} {:>6} {:>5} {:>5} {:>5} {:>5} {:>5} {:>8} {:>5} {:>6} {:>4} {:>4} {:>6}  {}",
            "source",
            "store",
            "msgs",
            "dup_id",
            "dup_new",
            "poison",
            "k_rnd",
            "k_clm",
            "k_hdl",
            "k_bfc",
            "k_aca",
            "restarts",
            "db/br",
            "double",
            "lost",
            "dlq",
            "secs",
            "result"
        )
    }

    fn point(&self, name: &str) -> u64 {
        self.point_kills.get(name).copied().unwrap_or(0)
    }

    fn passed(&self) -> bool {
        self.double == 0 && self.lost == 0 && self.problems.is_empty()
    }

    fn verdict(&self) -> String {
        if self.passed() {
            "ok".to_owned()
        } else {
            let mut what = Vec::new();
            if self.double > 0 {
                what.push(format!("{} double", self.double));
            }
            if self.lost > 0 {
                what.push(format!("{} lost", self.lost));
            }
            what.extend(self.problems.iter().cloned());
            format!("FAILED: {}", what.join("; "))
        }
    }

    fn row(&self) -> String {
        format!(
            "{:<18} {:<8} {:>5} {:>6} {:>7} {:>6} {:>5} {:>5} {:>5} {:>5} {:>5} {:>8} {:>5} {:>6} {:>4} {:>4} {:>6.1}  {}",
            self.source,
            self.store,
            self.messages,
            self.same_id,
            self.new_id,
            self.poison,
            self.random_kills,
            self.point("after_claim"),
            self.point("after_handler"),
            self.point("before_commit"),
            self.point("after_commit_before_ack"),
            self.restarts,
            self.outside_restarts,
            self.double,
            self.lost,
            self.dead_letters,
            self.seconds,
            self.verdict()
        )
    }

    /// Appends the Markdown row (and the header, to a new or empty file).
    fn append_to(&self, path: &Path) -> std::io::Result<()> {
        let fresh = std::fs::metadata(path)
            .map(|m| m.len() == 0)
            .unwrap_or(true);
        let mut file = OpenOptions::new().create(true).append(true).open(path)?;
        if fresh {
            writeln!(
                file,
                "| source | store | messages | dup same id | dup new id | poison | kills random | \
                 after_claim | after_handler | before_commit | after_commit_before_ack | restarts | \
                 db/broker restarts | double effects | lost | dead letters | seconds | result |"
            )?;
            writeln!(file, "|{}", "---|".repeat(18))?;
        }
        writeln!(
            file,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} |",
            self.source,
            self.store,
            self.messages,
            self.same_id,
            self.new_id,
            self.poison,
            self.random_kills,
            self.point("after_claim"),
            self.point("after_handler"),
            self.point("before_commit"),
            self.point("after_commit_before_ack"),
            self.restarts,
            self.outside_restarts,
            self.double,
            self.lost,
            self.dead_letters,
            self.seconds,
            self.verdict()
        )
    }
}

/// The short name of a source for the table.
fn source_label(endpoint: &Endpoint) -> String {
    endpoint
        .broker()
        .map_or_else(|| "jsonl".to_owned(), |broker| broker.id.to_owned())
}

/// The consume mode of a cell's workers, as a suffix of its source label.
fn mode_label(args: &ChaosArgs) -> String {
    match (args.batch, args.watermark) {
        (Some(n), _) => format!("/batch{n}"),
        (None, true) if args.concurrent_records => "/watermark-concurrent".to_owned(),
        (None, true) => "/watermark".to_owned(),
        (None, false) => String::new(),
    }
}

/// One worker slot: its process, restarted whenever it dies.
struct Slot {
    child: Option<Child>,
    started: Instant,
    /// Exited by itself with status 0 (drained).
    finished: bool,
    /// The process's `--http-addr` port (SQL workers, which run `consume`).
    port: Option<u16>,
    /// Where the process's stdout (its summary line) goes.
    stdout: PathBuf,
    /// Its outcome counters at the last scrape of `/metrics`.
    scraped: Option<observe::Counts>,
}

/// One cell being run.
struct CellRun<'a> {
    args: &'a ChaosArgs,
    store_url: &'a StoreUrl,
    source: &'a str,
    exe: &'a Path,
    work_dir: &'a Path,
    points: &'a [(&'static str, f64)],
}

/// What a cell needs to start workers.
struct Setup {
    run: String,
    prefix: String,
    table: String,
    consumer: String,
    endpoint: Endpoint,
    sql: bool,
    log: PathBuf,
    kill_log: PathBuf,
}

impl CellRun<'_> {
    async fn run(&self, rng: &mut fastrand::Rng) -> Result<Cell> {
        let args = self.args;
        let run = format!("{:08x}", rng.u32(..) ^ std::process::id().rotate_left(16));
        let source_url = self.source.replace("{run}", &run);
        let endpoint: Endpoint = source_url.parse().map_err(exit::usage)?;
        match &endpoint {
            Endpoint::Std => bail!(exit::usage("chaos needs a file or a broker, not `-`")),
            Endpoint::File(path)
                if std::fs::metadata(path)
                    .map(|m| m.len() > 0)
                    .unwrap_or(false) =>
            {
                bail!(exit::usage(format!(
                    "{} exists and is not empty: chaos publishes into a new file (use {{run}} in the name)",
                    path.display()
                )))
            }
            _ => {}
        }
        if args.watermark && !endpoint.supports_watermarks() {
            bail!(exit::usage(format!(
                "--watermark needs a kafka:// source, not {endpoint}"
            )));
        }
        let prefix = format!("chaos_{run}_");
        let store = CellStore::connect(self.store_url, &prefix, args.partitioned_inbox).await?;
        // Batches run on every cell store: one transaction with savepoints
        // on SQL, a round trip of leases each way on Redis.
        if args.watermark && !store.is_sql() {
            bail!(exit::usage(
                "--watermark cells need a SQL store (sqlite:, postgres://, mysql://)"
            ));
        }
        let setup = Setup {
            table: format!("{prefix}ledger"),
            consumer: "chaos".to_owned(),
            sql: store.is_sql(),
            log: self.work_dir.join(format!("cell-{run}.log")),
            kill_log: self.work_dir.join(format!("cell-{run}.kills")),
            run,
            prefix,
            endpoint,
        };
        eprintln!(
            "chaos: cell {} × {} (run {}, tables/keys {}*, log {})",
            setup.endpoint,
            self.store_url,
            setup.run,
            setup.prefix,
            setup.log.display()
        );
        store.prepare(&setup.table).await?;
        let plan = Plan::generate(
            &setup.run,
            args.messages,
            args.duplicates,
            args.producer_retries,
            args.poison,
            rng,
        );
        let mut cell = Cell {
            source: format!("{}{}", source_label(&setup.endpoint), mode_label(args)),
            store: self
                .store_url
                .display
                .split(':')
                .next()
                .map(|scheme| match args.partitioned_inbox {
                    Some(interval) => {
                        format!(
                            "{scheme} (partitioned {})",
                            humantime::format_duration(interval)
                        )
                    }
                    None => scheme.to_owned(),
                })
                .unwrap_or_default(),
            messages: plan.orders.len(),
            same_id: plan.same_id,
            new_id: plan.new_id,
            poison: plan.poison.len(),
            ..Cell::default()
        };
        if !setup.sql {
            cell.notes.push(store.lease_ledger_note().to_owned());
        }
        let started = Instant::now();

        // MQTT keeps messages only for sessions that exist: create them first.
        if setup
            .endpoint
            .broker()
            .is_some_and(|broker| broker.subscribe_before_publish)
        {
            let mut primers = Vec::new();
            for slot in 0..args.workers {
                let mut cmd =
                    self.worker_command(&setup, slot, Duration::from_secs(1), false, None, None)?;
                primers.push(cmd.spawn().context("starting a worker")?);
            }
            for mut primer in primers {
                primer.wait().context("waiting for a worker")?;
            }
        }
        // The broker's publisher takes the consumers' URL (an MQTT shared
        // subscription is published to as its topic, by a client of its own).
        plan.publish(&setup.endpoint).await?;
        if let Endpoint::File(path) = &setup.endpoint {
            // Each worker reads its own copy with its own checkpoint (a
            // restarted worker resumes where its last run left off): K
            // processes reading one stream into one inbox.
            for slot in 0..args.workers {
                std::fs::copy(path, slot_file(path, slot))
                    .with_context(|| format!("copying {}", path.display()))?;
            }
        }

        // A partitioned inbox is sealed as its partitions end, as the
        // pruner does, while the workers claim and get killed.
        let driven = std::sync::atomic::AtomicBool::new(false);
        let inbox = format!("{}inbox", setup.prefix);
        let (outcome, sealed) = tokio::join!(
            async {
                let outcome = self.drive(&setup, &store, &plan, &mut cell, rng).await;
                driven.store(true, std::sync::atomic::Ordering::SeqCst);
                outcome
            },
            async {
                let mut sealed = None;
                while args.partitioned_inbox.is_some()
                    && !driven.load(std::sync::atomic::Ordering::SeqCst)
                {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    // The database may be restarting: the next round seals.
                    if let Ok(count) = store.seal_partitions(&inbox).await {
                        sealed = count.or(sealed);
                    }
                }
                sealed
            }
        );
        outcome?;
        if let Some(sealed) = sealed {
            cell.notes.push(format!(
                "{sealed} partitions sealed during the run (claims looked into them through their key filters)"
            ));
        }
        cell.seconds = started.elapsed().as_secs_f64();
        check(&store, &setup.table, &setup.consumer, &plan, &mut cell).await?;
        if setup.sql {
            if cell.metrics_checked == 0 {
                cell.problems
                    .push("no drained worker's /metrics was scraped to check".into());
            } else {
                cell.notes.push(format!(
                    "/metrics: the last scrape of each drained worker, taken after its run \
                     ended (--http-linger), equals its summary line ({} workers)",
                    cell.metrics_checked
                ));
            }
        }
        if let Ok(text) = std::fs::read_to_string(&setup.kill_log) {
            // One death, one kill: each line is "POINT PID"; a pid counts
            // once, and not at all when the runner's random kill reached it
            // first (then the death is already counted as random).
            let mut dead = cell.randomly_killed.clone();
            for line in text.lines().filter(|l| !l.is_empty()) {
                let (point, pid) = line.split_once(' ').unwrap_or((line, ""));
                if let Ok(pid) = pid.parse::<u32>() {
                    if !dead.insert(pid) {
                        continue;
                    }
                }
                *cell.point_kills.entry(point.to_owned()).or_insert(0) += 1;
            }
        }
        Ok(cell)
    }

    /// The command line of worker `slot`.
    /// With `port`, a SQL worker serves `--http-addr` on it; its stdout
    /// goes to `stdout` if given, else to the cell log.
    fn worker_command(
        &self,
        setup: &Setup,
        slot: usize,
        idle: Duration,
        arm: bool,
        port: Option<u16>,
        stdout: Option<&Path>,
    ) -> Result<Command> {
        let args = self.args;
        let url = match &setup.endpoint {
            Endpoint::Broker { broker, url } => (broker.competing_url)(url, slot),
            Endpoint::File(path) => slot_file(path, slot).display().to_string(),
            Endpoint::Std => "-".to_owned(),
        };
        let idle = humantime::format_duration(idle).to_string();
        let concurrency = args.concurrency.to_string();
        let mut cmd = Command::new(self.exe);
        if setup.sql {
            let insert = format!(
                "INSERT INTO {} (order_id, amount, msg_id) VALUES (:idemq_key, :amount, :idemq_id)",
                setup.table
            );
            cmd.args(["consume", &url, "--consumer", &setup.consumer])
                .args(["--key", "json:/order_id", "--apply-sql", &insert])
                .args(["--idle-exit", &idle, "--concurrency", &concurrency])
                .args(["--max-attempts", "50", "--backoff", "50ms"]);
            if let Some(n) = args.batch {
                cmd.args(["--batch", &n.to_string()]);
            }
            if let Some(port) = port {
                // The worker waits for one scrape after its run ends (the
                // runner scrapes every 100 ms, unless a restart it runs holds it).
                cmd.args(["--http-addr", &format!("127.0.0.1:{port}")])
                    .args(["--http-linger", "60s"]);
            }
            if args.watermark {
                cmd.args(["--watermark", "--dedup-keys"]);
                if args.concurrent_records {
                    cmd.arg("--concurrent-records");
                }
            }
        } else {
            let lease = humantime::format_duration(args.lease).to_string();
            cmd.args(["chaos-worker", &url, "--consumer", &setup.consumer])
                .args(["--ledger", &setup.table, "--lease", &lease])
                .args(["--idle-exit", &idle, "--concurrency", &concurrency]);
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&setup.log)
            .with_context(|| format!("opening {}", setup.log.display()))?;
        let out = match stdout {
            Some(path) => std::fs::File::create(path)
                .with_context(|| format!("creating {}", path.display()))?,
            None => log.try_clone()?,
        };
        cmd.env("IDEMQ_STORE", &self.store_url.url)
            .env("IDEMQ_TABLE_PREFIX", &setup.prefix)
            .env_remove("IDEMQ_CONSUMER")
            .env(
                "IDEMQ_LOG",
                std::env::var("IDEMQ_CHAOS_WORKER_LOG").unwrap_or_else(|_| "error".into()),
            )
            .env_remove(worker::KILL_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(log));
        if arm && !self.points.is_empty() {
            let spec: Vec<String> = self
                .points
                .iter()
                .map(|(name, p)| format!("{name}:{p}"))
                .collect();
            cmd.env(worker::KILL_ENV, spec.join(","))
                .env(worker::KILL_LOG_ENV, &setup.kill_log);
        }
        Ok(cmd)
    }

    /// Runs the workers until the source is drained (or the timeout),
    /// killing and restarting them on the way.
    async fn drive(
        &self,
        setup: &Setup,
        store: &CellStore,
        plan: &Plan,
        cell: &mut Cell,
        rng: &mut fastrand::Rng,
    ) -> Result<()> {
        let args = self.args;
        let keys = plan.orders.len() as u64;
        // Random kills when the ledger passes these counts, spread over 2–90 %.
        let mut kill_at: VecDeque<u64> = {
            let mut at: Vec<u64> = (0..args.kills)
                .map(|_| (keys as f64 * (0.02 + 0.88 * rng.f64())) as u64)
                .collect();
            at.sort_unstable();
            at.into()
        };
        let mut restart_db = args
            .restart_db
            .as_ref()
            .map(|cmd| (keys * 2 / 5, cmd.clone()));
        let mut restart_broker = args
            .restart_broker
            .as_ref()
            .map(|cmd| (keys * 3 / 5, cmd.clone()));
        let deadline = Instant::now() + args.timeout;
        let mut slots: Vec<Slot> = Vec::new();
        for slot in 0..args.workers {
            slots.push(self.spawn(setup, slot)?);
        }
        let mut applied = 0;
        let mut last_poll = Instant::now() - Duration::from_secs(1);
        loop {
            tokio::time::sleep(Duration::from_millis(25)).await;
            // Reap: a worker that died (killed, or failed) is restarted at once.
            for (n, slot) in slots.iter_mut().enumerate() {
                let Some(child) = slot.child.as_mut() else {
                    continue;
                };
                let Some(status) = child.try_wait().context("waiting for a worker")? else {
                    continue;
                };
                slot.child = None;
                if status.success() {
                    slot.finished = true;
                    self.check_metrics(setup, slot, cell);
                    continue;
                }
                if status.signal() != Some(SIGKILL) {
                    cell.notes.push(format!(
                        "worker {n} exited with {status} after {:.1}s (restarted; see the log)",
                        slot.started.elapsed().as_secs_f64()
                    ));
                }
                *slot = self.spawn(setup, n)?;
                cell.restarts += 1;
            }
            if last_poll.elapsed() >= Duration::from_millis(100) {
                last_poll = Instant::now();
                // Each live worker's counters; the last scrape before a
                // worker drains falls in its idle time, after its last outcome.
                for slot in slots.iter_mut().filter(|s| s.child.is_some()) {
                    if let Some(port) = slot.port {
                        let scrape = observe::get(port, "/metrics", Duration::from_secs(1));
                        if let Some((200, metrics)) = scrape.await {
                            slot.scraped = Some(observe::scraped(&metrics, &setup.consumer));
                        }
                    }
                }
                // The store may be restarting: keep the last count.
                if let Ok(n) = store.applied(&setup.table).await {
                    applied = n;
                }
            }
            if kill_at.front().is_some_and(|&at| applied >= at) {
                let live: Vec<usize> = slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.child.is_some())
                    .map(|(n, _)| n)
                    .collect();
                if !live.is_empty() {
                    let n = live[rng.usize(..live.len())];
                    if let Some(mut child) = slots[n].child.take() {
                        if child.try_wait().context("waiting for a worker")?.is_some() {
                            // It died (at a named point) or finished since the
                            // reap above: the next reap handles it, and a later
                            // tick kills a live worker. Killing it here would
                            // count one death as two kills.
                            slots[n].child = Some(child);
                        } else {
                            cell.randomly_killed.insert(child.id());
                            child.kill().context("killing a worker")?;
                            child.wait().context("reaping a worker")?;
                            cell.random_kills += 1;
                            kill_at.pop_front();
                            slots[n] = self.spawn(setup, n)?;
                            cell.restarts += 1;
                        }
                    }
                }
            }
            for (database, restart) in [(true, &mut restart_db), (false, &mut restart_broker)] {
                if restart.as_ref().is_some_and(|(at, _)| applied >= *at) {
                    if let Some((_, cmd)) = restart.take() {
                        let ports: Vec<u16> = slots
                            .iter()
                            .filter(|s| s.child.is_some())
                            .filter_map(|s| s.port)
                            .collect();
                        if database && !ports.is_empty() {
                            let readiness =
                                observe::readiness_through(&ports, self.outside(&cmd, setup))
                                    .await?;
                            note_readiness(cell, &readiness);
                        } else {
                            self.outside(&cmd, setup).await?;
                        }
                        cell.outside_restarts += 1;
                    }
                }
            }
            if slots.iter().all(|s| s.finished) {
                // Every worker drained the source. Done if everything is
                // settled; otherwise (a killed worker's messages were still
                // invisible, e.g. an SQS visibility timeout) run another round.
                // A file has nothing to redeliver once every copy was read
                // to its end: what is missing then is lost.
                let file = matches!(setup.endpoint, Endpoint::File(_));
                if file || settled(store, setup, plan).await? || Instant::now() >= deadline {
                    if !kill_at.is_empty() {
                        cell.notes.push(format!(
                            "{} random kills not done: the run ended before the ledger reached their points",
                            kill_at.len()
                        ));
                    }
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                for (n, slot) in slots.iter_mut().enumerate() {
                    *slot = self.spawn(setup, n)?;
                }
                cell.rounds += 1;
                continue;
            }
            if Instant::now() >= deadline {
                for slot in &mut slots {
                    if let Some(mut child) = slot.child.take() {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                }
                cell.problems
                    .push(format!("timed out after {:?}", args.timeout));
                return Ok(());
            }
        }
    }

    fn spawn(&self, setup: &Setup, slot: usize) -> Result<Slot> {
        static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nth = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stdout = self
            .work_dir
            .join(format!("cell-{}.w{slot}.{nth}.out", setup.run));
        let port = if setup.sql {
            Some(observe::free_port()?)
        } else {
            None
        };
        let child = self
            .worker_command(setup, slot, self.args.idle_exit, true, port, Some(&stdout))?
            .spawn()
            .context("starting a worker")?;
        Ok(Slot {
            child: Some(child),
            started: Instant::now(),
            finished: false,
            port,
            stdout,
            scraped: None,
        })
    }

    /// A drained worker's last scrape against its summary line: equal (the
    /// worker lingers until a scrape begun after its run ended has been
    /// answered); else a problem.
    fn check_metrics(&self, setup: &Setup, slot: &Slot, cell: &mut Cell) {
        let Some(scraped) = &slot.scraped else {
            return;
        };
        let stdout = std::fs::read_to_string(&slot.stdout).unwrap_or_default();
        match observe::summarized(&stdout, &setup.consumer) {
            Some(summary) if summary == *scraped => cell.metrics_checked += 1,
            Some(summary) => cell.problems.push(format!(
                "a worker's last /metrics scrape {scraped:?} differs from its summary {summary:?}"
            )),
            None => cell.problems.push(format!(
                "a worker exited 0 without a summary line ({})",
                slot.stdout.display()
            )),
        }
    }

    /// Runs a user's restart command (`sh -c`), output to the cell log.
    async fn outside(&self, cmd: &str, setup: &Setup) -> Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&setup.log)?;
        let mut command = Command::new("sh");
        command
            .args(["-c", cmd])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
        let cmd = cmd.to_owned();
        let status = tokio::task::spawn_blocking(move || command.status())
            .await
            .context("running a restart command")?
            .with_context(|| format!("running {cmd:?}"))?;
        if !status.success() {
            bail!("the restart command {cmd:?} failed with {status}");
        }
        Ok(())
    }
}

/// What `/readyz` said through the database restart: a worker that never
/// turns ready again is a problem; one that never turned unready is noted.
fn note_readiness(cell: &mut Cell, readiness: &observe::Readiness) {
    if readiness.ready_again == Some(false) {
        cell.problems
            .push("no worker's /readyz answered 200 within 30 s after the database restart".into());
    }
    cell.notes.push(format!(
        "/readyz during the database restart: 503 in {} of {} polls, then {}",
        readiness.unready,
        readiness.polls,
        match readiness.ready_again {
            Some(true) => "200 again",
            Some(false) => "never 200",
            None => "no worker left to ask (they had drained their source)",
        }
    ));
}

/// SIGKILL's number (9 on every Unix).
const SIGKILL: i32 = 9;

/// Worker `slot`'s copy of a file source.
fn slot_file(path: &Path, slot: usize) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".w{slot}"));
    PathBuf::from(name)
}

/// Whether every order is in the ledger and every poison message was dead-lettered.
async fn settled(store: &CellStore, setup: &Setup, plan: &Plan) -> Result<bool> {
    let ledger = match store.ledger(&setup.table).await {
        Ok(l) => l,
        Err(_) => return Ok(false),
    };
    if plan.orders.keys().any(|k| !ledger.per_key.contains_key(k)) {
        return Ok(false);
    }
    let dead = match store.dead_letters(&setup.consumer).await {
        Ok(d) => d,
        Err(_) => return Ok(false),
    };
    Ok(plan.poison.iter().all(|(token, _)| {
        dead.iter()
            .any(|d| String::from_utf8_lossy(&d.message.payload).contains(token.as_str()))
    }))
}

/// The final check: double effects, losses, sums, dead letters.
async fn check(
    store: &CellStore,
    table: &str,
    consumer: &str,
    plan: &Plan,
    cell: &mut Cell,
) -> Result<()> {
    let ledger = store.ledger(table).await?;
    let dead = store.dead_letters(consumer).await?;
    cell.dead_letters = dead.len();
    cell.rewrites = ledger.rewrites;
    let mut total = 0;
    for (key, amount) in &plan.orders {
        match ledger.per_key.get(key) {
            None => cell.lost += 1,
            Some((rows, sum)) => {
                cell.double += rows - 1;
                if *sum != amount * (*rows as i64) {
                    cell.problems
                        .push(format!("{key}: amount {sum}, expected {amount}"));
                }
                total += sum;
            }
        }
    }
    let strangers = ledger
        .per_key
        .keys()
        .filter(|k| !plan.orders.contains_key(*k))
        .count();
    if strangers > 0 {
        cell.problems.push(format!(
            "{strangers} keys in the ledger that were never sent"
        ));
    }
    if cell.double == 0 && cell.lost == 0 && total != plan.total() {
        cell.problems
            .push(format!("ledger sum {total}, expected {}", plan.total()));
    }
    for (token, kind) in &plan.poison {
        let letters: Vec<_> = dead
            .iter()
            .filter(|d| String::from_utf8_lossy(&d.message.payload).contains(token.as_str()))
            .collect();
        if letters.is_empty() {
            cell.lost += 1;
        } else if letters.iter().any(|d| d.reason != kind.reason()) {
            cell.problems.push(format!(
                "poison {token} dead-lettered as {:?}, expected {}",
                letters
                    .iter()
                    .map(|d| d.reason.as_str())
                    .collect::<Vec<_>>(),
                kind.reason()
            ));
        }
    }
    // A letter that is neither a poison message nor an order is something
    // the consumer made up: a torn read of a line, a garbled record.
    let strange: Vec<_> = dead
        .iter()
        .filter(|d| {
            let payload = String::from_utf8_lossy(&d.message.payload);
            !plan
                .poison
                .iter()
                .any(|(token, _)| payload.contains(token.as_str()))
                && !d.key.as_ref().is_some_and(|k| plan.orders.contains_key(k))
        })
        .collect();
    if let Some(first) = strange.first() {
        cell.problems.push(format!(
            "{} dead letters of messages never sent (first: {}: {})",
            strange.len(),
            first.reason,
            first.error
        ));
    }
    let poison_letters = plan.poison.len();
    if dead.len() > poison_letters {
        let orders: Vec<_> = dead
            .iter()
            .filter(|d| d.key.as_ref().is_some_and(|k| plan.orders.contains_key(k)))
            .collect();
        if !orders.is_empty() {
            cell.problems.push(format!(
                "{} orders dead-lettered (first: {} {}: {})",
                orders.len(),
                orders[0].key.as_deref().unwrap_or_default(),
                orders[0].reason,
                orders[0].error
            ));
        }
        let copies = dead
            .len()
            .saturating_sub(poison_letters + orders.len() + strange.len());
        if copies > 0 {
            cell.notes.push(format!(
                "{copies} extra dead-letter rows for poison messages: the same poison message \
                 from another origin (another worker's copy of a file, another producer \
                 copy) is another letter; a redelivery of one delivery keeps one letter"
            ));
        }
    }
    if cell.rounds > 0 {
        cell.notes.push(format!(
            "{} more rounds of workers were started after all had gone idle with orders still \
             unapplied (messages of killed workers invisible until a visibility timeout, \
             ack_wait or session timeout ran out)",
            cell.rounds
        ));
    }
    if let Some(rewrites) = cell.rewrites {
        cell.notes.push(format!(
            "lease store: {rewrites} effect writes repeated by a later lease holder and absorbed by the keyed write"
        ));
    }
    Ok(())
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;

    /// The check is not vacuous: a second row, a missing order and poison
    /// that was never dead-lettered are all reported.
    #[tokio::test]
    async fn the_check_finds_double_effects_and_losses() {
        let dir = tempfile::tempdir().unwrap();
        let url: StoreUrl = format!("sqlite://{}", dir.path().join("c.db").display())
            .parse()
            .unwrap();
        let store = CellStore::connect(&url, "t_", None).await.unwrap();
        store.prepare("t_ledger").await.unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        let plan = Plan::generate("x", 3, 0.0, 0.0, 2, &mut rng);
        let orders: Vec<(&String, &i64)> = plan.orders.iter().collect();
        let CellStore::Sql(sqlite) = &store else {
            panic!("not a SQL store")
        };
        // The first order twice, the second once, the third never.
        for (key, amount) in [orders[0], orders[0], orders[1]] {
            sqlite
                .execute(&format!(
                    "INSERT INTO t_ledger (order_id, amount) VALUES ('{key}', {amount})"
                ))
                .await
                .unwrap();
        }
        let mut cell = Cell::default();
        check(&store, "t_ledger", "chaos", &plan, &mut cell)
            .await
            .unwrap();
        assert_eq!(cell.double, 1);
        assert_eq!(cell.lost, 1 + 2, "one order and two poison messages");
        assert!(!cell.passed());
        assert!(
            cell.verdict().starts_with("FAILED: 1 double; 3 lost"),
            "{}",
            cell.verdict()
        );
    }
}
