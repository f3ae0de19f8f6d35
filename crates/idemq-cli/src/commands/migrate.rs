//! `idemq migrate`.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::backend::{Backend, StoreUrl};
use crate::Command;

/// `idemq migrate`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct MigrateArgs {
    /// Create the inbox time-partitioned, one partition per DURATION (e.g.
    /// `1d`), when it does not exist yet (PostgreSQL, MariaDB). Retention then drops
    /// whole partitions. An inbox that exists keeps its layout.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub partitioned_inbox: Option<Duration>,

    /// With --partitioned-inbox: partitions kept created ahead of the current one.
    #[arg(
        long,
        default_value_t = 2,
        value_name = "N",
        requires = "partitioned_inbox"
    )]
    pub partitions_ahead: u32,
}

/// The SQL store options of a command: the table prefix, and for
/// `migrate --partitioned-inbox` the partitioned layout (PostgreSQL and
/// MariaDB only: a usage error on another store).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub fn sql_options(
    table_prefix: &str,
    command: &Command,
    url: &StoreUrl,
) -> Result<idemq::store::sql::SqlOptions> {
    let options = idemq::store::sql::SqlOptions::default().table_prefix(table_prefix);
    let Command::Migrate(MigrateArgs {
        partitioned_inbox: Some(interval),
        partitions_ahead,
    }) = command
    else {
        return Ok(options);
    };
    url.check_partitionable()?;
    Ok(options.partitioned_inbox(
        idemq::store::sql::InboxPartitions::every(*interval).ahead(*partitions_ahead),
    ))
}

/// Creates or upgrades the idemq tables.
pub async fn run<B: Backend>(store: &B, url: &StoreUrl, table_prefix: &str) -> Result<ExitCode> {
    store
        .migrate()
        .await
        .with_context(|| format!("migrating {url}"))?;
    println!("migrated {url} (tables prefix {table_prefix})");
    Ok(ExitCode::SUCCESS)
}
