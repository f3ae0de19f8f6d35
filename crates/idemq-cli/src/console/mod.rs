//! `idemq console`: a web page over a store for operators — every
//! consumer's numbers and charts, dead letters grouped by reason (replay
//! one, a selection or a whole reason, and delete), a key's whole story,
//! the outbox backlog and its dead rows. Read-only unless started with
//! `--allow-changes`.
//!
//! Replays run one at a time, on the console's own task, through the
//! handler a configuration file gives the consumer (`--config`, the file
//! `idemq run` runs): the same code path as `idemq dlq replay`.

mod history;
mod routes;
mod views;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use crate::sync::lock;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use idemq::store::now_ms;
use tokio::sync::{mpsc, oneshot};

use crate::backend::Backend;
use crate::commands::dlq::{collect, Replayer};
use crate::config;
use crate::interrupt::Interrupt;
use crate::{exit, Command, GlobalArgs};
use history::{Counts, History, Sample};

/// `idemq console`.
#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// Where the console listens (HTTP). It has no login of its own: keep it
    /// on loopback, or behind a proxy that authenticates.
    #[arg(
        long,
        env = "IDEMQ_CONSOLE_ADDR",
        default_value = "127.0.0.1:9466",
        value_name = "ADDR"
    )]
    pub http_addr: SocketAddr,

    /// Allow replaying and deleting dead letters from the page.
    #[arg(long)]
    pub allow_changes: bool,

    /// A configuration file (the one `idemq run` runs): its consumers'
    /// handlers replay their dead letters, and its `http-addr` is scraped
    /// for duplicates and conflicts.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// A running consumer's metrics URL to sample for duplicates and
    /// conflicts (e.g. `http://127.0.0.1:9464/metrics`). Repeatable.
    #[arg(long = "scrape", value_name = "URL")]
    pub scrape: Vec<String>,

    /// How often the charts sample the store and the scraped consumers.
    #[arg(long, default_value = "10s", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub sample_every: Duration,
}

/// What the pages share.
pub(crate) struct Console<B> {
    store: Arc<B>,
    allow_changes: bool,
    /// Every form carries it: a page of another site cannot post here.
    token: String,
    table_prefix: String,
    history: History,
    sample_every: Duration,
    scrape_targets: Vec<String>,
    scrape_failing: Mutex<Vec<String>>,
    /// Consumers whose handler is known (replay possible).
    replayable: Vec<String>,
    notes: Vec<String>,
    replays: mpsc::Sender<ReplayJob>,
}

/// A replay asked for by a page: the letters of `consumer` with these ids,
/// or of this reason.
struct ReplayJob {
    consumer: String,
    ids: Vec<i64>,
    reason: Option<String>,
    done: oneshot::Sender<Result<Vec<Settled>, String>>,
}

/// What became of one dead letter acted on from a page.
pub(crate) struct Settled {
    /// The letter's id.
    pub id: i64,
    /// What happened, in words.
    pub text: String,
    /// Whether that is the hoped-for end (processed, deleted).
    pub good: bool,
}

impl Settled {
    fn new(id: i64, text: impl Into<String>, good: bool) -> Self {
        Self {
            id,
            text: text.into(),
            good,
        }
    }
}

