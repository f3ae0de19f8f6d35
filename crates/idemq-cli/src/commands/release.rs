//! `idemq release`: free a stuck in-flight lease (lease stores), after a confirmation.

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::backend::Backend;
use crate::output::shell_word;
use crate::{exit, ReleaseArgs};

/// Releases the lease if one is held and the operator confirms.
pub async fn run<B: Backend>(store: &B, args: &ReleaseArgs) -> Result<ExitCode> {
    if B::SQL.is_some() {
        println!(
            "SQL stores hold no leases: a key that seems stuck is a row lock of a transaction \
             that is still open (the database rolls back the transactions of dead workers). \
             Look for it in the database's list of sessions."
        );
        return Ok(ExitCode::from(exit::NOT_FOUND));
    }
    let report = store
        .inspect(&args.consumer, &args.key)
        .await
        .map_err(|e| super::admin_error(e, "reading the key"))?;
    if !report.in_flight {
        println!(
            "no in-flight lease on key {} of consumer {}",
            shell_word(&args.key),
            shell_word(&args.consumer)
        );
        return Ok(ExitCode::from(exit::NOT_FOUND));
    }
    if !args.yes && !confirm(args)? {
        println!("left as it is");
        return Ok(ExitCode::SUCCESS);
    }
    let released = store
        .release(&args.consumer, &args.key)
        .await
        .map_err(|e| super::admin_error(e, "releasing the lease"))?;
    if released {
        println!(
            "released the in-flight lease on key {} of consumer {}: the next delivery claims it; \
             the old holder, if alive, can no longer complete it",
            shell_word(&args.key),
            shell_word(&args.consumer)
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!("the lease ended before it was released (completed or expired)");
        Ok(ExitCode::from(exit::NOT_FOUND))
    }
}

/// Asks on the terminal; refuses to guess when stdin is not one.
fn confirm(args: &ReleaseArgs) -> Result<bool> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(exit::usage(
            "stdin is not a terminal: pass --yes to release without a confirmation",
        ));
    }
    print!(
        "Release the in-flight lease on key {} of consumer {}? If its holder is still \
         running, the message may then run twice at the same time. [y/N] ",
        shell_word(&args.key),
        shell_word(&args.consumer)
    );
    std::io::stdout().flush().context("writing the prompt")?;
    let mut answer = String::new();
    stdin
        .lock()
        .read_line(&mut answer)
        .context("reading the answer")?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}
