//! `idemq produce`: publish a JSON-lines file to a broker, optionally with
//! duplicates of both kinds, for demos and tests.

use std::process::ExitCode;

use anyhow::{Context, Result};
use idemq::source::jsonl::parse_message;
use idemq::Message;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};

use crate::endpoint::Endpoint;
use crate::{exit, ProduceArgs};

/// Counts of what was published.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Input messages published (each once at least).
    pub messages: u64,
    /// Extra copies with the same id (redeliveries of an at-least-once producer).
    pub duplicates: u64,
    /// Extra copies with a new id and the same key and payload (producer retries).
    pub producer_retries: u64,
    /// Lines that were not valid JSON, published as raw payloads.
    pub raw: u64,
}

impl std::fmt::Display for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "published={} duplicates={} producer_retries={} raw={}",
            self.messages, self.duplicates, self.producer_retries, self.raw
        )
    }
}

/// Reads the input and publishes every line, then the summary.
pub async fn run(args: ProduceArgs) -> Result<ExitCode> {
    let publisher = args.to.open_publisher().await?;
    let input: Box<dyn AsyncBufRead + Send + Unpin> = if args.input.as_os_str() == "-" {
        Box::new(BufReader::new(tokio::io::stdin()))
    } else {
        let file = tokio::fs::File::open(&args.input)
            .await
            .with_context(|| format!("opening {}", args.input.display()))?;
        Box::new(BufReader::new(file))
    };
    let mut rng = match args.seed {
        Some(seed) => fastrand::Rng::with_seed(seed),
        None => fastrand::Rng::new(),
    };
    let mut counts = Published::default();
    let mut lines = input.lines();
    let mut number = 0u64;
    while let Some(line) = lines.next_line().await.context("reading the input")? {
        number += 1;
        if line.trim().is_empty() {
            continue;
        }
        let message = match parse_message(line.as_bytes()) {
            Ok(message) => message,
            Err(e) => {
                tracing::warn!(line = number, error = %e, "publishing an undecodable line as a raw payload");
                counts.raw += 1;
                Message::new(line.into_bytes())
            }
        };
        let message = complete(message, &args);
        let send = |m: Message| {
            let publisher = &publisher;
            let to = &args.to;
            async move {
                publisher
                    .publish(&m)
                    .await
                    .with_context(|| format!("publishing line {number} to {to}"))
            }
        };
        send(message.clone()).await?;
        counts.messages += 1;
        if rng.f64() < args.duplicates {
            send(message.clone()).await?;
            counts.duplicates += 1;
        }
        if rng.f64() < args.producer_retries {
            send(message.with_id(uuid::Uuid::new_v4().to_string())).await?;
            counts.producer_retries += 1;
        }
    }
    publisher.flush().await.context("flushing the publisher")?;
    if matches!(args.to, Endpoint::Std) {
        eprintln!("{counts}");
    } else {
        println!("{counts}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Fills in a missing id (a new UUID) and, with `--key`, a missing transport key.
fn complete(mut message: Message, args: &ProduceArgs) -> Message {
    if message.key.is_none() {
        if let Some(spec) = &args.key {
            match spec.extract(&message) {
                Ok(key) => message.key = Some(key),
                Err(e) => tracing::warn!(error = %e, "no key for a message; published without one"),
            }
        }
    }
    if message.id.is_none() {
        message.id = Some(uuid::Uuid::new_v4().to_string());
    }
    message
}

/// Parses a fraction in `[0, 1]`.
pub fn parse_fraction(text: &str) -> Result<f64, String> {
    let value: f64 = text.trim().parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(exit::usage(format!("{value} is not between 0 and 1")).to_string())
    }
}
