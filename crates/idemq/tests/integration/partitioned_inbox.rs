//! The time-partitioned inbox (`SqlOptions::partitioned_inbox`) on
//! PostgreSQL and MariaDB: a key stays single across partitions, under
//! concurrency and across a partition boundary; claims of other keys do not
//! wait for an open claim; a missing partition is created and the claim
//! retried; retention drops whole partitions while consumers run; a plain
//! inbox is never converted in place. The effect journal is partitioned
//! with it and keeps each step's first result across partitions. One-second
//! partitions, so that the tests cross boundaries in real time. Every test
//! runs on both databases (`mod postgres`, `mod mariadb`).
#![cfg(all(feature = "postgres", feature = "mysql"))]

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use idemq::store::sql::{
    Bind, Column, Dialect, InboxPartitions, SqlDatabase, SqlOptions, SqlStore,
};
use idemq::store::{now_ms, Claim, Store, StoreAdmin};
use idemq::StoreErrorKind;

use crate::support::{claim_request as req, sql_exec, sql_int, sql_rows};

const STEP_MS: i64 = 1_000;

/// A migrated store with a partitioned inbox of `interval_ms` partitions,
/// its own ledger table, and the table prefix.
async fn partitioned_every<DB: SqlDatabase>(interval_ms: u64) -> (SqlStore<DB>, String) {
    let options = SqlOptions::default()
        .max_connections(40)
        .partitioned_inbox(InboxPartitions::every(Duration::from_millis(interval_ms)).ahead(2));
    let (store, prefix) = support::sql_store::<DB>("part", options).await;
    sql_exec(
        &store,
        &format!(
            "CREATE TABLE {prefix}ledger (msg_key VARCHAR(600) NOT NULL, claimed_at BIGINT NOT NULL, \
             created_at BIGINT NOT NULL, answered_at BIGINT NOT NULL)"
        ),
        &[],
    )
    .await;
    (store, prefix)
}

/// [`partitioned_every`] one-second partitions.
async fn partitioned<DB: SqlDatabase>() -> (SqlStore<DB>, String) {
    partitioned_every(1_000).await
}

async fn cleanup<DB: SqlDatabase>(store: &SqlStore<DB>, prefix: &str) {
    support::drop_tables(store.pool(), prefix).await;
}

/// Sleeps until `margin_ms` into the next partition.
async fn into_next_partition(margin_ms: i64) {
    let now = now_ms();
    let next = (now / STEP_MS + 1) * STEP_MS + margin_ms;
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(next - now).unwrap_or(0),
    ))
    .await;
}

/// Claims `key`; if new, writes its ledger row in the claim's transaction
/// and commits: when the claim was asked for (`claimed_at`), the claim's
/// inbox row's `created_at` (what decides its partition, and so when
/// retention drops it), and when the claim answered new (`answered_at`,
/// after its look-up). Returns whether this call applied it.
async fn apply<DB: SqlDatabase>(store: &SqlStore<DB>, prefix: &str, key: &str) -> bool {
    let insert = DB::DIALECT.placeholders(format!(
        "INSERT INTO {prefix}ledger (msg_key, claimed_at, created_at, answered_at) \
         VALUES (?, ?, ?, ?)"
    ));
    let own_row = DB::DIALECT.placeholders(format!(
        "SELECT MAX(created_at) FROM {prefix}inbox WHERE consumer = ? AND msg_key = ?"
    ));
    let request = req(key);
    loop {
        // Before the claim's own `created_at`.
        let claimed_at = now_ms();
        match store.claim(&request).await {
            Ok(Claim::New(mut tx)) => {
                // After the claim's look-up found no row of the key.
                let answered_at = now_ms();
                let binds = [Bind::Text(request.consumer), Bind::Text(key)];
                let created_at = DB::fetch(&mut tx, &own_row, &binds, &[Column::Int])
                    .await
                    .expect("the claim's row")[0]
                    .int(0)
                    .expect("the claim's created_at");
                let binds = [
                    Bind::Text(key),
                    Bind::Int(claimed_at),
                    Bind::Int(created_at),
                    Bind::Int(answered_at),
                ];
                DB::execute(&mut tx, &insert, &binds)
                    .await
                    .expect("ledger row");
                // A little work, so that copies meet the open claim.
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..3))).await;
                store.commit(tx, &req(key), None).await.expect("commit");
                return true;
            }
            Ok(Claim::Done(_)) => return false,
            Ok(Claim::InFlight) => panic!("a SQL claim waits; it never answers in flight"),
            Err(e) if e.kind() == StoreErrorKind::Transient => continue,
            Err(e) => panic!("claim {key}: {e}"),
        }
    }
}

