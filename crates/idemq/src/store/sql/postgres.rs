//! The PostgreSQL inbox store.

use sqlx::postgres::{PgPool, PgPoolOptions};

use super::{sql_store, Dialect, SqlOptions};

async fn connect_pool(url: &str, options: &SqlOptions) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(options.max_connections.unwrap_or(10))
        .acquire_timeout(options.acquire_timeout)
        .connect(url)
        .await
}

sql_store!(
    /// The transactional inbox on PostgreSQL. The handler gets the open
    /// `sqlx::Transaction<'static, Postgres>` in which the key was claimed.
    PostgresStore,
    sqlx::Postgres,
    connect_pool,
    Dialect::Postgres
);
