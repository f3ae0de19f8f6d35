//! The SQL stores over TLS, verified against the certificates the local
//! services were started with (`scripts/services.sh` writes them to
//! `$IDEMQ_TOOLS/postgres/root.crt` and `$IDEMQ_TOOLS/mariadb/root.crt`):
//! PostgreSQL with `sslmode=verify-full&sslrootcert=…` and MariaDB with
//! `ssl-mode=VERIFY_IDENTITY&ssl-ca=…`, each running duplicates through a
//! consumer exactly once on connections the server reports as encrypted. A
//! server certificate that does not verify is refused with a configuration
//! error; without TLS the same check reports a plain connection. The Redis
//! store over `rediss://` with `cacert` on the local Redis's TLS port.
#![cfg(all(feature = "postgres", feature = "mysql"))]

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use idemq::source::queue::MemoryQueue;
use idemq::store::sql::mysql::{MySqlStore, MySqlTx};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::store::StoreAdmin;
use idemq::{handler_fn, Consumer, HandlerError, KeySpec, OutcomeKind, StoreErrorKind};
use support::{workload, Ledger, Plan};

/// Where the scripts keep the services' files.
fn tools() -> PathBuf {
    std::env::var_os("IDEMQ_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".idemq-tools")
        })
}

/// The CA that signed `service`'s certificate (it is self-signed).
fn root_cert(service: &str) -> String {
    let path = tools().join(service).join("root.crt");
    assert!(
        path.exists(),
        "{} is missing: run scripts/services.sh",
        path.display()
    );
    path.display().to_string()
}

/// PostgreSQL on `localhost` (the certificate's name), verifying it with `ca`.
fn postgres_verified(ca: &str) -> String {
    format!("postgres://postgres@localhost:5432/test?sslmode=verify-full&sslrootcert={ca}")
}

/// MariaDB on `localhost`, verifying its certificate and name with `ca`.
fn mariadb_verified(ca: &str) -> String {
    format!("mysql://root@localhost:3306/test?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}")
}

/// Handler calls per key.
type Calls = Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;

/// A handler over lease `Tx` that counts its calls per key in `calls`.
#[cfg(feature = "redis")]
fn counting<Tx: Send + 'static>(calls: &Calls) -> impl idemq::Handler<Tx> {
    let calls = Arc::clone(calls);
    handler_fn(move |ctx, _lease: &mut Tx| {
        *calls.lock().unwrap().entry(ctx.key.to_owned()).or_default() += 1;
        Box::pin(async { Ok(None) })
    })
}

/// Every one of `expected` keys was handled, each exactly once.
#[cfg(feature = "redis")]
fn assert_each_once(calls: &Calls, expected: usize) {
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), expected, "{calls:?}");
    assert!(
        calls.values().all(|&n| n == 1),
        "a payment handled twice: {calls:?}"
    );
}

/// A closed in-memory queue holding `messages`.
fn queue_of(messages: &[idemq::Message]) -> MemoryQueue {
    let queue = MemoryQueue::new("tls");
    for m in messages {
        queue.push(m.clone());
    }
    queue.close();
    queue
}

async fn postgres_encrypted(store: &PostgresStore) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .expect("read pg_stat_ssl")
}

async fn mariadb_cipher(store: &MySqlStore) -> String {
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(store.pool())
        .await
        .expect("read Ssl_cipher");
    cipher
}

