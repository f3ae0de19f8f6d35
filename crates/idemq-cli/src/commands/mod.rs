//! The subcommands, each written once, generic over [`Backend`].

pub(crate) mod chaos;
pub(crate) mod config;
mod consume;
pub(crate) mod dlq;
mod doctor;
pub(crate) mod generate;
pub(crate) mod inspect;
pub mod migrate;
mod produce;
#[cfg(feature = "proxy")]
pub(crate) mod proxy;
mod prune;
mod relay;
mod release;
mod stats;

use std::process::ExitCode;

use anyhow::Result;
use idemq::{ConsumerBuilder, KeySpec, RetryPolicy, StoreError, StoreErrorKind};

use crate::backend::{Backend, StoreUrl};
use crate::{Command, DlqCommand, GlobalArgs, ProcessingArgs};

/// Runs `command` on a connected store.
pub async fn run<B: Backend + Clone>(
    store: B,
    url: &StoreUrl,
    global: &GlobalArgs,
    command: Command,
) -> Result<ExitCode> {
    match command {
        Command::Consume(args) => consume::with_cache(store, args).await,
        Command::Produce(args) => produce::run(args).await,
        Command::Relay(args) => relay::run(args, global).await,
        Command::Migrate(_) => migrate::run(&store, url, &global.table_prefix).await,
        Command::Prune(args) => prune::run(&store, global, &args).await,
        Command::Stats(args) => stats::run(&store, &args).await,
        Command::Doctor(args) => doctor::run(&store, global, &args).await,
        Command::Inspect(args) => inspect::run(&store, &args).await,
        Command::Release(args) => release::run(&store, &args).await,
        Command::Dlq(DlqCommand::List(args)) => dlq::list(&store, &args).await,
        Command::Dlq(DlqCommand::Replay(args)) => dlq::replay(store, args).await,
        Command::Chaos(args) => chaos::run(args, global).await,
        Command::ChaosWorker(args) => chaos::worker::run(args, global).await,
        Command::Completions { shell } => generate::completions(shell),
        Command::Run(args) => config::run(args, global).await,
        Command::Config(command) => config::check(command, global),
        Command::Man => generate::man(),
        Command::Console(args) => crate::console::run(store, global, args).await,
        #[cfg(feature = "proxy")]
        Command::Proxy(args) => proxy::run(store, args).await,
    }
}

pub use migrate::MigrateArgs;
pub use produce::{parse_fraction, run as produce};
pub use relay::{run as relay, RelayArgs};

/// Adds a hint to run `idemq migrate` when the store says a table is missing.
fn admin_error(err: StoreError, doing: &str) -> anyhow::Error {
    let doing = if err.kind() == StoreErrorKind::MissingSchema {
        format!("{doing} (are the idemq tables missing? run `idemq migrate`)")
    } else {
        doing.to_owned()
    };
    anyhow::Error::new(err).context(doing)
}

/// Applies the key, fingerprint, retry and conflict flags to a consumer builder.
fn configure<B: Backend>(builder: ConsumerBuilder<B>, args: &ProcessingArgs) -> ConsumerBuilder<B> {
    builder
        .key(
            args.key
                .clone()
                .unwrap_or_else(|| KeySpec::transport_key().or(KeySpec::id())),
        )
        .fingerprint(args.fingerprint.clone())
        .retry(
            RetryPolicy::default()
                .with_max_attempts(args.max_attempts)
                .with_initial_backoff(args.backoff),
        )
        .on_conflict(args.on_conflict.into())
}
