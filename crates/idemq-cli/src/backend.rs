//! The store URL → a connected backend, and the per-backend glue.
//!
//! Every subcommand is written once, generic over [`Backend`]; this module
//! implements it for the three SQL stores that were compiled in.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::Result;
use idemq::engine::{BatchOptions, WatermarkOptions};
use idemq::outbox::{Backlog, DeadEvent, Outbox, OutboxError};
use idemq::source::Source;
use idemq::store::{Store, StoreAdmin};
use idemq::template::Placeholder;
use idemq::{Consumer, SourceError, StoreError, StoreErrorKind, Summary};

use crate::exit;
use crate::sink::{BindNull, BoxedHandler, RowsAffected, SqlStatement};
use idemq::store::sql::{SqlDatabase, SqlStore};
use sqlx::database::HasStatementCache;
use sqlx::{Encode, Executor, IntoArguments, Type};

/// The backends this binary can talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SQLite (`sqlite:`).
    #[cfg(feature = "sqlite")]
    Sqlite,
    /// PostgreSQL (`postgres://`, `postgresql://`).
    #[cfg(feature = "postgres")]
    Postgres,
    /// MySQL or MariaDB (`mysql://`, `mariadb://`).
    #[cfg(feature = "mysql")]
    MySql,
    /// The Redis lease store (`redis://`, `rediss://`).
    #[cfg(feature = "redis")]
    Redis,
    /// The MongoDB lease store (`mongodb://`).
    #[cfg(feature = "mongodb")]
    Mongo,
}

/// A parsed `--store` URL.
#[derive(Debug, Clone)]
pub struct StoreUrl {
    /// The backend the scheme names.
    pub kind: Kind,
    /// The URL as sqlx wants it (`mariadb://` rewritten to `mysql://`).
    pub url: String,
    /// The URL as given, with any password masked, for messages.
    pub display: String,
}

impl StoreUrl {
    /// A usage error unless the store can keep a time-partitioned inbox
    /// (PostgreSQL, MariaDB).
    pub fn check_partitionable(&self) -> anyhow::Result<()> {
        match self.kind {
            #[cfg(feature = "postgres")]
            Kind::Postgres => Ok(()),
            #[cfg(feature = "mysql")]
            Kind::MySql => Ok(()),
            #[allow(unreachable_patterns)]
            _ => Err(crate::exit::usage(format!(
                "--partitioned-inbox needs a postgres:// or mariadb:// store, not {self}"
            ))),
        }
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

/// The error for a backend that exists but was left out of this build.
#[allow(dead_code)] // unused when every backend feature is enabled
pub(crate) fn compiled_out(name: &str, feature: &str) -> String {
    format!("this idemq was built without {name} support (cargo feature `{feature}`)")
}

/// The node URLs of a Redis Cluster store URL,
/// `redis+cluster://[user:password@]host:port,host:port[?query]` (or
/// `rediss+cluster://` for TLS): one `redis://` (`rediss://`) URL per
/// node, each with the credentials and the query. `None` for any other URL.
#[cfg(feature = "redis")]
pub(crate) fn cluster_nodes(url: &str) -> Option<Vec<String>> {
    let (scheme, rest) = url.split_once("://")?;
    let node_scheme = match scheme.to_ascii_lowercase().as_str() {
        "redis+cluster" => "redis",
        "rediss+cluster" => "rediss",
        _ => return None,
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let query = tail.find('?').map_or("", |at| &tail[at..]);
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((user, hosts)) => (format!("{user}@"), hosts),
        None => (String::new(), authority),
    };
    Some(
        hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|host| format!("{node_scheme}://{userinfo}{host}{query}"))
            .collect(),
    )
}

impl FromStr for StoreUrl {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let (scheme, rest) = text.split_once(':').ok_or_else(|| {
            format!("{text:?} is not a store URL: expected sqlite:PATH, postgres://… or mysql://…")
        })?;
        let scheme = scheme.to_ascii_lowercase();
        let display = redact(text);
        let kind = match scheme.as_str() {
            "sqlite" => {
                #[cfg(feature = "sqlite")]
                {
                    Kind::Sqlite
                }
                #[cfg(not(feature = "sqlite"))]
                {
                    return Err(compiled_out("SQLite", "sqlite"));
                }
            }
            "postgres" | "postgresql" => {
                #[cfg(feature = "postgres")]
                {
                    Kind::Postgres
                }
                #[cfg(not(feature = "postgres"))]
                {
                    return Err(compiled_out("PostgreSQL", "postgres"));
                }
            }
            "mysql" | "mariadb" => {
                #[cfg(feature = "mysql")]
                {
                    Kind::MySql
                }
                #[cfg(not(feature = "mysql"))]
                {
                    return Err(compiled_out("MySQL/MariaDB", "mysql"));
                }
            }
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => {
                #[cfg(feature = "redis")]
                {
                    Kind::Redis
                }
                #[cfg(not(feature = "redis"))]
                {
                    return Err(compiled_out("Redis", "redis"));
                }
            }
            "mongodb" => {
                #[cfg(feature = "mongodb")]
                {
                    Kind::Mongo
                }
                #[cfg(not(feature = "mongodb"))]
                {
                    return Err(compiled_out("MongoDB", "mongodb"));
                }
            }
            "mongodb+srv" => {
                return Err(format!(
                    "{display}: mongodb+srv:// URLs are not supported (no DNS resolver in this \
                     build): list the hosts in a mongodb:// URL"
                ))
            }
            other => {
                return Err(format!(
                    "unknown store scheme {other:?} in {display}: expected sqlite:, postgres://, \
                     postgresql://, mysql://, mariadb://, redis://, redis+cluster:// or mongodb://"
                ))
            }
        };
        let url = if scheme == "mariadb" {
            format!("mysql:{rest}")
        } else {
            text.to_owned()
        };
        Ok(Self { kind, url, display })
    }
}