#[tokio::test]
async fn postgres_verify_full_applies_each_effect_once() {
    let ledger = Ledger::at(&postgres_verified(&root_cert("postgres"))).await;
    assert!(
        postgres_encrypted(&ledger.store).await,
        "the connection is not encrypted"
    );

    let w = workload(20, 0);
    let queue = queue_of(&w.messages);
    let consumer = ledger
        .consumer("tls", Arc::new(Plan::default()))
        .concurrency(4)
        .build()
        .unwrap();
    let summary = consumer.run(queue.source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    ledger.assert_exactly_once(&w.expected).await;
    ledger.cleanup().await;

    // The check can tell: without TLS the server reports a plain connection.
    let plain = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
        .await
        .unwrap();
    assert!(!postgres_encrypted(&plain).await);
}

#[tokio::test]
async fn mariadb_verify_identity_applies_each_effect_once() {
    let prefix = format!("{}_", support::unique("tls"));
    let store = MySqlStore::connect_with(
        &mariadb_verified(&root_cert("mariadb")),
        SqlOptions::default().table_prefix(&prefix),
    )
    .await
    .expect("connect to MariaDB over verified TLS");
    store.migrate().await.unwrap();
    assert!(
        !mariadb_cipher(&store).await.is_empty(),
        "the connection is not encrypted"
    );
    let ledger = format!("{prefix}ledger");
    sqlx::query(&format!(
        "CREATE TABLE {ledger} (seq BIGINT AUTO_INCREMENT PRIMARY KEY, msg_key VARCHAR(64) NOT NULL, amount BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await
    .unwrap();

    let w = workload(20, 0);
    let queue = queue_of(&w.messages);
    let insert: Arc<str> = format!("INSERT INTO {ledger} (msg_key, amount) VALUES (?, ?)").into();
    let consumer = Consumer::builder("tls", store.clone())
        .key(KeySpec::json("/payment_id"))
        .concurrency(4)
        .handler(handler_fn(move |ctx, tx: &mut MySqlTx| {
            let insert = Arc::clone(&insert);
            Box::pin(async move {
                let payload: serde_json::Value =
                    ctx.message.json().map_err(HandlerError::permanent)?;
                sqlx::query(&insert)
                    .bind(ctx.key)
                    .bind(payload["amount"].as_i64().unwrap_or_default())
                    .execute(&mut **tx)
                    .await?;
                Ok(None)
            })
        }))
        .build()
        .unwrap();
    let summary = consumer.run(queue.source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
        "SELECT msg_key, amount FROM {ledger} ORDER BY msg_key"
    ))
    .fetch_all(store.pool())
    .await
    .unwrap();
    let expected: Vec<(String, i64)> = w.expected.clone().into_iter().collect();
    assert_eq!(rows, expected, "every effect exactly once");
    for table in support::TEST_TABLES {
        let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{table}"))
            .execute(store.pool())
            .await;
    }
}

#[tokio::test]
async fn a_certificate_that_does_not_verify_is_refused() {
    // Each server's certificate checked against the other's: neither verifies.
    let postgres = PostgresStore::connect(&postgres_verified(&root_cert("mariadb"))).await;
    let err = postgres.expect_err("PostgreSQL with a foreign CA");
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err:?}");
    let mariadb = MySqlStore::connect(&mariadb_verified(&root_cert("postgres"))).await;
    let err = mariadb.expect_err("MariaDB with a foreign CA");
    assert_eq!(err.kind(), StoreErrorKind::Config, "{err:?}");
}

/// The Redis lease store over `rediss://` on the TLS port of the local
/// Redis, verified against its CA (`cacert`): duplicated payments, each
/// handled once. The same server checked against another CA is refused.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_rediss_with_cacert_handles_each_payment_once() {
    use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};

    let url = |ca: &str| format!("rediss://localhost:6380/?cacert={ca}");
    let store = RedisStore::connect_with(
        &url(&root_cert("redis")),
        RedisOptions::default().prefix(support::unique("tls")),
    )
    .await
    .expect("connect to Redis over verified TLS");
    let w = workload(20, 0);
    let calls = Calls::default();
    let consumer = Consumer::builder("tls", store)
        .key(KeySpec::json("/payment_id"))
        .concurrency(4)
        .handler(counting::<RedisLease>(&calls))
        .build()
        .unwrap();
    let summary = consumer.run(queue_of(&w.messages).source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Processed) as usize,
        w.expected.len(),
        "{summary}"
    );
    assert_each_once(&calls, w.expected.len());

    let foreign = RedisStore::connect_with(
        &url(&root_cert("postgres")),
        RedisOptions::default().timeouts(Duration::from_secs(2), Duration::from_secs(2)),
    )
    .await;
    assert!(foreign.is_err(), "a foreign CA was accepted");
}

/// The Redis Streams source and publisher over TLS (`cacert` in a
/// `redis-stream://` URL): duplicated payments published and consumed
/// through the TLS port, each handled once, and the stream removed.
#[cfg(all(feature = "redis", feature = "redis-streams"))]
#[tokio::test]
async fn redis_streams_over_tls_delivers_each_payment_once() {
    use idemq::source::registry;
    use idemq::store::memory::{Lease, MemoryStore};

    let stream = support::unique("tls");
    let url = format!(
        "redis-stream://localhost:6380/{stream}?group=g&cacert={}",
        root_cert("redis")
    );
    let broker = registry::lookup(&url)
        .unwrap()
        .expect("redis-stream is registered");
    let publisher = (broker.open_publisher)(&url)
        .await
        .expect("publisher over TLS");
    let w = workload(12, 0);
    support::publish_all(&*publisher, &w.messages).await;
    let source = (broker.open_source)(&url).await.expect("source over TLS");

    let calls = Calls::default();
    let consumer = Consumer::builder("tls", MemoryStore::new())
        .key(KeySpec::json("/payment_id"))
        .handler(counting::<Lease>(&calls))
        .build()
        .unwrap();
    let expected = w.expected.len();
    support::run_until(&consumer, source, Duration::from_secs(30), || {
        calls.lock().unwrap().len() == expected
    })
    .await;
    assert_each_once(&calls, expected);
    (broker.remove)(&url).await.expect("remove the stream");
}
