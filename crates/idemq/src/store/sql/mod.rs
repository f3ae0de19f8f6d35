//! Transactional SQL inbox stores over sqlx: PostgreSQL, MySQL/MariaDB, SQLite.
//!
//! The claim row is inserted in the same transaction the handler writes
//! through. Insert first, never check-then-insert: `ON CONFLICT DO NOTHING`
//! (PostgreSQL, SQLite) or `INSERT IGNORE` (MySQL) and the affected-row count
//! decide, so a duplicate never aborts the transaction. A second claim of a
//! key whose first claim is still uncommitted blocks on the row lock until
//! the first commits (→ duplicate) or rolls back (→ new).
//!
//! The three stores share one implementation (the `sql_store!` macro below);
//! their SQL lives in [`queries`], their connection setup in their own module.

pub mod queries;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use queries::{BatchQueries, Dialect, Queries, Tables};

use crate::error::{ConfigError, StoreError};

/// Options shared by the SQL stores.
#[derive(Debug, Clone)]
pub struct SqlOptions {
    /// Prefix of the table names (default `idemq_`), validated as an identifier.
    pub table_prefix: String,
    /// Maximum pooled connections. `None` picks the backend's default
    /// (10 for PostgreSQL and MySQL; 1 for SQLite, which has one writer anyway).
    pub max_connections: Option<u32>,
    /// How long to wait for a connection (also bounds the first connect to
    /// an unreachable server). Default 10 s.
    pub acquire_timeout: std::time::Duration,
}

impl Default for SqlOptions {
    fn default() -> Self {
        Self {
            table_prefix: "idemq_".to_owned(),
            max_connections: None,
            acquire_timeout: std::time::Duration::from_secs(10),
        }
    }
}

impl SqlOptions {
    /// Sets the table prefix.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// Sets the pool size.
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = Some(n);
        self
    }

    /// Sets how long to wait for a connection.
    pub fn acquire_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    pub(crate) fn tables(&self) -> Result<Tables, ConfigError> {
        Tables::new(&self.table_prefix)
    }
}

/// Whether a database error may pass if the operation is retried:
/// lost connections, pool timeouts, deadlocks, serialization failures, lock
/// timeouts and busy databases.
pub fn is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            #[cfg(feature = "mysql")]
            if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                // lock wait timeout, deadlock, too many connections, server gone, lost connection
                return matches!(my.number(), 1205 | 1213 | 1040 | 2006 | 2013);
            }
            #[cfg(feature = "sqlite")]
            if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
                // SQLITE_BUSY and SQLITE_LOCKED, with their extended codes
                let code = db.code().and_then(|c| c.parse::<i64>().ok()).unwrap_or(0);
                return matches!(code & 0xff, 5 | 6);
            }
            // PostgreSQL (and MySQL's SQLSTATEs): transaction rollback class,
            // connection exceptions, insufficient resources, lock not available,
            // operator intervention (shutdown).
            db.code().is_some_and(|code| {
                code.starts_with("40")
                    || code.starts_with("08")
                    || code.starts_with("53")
                    || code == "55P03"
                    || code.starts_with("57P")
            })
        }
        _ => false,
    }
}

/// Maps a database error to a [`StoreError`], keeping transience.
pub(crate) fn store_error(err: sqlx::Error) -> StoreError {
    if is_transient(&err) {
        StoreError::Transient(err.to_string())
    } else {
        StoreError::Other(err.to_string())
    }
}

/// Opens the pool the effect journal writes through: its own connections,
/// so that a journal write commits on its own while the handler's
/// transaction is open, and never waits for a connection a handler holds.
pub(crate) trait JournalPool: sqlx::Database {
    /// Opens it (lazily, where that is possible) next to `main`.
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        queries: &'a Queries,
    ) -> futures_util::future::BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>>;
}

/// At most this many connections serve the journal of a server database.
#[cfg(any(feature = "postgres", feature = "mysql"))]
const JOURNAL_CONNECTIONS: u32 = 2;

/// A small pool of its own on the same server (the v3 migration created the table).
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn server_journal<DB: sqlx::Database>(main: &sqlx::Pool<DB>) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(JOURNAL_CONNECTIONS)
        .acquire_timeout(main.options().get_acquire_timeout())
        .connect_lazy_with((*main.connect_options()).clone())
}

