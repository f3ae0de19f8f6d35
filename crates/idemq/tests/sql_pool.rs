//! The server stores' pools do not ping a connection on every acquire (a
//! round trip per transaction): a connection the server dropped while it
//! sat in the pool fails its next claim with a transient error, and the
//! claim after that runs on a new connection. Nothing is claimed twice.
#![cfg(feature = "postgres")]

mod support;

use std::time::Duration;

use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::store::{Claim, Store, StoreAdmin};
use idemq::StoreErrorKind;

use support::claim_request as req;

#[tokio::test]
async fn a_connection_dropped_in_the_pool_costs_one_transient_claim() {
    let prefix = format!("{}_", support::unique("pool"));
    let store = PostgresStore::connect_with(
        &support::postgres_url(),
        SqlOptions::default()
            .table_prefix(&prefix)
            .max_connections(1),
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
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
    for table in support::TEST_TABLES.iter().chain(&["effects"]) {
        sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{table}"))
            .execute(&admin)
            .await
            .unwrap();
    }
}