/// How many keys [`claimers`] apply at least: enough work to prove
/// something, also when a loaded machine makes each claim slow.
const MIN_APPLIED: usize = 51;

/// Eight tasks applying `key-0`, `key-1`, … in the same order until
/// `deadline` and, past it, until they applied [`MIN_APPLIED`] keys in all
/// (60 s at most), so that each key is claimed by eight at about the same
/// time; the handle's output is how many keys they applied in all.
async fn claimers<DB: SqlDatabase>(
    store: &SqlStore<DB>,
    prefix: &Arc<String>,
    deadline: i64,
) -> tokio::task::JoinHandle<usize> {
    let total = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|worker| {
            let (store, prefix, total) = (store.clone(), Arc::clone(prefix), Arc::clone(&total));
            tokio::spawn(async move {
                let mut applied = 0;
                let mut i = 0u64;
                let enough = || total.load(std::sync::atomic::Ordering::SeqCst) >= MIN_APPLIED;
                while now_ms() < deadline || (!enough() && now_ms() < deadline + 60_000) {
                    if apply(&store, &prefix, &format!("key-{i}")).await {
                        applied += 1;
                        total.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    i += 1;
                    if worker % 2 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                applied
            })
        })
        .collect();
    tokio::spawn(async move {
        let mut applied = 0;
        for task in tasks {
            applied += task.await.unwrap();
        }
        applied
    })
}

/// How many partitions `table` has (0: not partitioned).
async fn partition_count<DB: SqlDatabase>(store: &SqlStore<DB>, table: &str) -> i64 {
    let sql = match DB::DIALECT {
        Dialect::MySql => {
            "SELECT COUNT(*) FROM information_schema.PARTITIONS WHERE TABLE_SCHEMA = DATABASE() \
             AND TABLE_NAME = ? AND PARTITION_NAME IS NOT NULL"
        }
        _ => "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = to_regclass(?)",
    };
    sql_int(store, sql, &[Bind::Text(table)]).await
}

/// Whether `table` exists.
async fn table_exists<DB: SqlDatabase>(store: &SqlStore<DB>, table: &str) -> bool {
    let sql = match DB::DIALECT {
        Dialect::MySql => {
            "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() \
             AND TABLE_NAME = ?"
        }
        _ => "SELECT COUNT(*) FROM pg_class WHERE oid = to_regclass(?)",
    };
    sql_int(store, sql, &[Bind::Text(table)]).await > 0
}

/// `column` read as text (MariaDB reports byte-compared columns as binary).
fn text<DB: SqlDatabase>(column: &str) -> String {
    match DB::DIALECT {
        Dialect::MySql => format!("CONVERT({column} USING utf8mb4)"),
        _ => column.to_owned(),
    }
}

async fn ledger<DB: SqlDatabase>(store: &SqlStore<DB>, prefix: &str) -> BTreeMap<String, i64> {
    let sql = format!("SELECT msg_key, COUNT(*) FROM {prefix}ledger GROUP BY msg_key");
    sql_rows(store, &sql, &[], &[Column::Text, Column::Int])
        .await
        .iter()
        .map(|row| (row.text(0).unwrap(), row.int(1).unwrap()))
        .collect()
}

/// The ledger's applications per key, in the order they were answered:
/// (`created_at` of the claim's row, `answered_at`).
async fn ledger_claims<DB: SqlDatabase>(
    store: &SqlStore<DB>,
    prefix: &str,
) -> BTreeMap<String, Vec<(i64, i64)>> {
    let sql =
        format!("SELECT msg_key, created_at, answered_at FROM {prefix}ledger ORDER BY answered_at");
    let mut claims: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for row in sql_rows(store, &sql, &[], &[Column::Text, Column::Int, Column::Int]).await {
        claims
            .entry(row.text(0).unwrap())
            .or_default()
            .push((row.int(1).unwrap(), row.int(2).unwrap()));
    }
    claims
}

async fn migrate_creates_a_partitioned_inbox_with_partitions_ahead<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    // The current partition and two ahead.
    assert!(partition_count(&store, &format!("{prefix}inbox")).await >= 3);
    if DB::DIALECT == Dialect::MySql {
        // Guard rows are made by the claims that lock them.
        let guards = format!("SELECT COUNT(*) FROM {prefix}inbox_guard");
        assert_eq!(sql_int(&store, &guards, &[]).await, 0);
        assert!(apply(&store, &prefix, "order-1").await);
        assert_eq!(sql_int(&store, &guards, &[]).await, 1);
    }
    // Migrating again changes nothing and keeps the layout.
    store.migrate().await.unwrap();
    assert!(partition_count(&store, &format!("{prefix}inbox")).await >= 3);
    cleanup(&store, &prefix).await;
}

