//! `idemq completions SHELL` and `idemq man`: generated from the argument
//! definitions by `clap_complete` and `clap_mangen`, so they never drift.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::CommandFactory;

use crate::Cli;

/// Prints the completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> Result<ExitCode> {
    let mut cli = Cli::command();
    clap_complete::generate(shell, &mut cli, "idemq", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// Prints the man page (roff).
pub fn man() -> Result<ExitCode> {
    clap_mangen::Man::new(Cli::command())
        .render(&mut std::io::stdout())
        .context("writing the man page")?;
    Ok(ExitCode::SUCCESS)
}
