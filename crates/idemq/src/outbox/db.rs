//! The per-database half of the outbox: binding, decoding and transactions
//! for each sqlx database, behind a sealed trait so that [`Outbox`] and
//! [`Relay`] are written once.
//!
//! [`Outbox`]: super::Outbox
//! [`Relay`]: super::Relay

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::DeadEvent;
use crate::store::sql::Dialect;

/// A bound parameter.
#[derive(Debug, Clone, Copy)]
pub enum Bind<'a> {
    /// An integer.
    Int(i64),
    /// Text.
    Text(&'a str),
    /// Text or NULL.
    OptText(Option<&'a str>),
    /// Bytes.
    Bytes(&'a [u8]),
}

/// A locked head: (seq, destination, key).
pub type KeyRow = (i64, String, String);

/// One outbox row as the relay reads it.
#[derive(Debug, Clone)]
pub struct RawRow {
    /// The relay order.
    pub seq: i64,
    /// The event id.
    pub id: String,
    /// The destination.
    pub aggregatetype: String,
    /// The key.
    pub aggregateid: String,
    /// The event type (may be empty).
    pub event_type: String,
    /// Headers as JSON text, if any.
    pub headers: Option<String>,
    /// The payload.
    pub payload: Vec<u8>,
    /// Failed publish attempts so far.
    pub attempts: i64,
}

/// The database operations of the outbox; implemented for the sqlx
/// databases compiled in, and nowhere else (sealed).
pub trait Ops: sqlx::Database + Sized {
    /// The dialect of the SQL text.
    const DIALECT: Dialect;

    /// Runs a statement; returns the affected rows.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    /// Runs a query and returns its first column as integers.
    fn fetch_ints<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<Vec<i64>, sqlx::Error>>;

    /// Runs a query returning (seq, destination, key).
    fn fetch_keys<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<Vec<KeyRow>, sqlx::Error>>;

    /// Runs a query returning rows in the order of `schema::ROW_COLUMNS`.
    fn fetch_rows<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<Vec<RawRow>, sqlx::Error>>;

    /// Runs a query returning dead rows in the order of `schema::DEAD_COLUMNS`.
    fn fetch_dead<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<Vec<DeadEvent>, sqlx::Error>>;

    /// Begins the relay's batch transaction (SQLite: `BEGIN IMMEDIATE`, which
    /// takes the write lock at once, so that relays queue for it).
    fn begin(
        pool: &sqlx::Pool<Self>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>>;

    /// Starts waking `notify` on notifications of `channel` (PostgreSQL
    /// `LISTEN`); `None` where the database has none.
    fn listen(
        pool: &sqlx::Pool<Self>,
        channel: String,
        notify: Arc<Notify>,
    ) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>>;
}

/// Implements [`Ops`] for one database.
macro_rules! outbox_ops {
    ($db:ty, $dialect:expr, $begin:expr, $listen:expr) => {
        impl Ops for $db {
            const DIALECT: Dialect = $dialect;

            fn execute<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind<'a>],
            ) -> BoxFuture<'a, Result<u64, sqlx::Error>> {
                Box::pin(async move {
                    Ok(bind_all!($db, sqlx::query(sql), binds)
                        .execute(&mut *conn)
                        .await?
                        .rows_affected())
                })
            }

            fn fetch_ints<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind<'a>],
            ) -> BoxFuture<'a, Result<Vec<i64>, sqlx::Error>> {
                Box::pin(async move {
                    use sqlx::Row;
                    bind_all!($db, sqlx::query(sql), binds)
                        .fetch_all(&mut *conn)
                        .await?
                        .iter()
                        .map(|row| row.try_get::<i64, _>(0))
                        .collect()
                })
            }

            fn fetch_keys<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind<'a>],
            ) -> BoxFuture<'a, Result<Vec<KeyRow>, sqlx::Error>> {
                Box::pin(async move {
                    use sqlx::Row;
                    bind_all!($db, sqlx::query(sql), binds)
                        .fetch_all(&mut *conn)
                        .await?
                        .iter()
                        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
                        .collect()
                })
            }

            fn fetch_rows<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind<'a>],
            ) -> BoxFuture<'a, Result<Vec<RawRow>, sqlx::Error>> {
                Box::pin(async move {
                    use sqlx::Row;
                    bind_all!($db, sqlx::query(sql), binds)
                        .fetch_all(&mut *conn)
                        .await?
                        .iter()
                        .map(|row| {
                            Ok(RawRow {
                                seq: row.try_get(0)?,
                                id: row.try_get(1)?,
                                aggregatetype: row.try_get(2)?,
                                aggregateid: row.try_get(3)?,
                                event_type: row.try_get(4)?,
                                headers: row.try_get(5)?,
                                payload: row.try_get(6)?,
                                attempts: row.try_get(7)?,
                            })
                        })
                        .collect()
                })
            }

            fn fetch_dead<'a>(
                conn: &'a mut Self::Connection,
                sql: &'a str,
                binds: &'a [Bind<'a>],
            ) -> BoxFuture<'a, Result<Vec<DeadEvent>, sqlx::Error>> {
                Box::pin(async move {
                    use sqlx::Row;
                    bind_all!($db, sqlx::query(sql), binds)
                        .fetch_all(&mut *conn)
                        .await?
                        .iter()
                        .map(|row| {
                            Ok(DeadEvent {
                                seq: row.try_get(0)?,
                                id: row.try_get(1)?,
                                destination: row.try_get(2)?,
                                key: row.try_get(3)?,
                                event_type: row.try_get(4)?,
                                headers: row.try_get(5)?,
                                payload: row.try_get(6)?,
                                created_at: row.try_get(7)?,
                                attempts: row.try_get(8)?,
                                reason: row.try_get(9)?,
                                dead_at: row.try_get(10)?,
                            })
                        })
                        .collect()
                })
            }

            fn begin(
                pool: &sqlx::Pool<Self>,
            ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>> {
                Box::pin(async move { ($begin)(pool).await })
            }

            fn listen(
                pool: &sqlx::Pool<Self>,
                channel: String,
                notify: Arc<Notify>,
            ) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>> {
                Box::pin(async move { ($listen)(pool, channel, notify).await })
            }
        }
    };
}