async fn a_duplicate_in_a_later_partition_is_a_duplicate<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    assert!(apply(&store, &prefix, "order-1").await);
    into_next_partition(50).await;
    assert!(
        !apply(&store, &prefix, "order-1").await,
        "applied again in a later partition"
    );
    into_next_partition(50).await;
    let Claim::Done(record) = store.claim(&req("order-1")).await.unwrap() else {
        panic!("the key is processed");
    };
    assert!(record.first_seen_ms < now_ms() - STEP_MS);
    assert_eq!(ledger(&store, &prefix).await.get("order-1"), Some(&1));
    cleanup(&store, &prefix).await;
}

/// A claim in a later partition waits for the open claim of the key in an
/// earlier one, then answers by its outcome: committed → duplicate, rolled
/// back → new.
async fn a_claim_waits_for_an_open_claim_in_an_earlier_partition<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    for commit in [true, false] {
        let key = format!("order-{commit}");
        let Claim::New(tx) = store.claim(&req(&key)).await.unwrap() else {
            panic!("new key");
        };
        into_next_partition(50).await;
        let other = store.clone();
        let second_key = key.clone();
        let second = tokio::spawn(async move {
            match other.claim(&req(&second_key)).await.unwrap() {
                Claim::New(tx) => {
                    other.rollback(tx).await.unwrap();
                    "new"
                }
                Claim::Done(_) => "done",
                Claim::InFlight => "in flight",
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !second.is_finished(),
            "the second claim waits for the first"
        );
        if commit {
            store
                .commit(tx, &req(&key), Some(&serde_json::json!({"ok": true})))
                .await
                .unwrap();
            assert_eq!(second.await.unwrap(), "done");
        } else {
            store.rollback(tx).await.unwrap();
            assert_eq!(second.await.unwrap(), "new");
        }
    }
    cleanup(&store, &prefix).await;
}

/// While a claim is open, claims of other keys in the same partition go
/// through at once: each waits only on its own key (on MariaDB, a claim run
/// under REPEATABLE READ would lock the index gaps its look-up read and
/// make them queue).
async fn claims_of_other_keys_do_not_wait_for_an_open_claim<DB: SqlDatabase>() {
    let (store, prefix) = partitioned_every::<DB>(60_000).await;
    let Claim::New(open) = store.claim(&req("order-m")).await.unwrap() else {
        panic!("new key");
    };
    for key in ["order-a", "order-z", "order-n"] {
        let claimed = tokio::time::timeout(Duration::from_secs(2), store.claim(&req(key)))
            .await
            .unwrap_or_else(|_| panic!("the claim of {key} waited for the open claim of order-m"));
        let Claim::New(tx) = claimed.unwrap() else {
            panic!("new key {key}");
        };
        store.commit(tx, &req(key), None).await.unwrap();
    }
    store.rollback(open).await.unwrap();
    cleanup(&store, &prefix).await;
}

/// Copies of the same keys claimed at once by many tasks for three seconds,
/// across three partition boundaries: each key applied exactly once.
async fn concurrent_copies_across_boundaries_apply_once<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    let prefix = Arc::new(prefix);
    let deadline = now_ms() + 3 * STEP_MS;
    let applied = claimers(&store, &prefix, deadline).await.await.unwrap();
    let ledger = ledger(&store, &prefix).await;
    assert!(applied >= MIN_APPLIED, "only {applied} keys applied");
    assert_eq!(ledger.len(), applied, "one ledger row per applied key");
    let doubled: Vec<_> = ledger.iter().filter(|(_, n)| **n != 1).collect();
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    // The rows are spread over several (one-second) partitions.
    let spread = sql_int(
        &store,
        &format!("SELECT COUNT(DISTINCT FLOOR(created_at / {STEP_MS})) FROM {prefix}inbox"),
        &[],
    )
    .await;
    assert!(spread >= 3, "rows in {spread} partitions");
    cleanup(&store, &prefix).await;
}

/// With no partition for now (maintenance lapsed), a claim fails transient
/// and the next one creates the partitions and succeeds. Minute partitions:
/// the store's own upkeep is not due during the test.
async fn a_missing_partition_is_created_and_the_claim_retried<DB: SqlDatabase>() {
    let (store, prefix) = partitioned_every::<DB>(60_000).await;
    let inbox = format!("{prefix}inbox");
    match DB::DIALECT {
        // A partitioned table keeps one partition: the (empty) inbox gets
        // one that ends a minute ago.
        Dialect::MySql => {
            let sql = format!(
                "ALTER TABLE {inbox} PARTITION BY RANGE (created_at) \
                 (PARTITION p0 VALUES LESS THAN ({}))",
                now_ms() - 60_000
            );
            let mut conn = store.pool().acquire().await.unwrap();
            DB::execute_script(&mut conn, &sql).await.expect(&sql);
        }
        _ => {
            let names = sql_rows(
                &store,
                "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = to_regclass(?)",
                &[Bind::Text(&inbox)],
                &[Column::Text],
            )
            .await;
            for name in names {
                sql_exec(
                    &store,
                    &format!("DROP TABLE {}", name.text(0).unwrap()),
                    &[],
                )
                .await;
            }
        }
    }
    let err = store.claim(&req("order-1")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Transient, "{err}");
    assert!(err.to_string().contains("no partition"), "{err}");
    assert!(apply(&store, &prefix, "order-1").await);
    assert!(partition_count(&store, &inbox).await >= 3);
    cleanup(&store, &prefix).await;
}

