//! PostgreSQL's partitioned inbox and journal: the claim and journal-write
//! functions are PL/pgSQL; the lock is a transaction-scoped advisory lock
//! (claims on the `int4` pair of hashes of consumer and key, journal writes
//! on a single `bigint` hash: two key spaces); the look-up is a statement
//! of its own in a volatile function, which under READ COMMITTED reads a
//! new snapshot. Partitions are made by `CREATE TABLE` + `ATTACH` (claims do
//! not wait) and retired by `DETACH … CONCURRENTLY` + `DROP`.

use super::{missing_ranges, rows_held, Partition, PartitionSql};
use crate::error::StoreError;
use crate::store::sql::database::{Bind, Column, SqlDatabase};
use crate::store::sql::store_error;

/// The advisory lock key that serialises partition maintenance (and
/// migrations, which use the same key).
const MAINTENANCE_LOCK: &str = "SELECT pg_advisory_xact_lock(7243219087)";

/// The session lock that keeps two pruners from detaching the same partition.
const DROP_LOCK: &str = "SELECT pg_advisory_lock(7243219088)";

/// Which layout a table has: 0 none, 1 one table, 2 partitioned. Binds: the
/// table.
pub(super) const DETECT: &str = "SELECT (CASE WHEN to_regclass($1) IS NULL THEN 0 \
     WHEN EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass($1)) \
     THEN 2 ELSE 1 END)::bigint";

/// The partitioned inbox, its layout row and its claim function.
pub(super) fn schema(sql: &PartitionSql, interval_ms: i64, ahead: i64) -> Vec<String> {
    let PartitionSql {
        inbox, function, ..
    } = sql;
    let mut steps = vec![format!(
        "CREATE TABLE IF NOT EXISTS {inbox} (consumer VARCHAR(128) NOT NULL, \
         msg_key VARCHAR(512) NOT NULL, fingerprint VARCHAR(64) NOT NULL, \
         result_json TEXT NULL, created_at BIGINT NOT NULL, \
         PRIMARY KEY (consumer, msg_key, created_at)) PARTITION BY RANGE (created_at)"
    )];
    steps.extend(sql.layout_row(interval_ms, ahead));
    steps.push(lock_look_insert(
        function,
        "p_consumer TEXT, p_key TEXT, p_fingerprint TEXT, p_created_at BIGINT",
        "inbox claims",
        "hashtext(p_consumer), hashtext(p_key)",
        &format!("{inbox} WHERE consumer = p_consumer AND msg_key = p_key"),
        &format!(
            "{inbox} (consumer, msg_key, fingerprint, created_at) \
             VALUES (p_consumer, p_key, p_fingerprint, p_created_at)"
        ),
    ));
    steps
}

/// The partitioned journal and its write function.
pub(super) fn journal_schema(sql: &PartitionSql) -> Vec<String> {
    let PartitionSql {
        effects,
        put_function,
        ..
    } = sql;
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
            &format!("{effects} WHERE consumer = p_consumer AND msg_key = p_key AND step = p_step"),
            &format!(
                "{effects} (consumer, msg_key, step, result_json, created_at) \
                 VALUES (p_consumer, p_key, p_step, p_result, p_created_at)"
            ),
        ),
    ]
}

/// `n` claims in one statement, locking the keys in key order; returns the
/// indexes of the rows it inserted.
pub(super) fn claim_batch(sql: &PartitionSql, n: usize) -> String {
    let rows = (0..n)
        .map(|i| {
            let b = i * 4;
            format!(
                "({i}::bigint, ${}, ${}, ${}, ${})",
                b + 1,
                b + 2,
                b + 3,
                b + 4
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    // OFFSET 0 keeps the sorted rows a subquery the claim filters in order.
    format!(
        "SELECT s.i FROM (SELECT * FROM (VALUES {rows}) AS v(i, c, k, f, t) ORDER BY c, k OFFSET 0) AS s \
         WHERE {}(s.c, s.k, s.f, s.t)",
        sql.function
    )
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

/// Creates the missing partitions in one transaction under the
/// maintenance lock.
pub(super) async fn ensure<DB: SqlDatabase>(
    sql: &PartitionSql,
    pool: &sqlx::Pool<DB>,
    now_ms: i64,
) -> Result<(usize, i64), StoreError> {
    let mut tx = pool.begin().await.map_err(store_error)?;
    DB::execute(&mut tx, MAINTENANCE_LOCK, &[])
        .await
        .map_err(store_error)?;
    let (interval, ahead) = sql.read_layout::<DB>(&mut tx).await?;
    let mut created = 0;
    for parent in sql.partitioned_parents::<DB>(&mut tx).await? {
        let existing = partitions::<DB>(&mut tx, parent).await?;
        for (start, end) in missing_ranges(&existing, now_ms, interval, ahead) {
            let name = format!("{parent}_p{start}");
            // CREATE + ATTACH takes a SHARE UPDATE EXCLUSIVE lock on the
            // parent, which claims do not wait for (CREATE … PARTITION OF
            // would take ACCESS EXCLUSIVE).
            for statement in [
                format!("CREATE TABLE {name} (LIKE {parent} INCLUDING DEFAULTS)"),
                format!(
                    "ALTER TABLE {parent} ATTACH PARTITION {name} FOR VALUES FROM ({start}) TO ({end})"
                ),
            ] {
                DB::execute(&mut tx, &statement, &[])
                    .await
                    .map_err(store_error)?;
            }
            created += 1;
        }
    }
    tx.commit().await.map_err(store_error)?;
    Ok((created, interval))
}

/// Detaches (`CONCURRENTLY`: claims do not wait) and drops the partitions
/// of `parent` wholly before `cutoff_ms`; returns how many, and the rows
/// they held.
pub(super) async fn drop_before<DB: SqlDatabase>(
    conn: &mut DB::Connection,
    parent: &str,
    cutoff_ms: i64,
) -> Result<(usize, u64), StoreError> {
    DB::execute(conn, DROP_LOCK, &[])
        .await
        .map_err(store_error)?;
    let mut dropped = 0;
    let mut rows = 0;
    for partition in partitions::<DB>(conn, parent).await? {
        if partition.end > cutoff_ms {
            continue;
        }
        let name = &partition.name;
        rows += rows_held::<DB>(conn, &partition, &format!("SELECT COUNT(*) FROM {name}")).await?;
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
    }
    Ok((dropped, rows))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sql::{Dialect, Tables};

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
        let sql = PartitionSql::new(Dialect::Postgres, &Tables::default()).claim_batch(2);
        assert!(
            sql.contains("(0::bigint, $1, $2, $3, $4), (1::bigint, $5, $6, $7, $8)"),
            "{sql}"
        );
        assert!(sql.contains("ORDER BY c, k OFFSET 0"), "{sql}");
    }
}