/// `url` with its secrets hidden: user info and secret parameters (see
/// [`idemq::redact::redact_url`]).
pub(crate) fn redact(url: &str) -> String {
    idemq::redact::redact_url(url)
}

/// How a SQL database takes `--apply-sql` statements.
#[derive(Debug, Clone, Copy)]
pub struct SqlDialect {
    /// How the database spells bind parameters.
    pub placeholder: Placeholder,
    /// Whether one cached statement per text serves every message. Not on
    /// PostgreSQL: sqlx caches a statement by its text with the parameter
    /// types of its first use, so a later message binding another type (an
    /// integer where the first had text or null) would fail; there the
    /// statement's text carries the types of its values (a leading comment),
    /// and each combination of types is cached on its own.
    pub cache_statements: bool,
}

/// A store the CLI can drive: the library's traits plus what the SQL sink
/// and `--init-sql` need from the concrete database (SQL stores only).
pub trait Backend: Store + StoreAdmin + Sized {
    /// The SQL dialect; `None` for stores that are not SQL databases (Redis),
    /// which then take no `--apply-sql` or `--init-sql`.
    const SQL: Option<SqlDialect>;

    /// The store's SQL side (`--init-sql`, checking `--apply-sql`); `None`
    /// (the default) for stores that are not SQL databases.
    fn as_sql(&self) -> Option<&dyn SqlAdmin> {
        None
    }

    /// The `--apply-sql` handler for this database's transactions (SQL stores).
    fn sql_handler(statement: Arc<SqlStatement>) -> Option<BoxedHandler<Self::Tx>>;

    /// Runs `source` in batches (`--batch`), if the store can claim batches
    /// in one transaction or round trip; `None` (the default) if it cannot.
    async fn run_batched(
        consumer: &Consumer<Self>,
        source: Box<dyn Source>,
        options: BatchOptions,
        shutdown: ShutdownSignal<'_>,
    ) -> Option<Result<Summary, SourceError>> {
        let _ = (consumer, source, options, shutdown);
        None
    }

    /// Runs `source` in offset-watermark mode (`--watermark`), if the store
    /// keeps offset watermarks in its transactions; `None` (the default) if
    /// it cannot.
    async fn run_watermarked(
        consumer: &Consumer<Self>,
        source: Box<dyn Source>,
        options: WatermarkOptions,
        shutdown: ShutdownSignal<'_>,
    ) -> Option<Result<Summary, SourceError>> {
        let _ = (consumer, source, options, shutdown);
        None
    }
}

/// What the CLI does with a SQL store's own database, outside the inbox.
#[async_trait::async_trait]
pub trait SqlAdmin: Send + Sync {
    /// Runs one statement outside any transaction (`--init-sql`).
    async fn execute_raw(&self, sql: &str) -> Result<(), sqlx::Error>;

    /// Prepares a statement without running it, to validate it up front.
    async fn prepare(&self, sql: &str) -> Result<(), sqlx::Error>;

