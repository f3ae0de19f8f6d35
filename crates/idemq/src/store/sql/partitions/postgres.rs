//! PostgreSQL's partitioned inbox and journal: the claim and journal-write
//! functions are PL/pgSQL; the lock is a transaction-scoped advisory lock
//! (claims on the `int4` pair of hashes of consumer and key, journal writes
//! on a single `bigint` hash: two key spaces); the look-up is a statement
//! of its own in a volatile function, which under READ COMMITTED reads a
//! new snapshot. Partitions are made by `CREATE TABLE` + `ATTACH` (claims do
//! not wait) and retired by `DETACH … CONCURRENTLY` + `DROP`.

use super::{int_column, missing_ranges, rows_held, Partition, PartitionSql};
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

/// The partitioned inbox, its layout row, the sealed partitions' key
/// filters and the claim function.
pub(super) fn schema(sql: &PartitionSql, interval_ms: i64, ahead: i64) -> Vec<String> {
    let PartitionSql { inbox, .. } = sql;
    let Sealing {
        sealed,
        filter,
        refuse,
    } = Sealing::of(inbox);
    let mut steps = vec![format!(
        "CREATE TABLE IF NOT EXISTS {inbox} (consumer VARCHAR(128) NOT NULL, \
         msg_key VARCHAR(512) NOT NULL, fingerprint VARCHAR(64) NOT NULL, \
         result_json TEXT NULL, created_at BIGINT NOT NULL, \
         PRIMARY KEY (consumer, msg_key, created_at)) PARTITION BY RANGE (created_at)"
    )];
    steps.extend(sql.layout_row(interval_ms, ahead));
    steps.extend([
        format!(
            "CREATE TABLE IF NOT EXISTS {sealed} (start_ms BIGINT PRIMARY KEY, \
             end_ms BIGINT NOT NULL, mask BIGINT NOT NULL)"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {filter} (start_ms BIGINT NOT NULL, \
             block BIGINT NOT NULL, bits BIT VARYING NOT NULL, PRIMARY KEY (start_ms, block))"
        ),
        // 23514, a check violation: what a row no partition takes raises,
        // which the store reports as transient.
        format!(
            "CREATE OR REPLACE FUNCTION {refuse}() RETURNS trigger LANGUAGE plpgsql AS $idemq$ \
             BEGIN \
               RAISE EXCEPTION 'partition % of the idemq inbox is sealed: it takes no new rows', \
                 TG_TABLE_NAME USING ERRCODE = 'check_violation'; \
             END $idemq$"
        ),
        claim_function(sql),
    ]);
    steps
}

/// The claim function: the lock on the key's hash pair; then the look-up,
/// which probes the primary key of every partition not sealed, and of a
/// sealed partition only when its filter holds the key's bits; then the
/// insert, into the partition of `p_created_at` raised to the end of the
/// sealed range (a client whose clock lags that far writes to the first
/// partition not sealed).
fn claim_function(sql: &PartitionSql) -> String {
    let PartitionSql {
        inbox, function, ..
    } = sql;
    let Sealing { sealed, filter, .. } = Sealing::of(inbox);
    let key = "consumer = p_consumer AND msg_key = p_key";
    let bits = filter_bits("v_bits", "f.bits");
    // The filter is read block by block through its primary key: a LATERAL
    // subquery with LIMIT keeps the planner from joining the sealed rows to
    // the whole filter table (a hash join read all of it, 17 ms a claim).
    format!(
        "CREATE OR REPLACE FUNCTION {function}(p_consumer TEXT, p_key TEXT, p_fingerprint TEXT, \
         p_created_at BIGINT) RETURNS BOOLEAN LANGUAGE plpgsql VOLATILE AS $idemq$ \
         DECLARE v_from BIGINT; v_to BIGINT; v_block BIGINT; v_bits BIGINT; v_part RECORD; \
         BEGIN \
           IF current_setting('transaction_isolation') <> 'read committed' THEN \
             RAISE EXCEPTION 'partitioned idemq inbox claims run under READ COMMITTED only, not %', \
               current_setting('transaction_isolation') USING ERRCODE = 'feature_not_supported'; \
           END IF; \
           PERFORM pg_advisory_xact_lock(hashtext(p_consumer), hashtext(p_key)); \
           SELECT min(start_ms), max(end_ms) INTO v_from, v_to FROM {sealed}; \
           IF v_from IS NULL THEN \
             IF EXISTS (SELECT 1 FROM {inbox} WHERE {key}) THEN RETURN FALSE; END IF; \
           ELSE \
             IF EXISTS (SELECT 1 FROM {inbox} WHERE {key} AND created_at >= v_to) \
               OR EXISTS (SELECT 1 FROM {inbox} WHERE {key} AND created_at < v_from) THEN \
               RETURN FALSE; \
             END IF; \
             v_block := {block_hash}; \
             v_bits := {bits_hash}; \
             FOR v_part IN SELECT s.start_ms, s.end_ms FROM {sealed} s CROSS JOIN LATERAL \
               (SELECT bits FROM {filter} WHERE start_ms = s.start_ms \
                 AND block = (v_block & s.mask) LIMIT 1) f WHERE {bits} LOOP \
               IF EXISTS (SELECT 1 FROM {inbox} WHERE {key} AND created_at >= v_part.start_ms \
                 AND created_at < v_part.end_ms) THEN \
                 RETURN FALSE; \
               END IF; \
             END LOOP; \
             p_created_at := GREATEST(p_created_at, v_to); \
           END IF; \
           INSERT INTO {inbox} (consumer, msg_key, fingerprint, created_at) \
             VALUES (p_consumer, p_key, p_fingerprint, p_created_at); \
           RETURN TRUE; \
         END $idemq$",
        block_hash = key_hash("p_consumer", "p_key", 1),
        bits_hash = key_hash("p_consumer", "p_key", 2),
    )
}

