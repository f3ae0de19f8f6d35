//! The time-partitioned inbox (PostgreSQL, opt-in): the inbox is
//! range-partitioned by `created_at`, so that retention drops whole
//! partitions instead of deleting rows.
//!
//! PostgreSQL enforces a unique index on a partitioned table only when it
//! includes the partition key, so `(consumer, msg_key)` cannot be unique
//! across partitions. A claim therefore goes through one volatile PL/pgSQL
//! function, `{inbox}_claim`, that
//! 1. takes a transaction-scoped advisory lock on the hash of
//!    (consumer, key): every claim of the key, in any partition, waits here
//!    until the holder's transaction ends;
//! 2. looks for the key in every partition in a statement of its own (a
//!    volatile function takes a new snapshot per statement under READ
//!    COMMITTED, so it sees what the previous holder committed);
//! 3. inserts the row into the partition of `now` only if none was found.
//!
//! The lock plays the unique index's part: the handler's writes still
//! commit or roll back with the claim, and a crashed holder's lock dies
//! with its connection. The function refuses to run under any isolation
//! level but READ COMMITTED, where step 2 would read an older snapshot.
//!
//! The effect journal (`{effects}`) of a store migrated into this layout is
//! partitioned the same way, for the same reason: its primary key
//! `(consumer, msg_key, step)` cannot be unique across partitions, so a
//! journal write goes through `{effects}_put`, which keeps the first result
//! of a step the same way (an advisory lock on the hash of consumer, key and
//! step — in the single-`bigint` key space, apart from the claims' pairs —
//! then a look across partitions, then the insert).
//!
//! Partitions are created ahead (`{inbox}_layout` holds the interval and
//! how many ahead) by `migrate`, by every store before it claims or writes
//! the journal (once per quarter interval, at most every ten minutes) and
//! after a claim or journal write found no partition for its row; retention
//! detaches (`CONCURRENTLY`) and drops the partitions whose whole range is
//! older than the cutoff.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use super::database::{Bind, Column, SqlDatabase};
use super::{store_error, Tables};
use crate::error::StoreError;

/// The layout of a partitioned inbox, chosen when
/// [`StoreAdmin::migrate`](crate::store::StoreAdmin::migrate) creates the
/// inbox (PostgreSQL only). Later stores read it from the database: a store
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

/// The advisory lock key that serialises partition maintenance (and
/// migrations, which use the same key).
const MAINTENANCE_LOCK: &str = "SELECT pg_advisory_xact_lock(7243219087)";
/// Partitions estimated below this many rows are counted before they are
/// dropped; larger ones report PostgreSQL's estimate.
const EXACT_BELOW: i64 = 1_000_000;

/// The session lock that keeps two pruners from detaching the same partition.
const DROP_LOCK: &str = "SELECT pg_advisory_lock(7243219088)";

/// The statements of a partitioned inbox and journal over `tables`
/// (PostgreSQL text).
#[derive(Debug, Clone)]
pub(super) struct PartitionSql {
    inbox: String,
    layout_table: String,
    function: String,
    effects: String,
    put_function: String,
}

impl PartitionSql {
    pub(super) fn new(tables: &Tables) -> Self {
        Self {
            inbox: tables.inbox.clone(),
            layout_table: format!("{}_layout", tables.inbox),
            function: format!("{}_claim", tables.inbox),
            effects: tables.effects.clone(),
            put_function: format!("{}_put", tables.effects),
        }
    }

