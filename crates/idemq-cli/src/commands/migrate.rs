//! `idemq migrate`.

use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::backend::{Backend, StoreUrl};

/// Creates or upgrades the idemq tables.
pub async fn run<B: Backend>(store: &B, url: &StoreUrl, table_prefix: &str) -> Result<ExitCode> {
    store
        .migrate()
        .await
        .with_context(|| format!("migrating {url}"))?;
    println!("migrated {url} (tables prefix {table_prefix})");
    Ok(ExitCode::SUCCESS)
}