/// The names of a partitioned inbox's sealing: the sealed partitions'
/// ranges and block masks, their filters, and the trigger function that
/// refuses rows in a sealed partition.
struct Sealing {
    sealed: String,
    filter: String,
    refuse: String,
}

impl Sealing {
    fn of(inbox: &str) -> Self {
        Self {
            sealed: format!("{inbox}_sealed"),
            filter: format!("{inbox}_filter"),
            refuse: format!("{inbox}_refuse"),
        }
    }
}

/// Bits of a filter block: 2048, each key sets [`FILTER_PROBES`] of them.
const BLOCK_BITS: i64 = 2048;

/// How many bits of its block one key sets (11 bits of the second hash each).
const FILTER_PROBES: i64 = 5;

/// Filter bits per key, which sizes a sealed partition's blocks: with five
/// bits set per key, about 1 % of absent keys find all of theirs set.
const BITS_PER_KEY: i64 = 10;

/// One of the two 64-bit hashes of consumer and key (`seed` 1 chooses the
/// block, 2 the bits within it).
fn key_hash(consumer: &str, key: &str, seed: i64) -> String {
    format!("hashtextextended({consumer} || chr(1) || {key}, {seed})")
}

/// The condition that `bits` (a block) has every bit `hash` chooses set.
fn filter_bits(hash: &str, bits: &str) -> String {
    (0..FILTER_PROBES)
        .map(|i| {
            format!(
                "get_bit({bits}, (({hash} >> {}) & {})::int) = 1",
                i * 11,
                BLOCK_BITS - 1
            )
        })
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The block value of one key: its chosen bits set in a `bit(2048)`.
fn filter_mask(hash: &str) -> String {
    (0..FILTER_PROBES)
        .map(|i| {
            format!(
                "(B'1'::bit({BLOCK_BITS}) >> ((({hash} >> {}) & {})::int))",
                i * 11,
                BLOCK_BITS - 1
            )
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The block mask for `rows` keys: a power of two of blocks, at least
/// [`BITS_PER_KEY`] bits per key, less one.
fn block_mask(rows: i64) -> i64 {
    let bits = rows.max(1).saturating_mul(BITS_PER_KEY);
    let blocks = (bits + BLOCK_BITS - 1) / BLOCK_BITS;
    let blocks = u64::try_from(blocks.max(1))
        .unwrap_or(1)
        .next_power_of_two();
    i64::try_from(blocks).unwrap_or(i64::MAX) - 1
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

/// The transaction-scoped advisory lock that keeps two sealers apart (not
/// the maintenance lock: a seal reads a whole partition, and the partitions
/// ahead must not wait for it).
const SEAL_LOCK: &str = "SELECT pg_advisory_xact_lock(7243219090)";

/// Seals the partitions of the inbox that ended `grace` or more before
/// `now_ms` (and are not to be dropped: their end is after `keep_after_ms`),
/// oldest first, each after the last sealed one; returns how many.
///
/// Sealing a partition, in one transaction: a trigger that refuses new
/// rows is created on it, which waits for every transaction that has
/// inserted into it to end; then its keys' filter is built from what is
/// committed, and its range recorded as sealed. Claims then probe it only
/// when the filter holds the key's bits.
pub(super) async fn seal<DB: SqlDatabase>(
    sql: &PartitionSql,
    pool: &sqlx::Pool<DB>,
    now_ms: i64,
    keep_after_ms: i64,
) -> Result<usize, StoreError> {
    let inbox = sql.inbox();
    let Sealing {
        sealed,
        filter,
        refuse,
    } = Sealing::of(inbox);
    let mut done = 0;
    loop {
        let mut tx = pool.begin().await.map_err(store_error)?;
        DB::execute(&mut tx, SEAL_LOCK, &[])
            .await
            .map_err(store_error)?;
        let (interval, _) = sql.read_layout::<DB>(&mut tx).await?;
        let grace = interval.min(600_000);
        let sealed_starts =
            int_column::<DB>(&mut tx, &format!("SELECT start_ms FROM {sealed}"), &[]).await?;
        let mut existing = partitions::<DB>(&mut tx, inbox).await?;
        existing.sort_by_key(|p| p.start);
        // The first partition not sealed: the sealed ones are the oldest.
        let Some(next) = existing
            .into_iter()
            .find(|p| !sealed_starts.contains(&p.start))
        else {
            return Ok(done);
        };
        if next.end.saturating_add(grace) > now_ms
            || next.end <= keep_after_ms
            || next.detach_pending
        {
            return Ok(done);
        }
        let name = &next.name;
        DB::execute(&mut tx, "SET LOCAL lock_timeout = '5s'", &[])
            .await
            .map_err(store_error)?;
        let trigger = format!(
            "CREATE OR REPLACE TRIGGER idemq_sealed BEFORE INSERT ON {name} \
             FOR EACH ROW EXECUTE FUNCTION {refuse}()"
        );
        if let Err(e) = DB::execute(&mut tx, &trigger, &[]).await {
            if is_lock_timeout(&e) {
                tracing::info!(partition = %name, "a transaction writing to the partition is still open: sealing it later");
                return Ok(done);
            }
            return Err(store_error(e));
        }
        let count = format!("SELECT COUNT(*) FROM {name}");
        let counted = int_column::<DB>(&mut tx, &count, &[]).await?;
        let rows = counted.first().copied().unwrap_or(0);
        let mask = block_mask(rows);
        let start = next.start;
        let build = format!(
            "INSERT INTO {filter} (start_ms, block, bits) \
             SELECT {start}, b, bit_or(m) FROM (SELECT {block_hash} & {mask} AS b, {value} AS m \
             FROM (SELECT consumer, msg_key, {bits_hash} AS h FROM {name}) AS k) AS v GROUP BY b",
            block_hash = key_hash("consumer", "msg_key", 1),
            bits_hash = key_hash("consumer", "msg_key", 2),
            value = filter_mask("h"),
        );
        DB::execute(&mut tx, &build, &[])
            .await
            .map_err(store_error)?;
        let record = format!(
            "INSERT INTO {sealed} (start_ms, end_ms, mask) VALUES ({start}, {}, {mask})",
            next.end
        );
        DB::execute(&mut tx, &record, &[])
            .await
            .map_err(store_error)?;
        // Statistics for the claims' plans, which the new rows outdate.
        DB::execute(&mut tx, &format!("ANALYZE {sealed}, {filter}"), &[])
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        tracing::info!(partition = %name, rows, blocks = mask + 1, "sealed: claims probe it through its key filter");
        done += 1;
    }
}

/// One statement (so both or neither) that deletes the sealed rows matching
/// `condition` and their filters' rows.
fn forget_sealed(sealed: &str, filter: &str, condition: &str) -> String {
    format!(
        "WITH gone AS (DELETE FROM {sealed} WHERE {condition} RETURNING start_ms) \
         DELETE FROM {filter} f USING gone WHERE f.start_ms = gone.start_ms"
    )
}

/// Whether `err` is PostgreSQL's lock timeout (55P03).
fn is_lock_timeout(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
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
    // The inbox's sealed ranges go before their partitions: a partition
    // not (or no longer) recorded as sealed is probed by every claim.
    let Sealing { sealed, filter, .. } = Sealing::of(parent);
    let exists = "SELECT (to_regclass($1) IS NOT NULL)::int::bigint";
    let has_sealing = int_column::<DB>(conn, exists, &[Bind::Text(&sealed)]).await? == [1];
    let mut dropped = 0;
    let mut rows = 0;
    for partition in partitions::<DB>(conn, parent).await? {
        if partition.end > cutoff_ms {
            continue;
        }
        let name = &partition.name;
        rows += rows_held::<DB>(conn, &partition, &format!("SELECT COUNT(*) FROM {name}")).await?;
        if has_sealing {
            let forget =
                forget_sealed(&sealed, &filter, &format!("start_ms = {}", partition.start));
            DB::execute(conn, &forget, &[]).await.map_err(store_error)?;
        }
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
    if has_sealing {
        // A seal that raced another process's drop leaves rows for a
        // partition that is gone: they only cost space, and go here.
        let starts: Vec<String> = partitions::<DB>(conn, parent)
            .await?
            .iter()
            .map(|p| p.start.to_string())
            .collect();
        let gone = if starts.is_empty() {
            "TRUE".to_owned()
        } else {
            format!("start_ms NOT IN ({})", starts.join(", "))
        };
        DB::execute(conn, &forget_sealed(&sealed, &filter, &gone), &[])
            .await
            .map_err(store_error)?;
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
