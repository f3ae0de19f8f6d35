//! Savepoints for a retry in place ([`RetryLayer`](crate::engine::layers::RetryLayer)):
//! the handler's transaction goes back to where its first call began.

use super::database::SqlDatabase;
use super::store_error;
use crate::engine::layers::Rewind;
use crate::error::StoreError;

const MARK: &str = "SAVEPOINT idemq_retry";
const REWIND: &str = "ROLLBACK TO SAVEPOINT idemq_retry";
const RELEASE: &str = "RELEASE SAVEPOINT idemq_retry";

#[async_trait::async_trait]
impl<DB: SqlDatabase> Rewind for sqlx::Transaction<'static, DB> {
    async fn mark(&mut self) -> Result<(), StoreError> {
        run::<DB>(self, MARK).await
    }

    async fn rewind(&mut self) -> Result<(), StoreError> {
        run::<DB>(self, REWIND).await
    }

    async fn release(&mut self) -> Result<(), StoreError> {
        run::<DB>(self, RELEASE).await
    }
}

async fn run<DB: SqlDatabase>(
    tx: &mut sqlx::Transaction<'static, DB>,
    sql: &str,
) -> Result<(), StoreError> {
    DB::execute(tx, sql, &[])
        .await
        .map(|_| ())
        .map_err(store_error)
}