    /// The partitioned effect journal and its write function (migration
    /// v3's journal, in this layout).
    pub(super) fn journal_schema(&self) -> Vec<String> {
        let Self {
            effects,
            put_function,
            ..
        } = self;
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {effects} (consumer VARCHAR(128) NOT NULL, \
                 msg_key VARCHAR(512) NOT NULL, step VARCHAR(128) NOT NULL, \
                 result_json TEXT NOT NULL, created_at BIGINT NOT NULL, \
                 PRIMARY KEY (consumer, msg_key, step, created_at)) PARTITION BY RANGE (created_at)"
            ),
            // The single-bigint key space: apart from the claims' pairs.
            lock_look_insert(
                put_function,
                "p_consumer TEXT, p_key TEXT, p_step TEXT, p_result TEXT, p_created_at BIGINT",
                "journal writes",
                "hashtextextended(p_consumer || chr(1) || p_key || chr(1) || p_step, 7243219089)",
                &format!(
                    "{effects} WHERE consumer = p_consumer AND msg_key = p_key AND step = p_step"
                ),
                &format!(
                    "{effects} (consumer, msg_key, step, result_json, created_at) \
                     VALUES (p_consumer, p_key, p_step, p_result, p_created_at)"
                ),
            ),
        ]
    }

    /// One journal write that keeps a step's first result. Binds: consumer,
    /// key, step, result_json, created_at.
    pub(super) fn put(&self) -> String {
        format!("SELECT {}($1, $2, $3, $4, $5)", self.put_function)
    }

    /// The journal table.
    pub(super) fn effects(&self) -> &str {
        &self.effects
    }

    /// The schema of the partitioned inbox: the parent table, the layout
    /// row and the claim function (migration v1's inbox, in this layout).
    pub(super) fn schema(&self, interval_ms: i64, ahead: i64) -> Vec<String> {
        let Self {
            inbox,
            layout_table,
            function,
            ..
        } = self;
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {inbox} (consumer VARCHAR(128) NOT NULL, \
                 msg_key VARCHAR(512) NOT NULL, fingerprint VARCHAR(64) NOT NULL, \
                 result_json TEXT NULL, created_at BIGINT NOT NULL, \
                 PRIMARY KEY (consumer, msg_key, created_at)) PARTITION BY RANGE (created_at)"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {layout_table} (interval_ms BIGINT NOT NULL, \
                 ahead BIGINT NOT NULL)"
            ),
            format!(
                "INSERT INTO {layout_table} (interval_ms, ahead) SELECT {interval_ms}, {ahead} \
                 WHERE NOT EXISTS (SELECT 1 FROM {layout_table})"
            ),
            lock_look_insert(
                function,
                "p_consumer TEXT, p_key TEXT, p_fingerprint TEXT, p_created_at BIGINT",
                "inbox claims",
                "hashtext(p_consumer), hashtext(p_key)",
                &format!("{inbox} WHERE consumer = p_consumer AND msg_key = p_key"),
                &format!(
                    "{inbox} (consumer, msg_key, fingerprint, created_at) \
                     VALUES (p_consumer, p_key, p_fingerprint, p_created_at)"
                ),
            ),
        ]
    }

    /// One claim. Binds: consumer, key, fingerprint, created_at; returns one
    /// row (affects 1) if the key was new, none if it exists.
    pub(super) fn claim(&self) -> String {
        format!("SELECT 1 WHERE {}($1, $2, $3, $4)", self.function)
    }

    /// Claims `n` keys, locking them in key order; returns the keys it
    /// inserted. Binds per row: consumer, key, fingerprint, created_at.
    pub(super) fn claim_batch(&self, n: usize) -> String {
        let rows = (0..n)
            .map(|i| {
                let b = i * 4;
                format!("(${}, ${}, ${}, ${})", b + 1, b + 2, b + 3, b + 4)
            })
            .collect::<Vec<_>>()
            .join(", ");
        // OFFSET 0 keeps the sorted rows a subquery the claim filters in order.
        format!(
            "SELECT s.k FROM (SELECT * FROM (VALUES {rows}) AS v(c, k, f, t) ORDER BY c, k OFFSET 0) AS s \
             WHERE {}(s.c, s.k, s.f, s.t)",
            self.function
        )
    }

    /// The inbox table.
    pub(super) fn inbox(&self) -> &str {
        &self.inbox
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
}

/// A volatile PL/pgSQL function `name(params)` returning whether it inserted:
/// it refuses any isolation level but READ COMMITTED (where its look-up
/// would read an old snapshot), takes the transaction-scoped advisory lock
/// `lock`, returns false if `SELECT 1 FROM {found}` finds a row (a statement
/// of its own: a new snapshot), and otherwise runs `INSERT INTO {insert}`.
/// `what` names the callers in the refusal.
fn lock_look_insert(
    name: &str,
    params: &str,
    what: &str,
    lock: &str,
    found: &str,
    insert: &str,
) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {name}({params}) RETURNS BOOLEAN \
         LANGUAGE plpgsql VOLATILE AS $idemq$ \
         BEGIN \
           IF current_setting('transaction_isolation') <> 'read committed' THEN \
             RAISE EXCEPTION 'partitioned idemq {what} run under READ COMMITTED only, not %', \
               current_setting('transaction_isolation') USING ERRCODE = 'feature_not_supported'; \
           END IF; \
           PERFORM pg_advisory_xact_lock({lock}); \
           IF EXISTS (SELECT 1 FROM {found}) THEN \
             RETURN FALSE; \
           END IF; \
           INSERT INTO {insert}; \
           RETURN TRUE; \
         END $idemq$"
    )
}