/// Retention drops whole partitions past the cutoff while eight tasks keep
/// claiming copies; every key is applied once, the old partitions are gone
/// and the rows of the window stay.
async fn retention_drops_partitions_while_consumers_run<DB: SqlDatabase>() {
    // Keep 1.5 s: copies arrive within milliseconds of each other.
    const KEEP_MS: i64 = 3 * STEP_MS / 2;
    let (store, prefix) = partitioned::<DB>().await;
    let prefix = Arc::new(prefix);
    let deadline = now_ms() + 4 * STEP_MS;
    let claimers = claimers(&store, &prefix, deadline).await;
    let pruner = {
        let store = store.clone();
        tokio::spawn(async move {
            // Every cutoff used; each prune began at its cutoff + KEEP_MS.
            let (mut pruned, mut cutoffs) = (0, Vec::new());
            while now_ms() < deadline {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let cutoff = now_ms() - KEEP_MS;
                cutoffs.push(cutoff);
                pruned += idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
                    .await
                    .expect("prune");
            }
            (pruned, cutoffs)
        })
    };
    let applied = claimers.await.unwrap();
    let (mut pruned, cutoffs) = pruner.await.unwrap();
    // One more, after the claimers: nothing older than its cutoff's
    // partition may stay.
    let cutoff = now_ms() - KEEP_MS;
    pruned += idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
        .await
        .expect("prune");
    // The inbox never holds a key twice.
    let doubled = sql_int(
        &store,
        &format!(
            "SELECT COUNT(*) FROM (SELECT msg_key FROM {prefix}inbox \
             GROUP BY consumer, msg_key HAVING COUNT(*) > 1) AS d"
        ),
        &[],
    )
    .await;
    assert_eq!(doubled, 0, "a key has two rows in the inbox");
    // A key is applied again only after retention dropped its earlier row:
    // a prune whose cutoff is past the end of that row's partition (by the
    // row's own created_at, the time retention goes by) began before the
    // later claim answered. Not the claimers' own clock readings: a claim
    // may lag its caller's reading by any amount on a loaded machine (the
    // pool, partition upkeep, the key's lock), and created_at is taken
    // after that reading.
    let claims = ledger_claims(&store, &prefix).await;
    assert_eq!(claims.values().map(Vec::len).sum::<usize>(), applied);
    let dropped_before = |(created_at, _): (i64, i64), (_, answered_at): (i64, i64)| {
        let partition_end = (created_at.div_euclid(STEP_MS) + 1) * STEP_MS;
        cutoffs
            .iter()
            .any(|&cutoff| cutoff >= partition_end && cutoff + KEEP_MS <= answered_at)
    };
    let early: Vec<_> = claims
        .iter()
        .filter(|(_, c)| c.windows(2).any(|w| !dropped_before(w[0], w[1])))
        .collect();
    assert!(
        early.is_empty(),
        "applied again with no prune past its earlier row first \
         ((created_at, answered_at) per key; cutoffs {cutoffs:?}): {early:?}"
    );
    let kept = sql_int(&store, &format!("SELECT COUNT(*) FROM {prefix}inbox"), &[]).await;
    assert!(pruned > 0, "nothing pruned");
    assert_eq!(
        u64::try_from(kept).unwrap() + pruned,
        u64::try_from(applied).unwrap(),
        "every applied row is kept or was in a dropped partition"
    );
    let oldest = sql_int(
        &store,
        &format!("SELECT MIN(created_at) FROM {prefix}inbox"),
        &[],
    )
    .await;
    assert!(
        oldest >= cutoff / STEP_MS * STEP_MS,
        "a partition wholly before the cutoff stayed"
    );
    cleanup(&store, &prefix).await;
}

/// A store of `options` on `store`'s pool and tables.
fn with_options<DB: SqlDatabase>(
    store: &SqlStore<DB>,
    prefix: &str,
    options: SqlOptions,
) -> SqlStore<DB> {
    SqlStore::<DB>::from_pool(store.pool().clone(), options.table_prefix(prefix)).unwrap()
}

