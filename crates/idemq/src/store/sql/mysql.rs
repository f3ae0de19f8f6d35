//! The MySQL / MariaDB inbox store.

use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

use super::{sql_store, Dialect, SqlOptions};

async fn connect_pool(url: &str, options: &SqlOptions) -> Result<MySqlPool, sqlx::Error> {
    MySqlPoolOptions::new()
        .max_connections(options.max_connections.unwrap_or(10))
        .acquire_timeout(options.acquire_timeout)
        .connect(url)
        .await
}

sql_store!(
    /// The transactional inbox on MySQL 8 or MariaDB 10.5+ (InnoDB). The
    /// handler gets the open `sqlx::Transaction<'static, MySql>` in which the
    /// key was claimed. Keys compare byte-for-byte (`utf8mb4_bin`).
    MySqlStore,
    sqlx::MySql,
    connect_pool,
    Dialect::MySql
);