    /// The transactional outbox of `table_prefix` in this database: its
    /// backlog and its oldest `dead_limit` dead rows; `None` when the
    /// outbox tables do not exist.
    async fn outbox(
        &self,
        table_prefix: &str,
        dead_limit: usize,
    ) -> Result<Option<OutboxView>, OutboxError>;
}

/// What the console shows of an outbox ([`SqlAdmin::outbox`]).
#[derive(Debug, Clone)]
pub struct OutboxView {
    /// The outbox table's name.
    pub table: String,
    /// Rows waiting, their age, dead rows.
    pub backlog: Backlog,
    /// The oldest dead rows.
    pub dead: Vec<DeadEvent>,
}

/// The future that ends a run (Ctrl-C).
pub type ShutdownSignal<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

/// A cached store drives like the store it wraps.
impl<B: Backend + Clone> Backend for idemq::store::cache::CachedStore<B> {
    const SQL: Option<SqlDialect> = B::SQL;

    fn as_sql(&self) -> Option<&dyn SqlAdmin> {
        self.inner().as_sql()
    }

    fn sql_handler(statement: Arc<SqlStatement>) -> Option<BoxedHandler<Self::Tx>> {
        B::sql_handler(statement)
    }

    // The cache wraps single key claims: no batch or watermark mode.
}