/// An inbox created as one table stays one table: asking for partitions
/// later is a configuration error, not a silent conversion.
async fn a_plain_inbox_is_not_converted<DB: SqlDatabase>() {
    let (plain, prefix) = support::sql_store::<DB>("plain", SqlOptions::default()).await;
    let wants_parts = with_options(
        &plain,
        &prefix,
        SqlOptions::default().partitioned_inbox(InboxPartitions::daily()),
    );
    let err = wants_parts.migrate().await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err}");
    assert!(err.to_string().contains("one table"), "{err}");
    // It still claims, the plain way.
    match wants_parts.claim(&req("k")).await.unwrap() {
        Claim::New(tx) => wants_parts.commit(tx, &req("k"), None).await.unwrap(),
        _ => panic!("a new key"),
    }
    assert_eq!(partition_count(&plain, &format!("{prefix}inbox")).await, 0);
    cleanup(&plain, &prefix).await;
}

/// A plain inbox migrated before the journal existed (schema version 2)
/// is refused before anything is migrated: no journal, partitioned or not,
/// is added beside it.
async fn a_plain_inbox_gets_no_partitioned_journal<DB: SqlDatabase>() {
    let (plain, prefix) = support::sql_store::<DB>("plainv2", SqlOptions::default()).await;
    for sql in [
        format!("DROP TABLE {prefix}effects"),
        format!("ALTER TABLE {prefix}dead_letters DROP COLUMN letter_id"),
        format!("DELETE FROM {prefix}schema_migrations WHERE version >= 3"),
    ] {
        sql_exec(&plain, &sql, &[]).await;
    }
    let wants_parts = with_options(
        &plain,
        &prefix,
        SqlOptions::default().partitioned_inbox(InboxPartitions::daily()),
    );
    let err = wants_parts.migrate().await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err}");
    assert!(
        !table_exists(&plain, &format!("{prefix}effects")).await,
        "a journal was created beside the plain inbox"
    );
    cleanup(&plain, &prefix).await;
}

/// Journal rows of `key`'s `step`.
async fn journal_rows<DB: SqlDatabase>(
    store: &SqlStore<DB>,
    prefix: &str,
    key: &str,
    step: &str,
) -> i64 {
    sql_int(
        store,
        &format!("SELECT COUNT(*) FROM {prefix}effects WHERE msg_key = ? AND step = ?"),
        &[Bind::Text(key), Bind::Text(step)],
    )
    .await
}

/// A step journaled in one partition keeps its first result when it is
/// written again in a later one: one row, the first result, from `put`,
/// `get` and `steps`.
async fn the_journal_keeps_a_steps_first_result_in_a_later_partition<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    assert!(partition_count(&store, &format!("{prefix}effects")).await >= 3);
    let journal = store.journal().expect("a journal");
    let first = serde_json::json!({ "charge": "ch_1" });
    assert_eq!(
        journal
            .put("payments", "order-1", "charge", &first)
            .await
            .unwrap(),
        first
    );
    into_next_partition(50).await;
    let second = serde_json::json!({ "charge": "ch_2" });
    assert_eq!(
        journal
            .put("payments", "order-1", "charge", &second)
            .await
            .unwrap(),
        first,
        "a later partition took a second result"
    );
    assert_eq!(
        journal.get("payments", "order-1", "charge").await.unwrap(),
        Some(first.clone())
    );
    assert_eq!(
        journal.steps("payments", "order-1").await.unwrap(),
        vec![("charge".to_owned(), first)]
    );
    assert_eq!(journal_rows(&store, &prefix, "order-1", "charge").await, 1);
    cleanup(&store, &prefix).await;
}

