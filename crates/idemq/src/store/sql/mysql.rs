//! The MySQL / MariaDB inbox store.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::database::{
    begin_deferred, concrete_io, connect_server, no_listen, server_journal, SqlDatabase,
};
use super::{Dialect, Queries, SqlOptions, SqlStore};

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

    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        _queries: &'a Queries,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        server_journal(main)
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