/// Which layout `table` has: `None` while it does not exist.
pub(super) async fn detect_table<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    table: &str,
) -> Result<Option<Layout>, StoreError> {
    const DETECT: &str = "SELECT (CASE WHEN to_regclass($1) IS NULL THEN 0 \
         WHEN EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass($1)) \
         THEN 2 ELSE 1 END)::bigint";
    let rows = DB::fetch(conn, DETECT, &[Bind::Text(table)], &[Column::Int])
        .await
        .map_err(store_error)?;
    let code = match rows.first() {
        Some(row) => row.int(0).map_err(store_error)?,
        None => 0,
    };
    Ok(match code {
        0 => None,
        2 => Some(Layout::Partitioned),
        _ => Some(Layout::Plain),
    })
}

impl PartitionSql {
    /// The partitions of `parent`: name, range and approximate rows, and
    /// whether a concurrent detach of it was interrupted.
    async fn partitions<DB: SqlDatabase>(
        conn: &mut DB::Connection,
        parent: &str,
    ) -> Result<Vec<Partition>, StoreError> {
        const LIST: &str = "SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid), \
             (CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE -1 END)::bigint, (CASE WHEN i.inhdetachpending THEN 1 ELSE 0 END)::bigint \
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
             WHERE i.inhparent = to_regclass($1)";
        const COLUMNS: [Column; 4] = [Column::Text, Column::Text, Column::Int, Column::Int];
        let rows = DB::fetch(conn, LIST, &[Bind::Text(parent)], &COLUMNS)
            .await
            .map_err(store_error)?;
        let mut partitions = Vec::with_capacity(rows.len());
        for row in rows {
            let name = row.text(0).map_err(store_error)?;
            let bound = row.text(1).map_err(store_error)?;
            let Some((start, end)) = parse_range(&bound) else {
                tracing::warn!(partition = %name, %bound, "a partition without a plain range: left alone");
                continue;
            };
            partitions.push(Partition {
                name,
                start,
                end,
                rows: row.int(2).map_err(store_error)?,
                detach_pending: row.int(3).map_err(store_error)? != 0,
            });
        }
        Ok(partitions)
    }

    /// Creates the partitions from the one holding `now_ms` to `ahead` after
    /// it, those that do not exist yet, in one transaction under the
    /// maintenance lock. Returns how many it created, and the interval.
    pub(super) async fn ensure<DB: SqlDatabase>(
        &self,
        pool: &sqlx::Pool<DB>,
        now_ms: i64,
    ) -> Result<(usize, i64), StoreError> {
        let mut tx = pool.begin().await.map_err(store_error)?;
        DB::execute(&mut tx, MAINTENANCE_LOCK, &[])
            .await
            .map_err(store_error)?;
        let layout_sql = format!(
            "SELECT interval_ms, ahead FROM {} LIMIT 1",
            self.layout_table
        );
        let rows = DB::fetch(&mut tx, &layout_sql, &[], &[Column::Int, Column::Int])
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
        let first = now_ms.div_euclid(interval) * interval;
        let mut created = 0;
        for parent in self.partitioned_parents::<DB>(&mut tx).await? {
            let existing = Self::partitions::<DB>(&mut tx, parent).await?;
            for i in 0..=ahead {
                let start = first + i * interval;
                let end = start + interval;
                if existing.iter().any(|p| p.start < end && start < p.end) {
                    continue;
                }
                let name = format!("{parent}_p{start}");
                // CREATE + ATTACH takes a SHARE UPDATE EXCLUSIVE lock on the
                // parent, which claims do not wait for (CREATE … PARTITION OF
                // would take ACCESS EXCLUSIVE).
                for sql in [
                    format!("CREATE TABLE {name} (LIKE {parent} INCLUDING DEFAULTS)"),
                    format!(
                        "ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ({start}) TO ({end})"
                    ),
                ] {
                    DB::execute(&mut tx, &sql, &[]).await.map_err(store_error)?;
                }
                created += 1;
            }
        }
        tx.commit().await.map_err(store_error)?;
        if created > 0 {
            tracing::info!(inbox = %self.inbox, created, "created partitions ahead");
        }
        Ok((created, interval))
    }