/// Eight writers journal the same steps with results of their own, across
/// partition boundaries: every step has one row, and every writer was
/// answered with that row's result.
async fn concurrent_journal_writes_keep_one_result_per_step<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    let deadline = now_ms() + 2 * STEP_MS + 300;
    // Steps written by the furthest writer: past the deadline the writers go
    // on until more than 20 (60 s at most), also on a loaded machine.
    let furthest = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for w in 0..8 {
        let (store, furthest) = (store.clone(), Arc::clone(&furthest));
        writers.push(tokio::spawn(async move {
            let journal = store.journal().expect("a journal");
            let mut answers = Vec::new();
            let mut n = 0;
            let enough = || furthest.load(std::sync::atomic::Ordering::SeqCst) > 20;
            while now_ms() < deadline || (!enough() && now_ms() < deadline + 60_000) {
                let key = format!("order-{}", n / 4);
                let step = format!("step-{}", n % 4);
                let mine = serde_json::json!({ "writer": w });
                let stored = loop {
                    match journal.put("payments", &key, &step, &mine).await {
                        Ok(stored) => break stored,
                        Err(e) if e.kind() == StoreErrorKind::Transient => continue,
                        Err(e) => panic!("{e}"),
                    }
                };
                answers.push((key, step, stored));
                n += 1;
                furthest.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..4))).await;
            }
            answers
        }));
    }
    let mut answered: BTreeMap<(String, String), serde_json::Value> = BTreeMap::new();
    for writer in writers {
        for (key, step, stored) in writer.await.unwrap() {
            let first = answered
                .entry((key.clone(), step.clone()))
                .or_insert(stored.clone());
            assert_eq!(
                *first, stored,
                "{key}/{step}: two writers got different results"
            );
        }
    }
    assert!(
        answered.len() > 20,
        "too few steps written: {}",
        answered.len()
    );
    let rows = sql_rows(
        &store,
        &format!(
            "SELECT {}, {}, COUNT(*), MIN(result_json) FROM {prefix}effects GROUP BY msg_key, step",
            text::<DB>("msg_key"),
            text::<DB>("step")
        ),
        &[],
        &[Column::Text, Column::Text, Column::Int, Column::Text],
    )
    .await;
    assert_eq!(rows.len(), answered.len());
    for row in rows {
        let (key, step, count) = (
            row.text(0).unwrap(),
            row.text(1).unwrap(),
            row.int(2).unwrap(),
        );
        assert_eq!(count, 1, "{key}/{step} journaled {count} times");
        let stored: serde_json::Value = serde_json::from_str(&row.text(3).unwrap()).unwrap();
        assert_eq!(
            answered.get(&(key.clone(), step.clone())),
            Some(&stored),
            "{key}/{step}"
        );
    }
    cleanup(&store, &prefix).await;
}

/// Retention drops the journal's partitions past the cutoff with the
/// inbox's; the steps of the window stay.
async fn retention_drops_journal_partitions<DB: SqlDatabase>() {
    let (store, prefix) = partitioned::<DB>().await;
    let journal = store.journal().expect("a journal");
    let old = serde_json::json!("old");
    journal
        .put("payments", "order-old", "charge", &old)
        .await
        .unwrap();
    into_next_partition(50).await;
    into_next_partition(50).await;
    let new = serde_json::json!("new");
    journal
        .put("payments", "order-new", "charge", &new)
        .await
        .unwrap();
    let effects = format!("{prefix}effects");
    let before = partition_count(&store, &effects).await;
    // Past the old step's partition, not the new one's.
    let cutoff = now_ms() / STEP_MS * STEP_MS - STEP_MS;
    let pruned = idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
        .await
        .expect("prune");
    assert!(pruned >= 1, "nothing pruned");
    assert!(
        partition_count(&store, &effects).await < before,
        "no journal partition dropped"
    );
    assert_eq!(
        journal
            .get("payments", "order-old", "charge")
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        journal
            .get("payments", "order-new", "charge")
            .await
            .unwrap(),
        Some(new)
    );
    cleanup(&store, &prefix).await;
}

/// Each test above, on the database `$db`.
macro_rules! partitioned_suite {
    ($db:ty) => {
        partitioned_suite!($db;
            migrate_creates_a_partitioned_inbox_with_partitions_ahead,
            a_duplicate_in_a_later_partition_is_a_duplicate,
            a_missing_partition_is_created_and_the_claim_retried,
            a_plain_inbox_is_not_converted,
            a_plain_inbox_gets_no_partitioned_journal,
            the_journal_keeps_a_steps_first_result_in_a_later_partition,
            retention_drops_journal_partitions;
            multi_thread:
            a_claim_waits_for_an_open_claim_in_an_earlier_partition,
            claims_of_other_keys_do_not_wait_for_an_open_claim,
            concurrent_copies_across_boundaries_apply_once,
            retention_drops_partitions_while_consumers_run,
            concurrent_journal_writes_keep_one_result_per_step
        );
    };
    ($db:ty; $($test:ident),*; multi_thread: $($mt:ident),*) => {
        $(
            #[tokio::test]
            async fn $test() {
                super::$test::<$db>().await
            }
        )*
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $mt() {
                super::$mt::<$db>().await
            }
        )*
    };
}

mod postgres {
    use super::*;

    partitioned_suite!(sqlx::Postgres);

    /// The claim function refuses REPEATABLE READ, where its look-up would
    /// read a snapshot older than the lock it took.
    #[tokio::test]
    async fn claims_refuse_repeatable_read() {
        let (store, prefix) = partitioned::<sqlx::Postgres>().await;
        let mut tx = store.pool().begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = sqlx::query(&format!(
            "SELECT {prefix}inbox_claim('payments', 'k', 'f', 1)"
        ))
        .execute(&mut *tx)
        .await
        .unwrap_err();
        let code = err.as_database_error().and_then(|e| e.code()).unwrap();
        assert_eq!(code, "0A000", "{err}");
        drop(tx);
        cleanup(&store, &prefix).await;
    }

