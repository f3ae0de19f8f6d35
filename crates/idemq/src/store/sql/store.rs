//! [`SqlStore`]: the transactional inbox, written once over every
//! [`SqlDatabase`]; the [`Store`] and [`StoreAdmin`] halves live here, the
//! batch and offset halves in `batch`, the effect journal in `journal`.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::database::{Bind, Column, SqlDatabase, SqlRow};
use super::partitions::{detect_table, InboxPartitions, Layout, PartitionSql, Upkeep};
use super::{
    connect_error, is_no_partition, migrate, queries, store_error, BatchQueries, Dialect, Queries,
    SqlOptions, Tables,
};
use crate::error::{StoreError, StoreErrorKind};
use crate::store::{
    dead_letter_message, now_ms, parse_result, AttemptRecord, Claim, ClaimRequest, ConsumerStats,
    DeadLetter, DeadLetterRecord, InboxRecord, KeyReport, Store, StoreAdmin,
};

/// The columns of an inbox row as [`Queries::fetch`] returns them.
pub(super) const INBOX_COLUMNS: [Column; 3] = [Column::Text, Column::OptText, Column::Int];

/// The columns of a dead letter: `id`, then `DEAD_LETTER_COLUMNS`.
const DEAD_LETTER_ROW: [Column; 16] = [
    Column::Int,     // id
    Column::Text,    // consumer
    Column::OptText, // msg_key
    Column::Text,    // reason
    Column::Text,    // error
    Column::OptText, // message_id
    Column::OptText, // transport_key
    Column::OptText, // headers
    Column::Bytes,   // payload
    Column::Text,    // source
    Column::OptText, // topic
    Column::OptInt,  // source_partition
    Column::OptInt,  // source_offset
    Column::Int,     // delivery_count
    Column::Int,     // attempts
    Column::Int,     // created_at
];

/// The transactional inbox over one sqlx database: `PostgresStore`,
/// `MySqlStore` and `SqliteStore` (features `postgres`, `mysql`, `sqlite`)
/// are this type. The claim row is
/// inserted in the transaction the handler then writes through
/// ([`Store::Tx`] is the open `sqlx::Transaction`).
///
/// ```no_run
/// # async fn demo() -> Result<(), idemq::StoreError> {
/// use idemq::store::{sql::SqlStore, StoreAdmin};
/// let store = SqlStore::<sqlx::Sqlite>::connect("sqlite://ledger.db").await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
pub struct SqlStore<DB: SqlDatabase> {
    pub(super) pool: sqlx::Pool<DB>,
    pub(super) queries: Arc<Queries>,
    pub(super) batch: Arc<BatchQueries>,
    tables: Tables,
    journal: Arc<tokio::sync::OnceCell<sqlx::Pool<DB>>>,
    /// Keys with a failed attempt counted here: commits of the others skip
    /// the `DELETE` of attempts.
    pub(super) failed: Arc<super::failed_keys::FailedKeys>,
    /// The inbox's layout and, when it is partitioned, its upkeep.
    pub(super) parts: Arc<Partitioning>,
}

/// What a store knows of its inbox's layout.
#[derive(Debug)]
pub(super) struct Partitioning {
    /// The layout `migrate` creates an inbox in.
    wanted: Option<InboxPartitions>,
    /// The layout of the inbox, once it was seen to exist.
    layout: std::sync::OnceLock<Layout>,
    /// The layout of the effect journal, once it was seen to exist.
    journal_layout: std::sync::OnceLock<Layout>,
    pub(super) sql: PartitionSql,
    claim: String,
    /// The journal write of a partitioned journal.
    pub(super) put: String,
    upkeep: Upkeep,
}

impl<DB: SqlDatabase> Clone for SqlStore<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            queries: Arc::clone(&self.queries),
            batch: Arc::clone(&self.batch),
            tables: self.tables.clone(),
            journal: Arc::clone(&self.journal),
            failed: Arc::clone(&self.failed),
            parts: Arc::clone(&self.parts),
        }
    }
}

