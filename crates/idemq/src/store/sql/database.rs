//! What idemq needs of one sqlx database, behind one sealed trait, so that
//! the inbox ([`SqlStore`](super::SqlStore)), the effect journal and the
//! outbox are each written once, generically.
//!
//! Statements go through two primitives, [`SqlDatabase::execute`] and
//! [`SqlDatabase::fetch`], which take their parameters as [`Bind`]s and
//! return rows as [`SqlRow`]s of the column shapes asked for. Both are
//! implemented once, in `execute_generic` and `fetch_generic`; a
//! database's impl gets them by `concrete_io!()` (the compiler checks
//! sqlx's encode/decode bounds for each concrete database there).

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use super::{Dialect, Queries, SqlOptions};

/// A bound parameter.
#[derive(Debug, Clone, Copy)]
pub enum Bind<'a> {
    /// An integer.
    Int(i64),
    /// An integer or NULL.
    OptInt(Option<i64>),
    /// Text.
    Text(&'a str),
    /// Text or NULL.
    OptText(Option<&'a str>),
    /// Bytes.
    Bytes(&'a [u8]),
}

/// The shape of a column to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Column {
    /// A non-NULL integer.
    Int,
    /// An integer or NULL.
    OptInt,
    /// Non-NULL text.
    Text,
    /// Text or NULL.
    OptText,
    /// Non-NULL bytes.
    Bytes,
}

/// One decoded column value.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Int(Option<i64>),
    Text(Option<String>),
    Bytes(Vec<u8>),
}

/// A row decoded into the [`Column`] shapes its query asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlRow(Vec<Value>);

impl SqlRow {
    fn mismatch(index: usize, wanted: &str) -> sqlx::Error {
        sqlx::Error::ColumnDecode {
            index: index.to_string(),
            source: format!(
                "idemq read column {index} as {wanted}, which its query did not ask for"
            )
            .into(),
        }
    }

    /// A column read as [`Column::Int`].
    pub fn int(&self, index: usize) -> Result<i64, sqlx::Error> {
        self.opt_int(index)?
            .ok_or_else(|| sqlx::Error::ColumnDecode {
                index: index.to_string(),
                source: "unexpected NULL".into(),
            })
    }

    /// A column read as [`Column::OptInt`] (or [`Column::Int`]).
    pub fn opt_int(&self, index: usize) -> Result<Option<i64>, sqlx::Error> {
        match self.0.get(index) {
            Some(Value::Int(v)) => Ok(*v),
            _ => Err(Self::mismatch(index, "an integer")),
        }
    }

    /// A column read as [`Column::Text`].
    pub fn text(&self, index: usize) -> Result<String, sqlx::Error> {
        self.opt_text(index)?
            .ok_or_else(|| sqlx::Error::ColumnDecode {
                index: index.to_string(),
                source: "unexpected NULL".into(),
            })
    }

    /// A column read as [`Column::OptText`] (or [`Column::Text`]).
    pub fn opt_text(&self, index: usize) -> Result<Option<String>, sqlx::Error> {
        match self.0.get(index) {
            Some(Value::Text(v)) => Ok(v.clone()),
            _ => Err(Self::mismatch(index, "text")),
        }
    }

    /// A column read as [`Column::Bytes`].
    pub fn bytes(&self, index: usize) -> Result<Vec<u8>, sqlx::Error> {
        match self.0.get(index) {
            Some(Value::Bytes(v)) => Ok(v.clone()),
            _ => Err(Self::mismatch(index, "bytes")),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "mysql")]
    impl Sealed for sqlx::MySql {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::Sqlite {}
}

/// A sqlx database idemq runs on: PostgreSQL, MySQL/MariaDB and SQLite, as
/// far as their cargo features are on. Sealed: the SQL text of each
/// [`Dialect`] lives in this crate.
pub trait SqlDatabase: sqlx::Database + sealed::Sealed {
    /// The dialect of the SQL text.
    const DIALECT: Dialect;

    /// Opens the pool of a store (pool size, timeouts, the database's own
    /// connection settings).
    fn connect<'a>(
        url: &'a str,
        options: &'a SqlOptions,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>>;