/// Binds every parameter of `binds` to `query`.
macro_rules! bind_all {
    ($db:ty, $query:expr, $binds:expr) => {{
        let mut query = $query;
        for bind in $binds {
            query = match *bind {
                Bind::Int(v) => query.bind(v),
                Bind::Text(v) => query.bind(v),
                Bind::OptText(v) => query.bind(v),
                Bind::Bytes(v) => query.bind(v),
            };
        }
        query
    }};
}

#[cfg(feature = "postgres")]
outbox_ops!(
    sqlx::Postgres,
    Dialect::Postgres,
    begin_deferred,
    listen_postgres
);

#[cfg(feature = "mysql")]
outbox_ops!(sqlx::MySql, Dialect::MySql, begin_deferred, no_listen);

#[cfg(feature = "sqlite")]
outbox_ops!(sqlx::Sqlite, Dialect::Sqlite, begin_immediate, no_listen);

/// A plain `BEGIN`: row locks do the rest.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn begin_deferred<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> Result<sqlx::Transaction<'static, DB>, sqlx::Error> {
    pool.begin().await
}

/// SQLite has no row locks: take the database's write lock at once.
#[cfg(feature = "sqlite")]
async fn begin_immediate(
    pool: &sqlx::SqlitePool,
) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
    pool.begin_with("BEGIN IMMEDIATE").await
}

/// Databases without notifications: the relay polls.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
async fn no_listen<DB: sqlx::Database>(
    _pool: &sqlx::Pool<DB>,
    _channel: String,
    _notify: Arc<Notify>,
) -> Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error> {
    Ok(None)
}

/// `LISTEN channel` on a connection of its own; every notification (and
/// every reconnection, after which notifications may have been missed)
/// wakes the relay.
#[cfg(feature = "postgres")]
async fn listen_postgres(
    pool: &sqlx::PgPool,
    channel: String,
    notify: Arc<Notify>,
) -> Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error> {
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
}
