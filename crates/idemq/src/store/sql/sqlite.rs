//! The SQLite inbox store: the embedded default.

use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::{sql_store, Dialect, SqlOptions};

/// WAL for concurrent readers, FULL sync so that an acked message's effects
/// survive a power loss, and a long busy timeout for competing processes.
async fn connect_pool(url: &str, options: &SqlOptions) -> Result<SqlitePool, sqlx::Error> {
    let connect = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(30));
    SqlitePoolOptions::new()
        .max_connections(options.max_connections.unwrap_or(1))
        .acquire_timeout(options.acquire_timeout)
        .connect_with(connect)
        .await
}

sql_store!(
    /// The transactional inbox on SQLite. The handler gets the open
    /// `sqlx::Transaction<'static, Sqlite>` in which the key was claimed.
    ///
    /// SQLite has one writer at a time, so the pool defaults to one
    /// connection: concurrent messages queue for it rather than fail with
    /// `SQLITE_BUSY`. Several processes may share the file; they wait on
    /// each other through the busy timeout.
    SqliteStore,
    sqlx::Sqlite,
    connect_pool,
    Dialect::Sqlite
);