    /// Opens the pool the effect journal writes through: its own
    /// connections, so that a journal write commits on its own while the
    /// handler's transaction is open, and never waits for a connection a
    /// handler holds. Lazily, where that is possible.
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        queries: &'a Queries,
    ) -> BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>>;

    /// Begins a transaction that will write (SQLite: `BEGIN IMMEDIATE`,
    /// which takes the write lock at once, so that writers queue for it).
    fn begin_write(
        pool: &sqlx::Pool<Self>,
    ) -> BoxFuture<'_, Result<sqlx::Transaction<'static, Self>, sqlx::Error>>;

    /// Starts waking `notify` on notifications of `channel` (PostgreSQL
    /// `LISTEN`); `None` where the database has none.
    fn listen(
        pool: &sqlx::Pool<Self>,
        channel: String,
        notify: Arc<Notify>,
    ) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>>;

    /// How many rows a statement affected.
    fn rows_affected(result: &Self::QueryResult) -> u64;

    /// Runs a statement; returns the affected rows.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
    ) -> BoxFuture<'a, Result<u64, sqlx::Error>>;

    /// Runs a query and decodes its rows into `columns`.
    fn fetch<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
        binds: &'a [Bind<'a>],
        columns: &'a [Column],
    ) -> BoxFuture<'a, Result<Vec<SqlRow>, sqlx::Error>>;

    /// Runs `sql` unprepared, without parameters (schema statements: some,
    /// such as MariaDB's `CREATE FUNCTION`, cannot be prepared).
    fn execute_script<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
    ) -> BoxFuture<'a, Result<(), sqlx::Error>>;
}

/// Binds `binds` to `sql`, in order.
fn bound<'q, DB>(
    sql: &'q str,
    binds: &'q [Bind<'q>],
) -> sqlx::query::Query<'q, DB, DB::Arguments<'q>>
where
    DB: sqlx::Database,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q str: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    Option<&'q str>: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    &'q [u8]: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let mut query = sqlx::query::<DB>(sql);
    for bind in binds {
        query = match *bind {
            Bind::Int(v) => query.bind(v),
            Bind::OptInt(v) => query.bind(v),
            Bind::Text(v) => query.bind(v),
            Bind::OptText(v) => query.bind(v),
            Bind::Bytes(v) => query.bind(v),
        };
    }
    query
}

/// [`SqlDatabase::execute`], for every database.
pub(crate) async fn execute_generic<'a, DB>(
    conn: &'a mut DB::Connection,
    sql: &'a str,
    binds: &'a [Bind<'a>],
) -> Result<u64, sqlx::Error>
where
    DB: SqlDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments<'a>: sqlx::IntoArguments<'a, DB>,
    i64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<&'a str>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    &'a [u8]: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    let result = bound::<DB>(sql, binds).execute(&mut *conn).await?;
    Ok(DB::rows_affected(&result))
}

/// [`SqlDatabase::fetch`], for every database.
pub(crate) async fn fetch_generic<'a, DB>(
    conn: &'a mut DB::Connection,
    sql: &'a str,
    binds: &'a [Bind<'a>],
    columns: &'a [Column],
) -> Result<Vec<SqlRow>, sqlx::Error>
where
    DB: SqlDatabase,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments<'a>: sqlx::IntoArguments<'a, DB>,
    i64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<i64>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    &'a str: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    Option<&'a str>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    &'a [u8]: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    for<'r> i64: sqlx::Decode<'r, DB>,
    for<'r> String: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    for<'r> Vec<u8>: sqlx::Decode<'r, DB> + sqlx::Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::Row;
    let rows = bound::<DB>(sql, binds).fetch_all(&mut *conn).await?;
    rows.iter()
        .map(|row| {
            columns
                .iter()
                .enumerate()
                .map(|(i, column)| {
                    Ok(match column {
                        Column::Int | Column::OptInt => {
                            Value::Int(row.try_get::<Option<i64>, _>(i)?)
                        }
                        Column::Text | Column::OptText => {
                            Value::Text(row.try_get::<Option<String>, _>(i)?)
                        }
                        Column::Bytes => Value::Bytes(row.try_get::<Vec<u8>, _>(i)?),
                    })
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()
                .map(SqlRow)
        })
        .collect()
}

/// The methods of [`SqlDatabase`] that read the same for every database
/// but must be written where its concrete types are known: sqlx's encode
/// and decode bounds are checked there, and `rows_affected` is inherent to
/// each database's query result.
macro_rules! concrete_io {
    () => {
        fn rows_affected(result: &Self::QueryResult) -> u64 {
            result.rows_affected()
        }

        fn execute<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a str,
            binds: &'a [$crate::store::sql::Bind<'a>],
        ) -> futures_util::future::BoxFuture<'a, Result<u64, sqlx::Error>> {
            Box::pin($crate::store::sql::database::execute_generic::<Self>(
                conn, sql, binds,
            ))
        }

        fn fetch<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a str,
            binds: &'a [$crate::store::sql::Bind<'a>],
            columns: &'a [$crate::store::sql::Column],
        ) -> futures_util::future::BoxFuture<
            'a,
            Result<Vec<$crate::store::sql::SqlRow>, sqlx::Error>,
        > {
            Box::pin($crate::store::sql::database::fetch_generic::<Self>(
                conn, sql, binds, columns,
            ))
        }

        fn execute_script<'a>(
            conn: &'a mut Self::Connection,
            sql: &'a str,
        ) -> futures_util::future::BoxFuture<'a, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::Executor::execute(conn, sqlx::raw_sql(sql))
                    .await
                    .map(|_| ())
            })
        }
    };
}
pub(crate) use concrete_io;