/// The [`Backend`] of a lease store (no SQL; handlers get a lease with a
/// fencing token): batches run over its work units, and there is no
/// watermark mode (it keeps no offsets in a transaction with the effects).
#[cfg_attr(not(any(feature = "redis", feature = "mongodb")), allow(unused_macros))]
macro_rules! lease_backend {
    ($(#[$meta:meta])* $store:ty) => {
        $(#[$meta])*
        impl Backend for $store {
            const SQL: Option<SqlDialect> = None;

            fn sql_handler(_statement: Arc<SqlStatement>) -> Option<BoxedHandler<Self::Tx>> {
                None
            }

            async fn run_batched(
                consumer: &Consumer<Self>,
                source: Box<dyn Source>,
                options: BatchOptions,
                shutdown: ShutdownSignal<'_>,
            ) -> Option<Result<Summary, SourceError>> {
                Some(consumer.run_batched_until(source, options, shutdown).await)
            }
        }
    };
}

lease_backend!(
    /// The Redis lease store: a batch's leases are claimed in one round trip
    /// and completed in another.
    #[cfg(feature = "redis")]
    idemq::store::redis::RedisStore
);

lease_backend!(
    /// The MongoDB lease store: a batch's leases are claimed with one
    /// unordered insert and completed with another.
    #[cfg(feature = "mongodb")]
    idemq::store::mongo::MongoStore
);

/// A database whose [`SqlStore`] the CLI drives: how `--apply-sql` is
/// written for it. One line per database; everything else is generic.
pub trait SqlBackendDatabase: SqlDatabase + BindNull + HasStatementCache {
    /// Placeholders and statement caching of `--apply-sql` statements.
    const SINK_DIALECT: SqlDialect;
}

#[cfg(feature = "sqlite")]
impl SqlBackendDatabase for sqlx::Sqlite {
    const SINK_DIALECT: SqlDialect = SqlDialect {
        placeholder: Placeholder::Positional,
        cache_statements: true,
    };
}

#[cfg(feature = "postgres")]
impl SqlBackendDatabase for sqlx::Postgres {
    const SINK_DIALECT: SqlDialect = SqlDialect {
        placeholder: Placeholder::Numbered,
        cache_statements: false,
    };
}

#[cfg(feature = "mysql")]
impl SqlBackendDatabase for sqlx::MySql {
    const SINK_DIALECT: SqlDialect = SqlDialect {
        placeholder: Placeholder::Positional,
        cache_statements: true,
    };
}

#[async_trait::async_trait]
impl<DB> SqlAdmin for SqlStore<DB>
where
    DB: SqlDatabase,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
{
    async fn execute_raw(&self, sql: &str) -> Result<(), sqlx::Error> {
        crate::sink::execute_raw(self.pool(), sql).await
    }

    async fn prepare(&self, sql: &str) -> Result<(), sqlx::Error> {
        crate::sink::prepare(self.pool(), sql).await
    }

    async fn outbox(
        &self,
        table_prefix: &str,
        dead_limit: usize,
    ) -> Result<Option<OutboxView>, OutboxError> {
        let outbox = Outbox::<DB>::new(table_prefix)?;
        let backlog = match outbox.backlog(self.pool()).await {
            Ok(backlog) => backlog,
            Err(e) if e.is_missing_table() => return Ok(None),
            Err(e) => return Err(e),
        };
        let dead = outbox.dead_letters(self.pool(), dead_limit).await?;
        Ok(Some(OutboxView {
            table: outbox.table().to_owned(),
            backlog,
            dead,
        }))
    }
}

/// Every SQL store, over its sqlx database: the bodies are the generic
/// functions of [`crate::sink`] and the library's modes.
impl<DB> Backend for SqlStore<DB>
where
    DB: SqlBackendDatabase,
    DB::QueryResult: RowsAffected,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> DB::Arguments<'q>: IntoArguments<'q, DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> bool: Encode<'q, DB> + Type<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> f64: Encode<'q, DB> + Type<DB>,
{
    const SQL: Option<SqlDialect> = Some(DB::SINK_DIALECT);

    fn as_sql(&self) -> Option<&dyn SqlAdmin> {
        Some(self)
    }

    fn sql_handler(statement: Arc<SqlStatement>) -> Option<BoxedHandler<Self::Tx>> {
        Some(Box::new(crate::sink::SqlHandler::<DB>::new(statement)))
    }

    async fn run_batched(
        consumer: &Consumer<Self>,
        source: Box<dyn Source>,
        options: BatchOptions,
        shutdown: ShutdownSignal<'_>,
    ) -> Option<Result<Summary, SourceError>> {
        Some(consumer.run_batched_until(source, options, shutdown).await)
    }

    async fn run_watermarked(
        consumer: &Consumer<Self>,
        source: Box<dyn Source>,
        options: WatermarkOptions,
        shutdown: ShutdownSignal<'_>,
    ) -> Option<Result<Summary, SourceError>> {
        Some(
            consumer
                .run_watermarked_until(source, options, shutdown)
                .await,
        )
    }
}

/// A store connection error: a bad table prefix or URL is a usage error.
pub fn connect_error(url: &StoreUrl, err: StoreError) -> anyhow::Error {
    match err.kind() {
        StoreErrorKind::Config => exit::usage(err),
        _ => anyhow::Error::new(err).context(format!("cannot connect to {url}")),
    }
}

/// Connects to the SQL store `url` names; the table prefix is validated.
macro_rules! connect_sql {
    ($store:ty, $url:expr, $options:expr) => {
        <$store>::connect_with(&$url.url, $options)
            .await
            .map_err(|e| $crate::backend::connect_error($url, e))
    };
}
pub(crate) use connect_sql;

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "redis")]
    #[test]
    fn cluster_urls_name_every_node() {
        assert_eq!(
            cluster_nodes("redis+cluster://u:p@h1:7000,h2:7001/?cacert=ca.pem").unwrap(),
            [
                "redis://u:p@h1:7000?cacert=ca.pem",
                "redis://u:p@h2:7001?cacert=ca.pem"
            ]
        );
        assert_eq!(
            cluster_nodes("rediss+cluster://h:7000").unwrap(),
            ["rediss://h:7000"]
        );
        assert!(cluster_nodes("redis://h:6379").is_none());
        let u: StoreUrl = "redis+cluster://u:secret@h1:7000,h2:7001".parse().unwrap();
        assert_eq!(u.kind, Kind::Redis);
        assert!(!u.display.contains("secret"), "{}", u.display);
    }

    #[test]
    fn schemes() {
        assert!("ftp://x".parse::<StoreUrl>().is_err());
        assert!("nothing".parse::<StoreUrl>().is_err());
        #[cfg(feature = "mysql")]
        {
            let u: StoreUrl = "mariadb://root:pw@127.0.0.1:3306/test".parse().unwrap();
            assert_eq!(u.kind, Kind::MySql);
            assert_eq!(u.url, "mysql://root:pw@127.0.0.1:3306/test");
            assert_eq!(u.display, "mariadb://<credentials>@127.0.0.1:3306/test");
        }
        #[cfg(feature = "postgres")]
        {
            let u: StoreUrl = "postgresql://u@h/db".parse().unwrap();
            assert_eq!(u.kind, Kind::Postgres);
            // A user name alone is hidden too: NATS and Redis put tokens there.
            assert_eq!(u.display, "postgresql://<credentials>@h/db");
        }
        #[cfg(feature = "sqlite")]
        assert_eq!(
            "sqlite://idemq.db".parse::<StoreUrl>().unwrap().kind,
            Kind::Sqlite
        );
    }
}