#[cfg(feature = "postgres")]
impl JournalPool for sqlx::Postgres {
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        _queries: &'a Queries,
    ) -> futures_util::future::BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        Box::pin(async move { Ok(server_journal(main)) })
    }
}

#[cfg(feature = "mysql")]
impl JournalPool for sqlx::MySql {
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        _queries: &'a Queries,
    ) -> futures_util::future::BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        Box::pin(async move { Ok(server_journal(main)) })
    }
}

/// SQLite allows one writer per database file, and the handler's
/// transaction holds the main file's write lock while it runs: the journal
/// lives in a file of its own, `<main file>-effects` (an in-memory database
/// gets an in-memory journal that lives as long as the store), created with
/// its table when first used. Same pragmas as the main file.
#[cfg(feature = "sqlite")]
impl JournalPool for sqlx::Sqlite {
    fn open_journal<'a>(
        main: &'a sqlx::Pool<Self>,
        queries: &'a Queries,
    ) -> futures_util::future::BoxFuture<'a, Result<sqlx::Pool<Self>, sqlx::Error>> {
        Box::pin(async move {
            let options = (*main.connect_options()).clone();
            let file = options.get_filename().to_string_lossy().into_owned();
            // A private `:memory:` database stays one (kept alive below).
            let file = if file == ":memory:" {
                file
            } else {
                format!("{file}-effects")
            };
            let pool = sqlx::pool::PoolOptions::<sqlx::Sqlite>::new()
                .max_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .acquire_timeout(main.options().get_acquire_timeout())
                .connect_with(options.filename(file))
                .await?;
            for step in &queries.effects_schema {
                sqlx::query(step).execute(&pool).await?;
            }
            Ok(pool)
        })
    }
}