    /// Sealing (PostgreSQL): while eight tasks claim new keys and copies,
    /// and another claims late copies of keys applied over 2.5 s earlier
    /// (in partitions sealed by then), a sealer seals every partition that
    /// has ended: every key is applied once and every late copy is a
    /// duplicate. Then: a sealed partition refuses a row of its own, and a
    /// claim looks into a sealed partition only through its filter (with
    /// the filter's rows gone, a late copy of a key there is applied again).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sealed_partitions_keep_their_keys_while_claims_run() {
        let (store, prefix) = partitioned::<sqlx::Postgres>().await;
        let prefix = Arc::new(prefix);
        let deadline = now_ms() + 6 * STEP_MS;
        let claimers = claimers(&store, &prefix, deadline).await;
        let sealer = {
            let store = store.clone();
            tokio::spawn(async move {
                while now_ms() < deadline {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    // A cutoff of 0 drops nothing: this only seals.
                    idemq::retention::prune_before(&store, 0, 10_000, Duration::ZERO)
                        .await
                        .expect("seal");
                }
            })
        };
        let late = {
            let (store, prefix) = (store.clone(), Arc::clone(&prefix));
            tokio::spawn(async move {
                let (mut copies, mut applied) = (0, 0);
                // A second past the claimers (on a busy machine they are
                // slow), and on until 50 copies were tried (60 s at most).
                while now_ms() < deadline + STEP_MS || (copies < 50 && now_ms() < deadline + 60_000)
                {
                    let old = sql_rows(
                        &store,
                        &format!(
                            "SELECT msg_key FROM {prefix}ledger WHERE claimed_at < ? \
                             ORDER BY random() LIMIT 20"
                        ),
                        &[Bind::Int(now_ms() - 2_500)],
                        &[Column::Text],
                    )
                    .await;
                    for row in old {
                        copies += 1;
                        if apply(&store, &prefix, &row.text(0).unwrap()).await {
                            applied += 1;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                (copies, applied)
            })
        };
        let applied = claimers.await.unwrap();
        sealer.await.unwrap();
        let (copies, late_applied) = late.await.unwrap();
        let ledger = ledger(&store, &prefix).await;
        assert_eq!(ledger.len(), applied + late_applied);
        assert!(ledger.values().all(|n| *n == 1), "a key applied twice");
        assert_eq!(late_applied, 0, "a late copy was applied");
        assert!(copies >= 50, "only {copies} late copies");
        let sealed = sql_int(
            &store,
            &format!("SELECT COUNT(*) FROM {prefix}inbox_sealed"),
            &[],
        )
        .await;
        assert!(sealed >= 3, "{sealed} partitions sealed");

        // The oldest sealed partition, one of its keys.
        let rows = sql_rows(
            &store,
            &format!(
                "SELECT i.msg_key, s.start_ms FROM {prefix}inbox i JOIN {prefix}inbox_sealed s \
                 ON i.created_at >= s.start_ms AND i.created_at < s.end_ms \
                 ORDER BY s.start_ms LIMIT 1"
            ),
            &[],
            &[Column::Text, Column::Int],
        )
        .await;
        let (key, start) = (rows[0].text(0).unwrap(), rows[0].int(1).unwrap());
        let refused = sqlx::query(&format!(
            "INSERT INTO {prefix}inbox (consumer, msg_key, fingerprint, created_at) \
             VALUES ('payments', 'new-in-sealed', 'f', $1)"
        ))
        .bind(start)
        .execute(store.pool())
        .await
        .unwrap_err();
        let code = refused.as_database_error().and_then(|e| e.code()).unwrap();
        assert_eq!(code, "23514", "{refused}");
        assert!(!apply(&store, &prefix, &key).await, "{key} applied again");
        sql_exec(
            &store,
            &format!("DELETE FROM {prefix}inbox_filter WHERE start_ms = ?"),
            &[Bind::Int(start)],
        )
        .await;
        assert!(
            apply(&store, &prefix, &key).await,
            "{key}: the claim probed the sealed partition itself"
        );
        cleanup(&store, &prefix).await;
    }

    /// A sealed partition of 20,000 keys (128 filter blocks): every one of
    /// its keys is found again through the filter.
    #[tokio::test]
    async fn a_large_sealed_partition_finds_every_key() {
        let (store, prefix) = partitioned::<sqlx::Postgres>().await;
        sql_exec(
            &store,
            &format!(
                "INSERT INTO {prefix}inbox (consumer, msg_key, fingerprint, created_at) \
                 SELECT 'payments', 'bulk-' || g, 'f', ? FROM generate_series(1, 20000) AS g"
            ),
            &[Bind::Int(now_ms())],
        )
        .await;
        into_next_partition(1_100).await;
        idemq::retention::prune_before(&store, 0, 10_000, Duration::ZERO)
            .await
            .expect("seal");
        let blocks = sql_int(
            &store,
            &format!("SELECT MAX(mask) + 1 FROM {prefix}inbox_sealed"),
            &[],
        )
        .await;
        assert_eq!(blocks, 128);
        for n in (1..=20_000).step_by(10) {
            let key = format!("bulk-{n}");
            let claim = store.claim(&req(&key)).await.expect("claim");
            assert!(!matches!(claim, Claim::New(_)), "{key} claimed as new");
        }
        cleanup(&store, &prefix).await;
    }

    /// Retention drops a sealed partition with its sealed row and filter, and
    /// forgets the seal of a partition that is gone (a seal that raced
    /// another process's drop).
    #[tokio::test]
    async fn retention_forgets_the_seals_of_dropped_partitions() {
        let (store, prefix) = partitioned::<sqlx::Postgres>().await;
        for n in 0..50 {
            assert!(apply(&store, &prefix, &format!("old-{n}")).await);
        }
        into_next_partition(1_100).await;
        idemq::retention::prune_before(&store, 0, 10_000, Duration::ZERO)
            .await
            .expect("seal");
        let count_sealed = format!(
            "SELECT (SELECT COUNT(*) FROM {prefix}inbox_sealed) + \
             (SELECT COUNT(*) FROM {prefix}inbox_filter)"
        );
        assert!(
            sql_int(&store, &count_sealed, &[]).await >= 2,
            "nothing sealed"
        );
        // A seal of a partition that no longer exists.
        sql_exec(
            &store,
            &format!("INSERT INTO {prefix}inbox_sealed VALUES (1000, 2000, 0)"),
            &[],
        )
        .await;
        sql_exec(
            &store,
            &format!("INSERT INTO {prefix}inbox_filter VALUES (1000, 0, B'1'::bit(2048))"),
            &[],
        )
        .await;
        let pruned = idemq::retention::prune_before(&store, now_ms(), 10_000, Duration::ZERO)
            .await
            .expect("prune");
        assert_eq!(pruned, 50);
        assert_eq!(
            sql_int(&store, &count_sealed, &[]).await,
            0,
            "a seal outlived its partition"
        );
        cleanup(&store, &prefix).await;
    }

    /// Two engine consumers compete for a workload with redeliveries, producer
    /// retries and poison, fed over about four seconds, while retention drops
    /// the partitions older than two seconds: every payment applied once, the
    /// poison dead-lettered, and partitions dropped during the run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn retention_drops_partitions_while_engine_consumers_run() {
        use idemq::source::queue::MemoryQueue;
        let ledger = support::Ledger::partitioned(Duration::from_secs(1)).await;
        let work = support::workload(1_500, 5);
        let queue = MemoryQueue::new("payments");
        let plan = Arc::new(support::Plan::default());
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                ledger
                    .consumer("payments", Arc::clone(&plan))
                    .concurrency(8)
                    .build()
                    .expect("consumer")
            })
            .collect();
        let feeder = {
            let (queue, messages) = (queue.clone(), work.messages.clone());
            tokio::spawn(async move {
                for slice in messages.chunks(60) {
                    for message in slice {
                        queue.push(message.clone());
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
                queue.close();
            })
        };
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pruner = {
            let (store, done) = (ledger.store.clone(), Arc::clone(&done));
            tokio::spawn(async move {
                let mut pruned = 0;
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    let cutoff = now_ms() - 2 * STEP_MS;
                    pruned +=
                        idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
                            .await
                            .expect("prune");
                }
                pruned
            })
        };
        let runs: Vec<_> = consumers
            .into_iter()
            .map(|c| {
                let source = queue.source();
                tokio::spawn(async move { c.run(source).await })
            })
            .collect();
        for run in runs {
            run.await.unwrap().expect("consumer run");
        }
        feeder.await.unwrap();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        let pruned = pruner.await.unwrap();
        ledger.assert_exactly_once(&work.expected).await;
        support::assert_dead_lettered(
            &ledger.dead_letters().await,
            &work.poison,
            &idemq::DeadLetterReason::PermanentFailure,
        );
        assert!(pruned > 0, "no partition was dropped during the run");
        ledger.cleanup().await;
    }
}

mod mariadb {
    partitioned_suite!(sqlx::MySql);
}
