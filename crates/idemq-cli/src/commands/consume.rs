//! `idemq consume`: a JSON-lines file or stdin, exactly once into the store.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use idemq::source::jsonl::JsonLinesSource;
use idemq::{ConflictPolicy, Consumer, OutcomeKind, Summary};

use crate::backend::Backend;
use crate::interrupt::Interrupt;
use crate::output::shell_word;
use crate::progress::Progress;
use crate::{exit, sink, ConsumeArgs};

/// Consumes the input to its end (or Ctrl-C) and prints the summary.
pub async fn run<B: Backend>(store: B, args: ConsumeArgs) -> Result<ExitCode> {
    let sink::Sink { handler, statement } = sink::build::<B>(&args.sink)?;
    let progress = Progress::new(&args.consumer);
    let mut builder = super::configure(
        Consumer::builder(args.consumer.as_str(), store),
        &args.processing,
    )
    .handler(handler)
    .concurrency(args.concurrency);
    if let Some(progress) = &progress {
        builder = builder.on_outcome(progress.hook());
    }
    let consumer = builder.build().map_err(exit::usage)?;
    let store = consumer.store();

    if !args.no_migrate {
        store
            .migrate()
            .await
            .context("migrating the idemq tables")?;
    }
    sink::init(store.as_ref(), &args.sink, statement.as_deref()).await?;

    let source = open(&args.input, &args.consumer, args.no_checkpoint).await?;
    let interrupt = Interrupt::listen();
    if let Some(progress) = &progress {
        progress.show();
    }
    let result = consumer.run_until(source, interrupt.wait()).await;
    if let Some(progress) = progress {
        progress.finish();
    }
    let summary = result.context("reading the input")?;

    print_summary(&args, &summary);
    Ok(if interrupt.is_set() {
        ExitCode::from(exit::INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// Opens the input: stdin for `-`, else the file with its checkpoint.
async fn open(input: &Path, consumer: &str, no_checkpoint: bool) -> Result<JsonLinesSource> {
    if input.as_os_str() == "-" {
        if std::io::stdin().is_terminal() {
            eprintln!("idemq: reading JSON lines from the terminal (Ctrl-D ends the input)");
        }
        return Ok(JsonLinesSource::stdin());
    }
    let checkpoint = (!no_checkpoint).then(|| checkpoint_path(input, consumer));
    JsonLinesSource::open_with_checkpoint(input, checkpoint)
        .await
        .with_context(|| format!("opening {}", input.display()))
}

/// `<FILE>.<consumer>.checkpoint`, with characters unsafe in file names replaced.
fn checkpoint_path(input: &Path, consumer: &str) -> PathBuf {
    let safe: String = consumer
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut name = input.as_os_str().to_owned();
    name.push(format!(".{safe}.checkpoint"));
    PathBuf::from(name)
}

/// `consumer NAME: processed=… …`, plus a hint when dead letters were written.
fn print_summary(args: &ConsumeArgs, summary: &Summary) {
    println!("consumer {}: {summary}", args.consumer);
    let conflicts_dead_lettered = match args.processing.on_conflict.into() {
        ConflictPolicy::DeadLetter => summary.count(OutcomeKind::Conflict),
        ConflictPolicy::Ignore => 0,
    };
    if summary.count(OutcomeKind::DeadLettered) + conflicts_dead_lettered > 0 {
        println!(
            "dead letters: idemq dlq list --consumer {}",
            shell_word(&args.consumer)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_names() {
        assert_eq!(
            checkpoint_path(Path::new("/tmp/in.jsonl"), "payments"),
            PathBuf::from("/tmp/in.jsonl.payments.checkpoint")
        );
        assert_eq!(
            checkpoint_path(Path::new("in.jsonl"), "a/b c"),
            PathBuf::from("in.jsonl.a_b_c.checkpoint")
        );
    }
}
