//! PostgreSQL store specifics that cost round trips or scans:
//!
//! - the pools (the store's and its effect journal's) do not ping a
//!   connection on every acquire (a round trip per transaction): a
//!   connection the server dropped while it sat in the pool fails its next
//!   claim or journal write with a transient error, and the one after that
//!   runs on a new connection. Nothing is claimed or journaled twice.
//! - a batch's results reach a fresh, never analysed inbox by primary-key
//!   probes, not by a scan of the whole table per batch.
#![cfg(feature = "postgres")]

use crate::support;

use std::time::Duration;

use idemq::engine::BatchOptions;
use idemq::source::queue::MemoryQueue;
use idemq::store::sql::SqlOptions;
use idemq::store::{Claim, Store};
use idemq::{Consumer, KeySpec, Message, OutcomeKind, StoreErrorKind};

use crate::support::claim_request as req;

#[tokio::test]
async fn a_connection_dropped_in_the_pool_costs_one_transient_claim() {
    let (store, prefix) =
        support::sql_store::<sqlx::Postgres>("pool", SqlOptions::default().max_connections(1))
            .await;
    let Claim::New(tx) = store.claim(&req("order-1")).await.unwrap() else {
        panic!("new key");
    };
    store.commit(tx, &req("order-1"), None).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let admin = sqlx::PgPool::connect(&support::postgres_url())
        .await
        .unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(killed);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut transient = 0;
    let claim = loop {
        match store.claim(&req("order-2")).await {
            Ok(claim) => break claim,
            Err(e) if e.kind() == StoreErrorKind::Transient => transient += 1,
            Err(e) => panic!("{e}"),
        }
        assert!(transient <= 1, "more than one claim failed");
    };
    let Claim::New(tx) = claim else {
        panic!("new key");
    };
    store.commit(tx, &req("order-2"), None).await.unwrap();
    assert!(matches!(
        store.claim(&req("order-1")).await.unwrap(),
        Claim::Done(_)
    ));
    support::drop_tables(&admin, &prefix).await;
}

/// The inbox's scan counters, once the statistics of `inserted` rows and
/// `updated` row updates have reached the shared statistics and those of
/// every other statement before them have too (backends flush them when
/// idle, at most once a second: another connection's may come a second later).
async fn scans_after(pool: &sqlx::PgPool, inbox: &str, inserted: i64, updated: i64) -> (i64, i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (ins, upd): (i64, i64) = sqlx::query_as(
            "SELECT n_tup_ins, n_tup_upd FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(inbox)
        .fetch_one(pool)
        .await
        .unwrap();
        if ins >= inserted && upd >= updated {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            return sqlx::query_as(
                "SELECT seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = $1",
            )
            .bind(inbox)
            .fetch_one(pool)
            .await
            .unwrap();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{ins} of {inserted} inserts, {upd} of {updated} updates counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn batch_results_reach_a_fresh_inbox_by_key_not_by_scan() {
    const ROWS: i64 = 20_000;
    const BATCH: usize = 100;
    let (store, prefix) = support::sql_store::<sqlx::Postgres>("plan", SqlOptions::default()).await;
    let inbox = store.tables().inbox.clone();
    // A fresh inbox of 20 000 rows that autovacuum has not analysed: the
    // size at which the planner, left alone, hashes a scan of all of it.
    sqlx::query(&format!(
        "ALTER TABLE {inbox} SET (autovacuum_enabled = false)"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {inbox} (consumer, msg_key, fingerprint, result_json, created_at) \
         SELECT 'plan', 'old-' || g, 'f', NULL, 1 FROM generate_series(1, {ROWS}) g"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let (seq_before, idx_before) = scans_after(store.pool(), &inbox, ROWS, 0).await;

    let consumer = Consumer::builder("plan", store.clone())
        .key(KeySpec::json("/id"))
        .handler_fn(|ctx, _tx| {
            let key = ctx.key.to_owned();
            Box::pin(async move { Ok(Some(serde_json::json!({ "done": key }))) })
        })
        .build()
        .unwrap();
    let queue = MemoryQueue::new("plan");
    for i in 0..BATCH * 3 {
        queue.push(Message::new(format!(r#"{{"id":"new-{i}"}}"#)));
    }
    queue.close();
    let summary = consumer
        .run_batched(
            queue.source(),
            BatchOptions::new(BATCH, Duration::from_millis(50)),
        )
        .await
        .unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed),
        (BATCH * 3) as u64,
        "{summary}"
    );

    let (seq_after, idx_after) = scans_after(
        store.pool(),
        &inbox,
        ROWS + (BATCH * 3) as i64,
        (BATCH * 3) as i64,
    )
    .await;
    assert_eq!(
        seq_after - seq_before,
        0,
        "no batch statement scans the inbox ({} index scans)",
        idx_after - idx_before
    );
    let stored: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {inbox} WHERE result_json IS NOT NULL"
    ))
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(stored, (BATCH * 3) as i64, "every result stored");

    support::drop_tables(store.pool(), &prefix).await;
}

#[tokio::test]
async fn a_journal_connection_dropped_in_its_pool_costs_one_transient_write() {
    let (store, prefix) =
        support::sql_store::<sqlx::Postgres>("jpool", SqlOptions::default()).await;
    let journal = store.journal().expect("a journal");
    let first = serde_json::json!({ "charge": "ch_1" });
    journal
        .put("payments", "order-1", "charge", &first)
        .await
        .unwrap();
    // The journal's connections are the ones whose last statement read
    // its table.
    let admin = sqlx::PgPool::connect(&support::postgres_url())
        .await
        .unwrap();
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() \
         AND pid <> pg_backend_pid() AND query LIKE '%' || $1 || '%'",
    )
    .bind(format!("{prefix}effects"))
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(!pids.is_empty(), "no journal connection found");
    for pid in &pids {
        let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut transient = 0;
    let second = serde_json::json!({ "charge": "ch_2" });
    let stored = loop {
        match journal.put("payments", "order-1", "refund", &second).await {
            Ok(stored) => break stored,
            Err(e) if e.kind() == StoreErrorKind::Transient => transient += 1,
            Err(e) => panic!("{e}"),
        }
        assert!(
            transient <= pids.len(),
            "more writes failed than connections were dropped"
        );
    };
    assert_eq!(stored, second);
    assert_eq!(
        journal.get("payments", "order-1", "charge").await.unwrap(),
        Some(first)
    );
    let rows: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {prefix}effects"))
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(rows, 2, "each step journaled once");
    support::drop_tables(&admin, &prefix).await;
}
