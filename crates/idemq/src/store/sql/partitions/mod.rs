//! The time-partitioned inbox (PostgreSQL and MariaDB, opt-in): the inbox
//! is range-partitioned by `created_at`, so that retention drops whole
//! partitions instead of deleting rows.
//!
//! Neither database enforces a unique index on a partitioned table unless
//! it includes the partition key, so `(consumer, msg_key)` cannot be unique
//! across partitions. A claim therefore goes through one volatile function,
//! `{inbox}_claim`, that
//! 1. takes a lock on (a hash of) the consumer and key that is held until
//!    the claiming transaction ends: every claim of the key, in any
//!    partition, waits here until the holder commits or rolls back;
//! 2. looks for the key in every partition, reading what is committed
//!    now (not an older snapshot), so it sees what the previous holder
//!    committed;
//! 3. inserts the row into the partition of `now` only if none was found.
//!
//! The lock plays the unique index's part: the handler's writes still
//! commit or roll back with the claim, and a crashed holder's lock dies
//! with its connection. How each database provides the lock and the fresh
//! read is in [`postgres`] (an advisory transaction lock; a statement of its
//! own under READ COMMITTED) and [`mysql`] (the row lock of a guard row
//! chosen by the hash; a locking read).
//!
//! The effect journal (`{effects}`) of a store migrated into this layout is
//! partitioned the same way, for the same reason: its key
//! `(consumer, msg_key, step)` cannot be unique across partitions, so a
//! journal write goes through `{effects}_put`, which keeps the first result
//! of a step the same way (a lock on the hash of consumer, key and step —
//! in a key space apart from the claims', so that a journal write never
//! waits for its own handler's claim — then a look across partitions, then
//! the insert).
//!
//! Partitions are created ahead (`{inbox}_layout` holds the interval and
//! how many ahead) by `migrate`, by every store before it claims or writes
//! the journal (once per quarter interval, at most every ten minutes) and
//! after a claim or journal write found no partition for its row; retention
//! drops the partitions whose whole range is older than the cutoff.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use super::database::{Bind, Column, SqlDatabase};
use super::{store_error, Dialect, Tables};
use crate::error::StoreError;

pub(super) mod mysql;
pub(super) mod postgres;

/// The layout of a partitioned inbox, chosen when
/// [`StoreAdmin::migrate`](crate::store::StoreAdmin::migrate) creates the
/// inbox (PostgreSQL and MariaDB). Later stores read it from the database: a store
/// claims the way its inbox is laid out, whatever its own options say.
///
/// ```
/// use std::time::Duration;
/// use idemq::store::sql::{InboxPartitions, SqlOptions};
///
/// let options = SqlOptions::default()
///     .partitioned_inbox(InboxPartitions::daily().ahead(3));
/// assert_eq!(options.inbox_partitions.unwrap().interval, Duration::from_secs(86_400));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxPartitions {
    /// The time range one partition holds (default one day). Retention
    /// drops a partition once all of its range is past the cutoff.
    pub interval: Duration,
    /// How many partitions after the current one are kept created (default 2,
    /// at least 1).
    pub ahead: u32,
}

impl InboxPartitions {
    /// One partition per day, two ahead.
    pub fn daily() -> Self {
        Self {
            interval: Duration::from_secs(86_400),
            ahead: 2,
        }
    }

    /// Partitions of `interval` (at least one second), two ahead.
    pub fn every(interval: Duration) -> Self {
        Self { interval, ahead: 2 }
    }

    /// Keeps `n` partitions created ahead of the current one.
    pub fn ahead(mut self, n: u32) -> Self {
        self.ahead = n;
        self
    }

    /// The interval in milliseconds, checked: 1 s to 366 days, and 1 to 1000
    /// partitions ahead.
    pub(super) fn checked(&self) -> Result<(i64, i64), StoreError> {
        let ms = i64::try_from(self.interval.as_millis()).unwrap_or(i64::MAX);
        if !(1_000..=366 * 86_400_000).contains(&ms) {
            return Err(StoreError::config(format!(
                "an inbox partition interval must be from 1 s to 366 days, not {:?}",
                self.interval
            )));
        }
        if !(1..=1_000).contains(&self.ahead) {
            return Err(StoreError::config(format!(
                "inbox partitions ahead must be from 1 to 1000, not {}",
                self.ahead
            )));
        }
        Ok((ms, i64::from(self.ahead)))
    }
}

impl Default for InboxPartitions {
    fn default() -> Self {
        Self::daily()
    }
}

/// How an inbox table is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// One table with a unique `(consumer, msg_key)`.
    Plain,
    /// Range partitions by `created_at`, claims through `{inbox}_claim`.
    Partitioned,
}

