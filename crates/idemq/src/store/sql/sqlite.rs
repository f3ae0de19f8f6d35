//! The SQLite inbox store: the embedded default.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tokio::sync::Notify;

use super::database::{concrete_io, no_listen, SqlDatabase};
use super::{Dialect, Queries, SqlOptions, SqlStore};

/// The transactional inbox on SQLite. The handler gets the open
/// `sqlx::Transaction<'static, Sqlite>` in which the key was claimed.
///
/// SQLite has one writer at a time, so the pool defaults to one
/// connection: concurrent messages queue for it rather than fail with
/// `SQLITE_BUSY`. Several processes may share the file; they wait on
/// each other through the busy timeout.
pub type SqliteStore = SqlStore<sqlx::Sqlite>;

/// The transaction a [`SqliteStore`] hands to a handler: write the effects
/// through it, and they commit with the claim.
pub type SqliteTx = sqlx::Transaction<'static, sqlx::Sqlite>;

/// SQLITE_BUSY (5) or SQLITE_LOCKED (6), also in their extended forms.
fn is_busy(error: &sqlx::Error) -> bool {
    let code = match error {
        sqlx::Error::Database(e) => e.code(),
        _ => None,
    };
    code.and_then(|code| code.parse::<i32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

impl SqlDatabase for sqlx::Sqlite {
    const DIALECT: Dialect = Dialect::Sqlite;

    /// WAL for concurrent readers, FULL sync so that an acked message's
    /// effects survive a power loss, and a long busy timeout for competing
    /// processes.
    fn connect<'a>(
        url: &'a str,
        options: &'a SqlOptions,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        Box::pin(async move {
            let connect = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full)
                .busy_timeout(Duration::from_secs(30));
            // Switching a new file to WAL answers SQLITE_BUSY at once, not
            // after the busy timeout, when another connection (a second
            // consumer of the same file starting with this one) switches
            // it too: try again for a few seconds.
            let mut tries = 0;
            loop {
                let pool = SqlitePoolOptions::new()
                    .max_connections(options.max_connections.unwrap_or(1))
                    .acquire_timeout(options.acquire_timeout)
                    .connect_with(connect.clone())
                    .await;
                match pool {
                    Err(e) if tries < 50 && is_busy(&e) => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    pool => return pool,
                }
            }
        })
    }

    /// SQLite allows one writer per database file, and the handler's
    /// transaction holds the main file's write lock while it runs: the
    /// journal lives in a file of its own, `<main file>-effects` (an
    /// in-memory database gets an in-memory journal that lives as long as
    /// the store), created with its table when first used. Same pragmas as
    /// the main file.
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        queries: &'a Queries,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        Box::pin(async move {
            let options = (*main.connect_options()).clone();
            let file = options.get_filename().to_string_lossy().into_owned();
            // A private `:memory:` database stays one (kept alive below).
            let file = if file == ":memory:" {
                file
            } else {
                format!("{file}-effects")
            };
            let pool = SqlitePoolOptions::new()
                .max_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .acquire_timeout(main.options().get_acquire_timeout())
                .connect_with(options.filename(file))
                .await?;
            let mut conn = pool.acquire().await?;
            for step in &queries.effects_schema {
                Self::execute(&mut conn, step, &[]).await?;
            }
            drop(conn);
            Ok(pool)
        })
    }

    /// SQLite has no row locks: take the database's write lock at once.
    fn begin_write(
        pool: &sqlx::Pool<Self>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>> {
        Box::pin(pool.begin_with("BEGIN IMMEDIATE"))
    }

    fn listen(
        pool: &sqlx::Pool<Self>,
        channel: String,
        notify: Arc<Notify>,
    ) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>> {
        no_listen(pool, channel, notify)
    }

    concrete_io!();
}
