//! `idemq run --config FILE` (every job of a configuration file in one
//! process) and `idemq config check --config FILE`; the file's format is
//! [`crate::config`]'s.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand};
use futures_util::future::{select_all, FutureExt, LocalBoxFuture};

use crate::config::{self, Plan};
use crate::{exit, ops, Command, GlobalArgs};

/// `idemq run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The configuration file (TOML).
    #[arg(long, env = "IDEMQ_CONFIG", value_name = "FILE")]
    pub config: PathBuf,
}

/// `idemq config …`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate a configuration file and print each job's effective command
    /// line, with where its store came from (flag, environment, file,
    /// default); URLs' credentials and secret parameters and header values
    /// are hidden. Exit 0 when valid, 2 when not.
    Check(RunArgs),
}

/// Prints what `idemq run` would run.
pub fn check(command: ConfigCommand, global: &GlobalArgs) -> Result<ExitCode> {
    let ConfigCommand::Check(args) = command;
    let plan = config::load(&args.config, &global.given)?;
    println!("{}: valid", args.config.display());
    if let Some(addr) = plan.http_addr {
        println!("http-addr: {addr}");
    }
    for job in &plan.jobs {
        println!(
            "{} (store from {}): {}",
            job.label,
            job.store_from,
            config::redacted_argv(&job.argv)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs every job of the file at once, each as its command would run, and
/// returns when all have ended; when one fails, the others are stopped
/// (dropped: what they had in flight is redelivered) and its code is
/// the process's.
pub async fn run(args: RunArgs, global: &GlobalArgs) -> Result<ExitCode> {
    let Plan { http_addr, jobs } = config::load(&args.config, &global.given)?;
    let shared = match http_addr {
        Some(addr) => {
            let ops = ops::Ops::default();
            ops::serve(addr, ops.clone()).await?;
            Some(ops)
        }
        None => None,
    };
    let mut running: Vec<LocalBoxFuture<'static, (String, Result<ExitCode>)>> = Vec::new();
    for job in jobs {
        let mut cli = job.cli;
        let scoped = shared.as_ref().map(|ops| ops.scoped(&job.label));
        match &mut cli.command {
            Command::Consume(consume) => consume.ops = scoped,
            Command::Relay(relay) => relay.ops = scoped,
            _ => {}
        }
        let label = job.label;
        running.push(
            async move {
                let result = crate::dispatch(cli).await;
                (label, result)
            }
            .boxed_local(),
        );
    }
    let mut code = ExitCode::SUCCESS;
    while !running.is_empty() {
        let ((label, result), _, rest) = select_all(running).await;
        running = rest;
        let ended = match result {
            Ok(ended) => ended,
            Err(e) => exit::report(&e.context(label.clone())),
        };
        if ended != ExitCode::SUCCESS {
            if !running.is_empty() {
                eprintln!(
                    "idemq: {label} ended unsuccessfully: stopping the other {} jobs",
                    running.len()
                );
            }
            code = ended;
            break;
        }
    }
    Ok(code)
}