/// Partitions estimated below this many rows are counted before they are
/// dropped; larger ones report the database's estimate.
const EXACT_BELOW: i64 = 1_000_000;

/// The statements of a partitioned inbox and journal over `tables`, in the
/// dialect of their database.
#[derive(Debug, Clone)]
pub(super) struct PartitionSql {
    dialect: Dialect,
    inbox: String,
    layout_table: String,
    function: String,
    effects: String,
    put_function: String,
    /// MariaDB's guard rows (see [`mysql`]).
    guard: String,
}

impl PartitionSql {
    pub(super) fn new(dialect: Dialect, tables: &Tables) -> Self {
        let [layout_table, guard, _, _] = tables.partition_tables();
        let [function, put_function, _] = tables.partition_functions();
        Self {
            dialect,
            inbox: tables.inbox.clone(),
            layout_table,
            function,
            effects: tables.effects.clone(),
            put_function,
            guard,
        }
    }

    /// The schema of the partitioned inbox: the parent table (and on
    /// MariaDB its first partition, which must be named when the table is
    /// made), the layout row and the claim function (migration v1's inbox,
    /// in this layout).
    pub(super) fn schema(&self, interval_ms: i64, ahead: i64) -> Vec<String> {
        match self.dialect {
            Dialect::MySql => mysql::schema(self, interval_ms, ahead, crate::store::now_ms()),
            _ => postgres::schema(self, interval_ms, ahead),
        }
    }

    /// The partitioned effect journal and its write function (migration
    /// v3's journal, in this layout).
    pub(super) fn journal_schema(&self, interval_ms: i64) -> Vec<String> {
        match self.dialect {
            Dialect::MySql => mysql::journal_schema(self, interval_ms, crate::store::now_ms()),
            _ => postgres::journal_schema(self),
        }
    }

    /// The table and row that record the layout (made once: a later
    /// migrate keeps the first layout).
    fn layout_row(&self, interval_ms: i64, ahead: i64) -> [String; 2] {
        let layout_table = &self.layout_table;
        [
            format!(
                "CREATE TABLE IF NOT EXISTS {layout_table} (interval_ms BIGINT NOT NULL, \
                 ahead BIGINT NOT NULL)"
            ),
            format!(
                "INSERT INTO {layout_table} (interval_ms, ahead) SELECT {interval_ms}, {ahead} \
                 WHERE NOT EXISTS (SELECT 1 FROM {layout_table})"
            ),
        ]
    }

    /// One claim: a row if the key was new, none if it exists. Binds:
    /// consumer, key, fingerprint, created_at.
    pub(super) fn claim(&self) -> String {
        match self.dialect {
            Dialect::MySql => format!("SELECT 1 FROM DUAL WHERE {}(?, ?, ?, ?) = 1", self.function),
            _ => format!("SELECT 1 WHERE {}($1, $2, $3, $4)", self.function),
        }
    }

    /// One journal write that keeps a step's first result. Binds: consumer,
    /// key, step, result_json, created_at.
    pub(super) fn put(&self) -> String {
        match self.dialect {
            Dialect::MySql => format!("SELECT {}(?, ?, ?, ?, ?)", self.put_function),
            _ => format!("SELECT {}($1, $2, $3, $4, $5)", self.put_function),
        }
    }

    /// What a batch of `n` claims runs before [`claim_batch`](Self::claim_batch)
    /// (binds per row: consumer, key), if anything: MariaDB locks the
    /// batch's guard rows first, in one order, so that batches over
    /// overlapping guards never wait for each other in a cycle.
    pub(super) fn lock_batch(&self, n: usize) -> Option<String> {
        match self.dialect {
            Dialect::MySql => Some(mysql::lock_batch(self, n)),
            _ => None,
        }
    }

    /// Claims `n` keys, in key order; returns the indexes (`BIGINT`, from 0
    /// in the order bound) of the rows it inserted. Binds per row: consumer,
    /// key, fingerprint, created_at.
    pub(super) fn claim_batch(&self, n: usize) -> String {
        match self.dialect {
            Dialect::MySql => mysql::claim_batch(self, n),
            _ => postgres::claim_batch(self, n),
        }
    }

    /// The inbox table.
    pub(super) fn inbox(&self) -> &str {
        &self.inbox
    }

    /// The journal table.
    pub(super) fn effects(&self) -> &str {
        &self.effects
    }

    /// The partitioned tables among the inbox and the journal.
    async fn partitioned_parents<DB: SqlDatabase>(
        &self,
        conn: &mut DB::Connection,
    ) -> Result<Vec<&str>, StoreError> {
        let mut parents = Vec::with_capacity(2);
        for table in [&self.inbox, &self.effects] {
            if detect_table::<DB>(conn, table).await? == Some(Layout::Partitioned) {
                parents.push(table.as_str());
            }
        }
        Ok(parents)
    }

