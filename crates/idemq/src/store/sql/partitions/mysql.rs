//! MariaDB's partitioned inbox and journal.
//!
//! MariaDB has no transaction-scoped advisory lock (`GET_LOCK` belongs to
//! the session, and would outlive a transaction on a pooled connection), so
//! the lock is the row lock of a **guard row**: a claim writes the row of
//! the bucket of `CRC32(consumer, key)` into `{inbox}_guard` with `INSERT …
//! ON DUPLICATE KEY UPDATE`, which locks it exclusively, whether it existed
//! or is made now (2^20 buckets; journal writes use 2^18 buckets of their
//! own, after them, so the table never holds more than 1 310 720 rows of
//! an `INT`). An InnoDB row lock is held until the transaction ends and
//! dies with a lost connection, as PostgreSQL's advisory lock does. Two
//! keys of one bucket only queue behind each other; they never share a
//! claim.
//!
//! The look-up is a locking read (`LOCK IN SHARE MODE`), which reads the
//! latest committed rows whatever the transaction's snapshot. Claims run
//! under READ COMMITTED (the store begins them so, and the journal's
//! connections are set so): under REPEATABLE READ the same locking read
//! also locks the gaps it scanned, and claims of unrelated keys would then
//! queue and deadlock (they stay correct: a deadlock is a transient error).
//!
//! The functions are SQL stored functions called from `SELECT`; with
//! binary logging on, creating them needs `log_bin_trust_function_creators`
//! or the SUPER privilege. Partitions can only be added above the highest
//! (`ALTER TABLE … ADD PARTITION`) and are retired by `DROP PARTITION`;
//! both take the table's metadata lock, so each waits for the
//! transactions open on the table and holds new claims back while it does:
//! the maintenance session waits at most [`MAINTENANCE_WAIT_S`] and tries
//! again later (partitions are made ahead, so a missed turn costs nothing).

use super::{missing_ranges, rows_held, Partition, PartitionSql};
use crate::error::StoreError;
use crate::store::sql::database::{Bind, Column, SqlDatabase};
use crate::store::sql::store_error;

/// Guard rows of claims: buckets `0 .. CLAIM_BUCKETS`.
const CLAIM_BUCKETS: i64 = 1 << 20;
/// Guard rows of journal writes: buckets `CLAIM_BUCKETS ..` this many more.
const JOURNAL_BUCKETS: i64 = 1 << 18;

/// How long partition maintenance waits for the table's metadata lock.
pub(super) const MAINTENANCE_WAIT_S: u32 = 2;

/// Which layout a table has: 0 none, 1 one table, 2 partitioned. Binds: the
/// table, twice.
pub(super) const DETECT: &str =
    "SELECT CAST(CASE WHEN NOT EXISTS (SELECT 1 FROM information_schema.TABLES \
     WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?) THEN 0 \
     WHEN EXISTS (SELECT 1 FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() \
     AND TABLE_NAME = ? AND PARTITION_NAME IS NOT NULL) THEN 2 ELSE 1 END AS SIGNED)";

