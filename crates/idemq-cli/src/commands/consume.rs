//! `idemq consume`: a JSON-lines file, stdin or a broker, exactly once into the store.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use idemq::engine::{BatchOptions, WatermarkOptions};
use idemq::source::idle::IdleExit;
use idemq::source::Source;
use idemq::store::cache::CachedStore;
use idemq::{ConflictPolicy, Consumer, InFlightPolicy, OutcomeKind, Summary};

use crate::backend::Backend;
use crate::interrupt::Interrupt;
use crate::ops;
use crate::output::shell_word;
use crate::progress::Progress;
use crate::{exit, sink, ConsumeArgs, InFlight};

/// Puts the `--local-cache` / `--cache` fast path in front of the store, if
/// asked for, and consumes.
pub async fn with_cache<B: Backend + Clone>(store: B, args: ConsumeArgs) -> Result<ExitCode> {
    if args.local_cache == 0 && args.cache.is_none() {
        return run(store, args).await;
    }
    let cached = CachedStore::new(store).local(args.local_cache);
    let cached = match &args.cache {
        None => cached,
        #[cfg(feature = "redis")]
        Some(url) => {
            use idemq::store::cache::RedisFilter;
            use idemq::store::redis::RedisOptions;
            let options = RedisOptions::default().prefix("idemq_cache");
            let filter = RedisFilter::connect(url, options).await.with_context(|| {
                format!("connecting to the --cache {}", crate::backend::redact(url))
            })?;
            cached.redis(filter)
        }
        #[cfg(not(feature = "redis"))]
        Some(_) => return Err(exit::usage(crate::backend::compiled_out("Redis", "redis"))),
    };
    run(cached, args).await
}

/// Consumes the input to its end (or Ctrl-C) and prints the summary.
pub async fn run<B: Backend>(store: B, args: ConsumeArgs) -> Result<ExitCode> {
    if args.watermark && !args.input.supports_watermarks() {
        return Err(exit::usage(format!(
            "--watermark needs a kafka:// source (a partitioned log read in offset order), \
             not {}",
            args.input
        )));
    }
    let sink::Sink { handler, statement } = sink::build::<B>(&args.sink).await?;
    let progress = Progress::new(&args.consumer);
    let mut builder = super::configure(
        Consumer::builder(args.consumer.as_str(), store),
        &args.processing,
    )
    .key(
        args.processing
            .key
            .clone()
            .unwrap_or_else(|| args.input.default_key()),
    )
    .handler(handler)
    .concurrency(args.concurrency)
    .max_message_bytes(args.max_message_bytes)
    .shutdown_grace(args.shutdown_timeout)
    .lease(args.lease)
    .in_flight(match args.in_flight {
        InFlight::Reject => InFlightPolicy::Reject,
        InFlight::Wait => InFlightPolicy::wait(args.lease * 2),
    });
    if let Some(progress) = &progress {
        builder = builder.on_outcome(progress.hook());
    }
    let consumer = builder.build().map_err(exit::usage)?;
    let store = consumer.store();
    let ops = ops::for_run(args.http_addr, args.ops.as_ref()).await?;
    if let Some(ops) = &ops {
        ops.ready("store", store_answers(store));
        if let Some(addresses) = args.input.probe_addresses() {
            ops.ready("source", ops::reachable(addresses));
        }
    }

    if !args.no_migrate {
        store
            .migrate()
            .await
            .context("migrating the idemq tables")?;
    }
    sink::init(store.as_ref(), &args.sink, statement.as_deref()).await?;

    let source = args
        .input
        .open_source(&args.consumer, args.no_checkpoint, args.max_message_bytes)
        .await?;
    let source: Box<dyn Source> = match args.idle_exit {
        Some(idle) => Box::new(IdleExit::new(source, idle)),
        None => source,
    };
    let interrupt = Interrupt::listen();
    if let Some(progress) = &progress {
        progress.show();
    }
    let result = match args.batch {
        None if args.watermark => {
            let mut options = WatermarkOptions::default();
            options.dedup_keys = args.dedup_keys;
            options.concurrent_records = args.concurrent_records;
            B::run_watermarked(&consumer, source, options, Box::pin(interrupt.wait()))
                .await
                .ok_or_else(|| {
                    exit::usage(
                        "--watermark needs a SQL store (sqlite:, postgres://, mysql://) \
                         without --cache/--local-cache",
                    )
                })?
        }
        None => consumer.run_until(source, interrupt.wait()).await,
        Some(max_size) => {
            let options = BatchOptions::new(max_size, args.batch_wait);
            B::run_batched(&consumer, source, options, Box::pin(interrupt.wait()))
                .await
                .ok_or_else(|| {
                    exit::usage(
                        "--batch needs a SQL store or redis:// without \
                         --cache/--local-cache",
                    )
                })?
        }
    };
    if let Some(progress) = progress {
        progress.finish();
    }
    let summary = result.context("reading the input")?;

    print_summary(&args, &summary);
    // Only an endpoint of this run's own (`--http-addr`) lingers.
    if let (Some(ops), Some(grace), Some(_)) = (&ops, args.http_linger, args.http_addr) {
        ops.linger(grace).await;
    }
    Ok(if interrupt.is_set() {
        ExitCode::from(exit::INTERRUPTED)
    } else {
        ExitCode::SUCCESS
    })
}

/// A readiness check: `store` answers a ping.
fn store_answers<B: Backend>(store: &Arc<B>) -> ops::Probe {
    let store = Arc::clone(store);
    Arc::new(move || {
        let store = Arc::clone(&store);
        Box::pin(async move { store.ping().await.map_err(|e| e.to_string()) })
    })
}

/// `consumer NAME: processed=… …`, plus a hint when dead letters were written.
fn print_summary(args: &ConsumeArgs, summary: &Summary) {
    println!("consumer {}: {summary}", args.consumer);
    let conflicts_dead_lettered = match args.processing.on_conflict.into() {
        ConflictPolicy::DeadLetter => summary.count(OutcomeKind::Conflict),
        _ => 0,
    };
    if summary.count(OutcomeKind::DeadLettered) + conflicts_dead_lettered > 0 {
        println!(
            "dead letters: idemq dlq list --consumer {}",
            shell_word(&args.consumer)
        );
    }
}