/// Serves the console until Ctrl-C or SIGTERM.
pub async fn run<B: Backend + Clone>(
    store: B,
    global: &GlobalArgs,
    args: ConsoleArgs,
) -> Result<ExitCode> {
    let mut notes = Vec::new();
    let mut replayers = BTreeMap::new();
    let mut scrape_targets = args.scrape.clone();
    if let Some(path) = &args.config {
        let plan = config::load(path, &global.given)?;
        if let Some(addr) = plan.http_addr {
            scrape_targets.push(format!("http://{addr}/metrics"));
        }
        for job in plan.jobs {
            let Command::Consume(consume) = &job.cli.command else {
                continue;
            };
            if job.cli.global.store != global.store
                || job.cli.global.table_prefix != global.table_prefix
            {
                notes.push(format!(
                    "{}: the configuration gives it another store or table prefix than the console's; its dead letters are not replayed here",
                    job.label
                ));
                continue;
            }
            let replayer = Replayer::new(
                &consume.consumer,
                store.clone(),
                &consume.processing,
                &consume.sink,
            )
            .await
            .with_context(|| format!("preparing the replay of {}", job.label))?;
            replayers.insert(consume.consumer.clone(), replayer);
        }
    }
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| exit::usage(format!("cannot listen on {}: {e}", args.http_addr)))?;
    let (replays, jobs) = mpsc::channel(16);
    let console = Arc::new(Console {
        store: Arc::new(store),
        allow_changes: args.allow_changes,
        token: uuid::Uuid::new_v4().simple().to_string(),
        table_prefix: global.table_prefix.clone(),
        history: History::default(),
        sample_every: args.sample_every,
        scrape_targets,
        scrape_failing: Mutex::default(),
        replayable: replayers.keys().cloned().collect(),
        notes,
        replays,
    });
    println!(
        "idemq console on http://{} ({})",
        listener.local_addr().unwrap_or(args.http_addr),
        if args.allow_changes {
            "replay and delete allowed"
        } else {
            "read-only"
        }
    );
    let interrupt = Interrupt::listen();
    let server = axum::serve(listener, routes::router(Arc::clone(&console)))
        .with_graceful_shutdown({
            let interrupt = interrupt.clone();
            async move { interrupt.wait().await }
        });
    tokio::select! {
        served = server => served.context("serving the console")?,
        () = sample(&console) => {}
        () = replay_worker(replayers, jobs, interrupt.clone()) => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Takes a sample every `sample_every`, forever.
async fn sample<B: Backend>(console: &Console<B>) {
    let client = reqwest::Client::new();
    let mut tick = tokio::time::interval(console.sample_every);
    loop {
        tick.tick().await;
        let stats = match console.store.stats().await {
            Ok(stats) => stats,
            Err(e) => {
                tracing::warn!(error = %e, "the console could not read the store's stats");
                continue;
            }
        };
        let timeout = console.sample_every.min(Duration::from_secs(5));
        let (totals, failing) = history::scrape(&client, &console.scrape_targets, timeout).await;
        let scraped = !console.scrape_targets.is_empty();
        let outcome = |consumer: &str, outcome: &str| {
            scraped.then(|| {
                totals
                    .get(&(consumer.to_owned(), outcome.to_owned()))
                    .copied()
                    .unwrap_or(0.0)
            })
        };
        let consumers = stats
            .iter()
            .map(|s| {
                (
                    s.consumer.clone(),
                    Counts {
                        processed: s.processed,
                        dead_letters: s.dead_letters,
                        duplicates: outcome(&s.consumer, "duplicate"),
                        conflicts: outcome(&s.consumer, "conflict"),
                    },
                )
            })
            .collect();
        console.history.push(Sample {
            at_ms: now_ms(),
            consumers,
        });
        *lock(&console.scrape_failing) = failing;
    }
}

/// Runs the replays the pages ask for, one at a time, until the pages are
/// gone. Not a spawned task: the consumer's run need not be `Send`.
async fn replay_worker<B: Backend>(
    replayers: BTreeMap<String, Replayer<B>>,
    mut jobs: mpsc::Receiver<ReplayJob>,
    interrupt: Interrupt,
) {
    while let Some(job) = jobs.recv().await {
        let result = match replayers.get(&job.consumer) {
            None => Err(format!(
                "no handler is known for consumer {:?}: start the console with --config naming it",
                job.consumer
            )),
            Some(replayer) => replay(replayer, &job, &interrupt)
                .await
                .map_err(|e| format!("{e:#}")),
        };
        let _ = job.done.send(result);
    }
}

/// One [`ReplayJob`]: each letter's verdict, in id order.
async fn replay<B: Backend>(
    replayer: &Replayer<B>,
    job: &ReplayJob,
    interrupt: &Interrupt,
) -> Result<Vec<Settled>> {
    let wanted = (!job.ids.is_empty()).then(|| job.ids.iter().copied().collect());
    let letters = collect(replayer.store().as_ref(), &job.consumer, wanted.as_ref()).await?;
    let mut lines = Vec::new();
    for letter in letters
        .iter()
        .filter(|d| job.reason.as_ref().is_none_or(|r| *r == d.reason))
    {
        if interrupt.is_set() {
            break;
        }
        let verdict = replayer.replay(letter, interrupt.wait()).await?;
        lines.push(Settled::new(
            letter.id,
            verdict.to_string(),
            verdict.resolved(),
        ));
    }
    Ok(lines)
}