/// A byte-compared utf8mb4 column or parameter type of `chars` characters.
fn text(chars: u32) -> String {
    format!("VARCHAR({chars}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
}

/// The partition clause of a new table: one partition, the one holding
/// `now_ms` (MariaDB names a partitioned table's partitions when it makes
/// it).
fn first_partition(interval_ms: i64, now_ms: i64) -> String {
    let start = now_ms.div_euclid(interval_ms) * interval_ms;
    format!(
        " PARTITION BY RANGE (created_at) (PARTITION p{start} VALUES LESS THAN ({}))",
        start + interval_ms
    )
}

/// A stored function `name(params)` returning 1 if it inserted, 0 if not:
/// it locks the guard row of bucket `bucket` (writing it), returns 0 if a
/// locking read of `{found}` counts a row, and otherwise runs
/// `INSERT INTO {insert}`.
fn lock_look_insert(
    guard: &str,
    name: &str,
    params: &str,
    bucket: &str,
    found: &str,
    insert: &str,
) -> [String; 2] {
    [
        format!("DROP FUNCTION IF EXISTS {name}"),
        format!(
            "CREATE FUNCTION {name}({params}) RETURNS INT NOT DETERMINISTIC MODIFIES SQL DATA \
             BEGIN \
               DECLARE v_found INT; \
               INSERT INTO {guard} (bucket) VALUES ({bucket}) ON DUPLICATE KEY UPDATE bucket = bucket; \
               SELECT COUNT(*) INTO v_found FROM {found} LOCK IN SHARE MODE; \
               IF v_found > 0 THEN RETURN 0; END IF; \
               INSERT INTO {insert}; \
               RETURN 1; \
             END"
        ),
    ]
}

/// The guard bucket of a claim of (`consumer`, `key`), two SQL expressions.
fn claim_bucket(consumer: &str, key: &str) -> String {
    format!(
        "CRC32(CONCAT({consumer}, CHAR(1), {key})) & {}",
        CLAIM_BUCKETS - 1
    )
}

/// The partitioned inbox (its first partition), its layout row, the guard
/// table and the claim function.
pub(super) fn schema(sql: &PartitionSql, interval_ms: i64, ahead: i64, now_ms: i64) -> Vec<String> {
    let PartitionSql {
        inbox,
        function,
        guard,
        ..
    } = sql;
    let mut steps = vec![format!(
        "CREATE TABLE IF NOT EXISTS {inbox} (consumer {}, msg_key {}, \
         fingerprint VARCHAR(64) NOT NULL, result_json TEXT NULL, created_at BIGINT NOT NULL, \
         PRIMARY KEY (consumer, msg_key, created_at)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4{}",
        text(128) + " NOT NULL",
        text(512) + " NOT NULL",
        first_partition(interval_ms, now_ms)
    )];
    steps.extend(sql.layout_row(interval_ms, ahead));
    steps.push(format!(
        "CREATE TABLE IF NOT EXISTS {guard} (bucket INT NOT NULL PRIMARY KEY) ENGINE=InnoDB"
    ));
    steps.extend(lock_look_insert(
        guard,
        function,
        &format!(
            "p_consumer {}, p_key {}, p_fingerprint VARCHAR(64), p_created_at BIGINT",
            text(128),
            text(512)
        ),
        &claim_bucket("p_consumer", "p_key"),
        &format!("{inbox} WHERE consumer = p_consumer AND msg_key = p_key"),
        &format!(
            "{inbox} (consumer, msg_key, fingerprint, created_at) \
             VALUES (p_consumer, p_key, p_fingerprint, p_created_at)"
        ),
    ));
    steps
}

/// The partitioned journal (no primary key: `(consumer, msg_key, step,
/// created_at)` would pass InnoDB's 3 072-byte key limit; the write
/// function keeps a step single) and the write function.
pub(super) fn journal_schema(sql: &PartitionSql, interval_ms: i64, now_ms: i64) -> Vec<String> {
    let PartitionSql {
        effects,
        put_function,
        guard,
        ..
    } = sql;
    let mut steps = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {effects} (consumer {}, msg_key {}, step {}, \
             result_json TEXT NOT NULL, created_at BIGINT NOT NULL, \
             INDEX {effects}_step (consumer, msg_key, step)) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4{}",
            text(128) + " NOT NULL",
            text(512) + " NOT NULL",
            text(128) + " NOT NULL",
            first_partition(interval_ms, now_ms)
        ),
    ];
    steps.extend(lock_look_insert(
        guard,
        put_function,
        &format!(
            "p_consumer {}, p_key {}, p_step {}, p_result TEXT, p_created_at BIGINT",
            text(128),
            text(512),
            text(128)
        ),
        &format!(
            "{CLAIM_BUCKETS} + (CRC32(CONCAT(p_consumer, CHAR(1), p_key, CHAR(1), p_step)) & {})",
            JOURNAL_BUCKETS - 1
        ),
        &format!("{effects} WHERE consumer = p_consumer AND msg_key = p_key AND step = p_step"),
        &format!(
            "{effects} (consumer, msg_key, step, result_json, created_at) \
             VALUES (p_consumer, p_key, p_step, p_result, p_created_at)"
        ),
    ));
    steps
}

