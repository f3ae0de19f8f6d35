//! The time-partitioned PostgreSQL inbox (`SqlOptions::partitioned_inbox`):
//! a key stays single across partitions, under concurrency and across a
//! partition boundary; a missing partition is created and the claim retried;
//! retention drops whole partitions while consumers run; a plain inbox is
//! never converted in place. The effect journal is partitioned with it and
//! keeps each step's first result across partitions. One-second
//! partitions, so that the tests cross boundaries in real time.
#![cfg(feature = "postgres")]

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::{InboxPartitions, SqlOptions};
use idemq::store::{now_ms, Claim, Store, StoreAdmin};
use idemq::StoreErrorKind;

const STEP_MS: i64 = 1_000;

/// A migrated store with a partitioned inbox of one-second partitions, its
/// own ledger table, and the table prefix.
async fn partitioned() -> (PostgresStore, String) {
    let options = SqlOptions::default()
        .max_connections(40)
        .partitioned_inbox(InboxPartitions::every(Duration::from_millis(1_000)).ahead(2));
    let (store, prefix) = support::postgres_store("part", options).await;
    sqlx::query(&format!(
        "CREATE TABLE {prefix}ledger (msg_key TEXT NOT NULL, claimed_at BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .expect("ledger");
    (store, prefix)
}

async fn cleanup(store: &PostgresStore, prefix: &str) {
    support::drop_tables(store.pool(), prefix).await;
}

use support::claim_request as req;

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
/// and commits. Returns whether this call applied it.
async fn apply(store: &PostgresStore, prefix: &str, key: &str) -> bool {
    loop {
        match store.claim(&req(key)).await {
            Ok(Claim::New(mut tx)) => {
                sqlx::query(&format!(
                    "INSERT INTO {prefix}ledger (msg_key, claimed_at) VALUES ($1, $2)"
                ))
                .bind(key)
                .bind(now_ms())
                .execute(&mut *tx)
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

/// Eight tasks applying `key-0`, `key-1`, … in the same order until
/// `deadline`, so that each key is claimed by eight at about the same time;
/// the handle's output is how many keys they applied in all.
async fn claimers(
    store: &PostgresStore,
    prefix: &Arc<String>,
    deadline: i64,
) -> tokio::task::JoinHandle<usize> {
    let tasks: Vec<_> = (0..8)
        .map(|worker| {
            let (store, prefix) = (store.clone(), Arc::clone(prefix));
            tokio::spawn(async move {
                let mut applied = 0;
                let mut i = 0u64;
                while now_ms() < deadline {
                    if apply(&store, &prefix, &format!("key-{i}")).await {
                        applied += 1;
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

async fn partition_count(store: &PostgresStore, prefix: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(&format!(
        "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = '{prefix}inbox'::regclass"
    ))
    .fetch_one(store.pool())
    .await
    .expect("partitions")
}

async fn ledger(store: &PostgresStore, prefix: &str) -> BTreeMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT msg_key, COUNT(*) FROM {prefix}ledger GROUP BY msg_key"
    ))
    .fetch_all(store.pool())
    .await
    .expect("ledger");
    rows.into_iter().collect()
}

#[tokio::test]
async fn migrate_creates_a_partitioned_inbox_with_partitions_ahead() {
    let (store, prefix) = partitioned().await;
    let kind: String = sqlx::query_scalar(&format!(
        "SELECT relkind::text FROM pg_class WHERE oid = '{prefix}inbox'::regclass"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(kind, "p", "the inbox is a partitioned table");
    // The current partition and two ahead.
    assert!(partition_count(&store, &prefix).await >= 3);
    // Migrating again changes nothing and keeps the layout.
    store.migrate().await.unwrap();
    cleanup(&store, &prefix).await;
}

#[tokio::test]
async fn a_duplicate_in_a_later_partition_is_a_duplicate() {
    let (store, prefix) = partitioned().await;
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_an_open_claim_in_an_earlier_partition() {
    let (store, prefix) = partitioned().await;
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

/// Copies of the same keys claimed at once by many tasks for three seconds,
/// across three partition boundaries: each key applied exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_copies_across_boundaries_apply_once() {
    let (store, prefix) = partitioned().await;
    let prefix = Arc::new(prefix);
    let deadline = now_ms() + 3 * STEP_MS;
    let applied = claimers(&store, &prefix, deadline).await.await.unwrap();
    let ledger = ledger(&store, &prefix).await;
    assert!(applied > 50, "only {applied} keys applied");
    assert_eq!(ledger.len(), applied, "one ledger row per applied key");
    let doubled: Vec<_> = ledger.iter().filter(|(_, n)| **n != 1).collect();
    assert!(doubled.is_empty(), "applied twice: {doubled:?}");
    // The rows are spread over several partitions.
    let spread: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(DISTINCT tableoid) FROM {prefix}inbox"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert!(spread >= 3, "rows in {spread} partitions");
    cleanup(&store, &prefix).await;
}

/// With every partition gone (maintenance lapsed), a claim fails transient
/// and the next one creates the partitions and succeeds.
#[tokio::test]
async fn a_missing_partition_is_created_and_the_claim_retried() {
    let (store, prefix) = partitioned().await;
    let names: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = '{prefix}inbox'::regclass"
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    for name in names {
        sqlx::query(&format!("DROP TABLE {name}"))
            .execute(store.pool())
            .await
            .unwrap();
    }
    let err = store.claim(&req("order-1")).await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Transient, "{err}");
    assert!(err.to_string().contains("no partition"), "{err}");
    assert!(apply(&store, &prefix, "order-1").await);
    assert!(partition_count(&store, &prefix).await >= 3);
    cleanup(&store, &prefix).await;
}

/// The claim function refuses REPEATABLE READ, where its look-up would read
/// a snapshot older than the lock it took.
#[tokio::test]
async fn claims_refuse_repeatable_read() {
    let (store, prefix) = partitioned().await;
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

/// Retention drops whole partitions past the cutoff while eight tasks keep
/// claiming copies; every key is applied once, the old partitions are gone
/// and the rows of the window stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retention_drops_partitions_while_consumers_run() {
    let (store, prefix) = partitioned().await;
    let prefix = Arc::new(prefix);
    let deadline = now_ms() + 4 * STEP_MS;
    let claimers = claimers(&store, &prefix, deadline).await;
    let pruner = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut pruned = 0;
            while now_ms() < deadline {
                tokio::time::sleep(Duration::from_millis(300)).await;
                // Keep 1.5 s: copies arrive within milliseconds of each other.
                let cutoff = now_ms() - 3 * STEP_MS / 2;
                pruned += idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
                    .await
                    .expect("prune");
            }
            pruned
        })
    };
    let applied = claimers.await.unwrap();
    let mut pruned = pruner.await.unwrap();
    // One more, after the claimers: nothing older than its cutoff's
    // partition may stay.
    let cutoff = now_ms() - 3 * STEP_MS / 2;
    pruned += idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
        .await
        .expect("prune");
    let ledger = ledger(&store, &prefix).await;
    assert_eq!(ledger.len(), applied);
    assert!(ledger.values().all(|n| *n == 1), "a key applied twice");
    let kept: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {prefix}inbox"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(pruned > 0, "nothing pruned");
    assert_eq!(
        u64::try_from(kept).unwrap() + pruned,
        u64::try_from(applied).unwrap(),
        "every applied row is kept or was in a dropped partition"
    );
    let oldest: i64 = sqlx::query_scalar(&format!("SELECT MIN(created_at) FROM {prefix}inbox"))
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert!(
        oldest >= cutoff / STEP_MS * STEP_MS,
        "a partition wholly before the cutoff stayed"
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
                pruned += idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
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

/// An inbox created as one table stays one table: asking for partitions
/// later is a configuration error, not a silent conversion.
#[tokio::test]
async fn a_plain_inbox_is_not_converted() {
    let (plain, prefix) = support::postgres_store("plain", SqlOptions::default()).await;
    let wants_parts = PostgresStore::from_pool(
        plain.pool().clone(),
        SqlOptions::default()
            .table_prefix(&prefix)
            .partitioned_inbox(InboxPartitions::daily()),
    )
    .unwrap();
    let err = wants_parts.migrate().await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err}");
    assert!(err.to_string().contains("one table"), "{err}");
    // It still claims, the plain way.
    assert!(apply_plain(&wants_parts).await);
    cleanup(&plain, &prefix).await;
}

/// A plain inbox migrated before the journal existed (schema version 2)
/// is refused before anything is migrated: no journal, partitioned or not,
/// is added beside it.
#[tokio::test]
async fn a_plain_inbox_gets_no_partitioned_journal() {
    let (plain, prefix) = support::postgres_store("plainv2", SqlOptions::default()).await;
    for sql in [
        format!("DROP TABLE {prefix}effects"),
        format!("ALTER TABLE {prefix}dead_letters DROP COLUMN letter_id"),
        format!("DELETE FROM {prefix}schema_migrations WHERE version >= 3"),
    ] {
        sqlx::query(&sql).execute(plain.pool()).await.expect(&sql);
    }
    let wants_parts = PostgresStore::from_pool(
        plain.pool().clone(),
        SqlOptions::default()
            .table_prefix(&prefix)
            .partitioned_inbox(InboxPartitions::daily()),
    )
    .unwrap();
    let err = wants_parts.migrate().await.unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err}");
    let journal: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::text")
        .bind(format!("{prefix}effects"))
        .fetch_one(plain.pool())
        .await
        .unwrap();
    assert_eq!(
        journal, None,
        "a journal was created beside the plain inbox"
    );
    cleanup(&plain, &prefix).await;
}

async fn apply_plain(store: &PostgresStore) -> bool {
    match store.claim(&req("k")).await.unwrap() {
        Claim::New(tx) => {
            store.commit(tx, &req("k"), None).await.unwrap();
            true
        }
        _ => false,
    }
}

async fn journal_partitions(store: &PostgresStore, prefix: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(&format!(
        "SELECT COUNT(*) FROM pg_inherits WHERE inhparent = '{prefix}effects'::regclass"
    ))
    .fetch_one(store.pool())
    .await
    .expect("journal partitions")
}

/// Journal rows of `key`'s `step`.
async fn journal_rows(store: &PostgresStore, prefix: &str, key: &str, step: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(&format!(
        "SELECT COUNT(*) FROM {prefix}effects WHERE msg_key = $1 AND step = $2"
    ))
    .bind(key)
    .bind(step)
    .fetch_one(store.pool())
    .await
    .expect("journal rows")
}

/// A step journaled in one partition keeps its first result when it is
/// written again in a later one: one row, the first result, from `put`,
/// `get` and `steps`.
#[tokio::test]
async fn the_journal_keeps_a_steps_first_result_in_a_later_partition() {
    let (store, prefix) = partitioned().await;
    let kind: String = sqlx::query_scalar(&format!(
        "SELECT relkind::text FROM pg_class WHERE oid = '{prefix}effects'::regclass"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(kind, "p", "the journal is a partitioned table");
    assert!(journal_partitions(&store, &prefix).await >= 3);
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
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_journal_writes_keep_one_result_per_step() {
    let (store, prefix) = partitioned().await;
    let deadline = now_ms() + 2 * STEP_MS + 300;
    let mut writers = Vec::new();
    for w in 0..8 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            let journal = store.journal().expect("a journal");
            let mut answers = Vec::new();
            let mut n = 0;
            while now_ms() < deadline {
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
    let rows: Vec<(String, String, i64, String)> = sqlx::query_as(&format!(
        "SELECT msg_key, step, COUNT(*), MIN(result_json) FROM {prefix}effects GROUP BY msg_key, step"
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), answered.len());
    for (key, step, count, result) in rows {
        assert_eq!(count, 1, "{key}/{step} journaled {count} times");
        let stored: serde_json::Value = serde_json::from_str(&result).unwrap();
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
#[tokio::test]
async fn retention_drops_journal_partitions() {
    let (store, prefix) = partitioned().await;
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
    let before = journal_partitions(&store, &prefix).await;
    // Past the old step's partition, not the new one's.
    let cutoff = now_ms() / STEP_MS * STEP_MS - STEP_MS;
    let pruned = idemq::retention::prune_before(&store, cutoff, 10_000, Duration::ZERO)
        .await
        .expect("prune");
    assert!(pruned >= 1, "nothing pruned");
    assert!(
        journal_partitions(&store, &prefix).await < before,
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
