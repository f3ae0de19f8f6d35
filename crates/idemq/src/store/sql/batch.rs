//! The statements behind [`SqlStore`]'s units of work: many claims in one
//! transaction (savepoints isolate a failing member), and the per-partition
//! offset watermark.

use std::collections::{HashMap, HashSet};

use super::database::{Bind, Column, SqlDatabase};
use super::partitions::Layout;
use super::store::INBOX_COLUMNS;
use super::{store_error, SqlStore};
use crate::error::StoreError;
use crate::store::unit::WatermarkStore;
use crate::store::{now_ms, parse_result, ClaimRequest, InboxRecord};

/// One key's answer in a batch claim.
#[derive(Debug)]
pub(super) enum BatchClaim {
    /// The key is new and now claimed in the batch's transaction.
    New,
    /// The key was processed before.
    Done(InboxRecord),
    /// The key exists but its row is not visible to this transaction yet
    /// (another transaction is committing it).
    Busy,
}

/// The answer to an offset claim.
pub(super) enum OffsetClaim<Tx> {
    /// The offset is at or past the watermark: apply it in this transaction.
    New(Tx),
    /// The offset is below the watermark: it was applied before.
    Applied,
}

/// The open transaction a unit works in.
pub(super) type Tx<DB> = sqlx::Transaction<'static, DB>;

/// At most this many results are stored by one statement (3 binds each).
const RESULTS_PER_STATEMENT: usize = 1_000;

const SAVEPOINT: &str = "SAVEPOINT idemq_message";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT idemq_message";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT idemq_message";

