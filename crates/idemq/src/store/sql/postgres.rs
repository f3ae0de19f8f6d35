//! The PostgreSQL inbox store.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::database::{
    begin_deferred, concrete_io, connect_server, pool_options, server_journal_with, SqlDatabase,
};
use super::{Dialect, Queries, SqlOptions, SqlStore};

/// The transactional inbox on PostgreSQL. The handler gets the open
/// `sqlx::Transaction<'static, Postgres>` in which the key was claimed.
pub type PostgresStore = SqlStore<sqlx::Postgres>;

/// The transaction a [`PostgresStore`] hands to a handler: write the effects
/// through it, and they commit with the claim.
pub type PostgresTx = sqlx::Transaction<'static, sqlx::Postgres>;

impl SqlDatabase for sqlx::Postgres {
    const DIALECT: Dialect = Dialect::Postgres;

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
        server_journal_with(main, pool_options())
    }

    fn begin_write(
        pool: &sqlx::Pool<Self>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>> {
        begin_deferred(pool)
    }

    /// `LISTEN channel` on a connection of its own; every notification (and
    /// every reconnection, after which notifications may have been missed)
    /// wakes the relay.
    fn listen(
        pool: &sqlx::Pool<Self>,
        channel: String,
        notify: Arc<Notify>,
    ) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>> {
        Box::pin(async move {
            let mut listener = sqlx::postgres::PgListener::connect_with(pool).await?;
            listener.listen(&channel).await?;
            Ok(Some(tokio::spawn(async move {
                loop {
                    match listener.recv().await {
                        Ok(_) => notify.notify_one(),
                        Err(e) => {
                            tracing::warn!(%channel, error = %e, "outbox LISTEN connection failed; polling until it is back");
                            notify.notify_one();
                            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        }
                    }
                }
            })))
        })
    }

    concrete_io!();
}
