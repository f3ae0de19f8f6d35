//! Transactional SQL inbox stores over sqlx: PostgreSQL, MySQL/MariaDB, SQLite.
//!
//! The claim row is inserted in the same transaction the handler writes
//! through. Insert first, never check-then-insert: `ON CONFLICT DO NOTHING`
//! (PostgreSQL, SQLite) or `INSERT IGNORE` (MySQL) and the affected-row count
//! decide, so a duplicate never aborts the transaction. A second claim of a
//! key whose first claim is still uncommitted blocks on the row lock until
//! the first commits (→ duplicate) or rolls back (→ new).
//!
//! The three stores are one generic type, [`SqlStore`], over the sealed
//! [`SqlDatabase`] trait; their SQL lives in [`queries`], their connection
//! setup and error codes in their own module. The outbox runs on the same
//! trait.

mod batch;
pub mod database;
mod failed_keys;
mod journal;
mod partitions;
pub mod queries;
mod rewind;
mod store;
mod unit;

#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use database::{Bind, Column, SqlDatabase, SqlRow};
pub use partitions::InboxPartitions;
pub use queries::{BatchQueries, Dialect, Queries, Tables};
pub use store::SqlStore;
pub use unit::SqlUnit;

use crate::error::{ConfigError, StoreError, StoreErrorKind};

/// Options shared by the SQL stores.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SqlOptions {
    /// Prefix of the table names (default `idemq_`), validated as an identifier.
    pub table_prefix: String,
    /// Maximum pooled connections. `None` picks the backend's default
    /// (10 for PostgreSQL and MySQL; 1 for SQLite, which has one writer anyway).
    pub max_connections: Option<u32>,
    /// How long to wait for a connection (also bounds the first connect to
    /// an unreachable server). Default 10 s.
    pub acquire_timeout: std::time::Duration,
    /// Creates the inbox time-partitioned when
    /// [`migrate`](crate::store::StoreAdmin::migrate) creates it (PostgreSQL
    /// only; default `None`, one table). An inbox that exists keeps its
    /// layout: every store claims the way its inbox is laid out.
    pub inbox_partitions: Option<InboxPartitions>,
}

impl Default for SqlOptions {
    fn default() -> Self {
        Self {
            table_prefix: "idemq_".to_owned(),
            max_connections: None,
            acquire_timeout: std::time::Duration::from_secs(10),
            inbox_partitions: None,
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

    /// Asks `migrate` to create a time-partitioned inbox (PostgreSQL).
    pub fn partitioned_inbox(mut self, partitions: InboxPartitions) -> Self {
        self.inbox_partitions = Some(partitions);
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

/// Whether a database error says a table does not exist: the idemq tables
/// were not created (PostgreSQL `42P01`, MySQL/MariaDB 1146, SQLite's
/// "no such table", which has no code of its own).
pub fn is_missing_table(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else {
        return false;
    };
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return my.number() == 1146;
    }
    #[cfg(feature = "sqlite")]
    if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
        return db.message().starts_with("no such table");
    }
    db.code().is_some_and(|code| code == "42P01")
}

/// Whether a database error says no partition holds the row written
/// (PostgreSQL `23514` on a partitioned table, MariaDB 1526): a partitioned
/// inbox's partitions ahead were not made in time.
pub(crate) fn is_no_partition(err: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = err else {
        return false;
    };
    #[cfg(feature = "mysql")]
    if let Some(my) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return my.number() == 1526;
    }
    db.code().is_some_and(|code| code == "23514")
}

/// Maps a database error to a [`StoreError`] of its kind (transient,
/// missing tables, other), with the error as its source.
/// A connect error: as [`store_error`], except that an I/O error of kind
/// `InvalidData` is a configuration error. That is how rustls reports a
/// server certificate it refused; on a connection that is up, the same kind
/// stays transient (a broken stream), so only connecting decides this.
pub(crate) fn connect_error(err: sqlx::Error) -> StoreError {
    match &err {
        sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            StoreError::from_source(StoreErrorKind::Config, err)
        }
        _ => store_error(err),
    }
}

pub(crate) fn store_error(err: sqlx::Error) -> StoreError {
    let kind = if is_transient(&err) {
        StoreErrorKind::Transient
    } else if is_missing_table(&err) {
        StoreErrorKind::MissingSchema
    } else if matches!(err, sqlx::Error::Tls(_) | sqlx::Error::Configuration(_)) {
        // A certificate that does not verify, a bad sslmode or CA path:
        // retrying cannot help.
        StoreErrorKind::Config
    } else {
        StoreErrorKind::Other
    };
    StoreError::from_source(kind, err)
}

/// Applies the `migrations` (version, statements) not yet recorded in
/// `{prefix}schema_migrations`, in one transaction under the dialect's
/// migration lock, so that concurrent runs apply each step once. `what`
/// names the schema in the log (`inbox`, `outbox`).
pub(crate) async fn migrate<DB: SqlDatabase>(
    pool: &sqlx::Pool<DB>,
    queries: &Queries,
    migrations: &[(i64, Vec<String>)],
    what: &str,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    if let Some(lock) = &queries.migrate_lock {
        DB::execute(&mut tx, lock, &[]).await?;
    }
    let outcome: Result<(), sqlx::Error> = async {
        DB::execute(&mut tx, &queries.create_migrations_table, &[]).await?;
        let applied = DB::fetch(&mut tx, &queries.applied_versions, &[], &[Column::Int])
            .await?
            .iter()
            .map(|row| row.int(0))
            .collect::<Result<Vec<i64>, _>>()?;
        for (version, steps) in migrations {
            if applied.contains(version) {
                continue;
            }
            for step in steps {
                DB::execute_script(&mut tx, step).await?;
            }
            let binds = [Bind::Int(*version), Bind::Int(crate::store::now_ms())];
            DB::execute(&mut tx, &queries.record_version, &binds).await?;
            tracing::info!(schema = what, version, "applied an idemq schema migration");
        }
        Ok(())
    }
    .await;
    if let Some(unlock) = &queries.migrate_unlock {
        DB::execute(&mut tx, unlock, &[]).await?;
    }
    match outcome {
        Ok(()) => tx.commit().await,
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}