impl<DB: SqlDatabase> SqlStore<DB> {
    /// Opens a transaction and claims every `(key, fingerprint)` of
    /// `consumer` in it, in one statement; answers in the order given. The
    /// keys must be distinct.
    pub(super) async fn claim_batch(
        &self,
        consumer: &str,
        claims: &[(&str, &str)],
    ) -> Result<(Tx<DB>, Vec<BatchClaim>), StoreError> {
        let layout = self.prepare_claims().await?;
        let mut tx = self.begin_claims(layout).await?;
        if claims.is_empty() {
            return Ok((tx, Vec::new()));
        }
        // Insert in key order, so that concurrent batches over overlapping
        // keys lock rows in the same order.
        let mut sorted: Vec<&(&str, &str)> = claims.iter().collect();
        sorted.sort_unstable_by_key(|(key, _)| *key);
        let now = now_ms();
        let binds: Vec<Bind<'_>> = sorted
            .iter()
            .flat_map(|(key, fingerprint)| {
                [
                    Bind::Text(consumer),
                    Bind::Text(key),
                    Bind::Text(fingerprint),
                    Bind::Int(now),
                ]
            })
            .collect();
        let inserted: HashSet<&str> = match layout {
            Layout::Plain => {
                let sql = self.batch.claim(sorted.len());
                let rows = DB::fetch(&mut tx, &sql, &binds, &[Column::Text])
                    .await
                    .map_err(store_error)?;
                let keys = rows
                    .iter()
                    .map(|row| row.text(0))
                    .collect::<Result<HashSet<String>, _>>()
                    .map_err(store_error)?;
                claims
                    .iter()
                    .map(|(key, _)| *key)
                    .filter(|key| keys.contains(*key))
                    .collect()
            }
            Layout::Partitioned => {
                self.claim_partitioned(&mut tx, consumer, &sorted, &binds)
                    .await?
            }
        };
        let existing: Vec<&str> = claims
            .iter()
            .map(|(key, _)| *key)
            .filter(|key| !inserted.contains(*key))
            .collect();
        let mut records = HashMap::new();
        if !existing.is_empty() {
            let sql = self.batch.fetch(existing.len());
            let binds: Vec<Bind<'_>> = std::iter::once(Bind::Text(consumer))
                .chain(existing.iter().map(|key| Bind::Text(key)))
                .collect();
            // msg_key, then the inbox columns.
            let columns = [
                Column::Text,
                INBOX_COLUMNS[0],
                INBOX_COLUMNS[1],
                INBOX_COLUMNS[2],
            ];
            for row in DB::fetch(&mut tx, &sql, &binds, &columns)
                .await
                .map_err(store_error)?
            {
                let key = row.text(0).map_err(store_error)?;
                let record = InboxRecord {
                    consumer: consumer.to_owned(),
                    key: key.clone(),
                    fingerprint: row.text(1).map_err(store_error)?,
                    result: parse_result(row.opt_text(2).map_err(store_error)?),
                    first_seen_ms: row.int(3).map_err(store_error)?,
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

    /// Claims the rows `sorted` (bound as `binds`, four per row) on a
    /// partitioned inbox; returns the keys it inserted.
    async fn claim_partitioned<'k>(
        &self,
        tx: &mut Tx<DB>,
        consumer: &str,
        sorted: &[&(&'k str, &str)],
        binds: &[Bind<'_>],
    ) -> Result<HashSet<&'k str>, StoreError> {
        let layout = Layout::Partitioned;
        if let Some(lock) = self.parts.sql.lock_batch(sorted.len()) {
            let lock_binds: Vec<Bind<'_>> = sorted
                .iter()
                .flat_map(|(key, _)| [Bind::Text(consumer), Bind::Text(key)])
                .collect();
            DB::execute(tx, &lock, &lock_binds)
                .await
                .map_err(|e| self.partitioned_error(layout, e))?;
        }
        let sql = self.parts.sql.claim_batch(sorted.len());
        let rows = DB::fetch(tx, &sql, binds, &[Column::Int])
            .await
            .map_err(|e| self.partitioned_error(layout, e))?;
        let mut inserted = HashSet::with_capacity(rows.len());
        for row in rows {
            let index = row.int(0).map_err(store_error)?;
            let row = usize::try_from(index)
                .ok()
                .and_then(|i| sorted.get(i))
                .ok_or_else(|| {
                    StoreError::corrupt(format!(
                        "a batch claim answered row {index} of {}",
                        sorted.len()
                    ))
                })?;
            inserted.insert(row.0);
        }
        Ok(inserted)
    }

    /// Marks the point one member's work can be rolled back to.
    pub(super) async fn savepoint(&self, tx: &mut Tx<DB>) -> Result<(), StoreError> {
        DB::execute(tx, SAVEPOINT, &[])
            .await
            .map(|_| ())
            .map_err(store_error)
    }

    /// Keeps one member's work (releases its savepoint).
    pub(super) async fn release_savepoint(&self, tx: &mut Tx<DB>) -> Result<(), StoreError> {
        DB::execute(tx, RELEASE_SAVEPOINT, &[])
            .await
            .map(|_| ())
            .map_err(store_error)
    }

    /// Undoes one member's work back to its savepoint and gives up its
    /// claim, so that the redelivery can claim the key again.
    pub(super) async fn rollback_message(
        &self,
        tx: &mut Tx<DB>,
        consumer: &str,
        key: &str,
    ) -> Result<(), StoreError> {
        DB::execute(tx, ROLLBACK_TO_SAVEPOINT, &[])
            .await
            .map_err(store_error)?;
        DB::execute(tx, RELEASE_SAVEPOINT, &[])
            .await
            .map_err(store_error)?;
        let binds = [Bind::Text(consumer), Bind::Text(key)];
        DB::execute(tx, &self.batch.unclaim(), &binds)
            .await
            .map(|_| ())
            .map_err(store_error)
    }

    /// Stores the results, clears the processed keys' failed attempts and
    /// commits the batch.
    pub(super) async fn commit_batch(
        &self,
        mut tx: Tx<DB>,
        consumer: &str,
        processed: &[(&str, Option<&serde_json::Value>)],
    ) -> Result<(), StoreError> {
        let results: Vec<(&str, String)> = processed
            .iter()
            .filter_map(|(key, result)| result.map(|r| (*key, r.to_string())))
            .collect();
        let per_statement = if self.batch.merges_results() {
            RESULTS_PER_STATEMENT
        } else {
            1
        };
        if let (Some(pin), true) = (self.batch.pin_result_plan(), results.len() > 1) {
            DB::execute(&mut tx, pin, &[]).await.map_err(store_error)?;
        }
        for chunk in results.chunks(per_statement) {
            if let [(key, text)] = chunk {
                let result_sql = &self.queries.set_result;
                let binds = [Bind::Text(text), Bind::Text(consumer), Bind::Text(key)];
                DB::execute(&mut tx, result_sql, &binds)
                    .await
                    .map_err(store_error)?;
                continue;
            }
            let sql = self.batch.set_results(chunk.len());
            let binds = self.batch.results_binds(consumer, chunk);
            DB::execute(&mut tx, &sql, &binds)
                .await
                .map_err(store_error)?;
        }
        // Only keys this store counted a failure for can have attempts to
        // clear (see `failed_keys`).
        let failed: Vec<&str> = processed
            .iter()
            .map(|(key, _)| *key)
            .filter(|key| self.failed.may_have(consumer, key))
            .collect();
        if !failed.is_empty() {
            let sql = self.batch.clear_attempts(failed.len());
            let binds: Vec<Bind<'_>> = std::iter::once(Bind::Text(consumer))
                .chain(failed.iter().map(|key| Bind::Text(key)))
                .collect();
            DB::execute(&mut tx, &sql, &binds)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)?;
        for key in failed {
            self.failed.forget(consumer, key);
        }
        Ok(())
    }
}

impl<DB: SqlDatabase> SqlStore<DB> {
    /// Reads the partition's offset row in `tx`, locking it with `lock`;
    /// its next offset, if it exists.
    async fn read_offset(
        &self,
        tx: &mut Tx<DB>,
        consumer: &str,
        topic: &str,
        partition: i32,
        lock: bool,
    ) -> Result<Option<i64>, StoreError> {
        let binds = [
            Bind::Text(consumer),
            Bind::Text(topic),
            Bind::Int(i64::from(partition)),
        ];
        let sql = if lock {
            &self.queries.offset_lock
        } else {
            &self.queries.offset_select
        };
        let rows = DB::fetch(tx, sql, &binds, &[Column::Int])
            .await
            .map_err(store_error)?;
        rows.first()
            .map(|row| row.int(0))
            .transpose()
            .map_err(store_error)
    }
}

impl<DB: SqlDatabase> SqlStore<DB> {
    /// Opens a transaction and answers whether `offset` is still to be
    /// applied (below the partition's watermark it is not). With
    /// `lock_partition` the transaction holds the partition's watermark row
    /// until it ends.
    pub(super) async fn claim_offset(
        &self,
        consumer: &str,
        topic: &str,
        partition: i32,
        offset: i64,
        lock_partition: bool,
    ) -> Result<OffsetClaim<Tx<DB>>, StoreError> {
        // The unit may claim a key in this transaction (`claim_key_in`).
        self.prepare_claims().await?;
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        // Read (and lock) the partition's row; only the first claim of a
        // partition ever finds none and creates it (one round trip per
        // message in the steady state, not two).
        let mut next_offset = self
            .read_offset(&mut tx, consumer, topic, partition, lock_partition)
            .await?;
        if next_offset.is_none() {
            // Create the row outside this transaction, then lock it in a new
            // one: on MySQL/MariaDB the locking read of a missing row holds a
            // gap lock, and two first claims (of different partitions)
            // inserting under their gap locks deadlock each other.
            tx.rollback().await.map_err(store_error)?;
            let binds = [
                Bind::Text(consumer),
                Bind::Text(topic),
                Bind::Int(i64::from(partition)),
                Bind::Int(now_ms()),
            ];
            Self::execute_on(&self.pool, &self.queries.offset_ensure, &binds).await?;
            tx = self.pool.begin().await.map_err(store_error)?;
            next_offset = self
                .read_offset(&mut tx, consumer, topic, partition, lock_partition)
                .await?;
        }
        let next_offset = next_offset.ok_or_else(|| {
            StoreError::transient(format!(
                "the offset row of {topic}/{partition} is not visible after creating it"
            ))
        })?;
        if offset < next_offset {
            tx.rollback().await.map_err(store_error)?;
            return Ok(OffsetClaim::Applied);
        }
        Ok(OffsetClaim::New(tx))
    }

    /// Inside a unit's transaction, claims a key: `None` if it is new, else
    /// its record.
    pub(super) async fn claim_key_in(
        &self,
        tx: &mut Tx<DB>,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<InboxRecord>, StoreError> {
        if self.insert_claim(tx, req).await? {
            return Ok(None);
        }
        let record = Self::fetch_record(tx, &self.queries.fetch, req.consumer, req.key).await?;
        record.map(Some).ok_or_else(|| {
            StoreError::transient(format!(
                "key {:?} exists but its row is not visible yet",
                req.key
            ))
        })
    }

    /// Moves the watermark to `next_offset` (never back; `None` leaves it),
    /// stores the key's result if a key was claimed, and commits.
    pub(super) async fn commit_offset(
        &self,
        mut tx: Tx<DB>,
        consumer: &str,
        topic: &str,
        partition: i32,
        next_offset: Option<i64>,
        key: Option<(&ClaimRequest<'_>, Option<&serde_json::Value>)>,
    ) -> Result<(), StoreError> {
        if let Some(next) = next_offset {
            let binds = [
                Bind::Int(next),
                Bind::Int(next),
                Bind::Int(now_ms()),
                Bind::Text(consumer),
                Bind::Text(topic),
                Bind::Int(i64::from(partition)),
            ];
            DB::execute(&mut tx, &self.queries.offset_advance, &binds)
                .await
                .map_err(store_error)?;
        }
        if let Some((req, Some(result))) = key {
            self.set_result(&mut tx, req.consumer, req.key, result)
                .await?;
        }
        tx.commit().await.map_err(store_error)
    }
}

#[async_trait::async_trait]
impl<DB: SqlDatabase> WatermarkStore for SqlStore<DB> {
    async fn watermark(
        &self,
        consumer: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i64>, StoreError> {
        let binds = [
            Bind::Text(consumer),
            Bind::Text(topic),
            Bind::Int(i64::from(partition)),
        ];
        let rows = Self::fetch_on(
            &self.pool,
            &self.queries.offset_select,
            &binds,
            &[Column::Int],
        )
        .await?;
        rows.first()
            .map(|row| row.int(0))
            .transpose()
            .map_err(store_error)
    }
}