    /// The interval and how many partitions ahead, from the layout row.
    async fn read_layout<DB: SqlDatabase>(
        &self,
        conn: &mut DB::Connection,
    ) -> Result<(i64, i64), StoreError> {
        let sql = format!(
            "SELECT interval_ms, ahead FROM {} LIMIT 1",
            self.layout_table
        );
        let rows = DB::fetch(conn, &sql, &[], &[Column::Int, Column::Int])
            .await
            .map_err(store_error)?;
        let row = rows.first().ok_or_else(|| {
            StoreError::corrupt(format!(
                "{} has no row: the partitioned inbox's layout is unknown",
                self.layout_table
            ))
        })?;
        let interval = row.int(0).map_err(store_error)?.max(1_000);
        let ahead = row.int(1).map_err(store_error)?.clamp(1, 1_000);
        Ok((interval, ahead))
    }

    /// Creates the partitions from the one holding `now_ms` to `ahead` after
    /// it, those that do not exist yet, under the maintenance lock. Returns
    /// how many it created, and the interval.
    pub(super) async fn ensure<DB: SqlDatabase>(
        &self,
        pool: &sqlx::Pool<DB>,
        now_ms: i64,
    ) -> Result<(usize, i64), StoreError> {
        let (created, interval) = match DB::DIALECT {
            Dialect::MySql => mysql::ensure::<DB>(self, pool, now_ms).await?,
            _ => postgres::ensure::<DB>(self, pool, now_ms).await?,
        };
        if created > 0 {
            tracing::info!(inbox = %self.inbox, created, "created partitions ahead");
        }
        Ok((created, interval))
    }

    /// Seals the inbox's partitions that have ended (PostgreSQL; see
    /// `postgres::seal`): claims then probe a sealed partition only when its
    /// key filter holds the key. Partitions ending at or before
    /// `keep_after_ms` are about to be dropped and are not sealed. Returns
    /// how many it sealed; MariaDB seals none (its claims probe every
    /// partition).
    pub(super) async fn seal<DB: SqlDatabase>(
        &self,
        pool: &sqlx::Pool<DB>,
        now_ms: i64,
        keep_after_ms: i64,
    ) -> Result<usize, StoreError> {
        match DB::DIALECT {
            Dialect::Postgres => postgres::seal::<DB>(self, pool, now_ms, keep_after_ms).await,
            _ => Ok(0),
        }
    }

    /// Drops every partition of `parent` (the inbox or the journal) whose
    /// whole range is before `cutoff_ms`; returns the rows they held
    /// (counted below a million rows; above, the database's estimate).
    /// Runs on a connection of its own, closed afterwards, under a session
    /// lock that keeps two pruners apart.
    pub(super) async fn drop_before<DB: SqlDatabase>(
        pool: &sqlx::Pool<DB>,
        parent: &str,
        cutoff_ms: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = pool.acquire().await.map_err(store_error)?.detach();
        let outcome = match DB::DIALECT {
            Dialect::MySql => mysql::drop_before::<DB>(&mut conn, parent, cutoff_ms).await,
            _ => postgres::drop_before::<DB>(&mut conn, parent, cutoff_ms).await,
        };
        // The session lock ends with the connection.
        let _ = sqlx::Connection::close(conn).await;
        let (dropped, rows) = outcome?;
        if dropped > 0 {
            tracing::info!(table = %parent, partitions = dropped, rows, "dropped partitions past the retention cutoff");
        }
        Ok(rows)
    }
}

/// Which layout `table` has: `None` while it does not exist.
pub(super) async fn detect_table<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    table: &str,
) -> Result<Option<Layout>, StoreError> {
    let (sql, binds): (&str, &[Bind<'_>]) = match DB::DIALECT {
        Dialect::MySql => (mysql::DETECT, &[Bind::Text(table), Bind::Text(table)]),
        _ => (postgres::DETECT, &[Bind::Text(table)]),
    };
    let code = int_column::<DB>(conn, sql, binds).await?.first().copied();
    Ok(match code.unwrap_or(0) {
        0 => None,
        2 => Some(Layout::Partitioned),
        _ => Some(Layout::Plain),
    })
}

/// One partition of a partitioned table.
#[derive(Debug)]
struct Partition {
    name: String,
    /// The range is `[start, end)`; MariaDB's first partition starts at
    /// `i64::MIN` (its range is "less than `end`").
    start: i64,
    end: i64,
    /// The database's estimate, -1 if it has none.
    rows: i64,
    /// PostgreSQL: a concurrent detach of it was interrupted.
    detach_pending: bool,
}

/// The ranges `[start, end)` from the partition holding `now_ms` to `ahead`
/// after it that no partition in `existing` overlaps, in order.
fn missing_ranges(
    existing: &[Partition],
    now_ms: i64,
    interval: i64,
    ahead: i64,
) -> Vec<(i64, i64)> {
    let first = now_ms.div_euclid(interval) * interval;
    (0..=ahead)
        .map(|i| (first + i * interval, first + (i + 1) * interval))
        .filter(|&(start, end)| !existing.iter().any(|p| p.start < end && start < p.end))
        .collect()
}

/// How many rows `partition` holds: its estimate when that is large (a
/// count reads it whole), a count by `count_sql` otherwise (a small
/// partition's estimate may predate its last rows).
async fn rows_held<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    partition: &Partition,
    count_sql: &str,
) -> Result<u64, StoreError> {
    if partition.rows >= EXACT_BELOW {
        return Ok(u64::try_from(partition.rows).unwrap_or(0));
    }
    let count = int_column::<DB>(conn, count_sql, &[])
        .await?
        .first()
        .copied();
    Ok(u64::try_from(count.unwrap_or(0)).unwrap_or(0))
}

