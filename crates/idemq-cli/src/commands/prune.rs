//! `idemq prune`.

use std::process::ExitCode;

use anyhow::{Context, Result};
use idemq::RetentionPolicy;

use crate::backend::Backend;
use crate::PruneArgs;

/// Deletes inbox rows older than `--older-than`.
pub async fn run<B: Backend>(store: &B, args: &PruneArgs) -> Result<ExitCode> {
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