/// Locks the guard rows of `n` claims in bucket order (an `INSERT …
/// SELECT` writes, and so locks, its rows in the order of its `ORDER BY`).
/// Binds per row: consumer, key.
pub(super) fn lock_batch(sql: &PartitionSql, n: usize) -> String {
    let buckets = vec![format!("SELECT {} AS b", claim_bucket("?", "?")); n].join(" UNION ALL ");
    format!(
        "INSERT INTO {} (bucket) SELECT b FROM ({buckets}) AS s ORDER BY b \
         ON DUPLICATE KEY UPDATE bucket = bucket",
        sql.guard
    )
}

/// `n` claims in one statement, one `SELECT` per row in the order bound;
/// returns the indexes of the rows it inserted. Binds per row: consumer,
/// key, fingerprint, created_at.
pub(super) fn claim_batch(sql: &PartitionSql, n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "SELECT CAST({i} AS SIGNED) AS i FROM DUAL WHERE {}(?, ?, ?, ?) = 1",
                sql.function
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ")
}

/// Takes the session lock `name`, waiting up to `wait_s`.
async fn session_lock<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    name: &str,
    wait_s: i64,
) -> Result<(), StoreError> {
    let rows = DB::fetch(
        conn,
        "SELECT GET_LOCK(?, ?)",
        &[Bind::Text(name), Bind::Int(wait_s)],
        &[Column::OptInt],
    )
    .await
    .map_err(store_error)?;
    match rows.first().map(|row| row.opt_int(0)) {
        Some(Ok(Some(1))) => Ok(()),
        _ => Err(StoreError::transient(format!(
            "the lock {name} is held by another session"
        ))),
    }
}

/// Bounds how long this session's DDL waits for a table's metadata lock.
async fn bound_metadata_wait<DB: SqlDatabase>(conn: &mut DB::Connection) -> Result<(), StoreError> {
    DB::execute_script(
        conn,
        &format!("SET SESSION lock_wait_timeout = {MAINTENANCE_WAIT_S}"),
    )
    .await
    .map_err(store_error)
}

/// The partitions of `parent` in order, each from the previous one's bound
/// to its own.
async fn partitions<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    parent: &str,
) -> Result<Vec<Partition>, StoreError> {
    const LIST: &str = "SELECT PARTITION_NAME, PARTITION_DESCRIPTION, \
         CAST(COALESCE(TABLE_ROWS, -1) AS SIGNED) FROM information_schema.PARTITIONS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND PARTITION_NAME IS NOT NULL \
         ORDER BY PARTITION_ORDINAL_POSITION";
    const COLUMNS: [Column; 3] = [Column::Text, Column::Text, Column::Int];
    let rows = DB::fetch(conn, LIST, &[Bind::Text(parent)], &COLUMNS)
        .await
        .map_err(store_error)?;
    let mut partitions = Vec::with_capacity(rows.len());
    let mut start = i64::MIN;
    for row in rows {
        let name = row.text(0).map_err(store_error)?;
        let bound = row.text(1).map_err(store_error)?;
        let Ok(end) = bound.trim().parse::<i64>() else {
            tracing::warn!(partition = %name, %bound, "a partition without a numeric bound: left alone");
            continue;
        };
        partitions.push(Partition {
            name,
            start,
            end,
            rows: row.int(2).map_err(store_error)?,
            detach_pending: false,
        });
        start = end;
    }
    Ok(partitions)
}