/// Generates a SQL store type over one sqlx database. Every dialect runs this
/// same code; only the SQL text ([`Queries`]) and the pool setup differ.
macro_rules! sql_store {
    ($(#[$doc:meta])* $store:ident, $db:ty, $connect:path, $dialect:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $store {
            pool: sqlx::Pool<$db>,
            queries: std::sync::Arc<$crate::store::sql::Queries>,
            batch: std::sync::Arc<$crate::store::sql::BatchQueries>,
            tables: $crate::store::sql::Tables,
            journal: std::sync::Arc<tokio::sync::OnceCell<sqlx::Pool<$db>>>,
        }

        impl $store {
            /// Connects with default [`SqlOptions`](crate::store::sql::SqlOptions).
            pub async fn connect(url: &str) -> Result<Self, $crate::StoreError> {
                Self::connect_with(url, $crate::store::sql::SqlOptions::default()).await
            }

            /// Connects with `options`. Does not migrate: call
            /// [`StoreAdmin::migrate`](crate::store::StoreAdmin::migrate).
            pub async fn connect_with(
                url: &str,
                options: $crate::store::sql::SqlOptions,
            ) -> Result<Self, $crate::StoreError> {
                let tables = options
                    .tables()
                    .map_err(|e| $crate::StoreError::Config(e.to_string()))?;
                let pool = $connect(url, &options)
                    .await
                    .map_err($crate::store::sql::store_error)?;
                Ok(Self::with_tables(pool, tables))
            }

            /// Wraps an existing pool (share it with the rest of the application).
            pub fn from_pool(
                pool: sqlx::Pool<$db>,
                options: $crate::store::sql::SqlOptions,
            ) -> Result<Self, $crate::StoreError> {
                let tables = options
                    .tables()
                    .map_err(|e| $crate::StoreError::Config(e.to_string()))?;
                Ok(Self::with_tables(pool, tables))
            }

            fn with_tables(pool: sqlx::Pool<$db>, tables: $crate::store::sql::Tables) -> Self {
                let queries = $crate::store::sql::Queries::new($dialect, &tables);
                let batch = $crate::store::sql::BatchQueries::new($dialect, &tables);
                Self {
                    pool,
                    queries: std::sync::Arc::new(queries),
                    batch: std::sync::Arc::new(batch),
                    tables,
                    journal: std::sync::Arc::new(tokio::sync::OnceCell::new()),
                }
            }

            /// The effect journal's own pool, opened on first use.
            async fn journal_pool(&self) -> Result<&sqlx::Pool<$db>, $crate::StoreError> {
                self.journal
                    .get_or_try_init(|| {
                        <$db as $crate::store::sql::JournalPool>::open_journal(
                            &self.pool,
                            &self.queries,
                        )
                    })
                    .await
                    .map_err($crate::store::sql::store_error)
            }

            /// The connection pool.
            pub fn pool(&self) -> &sqlx::Pool<$db> {
                &self.pool
            }

            /// The table names in use.
            pub fn tables(&self) -> &$crate::store::sql::Tables {
                &self.tables
            }

            async fn fetch_record(
                &self,
                conn: &mut <$db as sqlx::Database>::Connection,
                sql: &str,
                consumer: &str,
                key: &str,
            ) -> Result<Option<$crate::store::InboxRecord>, sqlx::Error> {
                use sqlx::Row;
                let row = sqlx::query(sql)
                    .bind(consumer)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
                row.map(|row| {
                    Ok($crate::store::InboxRecord {
                        consumer: consumer.to_owned(),
                        key: key.to_owned(),
                        fingerprint: row.try_get::<String, _>(0)?,
                        result: $crate::store::parse_result(row.try_get::<Option<String>, _>(1)?),
                        first_seen_ms: row.try_get::<i64, _>(2)?,
                    })
                })
                .transpose()
            }

            async fn fetch_attempts(
                &self,
                consumer: &str,
                key: &str,
            ) -> Result<Option<$crate::store::AttemptRecord>, sqlx::Error> {
                use sqlx::Row;
                let row = sqlx::query(&self.queries.attempt_select)
                    .bind(consumer)
                    .bind(key)
                    .fetch_optional(&self.pool)
                    .await?;
                row.map(|row| {
                    Ok($crate::store::AttemptRecord {
                        attempts: u32::try_from(row.try_get::<i64, _>(0)?).unwrap_or(u32::MAX),
                        last_error: row.try_get::<String, _>(1)?,
                        first_failed_ms: row.try_get::<i64, _>(2)?,
                        last_failed_ms: row.try_get::<i64, _>(3)?,
                    })
                })
                .transpose()
            }

            fn dead_letter_from_row(
                row: &<$db as sqlx::Database>::Row,
            ) -> Result<$crate::store::DeadLetterRecord, sqlx::Error> {
                use sqlx::Row;
                let (message, meta) = $crate::store::dead_letter_message(
                    row.try_get::<Option<String>, _>(5)?,
                    row.try_get::<Option<String>, _>(6)?,
                    row.try_get::<Option<String>, _>(7)?,
                    row.try_get::<Vec<u8>, _>(8)?,
                    row.try_get::<String, _>(9)?,
                    row.try_get::<Option<String>, _>(10)?,
                    row.try_get::<Option<i64>, _>(11)?.and_then(|p| i32::try_from(p).ok()),
                    row.try_get::<Option<i64>, _>(12)?,
                    row.try_get::<i64, _>(13)?,
                );
                Ok($crate::store::DeadLetterRecord {
                    id: row.try_get::<i64, _>(0)?,
                    consumer: row.try_get::<String, _>(1)?,
                    key: row.try_get::<Option<String>, _>(2)?,
                    reason: row.try_get::<String, _>(3)?,
                    error: row.try_get::<String, _>(4)?,
                    message,
                    meta,
                    attempts: u32::try_from(row.try_get::<i64, _>(14)?).unwrap_or(u32::MAX),
                    created_ms: row.try_get::<i64, _>(15)?,
                })
            }

            async fn count_by_consumer(&self, sql: &str) -> Result<Vec<(String, u64)>, sqlx::Error> {
                use sqlx::Row;
                sqlx::query(sql)
                    .fetch_all(&self.pool)
                    .await?
                    .iter()
                    .map(|row| {
                        Ok((
                            row.try_get::<String, _>(0)?,
                            u64::try_from(row.try_get::<i64, _>(1)?).unwrap_or(0),
                        ))
                    })
                    .collect()
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::Store for $store {
            type Tx = sqlx::Transaction<'static, $db>;

            async fn claim(
                &self,
                req: &$crate::store::ClaimRequest<'_>,
            ) -> Result<$crate::store::Claim<Self::Tx>, $crate::StoreError> {
                use $crate::store::sql::store_error;
                // A claim that finds a key whose row it cannot yet see (possible
                // under REPEATABLE READ) starts over in a new transaction.
                for _ in 0..3 {
                    let mut tx = self.pool.begin().await.map_err(store_error)?;
                    let inserted = sqlx::query(&self.queries.claim)
                        .bind(req.consumer)
                        .bind(req.key)
                        .bind(req.fingerprint)
                        .bind($crate::store::now_ms())
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?
                        .rows_affected();
                    if inserted == 1 {
                        return Ok($crate::store::Claim::New(tx));
                    }
                    let record = self
                        .fetch_record(&mut tx, &self.queries.fetch, req.consumer, req.key)
                        .await
                        .map_err(store_error)?;
                    tx.rollback().await.map_err(store_error)?;
                    if let Some(record) = record {
                        return Ok($crate::store::Claim::Done(record));
                    }
                }
                Err($crate::StoreError::Transient(format!(
                    "key {:?} exists but its row is not visible yet",
                    req.key
                )))
            }

            async fn commit(
                &self,
                mut tx: Self::Tx,
                req: &$crate::store::ClaimRequest<'_>,
                result: Option<&serde_json::Value>,
            ) -> Result<(), $crate::StoreError> {
                use $crate::store::sql::store_error;
                if let Some(result) = result {
                    sqlx::query(&self.queries.set_result)
                        .bind(result.to_string())
                        .bind(req.consumer)
                        .bind(req.key)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                sqlx::query(&self.queries.clear_attempts)
                    .bind(req.consumer)
                    .bind(req.key)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                tx.commit().await.map_err(store_error)
            }

            async fn rollback(&self, tx: Self::Tx) -> Result<(), $crate::StoreError> {
                tx.rollback().await.map_err($crate::store::sql::store_error)
            }

            async fn record_failure(
                &self,
                consumer: &str,
                key: &str,
                error: &str,
            ) -> Result<u32, $crate::StoreError> {
                use $crate::store::sql::store_error;
                let now = $crate::store::now_ms();
                sqlx::query(&self.queries.attempt_upsert)
                    .bind(consumer)
                    .bind(key)
                    .bind(error)
                    .bind(now)
                    .bind(now)
                    .execute(&self.pool)
                    .await
                    .map_err(store_error)?;
                let record = self.fetch_attempts(consumer, key).await.map_err(store_error)?;
                Ok(record.map_or(1, |r| r.attempts))
            }

            async fn dead_letter(
                &self,
                letter: &$crate::store::DeadLetter<'_>,
            ) -> Result<(), $crate::StoreError> {
                use $crate::store::sql::store_error;
                let mut tx = self.pool.begin().await.map_err(store_error)?;
                sqlx::query(&self.queries.dead_letter_insert)
                    .bind(letter.consumer)
                    .bind(letter.key)
                    .bind(letter.reason.code())
                    .bind(letter.error)
                    .bind(letter.message.id.as_deref())
                    .bind(letter.message.key.as_deref())
                    .bind(letter.message.headers.to_json().to_string())
                    .bind(letter.message.payload.as_slice())
                    .bind(letter.meta.source.as_str())
                    .bind(letter.meta.topic.as_deref())
                    .bind(letter.meta.partition.map(i64::from))
                    .bind(letter.meta.offset)
                    .bind(i64::from(letter.meta.delivery_count))
                    .bind(i64::from(letter.attempts))
                    .bind($crate::store::now_ms())
                    .bind(letter.letter_id())
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                if let Some(key) = letter.key {
                    sqlx::query(&self.queries.clear_attempts)
                        .bind(letter.consumer)
                        .bind(key)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)
            }

            fn journal(&self) -> Option<&dyn $crate::effect::EffectJournal> {
                Some(self)
            }
        }

        /// The journal table `{prefix}effects`, written through a pool of its
        /// own (each statement commits by itself), pruned with the inbox.
        #[async_trait::async_trait]
        impl $crate::effect::EffectJournal for $store {
            async fn get(
                &self,
                consumer: &str,
                key: &str,
                step: &str,
            ) -> Result<Option<serde_json::Value>, $crate::StoreError> {
                use sqlx::Row;
                let pool = self.journal_pool().await?;
                let row = sqlx::query(&self.queries.effect_get)
                    .bind(consumer)
                    .bind(key)
                    .bind(step)
                    .fetch_optional(pool)
                    .await
                    .map_err($crate::store::sql::store_error)?;
                row.map(|r| r.try_get::<String, _>(0))
                    .transpose()
                    .map(|text| $crate::store::parse_result(text))
                    .map_err($crate::store::sql::store_error)
            }

            async fn put(
                &self,
                consumer: &str,
                key: &str,
                step: &str,
                result: &serde_json::Value,
            ) -> Result<serde_json::Value, $crate::StoreError> {
                let pool = self.journal_pool().await?;
                sqlx::query(&self.queries.effect_put)
                    .bind(consumer)
                    .bind(key)
                    .bind(step)
                    .bind(result.to_string())
                    .bind($crate::store::now_ms())
                    .execute(pool)
                    .await
                    .map_err($crate::store::sql::store_error)?;
                let stored = $crate::effect::EffectJournal::get(self, consumer, key, step).await?;
                stored.ok_or_else(|| {
                    $crate::StoreError::Transient(format!(
                        "effect {step:?} of key {key:?}: the journal row is not visible after writing it"
                    ))
                })
            }

            async fn steps(
                &self,
                consumer: &str,
                key: &str,
            ) -> Result<Vec<(String, serde_json::Value)>, $crate::StoreError> {
                use sqlx::Row;
                let pool = self.journal_pool().await?;
                let rows = sqlx::query(&self.queries.effect_steps)
                    .bind(consumer)
                    .bind(key)
                    .fetch_all(pool)
                    .await
                    .map_err($crate::store::sql::store_error)?;
                rows.iter()
                    .map(|r| {
                        let step: String = r.try_get(0)?;
                        let text: String = r.try_get(1)?;
                        let value = $crate::store::parse_result(Some(text))
                            .unwrap_or(serde_json::Value::Null);
                        Ok((step, value))
                    })
                    .collect::<Result<Vec<_>, sqlx::Error>>()
                    .map_err($crate::store::sql::store_error)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::BatchStore for $store {
            async fn claim_batch(
                &self,
                consumer: &str,
                claims: &[(&str, &str)],
            ) -> Result<(Self::Tx, Vec<$crate::store::BatchClaim>), $crate::StoreError> {
                use sqlx::Row;
                use $crate::store::sql::store_error;
                use $crate::store::BatchClaim;
                let mut tx = self.pool.begin().await.map_err(store_error)?;
                if claims.is_empty() {
                    return Ok((tx, Vec::new()));
                }
                // Insert in key order, so that concurrent batches over
                // overlapping keys lock rows in the same order.
                let mut sorted: Vec<&(&str, &str)> = claims.iter().collect();
                sorted.sort_unstable_by_key(|(key, _)| *key);
                let now = $crate::store::now_ms();
                let sql = self.batch.claim(sorted.len());
                let mut query = sqlx::query(&sql);
                for (key, fingerprint) in &sorted {
                    query = query.bind(consumer).bind(*key).bind(*fingerprint).bind(now);
                }
                let inserted: std::collections::HashSet<String> = query
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(store_error)?
                    .iter()
                    .map(|row| row.try_get::<String, _>(0))
                    .collect::<Result<_, _>>()
                    .map_err(store_error)?;
                let existing: Vec<&str> = claims
                    .iter()
                    .map(|(key, _)| *key)
                    .filter(|key| !inserted.contains(*key))
                    .collect();
                let mut records = std::collections::HashMap::new();
                if !existing.is_empty() {
                    let sql = self.batch.fetch(existing.len());
                    let mut query = sqlx::query(&sql).bind(consumer);
                    for key in &existing {
                        query = query.bind(*key);
                    }
                    for row in query.fetch_all(&mut *tx).await.map_err(store_error)? {
                        let key = row.try_get::<String, _>(0).map_err(store_error)?;
                        let record = $crate::store::InboxRecord {
                            consumer: consumer.to_owned(),
                            key: key.clone(),
                            fingerprint: row.try_get::<String, _>(1).map_err(store_error)?,
                            result: $crate::store::parse_result(
                                row.try_get::<Option<String>, _>(2).map_err(store_error)?,
                            ),
                            first_seen_ms: row.try_get::<i64, _>(3).map_err(store_error)?,
                        };
                        records.insert(key, record);
                    }
                }
                let answers = claims
                    .iter()
                    .map(|(key, _)| {
                        if inserted.contains(*key) {
                            BatchClaim::New
                        } else {
                            records
                                .remove(*key)
                                .map_or(BatchClaim::Busy, BatchClaim::Done)
                        }
                    })
                    .collect();
                Ok((tx, answers))
            }

            async fn savepoint(&self, tx: &mut Self::Tx) -> Result<(), $crate::StoreError> {
                sqlx::query("SAVEPOINT idemq_message")
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
                    .map_err($crate::store::sql::store_error)
            }

            async fn release_savepoint(&self, tx: &mut Self::Tx) -> Result<(), $crate::StoreError> {
                sqlx::query("RELEASE SAVEPOINT idemq_message")
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
                    .map_err($crate::store::sql::store_error)
            }

            async fn rollback_message(
                &self,
                tx: &mut Self::Tx,
                consumer: &str,
                key: &str,
            ) -> Result<(), $crate::StoreError> {
                use $crate::store::sql::store_error;
                sqlx::query("ROLLBACK TO SAVEPOINT idemq_message")
                    .execute(&mut **tx)
                    .await
                    .map_err(store_error)?;
                sqlx::query("RELEASE SAVEPOINT idemq_message")
                    .execute(&mut **tx)
                    .await
                    .map_err(store_error)?;
                sqlx::query(&self.batch.unclaim())
                    .bind(consumer)
                    .bind(key)
                    .execute(&mut **tx)
                    .await
                    .map(|_| ())
                    .map_err(store_error)
            }

            async fn commit_batch(
                &self,
                mut tx: Self::Tx,
                consumer: &str,
                processed: &[(&str, Option<&serde_json::Value>)],
            ) -> Result<(), $crate::StoreError> {
                use $crate::store::sql::store_error;
                for (key, result) in processed {
                    if let Some(result) = result {
                        sqlx::query(&self.queries.set_result)
                            .bind(result.to_string())
                            .bind(consumer)
                            .bind(*key)
                            .execute(&mut *tx)
                            .await
                            .map_err(store_error)?;
                    }
                }
                if !processed.is_empty() {
                    let sql = self.batch.clear_attempts(processed.len());
                    let mut query = sqlx::query(&sql).bind(consumer);
                    for (key, _) in processed {
                        query = query.bind(*key);
                    }
                    query.execute(&mut *tx).await.map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::OffsetStore for $store {
            async fn claim_offset(
                &self,
                consumer: &str,
                topic: &str,
                partition: i32,
                offset: i64,
            ) -> Result<$crate::store::OffsetClaim<Self::Tx>, $crate::StoreError> {
                use sqlx::Row;
                use $crate::store::sql::store_error;
                let mut tx = self.pool.begin().await.map_err(store_error)?;
                // Lock the partition's row; only the first claim of a
                // partition ever finds none and creates it (one round trip
                // per message in the steady state, not two).
                let lock = sqlx::query(&self.queries.offset_lock)
                    .bind(consumer)
                    .bind(topic)
                    .bind(partition);
                let mut next_offset: Option<i64> = lock
                    .fetch_optional(&mut *tx)
                    .await
                    .and_then(|row| row.map(|r| r.try_get::<i64, _>(0)).transpose())
                    .map_err(store_error)?;
                if next_offset.is_none() {
                    // Create the row outside this transaction, then lock it
                    // in a new one: on MySQL/MariaDB the locking read of a
                    // missing row holds a gap lock, and two first claims
                    // (of different partitions) inserting under their gap
                    // locks deadlock each other.
                    tx.rollback().await.map_err(store_error)?;
                    sqlx::query(&self.queries.offset_ensure)
                        .bind(consumer)
                        .bind(topic)
                        .bind(partition)
                        .bind($crate::store::now_ms())
                        .execute(&self.pool)
                        .await
                        .map_err(store_error)?;
                    tx = self.pool.begin().await.map_err(store_error)?;
                    next_offset = sqlx::query(&self.queries.offset_lock)
                        .bind(consumer)
                        .bind(topic)
                        .bind(partition)
                        .fetch_optional(&mut *tx)
                        .await
                        .and_then(|row| row.map(|r| r.try_get::<i64, _>(0)).transpose())
                        .map_err(store_error)?;
                }
                let next_offset = next_offset.ok_or_else(|| {
                    $crate::StoreError::Transient(format!(
                        "the offset row of {topic}/{partition} is not visible after creating it"
                    ))
                })?;
                if offset < next_offset {
                    tx.rollback().await.map_err(store_error)?;
                    return Ok($crate::store::OffsetClaim::Applied { next_offset });
                }
                Ok($crate::store::OffsetClaim::New(tx))
            }

            async fn claim_key_in(
                &self,
                tx: &mut Self::Tx,
                req: &$crate::store::ClaimRequest<'_>,
            ) -> Result<Option<$crate::store::InboxRecord>, $crate::StoreError> {
                use $crate::store::sql::store_error;
                let inserted = sqlx::query(&self.queries.claim)
                    .bind(req.consumer)
                    .bind(req.key)
                    .bind(req.fingerprint)
                    .bind($crate::store::now_ms())
                    .execute(&mut **tx)
                    .await
                    .map_err(store_error)?
                    .rows_affected();
                if inserted == 1 {
                    return Ok(None);
                }
                let record = self
                    .fetch_record(&mut *tx, &self.queries.fetch, req.consumer, req.key)
                    .await
                    .map_err(store_error)?;
                record.map(Some).ok_or_else(|| {
                    $crate::StoreError::Transient(format!(
                        "key {:?} exists but its row is not visible yet",
                        req.key
                    ))
                })
            }

            async fn commit_offset(
                &self,
                mut tx: Self::Tx,
                consumer: &str,
                topic: &str,
                partition: i32,
                offset: i64,
                key: Option<(&$crate::store::ClaimRequest<'_>, Option<&serde_json::Value>)>,
            ) -> Result<(), $crate::StoreError> {
                use $crate::store::sql::store_error;
                let next = offset.saturating_add(1);
                sqlx::query(&self.queries.offset_advance)
                    .bind(next)
                    .bind(next)
                    .bind($crate::store::now_ms())
                    .bind(consumer)
                    .bind(topic)
                    .bind(partition)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_error)?;
                if let Some((req, Some(result))) = key {
                    sqlx::query(&self.queries.set_result)
                        .bind(result.to_string())
                        .bind(req.consumer)
                        .bind(req.key)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_error)?;
                }
                tx.commit().await.map_err(store_error)
            }

            async fn advance_offset(
                &self,
                consumer: &str,
                topic: &str,
                partition: i32,
                offset: i64,
            ) -> Result<(), $crate::StoreError> {
                match self.claim_offset(consumer, topic, partition, offset).await? {
                    $crate::store::OffsetClaim::New(tx) => {
                        self.commit_offset(tx, consumer, topic, partition, offset, None)
                            .await
                    }
                    $crate::store::OffsetClaim::Applied { .. } => Ok(()),
                }
            }

            async fn watermark(
                &self,
                consumer: &str,
                topic: &str,
                partition: i32,
            ) -> Result<Option<i64>, $crate::StoreError> {
                use sqlx::Row;
                use $crate::store::sql::store_error;
                sqlx::query(&self.queries.offset_select)
                    .bind(consumer)
                    .bind(topic)
                    .bind(partition)
                    .fetch_optional(&self.pool)
                    .await
                    .and_then(|row| row.map(|r| r.try_get::<i64, _>(0)).transpose())
                    .map_err(store_error)
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::StoreAdmin for $store {
            async fn migrate(&self) -> Result<(), $crate::StoreError> {
                use sqlx::Row;
                use $crate::store::sql::store_error;
                let q = &self.queries;
                let mut tx = self.pool.begin().await.map_err(store_error)?;
                if let Some(lock) = &q.migrate_lock {
                    sqlx::query(lock).execute(&mut *tx).await.map_err(store_error)?;
                }
                let outcome: Result<(), sqlx::Error> = async {
                    sqlx::query(&q.create_migrations_table).execute(&mut *tx).await?;
                    let applied: Vec<i64> = sqlx::query(&q.applied_versions)
                        .fetch_all(&mut *tx)
                        .await?
                        .iter()
                        .map(|r| r.try_get::<i64, _>(0))
                        .collect::<Result<_, _>>()?;
                    for (version, steps) in &q.migrations {
                        if applied.contains(version) {
                            continue;
                        }
                        for step in steps {
                            sqlx::query(step).execute(&mut *tx).await?;
                        }
                        sqlx::query(&q.record_version)
                            .bind(*version)
                            .bind($crate::store::now_ms())
                            .execute(&mut *tx)
                            .await?;
                        tracing::info!(version, "applied idemq schema migration");
                    }
                    Ok(())
                }
                .await;
                if let Some(unlock) = &q.migrate_unlock {
                    sqlx::query(unlock).execute(&mut *tx).await.map_err(store_error)?;
                }
                match outcome {
                    Ok(()) => tx.commit().await.map_err(store_error),
                    Err(e) => {
                        let _ = tx.rollback().await;
                        Err(store_error(e))
                    }
                }
            }

            async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, $crate::StoreError> {
                use $crate::store::sql::store_error;
                let deleted = sqlx::query(&self.queries.prune_inbox)
                    .bind(cutoff_ms)
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await
                    .map_err(store_error)?
                    .rows_affected();
                sqlx::query(&self.queries.prune_attempts)
                    .bind(cutoff_ms)
                    .bind(i64::from(batch))
                    .execute(&self.pool)
                    .await
                    .map_err(store_error)?;
                let effects = sqlx::query(&self.queries.prune_effects)
                    .bind(cutoff_ms)
                    .bind(i64::from(batch))
                    .execute(self.journal_pool().await?)
                    .await
                    .map_err(store_error)?
                    .rows_affected();
                Ok(deleted.max(effects))
            }

            async fn inspect(
                &self,
                consumer: &str,
                key: &str,
            ) -> Result<$crate::store::KeyReport, $crate::StoreError> {
                use $crate::store::sql::store_error;
                let mut conn = self.pool.acquire().await.map_err(store_error)?;
                let inbox = self
                    .fetch_record(&mut conn, &self.queries.inspect_inbox, consumer, key)
                    .await
                    .map_err(store_error)?;
                drop(conn);
                let attempts = self.fetch_attempts(consumer, key).await.map_err(store_error)?;
                let dead_letters = sqlx::query(&self.queries.dead_letters_of_key)
                    .bind(consumer)
                    .bind(key)
                    .fetch_all(&self.pool)
                    .await
                    .map_err(store_error)?
                    .iter()
                    .map(Self::dead_letter_from_row)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(store_error)?;
                Ok($crate::store::KeyReport {
                    inbox,
                    in_flight: false,
                    attempts,
                    dead_letters,
                })
            }

            async fn stats(&self) -> Result<Vec<$crate::store::ConsumerStats>, $crate::StoreError> {
                use sqlx::Row;
                use $crate::store::sql::store_error;
                let mut by_consumer: std::collections::BTreeMap<String, $crate::store::ConsumerStats> =
                    std::collections::BTreeMap::new();
                let rows = sqlx::query(&self.queries.stats_inbox)
                    .fetch_all(&self.pool)
                    .await
                    .map_err(store_error)?;
                for row in &rows {
                    let consumer: String = row.try_get(0).map_err(store_error)?;
                    let stats = by_consumer.entry(consumer.clone()).or_default();
                    stats.consumer = consumer;
                    stats.processed = u64::try_from(row.try_get::<i64, _>(1).map_err(store_error)?).unwrap_or(0);
                    stats.oldest_ms = row.try_get::<Option<i64>, _>(2).map_err(store_error)?;
                    stats.newest_ms = row.try_get::<Option<i64>, _>(3).map_err(store_error)?;
                }
                let counts: [(&str, fn(&mut $crate::store::ConsumerStats, u64)); 2] = [
                    (&self.queries.stats_dead_letters, |s, n| s.dead_letters = n),
                    (&self.queries.stats_failing, |s, n| s.failing = n),
                ];
                for (sql, set) in counts {
                    for (consumer, n) in self.count_by_consumer(sql).await.map_err(store_error)? {
                        let stats = by_consumer.entry(consumer.clone()).or_default();
                        stats.consumer = consumer;
                        set(stats, n);
                    }
                }
                Ok(by_consumer.into_values().collect())
            }

            async fn dead_letters(
                &self,
                consumer: Option<&str>,
                after_id: i64,
                limit: u32,
            ) -> Result<Vec<$crate::store::DeadLetterRecord>, $crate::StoreError> {
                use $crate::store::sql::store_error;
                let query = match consumer {
                    Some(c) => sqlx::query(&self.queries.dead_letters_of_consumer).bind(c),
                    None => sqlx::query(&self.queries.dead_letters_all),
                };
                query
                    .bind(after_id)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await
                    .map_err(store_error)?
                    .iter()
                    .map(Self::dead_letter_from_row)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(store_error)
            }

            async fn delete_dead_letter(&self, id: i64) -> Result<bool, $crate::StoreError> {
                let n = sqlx::query(&self.queries.dead_letter_delete)
                    .bind(id)
                    .execute(&self.pool)
                    .await
                    .map_err($crate::store::sql::store_error)?
                    .rows_affected();
                Ok(n > 0)
            }
        }
    };
}

pub(crate) use sql_store;