/// The first column of the rows of `sql`, as integers.
async fn int_column<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    sql: &str,
    binds: &[Bind<'_>],
) -> Result<Vec<i64>, StoreError> {
    DB::fetch(conn, sql, binds, &[Column::Int])
        .await
        .map_err(store_error)?
        .iter()
        .map(|row| row.int(0).map_err(store_error))
        .collect()
}

/// When a store next makes sure the partitions ahead exist, and the turn
/// of the one claim that does it.
#[derive(Debug, Default)]
pub(super) struct Upkeep {
    next_ms: AtomicI64,
    turn: tokio::sync::Mutex<()>,
}

impl Upkeep {
    /// Whether upkeep is due at `now_ms`.
    pub(super) fn due(&self, now_ms: i64) -> bool {
        now_ms >= self.next_ms.load(Ordering::Relaxed)
    }

    /// Waits for the turn to do upkeep: of the claims that find it due at
    /// once, the first does it and the others wait for it to end, then
    /// find it no longer due (instead of each taking a connection and
    /// queueing on the maintenance lock to do it again).
    pub(super) async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.turn.lock().await
    }

    /// Schedules the next upkeep after one done at `now_ms` over partitions
    /// of `interval_ms`: a quarter interval later, at most ten minutes.
    pub(super) fn done(&self, now_ms: i64, interval_ms: i64) {
        let wait = (interval_ms / 4).clamp(250, 600_000);
        self.next_ms.store(now_ms + wait, Ordering::Relaxed);
    }

    /// Makes upkeep due now (a claim found no partition for its row).
    pub(super) fn now(&self) {
        self.next_ms.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(start: i64, end: i64) -> Partition {
        Partition {
            name: format!("p{start}"),
            start,
            end,
            rows: 0,
            detach_pending: false,
        }
    }

    #[test]
    fn missing_ranges_skip_what_exists() {
        // Now is in [2000, 3000); two ahead.
        let existing = [partition(1000, 2000), partition(2000, 3000)];
        assert_eq!(
            missing_ranges(&existing, 2500, 1000, 2),
            vec![(3000, 4000), (4000, 5000)]
        );
        // MariaDB's first partition: everything below its bound.
        let existing = [partition(i64::MIN, 4000)];
        assert_eq!(missing_ranges(&existing, 2500, 1000, 2), vec![(4000, 5000)]);
        assert_eq!(
            missing_ranges(&[], 2500, 1000, 1),
            vec![(2000, 3000), (3000, 4000)]
        );
    }

    #[tokio::test]
    async fn the_claims_that_find_upkeep_due_wait_for_the_one_doing_it() {
        let upkeep = std::sync::Arc::new(Upkeep::default());
        assert!(upkeep.due(1_000));
        let first = upkeep.turn().await;
        let waiter = tokio::spawn({
            let upkeep = upkeep.clone();
            async move {
                let _turn = upkeep.turn().await;
                upkeep.due(1_100)
            }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "waits for the upkeep in progress");
        upkeep.done(1_000, 2_000);
        drop(first);
        assert!(!waiter.await.unwrap(), "then finds it done");
        assert!(upkeep.due(1_500), "a quarter interval later");
        upkeep.done(2_000, 2_000);
        upkeep.now();
        assert!(upkeep.due(2_001), "a claim found no partition: due now");
    }

    #[test]
    fn layouts_are_checked() {
        assert!(InboxPartitions::daily().checked().is_ok());
        assert!(InboxPartitions::every(Duration::from_millis(10))
            .checked()
            .is_err());
        assert!(InboxPartitions::daily().ahead(0).checked().is_err());
    }
}
