//! `idemq prune`.

use std::process::ExitCode;

use anyhow::{Context, Result};
use idemq::RetentionPolicy;

use crate::backend::Backend;
use crate::endpoint::Endpoint;
use crate::{config, GlobalArgs, PruneArgs};

/// Deletes inbox rows older than `--older-than`, unless that is under a
/// source's redelivery horizon or `--floor` (without `--force`).
pub async fn run<B: Backend>(store: &B, global: &GlobalArgs, args: &PruneArgs) -> Result<ExitCode> {
    check_floor(global, args).await?;
    let mut policy = RetentionPolicy::default();
    policy.keep_for = args.older_than.value;
    policy.batch_size = args.batch_size;
    policy.pause = args.pause;
    let rows = idemq::retention::prune(store, &policy)
        .await
        .context("pruning the inbox")?;
    println!("pruned {rows} rows older than {}", args.older_than);
    Ok(ExitCode::SUCCESS)
}

/// Reads the horizons of `--source` and `--config`'s sources and refuses
/// an `--older-than` under the longest, or under `--floor` (a usage
/// error), unless `--force`.
async fn check_floor(global: &GlobalArgs, args: &PruneArgs) -> Result<()> {
    let mut sources: Vec<Endpoint> = args.sources.clone();
    if let Some(path) = &args.config {
        sources.extend(
            config::consumers(path, &global.given)?
                .into_iter()
                .map(|(_, s)| s),
        );
    }
    let mut horizons = Vec::new();
    for source in &sources {
        let Endpoint::Broker { broker, url } = source else {
            continue;
        };
        match (broker.inspect)(url).await {
            Ok(health) => horizons.push((source.to_string(), health.horizon)),
            Err(e) => {
                tracing::warn!(source = %source, error = %e, "could not read the broker's redelivery horizon; --older-than is not checked against it")
            }
        }
    }
    if sources.is_empty() && args.floor.is_none() {
        tracing::info!(
            "no --source, --config or --floor: --older-than is not checked against any broker"
        );
    }
    let named: Vec<(&str, &idemq::source::health::Horizon)> =
        horizons.iter().map(|(s, h)| (s.as_str(), h)).collect();
    let floor = args.floor.as_ref().map(|f| f.value);
    if let Some(why) = idemq::retention::floor_violation(args.older_than.value, &named, floor) {
        if !args.force {
            return Err(crate::exit::usage(format!(
                "refusing to prune: {why} (--force prunes anyway)"
            )));
        }
        tracing::warn!("pruning anyway (--force): {why}");
    }
    Ok(())
}