    /// Detaches and drops every partition of `parent` (the inbox or the
    /// journal) whose whole range is before `cutoff_ms`; returns the rows
    /// they held (counted below a million rows; above, PostgreSQL's estimate
    /// as of the partition's last analyze). Runs on a connection of its own,
    /// closed afterwards, under a session lock that keeps two pruners apart.
    pub(super) async fn drop_before<DB: SqlDatabase>(
        pool: &sqlx::Pool<DB>,
        parent: &str,
        cutoff_ms: i64,
    ) -> Result<u64, StoreError> {
        let mut conn = pool.acquire().await.map_err(store_error)?.detach();
        let outcome = Self::drop_on::<DB>(&mut conn, parent, cutoff_ms).await;
        // The session lock ends with the connection.
        let _ = sqlx::Connection::close(conn).await;
        outcome
    }

    async fn drop_on<DB: SqlDatabase>(
        conn: &mut DB::Connection,
        parent: &str,
        cutoff_ms: i64,
    ) -> Result<u64, StoreError> {
        DB::execute(conn, DROP_LOCK, &[])
            .await
            .map_err(store_error)?;
        let mut dropped = 0;
        let mut rows = 0;
        for partition in Self::partitions::<DB>(conn, parent).await? {
            if partition.end > cutoff_ms {
                continue;
            }
            let name = &partition.name;
            // PostgreSQL's estimate for a large partition (a count reads it
            // whole); a count where there is no estimate or it is small (a
            // small partition's estimate may predate its last rows).
            let held = if partition.rows >= EXACT_BELOW {
                partition.rows
            } else {
                let count = format!("SELECT COUNT(*) FROM {name}");
                let found = DB::fetch(conn, &count, &[], &[Column::Int])
                    .await
                    .map_err(store_error)?;
                match found.first() {
                    Some(row) => row.int(0).map_err(store_error)?,
                    None => 0,
                }
            };
            // A detach interrupted earlier is finished, not started again.
            let detach = if partition.detach_pending {
                format!("ALTER TABLE {parent} DETACH PARTITION {name} FINALIZE")
            } else {
                format!("ALTER TABLE {parent} DETACH PARTITION {name} CONCURRENTLY")
            };
            DB::execute(conn, &detach, &[]).await.map_err(store_error)?;
            DB::execute(conn, &format!("DROP TABLE IF EXISTS {name}"), &[])
                .await
                .map_err(store_error)?;
            dropped += 1;
            rows += u64::try_from(held).unwrap_or(0);
        }
        if dropped > 0 {
            tracing::info!(table = %parent, partitions = dropped, rows, "dropped partitions past the retention cutoff");
        }
        Ok(rows)
    }
}

/// One partition of the inbox.
#[derive(Debug)]
struct Partition {
    name: String,
    start: i64,
    end: i64,
    /// PostgreSQL's estimate, -1 if it has none (never analyzed).
    rows: i64,
    detach_pending: bool,
}

/// The `[start, end)` of `FOR VALUES FROM (a) TO (b)` (PostgreSQL quotes
/// the numbers or not, by version); `None` for any other bound.
fn parse_range(bound: &str) -> Option<(i64, i64)> {
    let rest = bound.strip_prefix("FOR VALUES FROM (")?;
    let (from, rest) = rest.split_once(") TO (")?;
    let to = rest.strip_suffix(')')?;
    let number = |s: &str| s.trim().trim_matches('\'').parse::<i64>().ok();
    Some((number(from)?, number(to)?))
}

/// When a store next makes sure the partitions ahead exist.
#[derive(Debug, Default)]
pub(super) struct Upkeep {
    next_ms: AtomicI64,
}

impl Upkeep {
    /// Whether upkeep is due at `now_ms`.
    pub(super) fn due(&self, now_ms: i64) -> bool {
        now_ms >= self.next_ms.load(Ordering::Relaxed)
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

    #[test]
    fn ranges_parse_quoted_or_not() {
        assert_eq!(
            parse_range("FOR VALUES FROM ('1000') TO ('2000')"),
            Some((1000, 2000))
        );
        assert_eq!(
            parse_range("FOR VALUES FROM (1000) TO (2000)"),
            Some((1000, 2000))
        );
        assert_eq!(parse_range("FOR VALUES FROM (MINVALUE) TO (5)"), None);
        assert_eq!(parse_range("DEFAULT"), None);
    }

    #[test]
    fn batch_claims_bind_four_per_row_in_key_order() {
        let sql = PartitionSql::new(&Tables::default()).claim_batch(2);
        assert!(sql.contains("($1, $2, $3, $4), ($5, $6, $7, $8)"), "{sql}");
        assert!(sql.contains("ORDER BY c, k OFFSET 0"), "{sql}");
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