/// A pooled connection idle at least this long is pinged before use.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const PING_IF_IDLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// Opens the pool of a server database (PostgreSQL, MySQL/MariaDB): 10
/// connections unless the options say otherwise.
///
/// sqlx pings every connection it hands out by default: a round trip per
/// transaction. Only a connection idle for [`PING_IF_IDLE_FOR`] is pinged
/// here (a server or proxy may have closed it meanwhile; one that fails the
/// ping is closed and another taken); a connection lost otherwise fails its
/// first statement with an I/O error, which is transient: the message is
/// retried.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn connect_server<'a, DB: sqlx::Database>(
    url: &'a str,
    options: &'a SqlOptions,
) -> BoxFuture<'a, Result<sqlx::Pool<DB>, sqlx::Error>> {
    Box::pin(
        pool_options::<DB>()
            .max_connections(options.max_connections.unwrap_or(10))
            .acquire_timeout(options.acquire_timeout)
            .connect(url),
    )
}

/// The pool options of every server-database pool (the store's and its
/// journal's): a connection is pinged before use only after
/// [`PING_IF_IDLE_FOR`] idle (see [`connect_server`]).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn pool_options<DB: sqlx::Database>() -> sqlx::pool::PoolOptions<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for < PING_IF_IDLE_FOR {
                    return Ok(true);
                }
                Ok(sqlx::Connection::ping(conn).await.is_ok())
            })
        })
}

/// A plain `BEGIN`: row locks do the rest.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn begin_deferred<DB: sqlx::Database>(
    pool: &sqlx::Pool<DB>,
) -> BoxFuture<'_, Result<sqlx::Transaction<'static, DB>, sqlx::Error>> {
    Box::pin(pool.begin())
}

/// Databases without notifications: the relay polls.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(crate) fn no_listen<DB: sqlx::Database>(
    _pool: &sqlx::Pool<DB>,
    _channel: String,
    _notify: Arc<Notify>,
) -> BoxFuture<'_, Result<Option<tokio::task::JoinHandle<()>>, sqlx::Error>> {
    Box::pin(async { Ok(None) })
}

/// At most this many connections serve the journal of a server database.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const JOURNAL_CONNECTIONS: u32 = 2;

/// The journal of a server database: a small pool of its own on the same
/// server (the v3 migration created the table).
/// `options` are [`pool_options`], with what the database adds (MariaDB's
/// journal connections set their isolation level when they connect).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn server_journal_with<DB: sqlx::Database>(
    main: &sqlx::Pool<DB>,
    options: sqlx::pool::PoolOptions<DB>,
) -> BoxFuture<'_, Result<sqlx::Pool<DB>, sqlx::Error>> {
    let pool = options
        .max_connections(JOURNAL_CONNECTIONS)
        .acquire_timeout(main.options().get_acquire_timeout())
        .connect_lazy_with((*main.connect_options()).clone());
    Box::pin(async move { Ok(pool) })
}