/// Adds the missing partitions above the highest, on a connection of its
/// own under a session lock.
pub(super) async fn ensure<DB: SqlDatabase>(
    sql: &PartitionSql,
    pool: &sqlx::Pool<DB>,
    now_ms: i64,
) -> Result<(usize, i64), StoreError> {
    let mut conn = pool.acquire().await.map_err(store_error)?.detach();
    let outcome = ensure_on::<DB>(sql, &mut conn, now_ms).await;
    // The session lock ends with the connection.
    let _ = sqlx::Connection::close(conn).await;
    outcome
}

async fn ensure_on<DB: SqlDatabase>(
    sql: &PartitionSql,
    conn: &mut DB::Connection,
    now_ms: i64,
) -> Result<(usize, i64), StoreError> {
    bound_metadata_wait::<DB>(conn).await?;
    session_lock::<DB>(conn, &format!("{}_partitions", sql.inbox), 10).await?;
    let (interval, ahead) = sql.read_layout::<DB>(conn).await?;
    let mut created = 0;
    for parent in sql.partitioned_parents::<DB>(conn).await? {
        let existing = partitions::<DB>(conn, parent).await?;
        let missing = missing_ranges(&existing, now_ms, interval, ahead);
        if missing.is_empty() {
            continue;
        }
        // Partitions are contiguous: each added one starts at the bound of
        // the one before it.
        let added = missing
            .iter()
            .map(|(start, end)| format!("PARTITION p{start} VALUES LESS THAN ({end})"))
            .collect::<Vec<_>>()
            .join(", ");
        DB::execute_script(
            conn,
            &format!("ALTER TABLE {parent} ADD PARTITION ({added})"),
        )
        .await
        .map_err(store_error)?;
        created += missing.len();
    }
    Ok((created, interval))
}

/// Drops the partitions of `parent` wholly before `cutoff_ms` in one
/// `DROP PARTITION` (never the last one: a partitioned table keeps one);
/// returns how many, and the rows they held.
pub(super) async fn drop_before<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    parent: &str,
    cutoff_ms: i64,
) -> Result<(usize, u64), StoreError> {
    bound_metadata_wait::<DB>(conn).await?;
    session_lock::<DB>(conn, &format!("{parent}_drop"), 30).await?;
    let mut partitions = partitions::<DB>(conn, parent).await?;
    partitions.pop();
    let mut names = Vec::new();
    let mut rows = 0;
    for partition in partitions.iter().filter(|p| p.end <= cutoff_ms) {
        let name = &partition.name;
        let count = format!("SELECT COUNT(*) FROM {parent} PARTITION ({name})");
        rows += rows_held::<DB>(conn, partition, &count).await?;
        names.push(name.as_str());
    }
    if !names.is_empty() {
        let drop = format!("ALTER TABLE {parent} DROP PARTITION {}", names.join(", "));
        DB::execute_script(conn, &drop).await.map_err(store_error)?;
    }
    Ok((names.len(), rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::{Dialect, Tables};

    #[test]
    fn batches_lock_guards_in_bucket_order_then_claim_in_row_order() {
        let sql = PartitionSql::new(Dialect::MySql, &Tables::default());
        let lock = lock_batch(&sql, 2);
        assert!(
            lock.contains("ORDER BY b ON DUPLICATE KEY UPDATE"),
            "{lock}"
        );
        assert_eq!(lock.matches('?').count(), 4);
        let claim = claim_batch(&sql, 2);
        assert_eq!(claim.matches('?').count(), 8);
        assert!(claim.contains("CAST(1 AS SIGNED)"), "{claim}");
    }

    #[test]
    fn the_first_partition_holds_now() {
        assert_eq!(
            first_partition(1_000, 2_500),
            " PARTITION BY RANGE (created_at) (PARTITION p2000 VALUES LESS THAN (3000))"
        );
    }
}
