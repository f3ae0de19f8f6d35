//! The MySQL / MariaDB inbox store.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::database::{
    begin_deferred, concrete_io, connect_server, no_listen, pool_options, server_journal_with,
    SqlDatabase,
};
use super::{Dialect, Queries, SqlOptions, SqlStore};

/// Makes a session's transactions READ COMMITTED.
const READ_COMMITTED_SESSION: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// The transactional inbox on MySQL 8 or MariaDB 10.5+ (InnoDB). The
/// handler gets the open `sqlx::Transaction<'static, MySql>` in which the
/// key was claimed. Keys compare byte-for-byte (`utf8mb4_bin`).
pub type MySqlStore = SqlStore<sqlx::MySql>;

/// The transaction a [`MySqlStore`] hands to a handler: write the effects
/// through it, and they commit with the claim.
pub type MySqlTx = sqlx::Transaction<'static, sqlx::MySql>;

impl SqlDatabase for sqlx::MySql {
    const DIALECT: Dialect = Dialect::MySql;

    fn connect<'a>(
        url: &'a str,
        options: &'a SqlOptions,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        connect_server(url, options)
    }

    /// The journal's connections run READ COMMITTED: a partitioned
    /// journal's write reads across partitions with a locking read, which
    /// under REPEATABLE READ would also lock the gaps (and make concurrent
    /// writes of other steps deadlock); a plain journal's statements do the
    /// same under either level.
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        _queries: &'a Queries,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        let options = pool_options::<Self>().after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::Executor::execute(conn, READ_COMMITTED_SESSION)
                    .await
                    .map(|_| ())
            })
        });
        server_journal_with(main, options)
    }

    fn begin_write(
        pool: &sqlx::Pool<Self>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>> {
        begin_deferred(pool)
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