impl<DB: SqlDatabase> std::fmt::Debug for SqlStore<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlStore")
            .field("dialect", &DB::DIALECT)
            .field("tables", &self.tables)
            .finish_non_exhaustive()
    }
}

impl<DB: SqlDatabase> SqlStore<DB> {
    /// Connects with default [`SqlOptions`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, SqlOptions::default()).await
    }

    /// Connects with `options`. Does not migrate: call
    /// [`StoreAdmin::migrate`].
    pub async fn connect_with(url: &str, options: SqlOptions) -> Result<Self, StoreError> {
        let tables = options
            .tables()
            .map_err(|e| StoreError::from_source(StoreErrorKind::Config, e))?;
        let pool = DB::connect(url, &options).await.map_err(connect_error)?;
        Ok(Self::with_tables(pool, tables, options.inbox_partitions))
    }

    /// Wraps an existing pool (share it with the rest of the application).
    pub fn from_pool(pool: sqlx::Pool<DB>, options: SqlOptions) -> Result<Self, StoreError> {
        let tables = options
            .tables()
            .map_err(|e| StoreError::from_source(StoreErrorKind::Config, e))?;
        Ok(Self::with_tables(pool, tables, options.inbox_partitions))
    }

    fn with_tables(pool: sqlx::Pool<DB>, tables: Tables, wanted: Option<InboxPartitions>) -> Self {
        let sql = PartitionSql::new(DB::DIALECT, &tables);
        let parts = Partitioning {
            wanted,
            layout: std::sync::OnceLock::new(),
            journal_layout: std::sync::OnceLock::new(),
            claim: sql.claim(),
            put: sql.put(),
            sql,
            upkeep: Upkeep::default(),
        };
        Self {
            pool,
            queries: Arc::new(Queries::new(DB::DIALECT, &tables)),
            batch: Arc::new(BatchQueries::new(DB::DIALECT, &tables)),
            tables,
            journal: Arc::new(tokio::sync::OnceCell::new()),
            failed: Arc::default(),
            parts: Arc::new(parts),
        }
    }

    /// The inbox's layout, read from the database once the inbox exists
    /// (PostgreSQL, MariaDB; SQLite has one layout).
    pub(super) async fn layout(&self) -> Result<Layout, StoreError> {
        self.table_layout(&self.parts.layout, self.parts.sql.inbox())
            .await
    }

    /// The effect journal's layout, read the same way.
    pub(super) async fn journal_layout(&self) -> Result<Layout, StoreError> {
        self.table_layout(&self.parts.journal_layout, self.parts.sql.effects())
            .await
    }

    /// The layout of `table`, kept in `seen` once the table exists.
    async fn table_layout(
        &self,
        seen: &std::sync::OnceLock<Layout>,
        table: &str,
    ) -> Result<Layout, StoreError> {
        if DB::DIALECT == Dialect::Sqlite {
            return Ok(Layout::Plain);
        }
        if let Some(layout) = seen.get() {
            return Ok(*layout);
        }
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        Ok(match detect_table::<DB>(&mut conn, table).await? {
            Some(layout) => *seen.get_or_init(|| layout),
            // No table yet: the statement will say so.
            None => Layout::Plain,
        })
    }

    /// Before a claim's transaction: on a partitioned inbox, makes sure the
    /// partitions ahead exist when that is due. A failure is logged, not
    /// returned: the partitions made earlier may still hold the claim.
    pub(super) async fn prepare_claims(&self) -> Result<Layout, StoreError> {
        let layout = self.layout().await?;
        if layout == Layout::Partitioned {
            self.keep_partitions_ahead().await;
        }
        Ok(layout)
    }

    /// Before a journal write: on a partitioned journal, the same as
    /// [`prepare_claims`](Self::prepare_claims).
    pub(super) async fn prepare_journal(&self) -> Result<Layout, StoreError> {
        let layout = self.journal_layout().await?;
        if layout == Layout::Partitioned {
            self.keep_partitions_ahead().await;
        }
        Ok(layout)
    }

    /// Creates the partitions ahead (of the inbox and the journal) when that
    /// is due: one claim of the store at a time, the others waiting for it.
    async fn keep_partitions_ahead(&self) {
        if !self.parts.upkeep.due(now_ms()) {
            return;
        }
        let _turn = self.parts.upkeep.turn().await;
        // Another claim may have done it while this one waited.
        let now = now_ms();
        if !self.parts.upkeep.due(now) {
            return;
        }
        match self.parts.sql.ensure(&self.pool, now).await {
            Ok((_, interval_ms)) => self.parts.upkeep.done(now, interval_ms),
            Err(e) => {
                tracing::warn!(inbox = %self.tables.inbox, error = %e, "could not create partitions ahead; trying again in a second");
                self.parts.upkeep.done(now, 4_000);
            }
        }
    }

    /// Begins the transaction of claims on an inbox of `layout`: MariaDB's
    /// partitioned claims run under READ COMMITTED (see
    /// `partitions::mysql`), the rest at the pool's level.
    pub(super) async fn begin_claims(
        &self,
        layout: Layout,
    ) -> Result<sqlx::Transaction<'static, DB>, StoreError> {
        let begun = match (DB::DIALECT, layout) {
            (Dialect::MySql, Layout::Partitioned) => {
                self.pool
                    .begin_with("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
                    .await
            }
            _ => self.pool.begin().await,
        };
        begun.map_err(store_error)
    }

    /// A claim's or journal write's database error as a store error: on a
    /// partitioned table, a row no partition holds is transient, and makes
    /// the next claim or write create the partitions first.
    pub(super) fn partitioned_error(&self, layout: Layout, err: sqlx::Error) -> StoreError {
        if layout == Layout::Partitioned && is_no_partition(&err) {
            self.parts.upkeep.now();
            return StoreError::from_source(StoreErrorKind::Transient, err);
        }
        store_error(err)
    }

    /// The connection pool.
    pub fn pool(&self) -> &sqlx::Pool<DB> {
        &self.pool
    }

    /// The table names in use.
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The effect journal's own pool, opened on first use.
    pub(super) async fn journal_pool(&self) -> Result<&sqlx::Pool<DB>, StoreError> {
        self.journal
            .get_or_try_init(|| DB::open_journal(&self.pool, &self.queries))
            .await
            .map_err(store_error)
    }

    /// Runs a statement on a pooled connection of `pool`.
    pub(super) async fn execute_on(
        pool: &sqlx::Pool<DB>,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> Result<u64, StoreError> {
        let mut conn = pool.acquire().await.map_err(store_error)?;
        DB::execute(&mut conn, sql, binds)
            .await
            .map_err(store_error)
    }

    /// Runs a query on a pooled connection of `pool`.
    pub(super) async fn fetch_on(
        pool: &sqlx::Pool<DB>,
        sql: &str,
        binds: &[Bind<'_>],
        columns: &[Column],
    ) -> Result<Vec<SqlRow>, StoreError> {
        let mut conn = pool.acquire().await.map_err(store_error)?;
        DB::fetch(&mut conn, sql, binds, columns)
            .await
            .map_err(store_error)
    }

    /// The inbox row of (`consumer`, `key`) as `sql` reads it.
    pub(super) async fn fetch_record(
        conn: &mut DB::Connection,
        sql: &str,
        consumer: &str,
        key: &str,
    ) -> Result<Option<InboxRecord>, StoreError> {
        let binds = [Bind::Text(consumer), Bind::Text(key)];
        let rows = DB::fetch(conn, sql, &binds, &INBOX_COLUMNS)
            .await
            .map_err(store_error)?;
        rows.first()
            .map(|row| {
                Ok(InboxRecord {
                    consumer: consumer.to_owned(),
                    key: key.to_owned(),
                    fingerprint: row.text(0)?,
                    result: parse_result(row.opt_text(1)?),
                    first_seen_ms: row.int(2)?,
                })
            })
            .transpose()
            .map_err(store_error)
    }

    /// Claims (`consumer`, `key`) in `tx`: `true` if the row is new.
    pub(super) async fn insert_claim(
        &self,
        tx: &mut DB::Connection,
        req: &ClaimRequest<'_>,
    ) -> Result<bool, StoreError> {
        let binds = [
            Bind::Text(req.consumer),
            Bind::Text(req.key),
            Bind::Text(req.fingerprint),
            Bind::Int(now_ms()),
        ];
        let layout = self.layout().await?;
        let inserted = match layout {
            Layout::Plain => DB::execute(tx, &self.queries.claim, &binds).await,
            // A function's answer is a row, not an affected-row count.
            Layout::Partitioned => DB::fetch(tx, &self.parts.claim, &binds, &[])
                .await
                .map(|rows| rows.len() as u64),
        }
        .map_err(|e| self.partitioned_error(layout, e))?;
        Ok(inserted == 1)
    }

    /// Stores the handler's result on the claimed row.
    pub(super) async fn set_result(
        &self,
        tx: &mut DB::Connection,
        consumer: &str,
        key: &str,
        result: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let text = result.to_string();
        let binds = [Bind::Text(&text), Bind::Text(consumer), Bind::Text(key)];
        DB::execute(tx, &self.queries.set_result, &binds)
            .await
            .map(|_| ())
            .map_err(store_error)
    }

    async fn fetch_attempts(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Option<AttemptRecord>, StoreError> {
        const COLUMNS: [Column; 4] = [Column::Int, Column::Text, Column::Int, Column::Int];
        let binds = [Bind::Text(consumer), Bind::Text(key)];
        let rows =
            Self::fetch_on(&self.pool, &self.queries.attempt_select, &binds, &COLUMNS).await?;
        rows.first()
            .map(|row| {
                Ok(AttemptRecord {
                    attempts: u32::try_from(row.int(0)?).unwrap_or(u32::MAX),
                    last_error: row.text(1)?,
                    first_failed_ms: row.int(2)?,
                    last_failed_ms: row.int(3)?,
                })
            })
            .transpose()
            .map_err(store_error)
    }

    async fn dead_letter_rows(
        &self,
        sql: &str,
        binds: &[Bind<'_>],
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let rows = Self::fetch_on(&self.pool, sql, binds, &DEAD_LETTER_ROW).await?;
        rows.iter()
            .map(dead_letter_from_row)
            .collect::<Result<Vec<_>, _>>()
            .map_err(store_error)
    }

    async fn count_by_consumer(&self, sql: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let rows = Self::fetch_on(&self.pool, sql, &[], &[Column::Text, Column::Int]).await?;
        rows.iter()
            .map(|row| Ok((row.text(0)?, u64::try_from(row.int(1)?).unwrap_or(0))))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(store_error)
    }
}

fn dead_letter_from_row(row: &SqlRow) -> Result<DeadLetterRecord, sqlx::Error> {
    let (message, meta) = dead_letter_message(
        row.opt_text(5)?,
        row.opt_text(6)?,
        row.opt_text(7)?,
        row.bytes(8)?,
        row.text(9)?,
        row.opt_text(10)?,
        row.opt_int(11)?.and_then(|p| i32::try_from(p).ok()),
        row.opt_int(12)?,
        row.int(13)?,
    );
    Ok(DeadLetterRecord {
        id: row.int(0)?,
        consumer: row.text(1)?,
        key: row.opt_text(2)?,
        reason: row.text(3)?,
        error: row.text(4)?,
        message,
        meta,
        attempts: u32::try_from(row.int(14)?).unwrap_or(u32::MAX),
        created_ms: row.int(15)?,
    })
}

#[async_trait::async_trait]
impl<DB: SqlDatabase> Store for SqlStore<DB> {
    type Tx = sqlx::Transaction<'static, DB>;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<Self::Tx>, StoreError> {
        // A claim that finds a key whose row it cannot yet see (possible
        // under REPEATABLE READ) starts over in a new transaction.
        let layout = self.prepare_claims().await?;
        for _ in 0..3 {
            let mut tx = self.begin_claims(layout).await?;
            if self.insert_claim(&mut tx, req).await? {
                return Ok(Claim::New(tx));
            }
            let record =
                Self::fetch_record(&mut tx, &self.queries.fetch, req.consumer, req.key).await?;
            tx.rollback().await.map_err(store_error)?;
            if let Some(record) = record {
                return Ok(Claim::Done(record));
            }
        }
        Err(StoreError::transient(format!(
            "key {:?} exists but its row is not visible yet",
            req.key
        )))
    }

    async fn commit(
        &self,
        mut tx: Self::Tx,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        if let Some(result) = result {
            self.set_result(&mut tx, req.consumer, req.key, result)
                .await?;
        }
        // Only a key this store counted a failure for can have an attempts
        // row to clear (see `failed_keys`): the others skip a round trip.
        let failed_here = self.failed.may_have(req.consumer, req.key);
        if failed_here {
            let binds = [Bind::Text(req.consumer), Bind::Text(req.key)];
            DB::execute(&mut tx, &self.queries.clear_attempts, &binds)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)?;
        if failed_here {
            self.failed.forget(req.consumer, req.key);
        }
        Ok(())
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(store_error)
    }

    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError> {
        let now = now_ms();
        let binds = [
            Bind::Text(consumer),
            Bind::Text(key),
            Bind::Text(error),
            Bind::Int(now),
            Bind::Int(now),
        ];
        self.failed.record(consumer, key);
        Self::execute_on(&self.pool, &self.queries.attempt_upsert, &binds).await?;
        let record = self.fetch_attempts(consumer, key).await?;
        Ok(record.map_or(1, |r| r.attempts))
    }

    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError> {
        let headers = letter.message.headers.to_json().to_string();
        let letter_id = letter.letter_id();
        let binds = [
            Bind::Text(letter.consumer),
            Bind::OptText(letter.key),
            Bind::Text(letter.reason.code()),
            Bind::Text(letter.error),
            Bind::OptText(letter.message.id.as_deref()),
            Bind::OptText(letter.message.key.as_deref()),
            Bind::Text(&headers),
            Bind::Bytes(letter.message.payload.as_slice()),
            Bind::Text(letter.meta.source.as_str()),
            Bind::OptText(letter.meta.topic.as_deref()),
            Bind::OptInt(letter.meta.partition.map(i64::from)),
            Bind::OptInt(letter.meta.offset),
            Bind::Int(i64::from(letter.meta.delivery_count)),
            Bind::Int(i64::from(letter.attempts)),
            Bind::Int(now_ms()),
            Bind::Text(&letter_id),
        ];
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        DB::execute(&mut tx, &self.queries.dead_letter_insert, &binds)
            .await
            .map_err(store_error)?;
        if let Some(key) = letter.key {
            let binds = [Bind::Text(letter.consumer), Bind::Text(key)];
            DB::execute(&mut tx, &self.queries.clear_attempts, &binds)
                .await
                .map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)?;
        if let Some(key) = letter.key {
            self.failed.forget(letter.consumer, key);
        }
        Ok(())
    }

    fn journal(&self) -> Option<&dyn crate::effect::EffectJournal> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl<DB: SqlDatabase> StoreAdmin for SqlStore<DB> {
    async fn ping(&self) -> Result<(), StoreError> {
        Self::execute_on(&self.pool, "SELECT 1", &[])
            .await
            .map(drop)
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let wanted = match self.parts.wanted {
            Some(parts) if DB::DIALECT != Dialect::Sqlite => Some(parts.checked()?),
            Some(_) => {
                return Err(StoreError::config(
                    "a partitioned inbox is PostgreSQL or MariaDB only",
                ))
            }
            None => None,
        };
        // A plain inbox is refused before anything is migrated, so that no
        // partitioned journal is added beside it.
        let existing = match wanted {
            Some(_) => {
                let mut conn = self.pool.acquire().await.map_err(store_error)?;
                detect_table::<DB>(&mut conn, &self.tables.inbox).await?
            }
            None => None,
        };
        let plain_inbox = || {
            StoreError::config(format!(
                "the inbox {} exists as one table: a partitioned inbox is made by migrate \
                 under a new table prefix (or in another database); rows are not moved in place",
                self.tables.inbox
            ))
        };
        if existing == Some(Layout::Plain) {
            return Err(plain_inbox());
        }
        let migrations = match wanted {
            Some(parts) => queries::schema_versions(DB::DIALECT, &self.tables, Some(parts)),
            None => self.queries.migrations.clone(),
        };
        migrate::<DB>(&self.pool, &self.queries, &migrations, "inbox")
            .await
            .map_err(store_error)?;
        match self.layout().await? {
            Layout::Plain if wanted.is_some() => Err(plain_inbox()),
            Layout::Plain => Ok(()),
            Layout::Partitioned => {
                let now = now_ms();
                let (_, interval_ms) = self.parts.sql.ensure(&self.pool, now).await?;
                self.parts.upkeep.done(now, interval_ms);
                Ok(())
            }
        }
    }

    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let binds = [Bind::Int(cutoff_ms), Bind::Int(i64::from(batch))];
        let deleted = match self.layout().await? {
            Layout::Plain => {
                Self::execute_on(&self.pool, &self.queries.prune_inbox, &binds).await?
            }
            Layout::Partitioned => {
                self.parts.sql.seal(&self.pool, now_ms(), cutoff_ms).await?;
                PartitionSql::drop_before(&self.pool, &self.tables.inbox, cutoff_ms).await?
            }
        };
        Self::execute_on(&self.pool, &self.queries.prune_attempts, &binds).await?;
        let effects = match self.journal_layout().await? {
            Layout::Plain => {
                let journal = self.journal_pool().await?;
                Self::execute_on(journal, &self.queries.prune_effects, &binds).await?
            }
            Layout::Partitioned => {
                PartitionSql::drop_before(&self.pool, self.parts.sql.effects(), cutoff_ms).await?
            }
        };
        Ok(deleted.max(effects))
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(store_error)?;
        let inbox =
            Self::fetch_record(&mut conn, &self.queries.inspect_inbox, consumer, key).await?;
        drop(conn);
        let attempts = self.fetch_attempts(consumer, key).await?;
        let binds = [Bind::Text(consumer), Bind::Text(key)];
        let dead_letters = self
            .dead_letter_rows(&self.queries.dead_letters_of_key, &binds)
            .await?;
        Ok(KeyReport {
            inbox,
            in_flight: false,
            attempts,
            dead_letters,
        })
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        const COLUMNS: [Column; 4] = [Column::Text, Column::Int, Column::OptInt, Column::OptInt];
        let mut by_consumer: BTreeMap<String, ConsumerStats> = BTreeMap::new();
        let rows = Self::fetch_on(&self.pool, &self.queries.stats_inbox, &[], &COLUMNS).await?;
        for row in &rows {
            let consumer = row.text(0).map_err(store_error)?;
            let stats = by_consumer.entry(consumer.clone()).or_default();
            stats.consumer = consumer;
            stats.processed = u64::try_from(row.int(1).map_err(store_error)?).unwrap_or(0);
            stats.oldest_ms = row.opt_int(2).map_err(store_error)?;
            stats.newest_ms = row.opt_int(3).map_err(store_error)?;
        }
        let counts: [(&str, fn(&mut ConsumerStats, u64)); 2] = [
            (&self.queries.stats_dead_letters, |s, n| s.dead_letters = n),
            (&self.queries.stats_failing, |s, n| s.failing = n),
        ];
        for (sql, set) in counts {
            for (consumer, n) in self.count_by_consumer(sql).await? {
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
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let limit = i64::from(limit);
        match consumer {
            Some(c) => {
                let binds = [Bind::Text(c), Bind::Int(after_id), Bind::Int(limit)];
                self.dead_letter_rows(&self.queries.dead_letters_of_consumer, &binds)
                    .await
            }
            None => {
                let binds = [Bind::Int(after_id), Bind::Int(limit)];
                self.dead_letter_rows(&self.queries.dead_letters_all, &binds)
                    .await
            }
        }
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let n = Self::execute_on(
            &self.pool,
            &self.queries.dead_letter_delete,
            &[Bind::Int(id)],
        )
        .await?;
        Ok(n > 0)
    }
}
