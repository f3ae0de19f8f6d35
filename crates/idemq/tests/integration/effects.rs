#![cfg(all(feature = "sqlite", feature = "postgres", feature = "mysql"))]
//! Effects outside the database: `ctx.effect` and derived idempotency keys,
//! on SQLite, PostgreSQL, MariaDB, the memory store, (feature `redis`) Redis
//! and (feature `mongodb`) MongoDB.
//!
//! The "provider" is an in-process payment API that deduplicates by
//! idempotency key and counts its calls. Each scenario runs the same handler
//! over an in-process queue: charge through `ctx.effect("charge", …)`, write
//! the business row (in the claim's transaction on the SQL stores), then
//! fail or hang as the payload asks.

use crate::support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use idemq::effect::idempotency_key;
use idemq::source::queue::MemoryQueue;
use idemq::store::memory::MemoryStore;
use idemq::store::sql::mysql::MySqlStore;
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::sqlite::SqliteStore;
use idemq::store::sql::SqlOptions;
use idemq::store::{now_ms, Store, StoreAdmin};
use idemq::{retention, Consumer, HandlerError, KeySpec, Message, Outcome, OutcomeKind};
use uuid::Uuid;

/// A payment API that deduplicates by idempotency key and counts every call.
#[derive(Default)]
struct Provider {
    calls: AtomicU32,
    charges: Mutex<HashMap<Uuid, String>>,
    keys_seen: Mutex<Vec<(String, Uuid)>>,
}

impl Provider {
    async fn charge(&self, step: &str, key: Uuid) -> Result<serde_json::Value, HandlerError> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        self.keys_seen.lock().unwrap().push((step.to_owned(), key));
        let mut charges = self.charges.lock().unwrap();
        let id = charges.entry(key).or_insert_with(|| format!("{step}-{n}"));
        Ok(serde_json::json!({ "id": id }))
    }

    fn calls(&self) -> u32 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// What the handler does besides the effect, per key: fail retryably or
/// hang (a crash stand-in) on the first attempt only.
#[derive(Default)]
struct Script {
    tripped: Mutex<std::collections::HashSet<String>>,
}

impl Script {
    fn first_time(&self, key: &str) -> bool {
        self.tripped.lock().unwrap().insert(key.to_owned())
    }

    /// Whether `key`'s handler has reached its scripted step.
    fn reached(&self, key: &str) -> bool {
        self.tripped.lock().unwrap().contains(key)
    }
}

/// Writes (consumer, key, charge id) through the claim's transaction or lease.
type Write<Tx> =
    for<'a> fn(&'a mut Tx, &'a str, &'a str, &'a str) -> BoxFuture<'a, Result<(), HandlerError>>;

/// The business table of the SQL stores (one per database, rows per consumer).
const LEDGER: &str = "idemq_effects_test_ledger";
const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS idemq_effects_test_ledger \
    (consumer VARCHAR(200) NOT NULL, msg_key VARCHAR(200) NOT NULL, charge TEXT NOT NULL, \
    PRIMARY KEY (consumer, msg_key))";

/// A store under test: the business write and its rows.
trait Env: Send + Sync + 'static {
    type S: Store + StoreAdmin + Clone;
    fn store(&self) -> Self::S;
    /// Writes the business row, through `tx` on SQL stores.
    fn write() -> Write<<Self::S as Store>::Tx>;
    /// The consumer's business rows (`None` for lease stores, whose writes
    /// are their own).
    fn ledger<'a>(&'a self, consumer: &'a str) -> BoxFuture<'a, Option<Vec<(String, String)>>>;
    /// How long after its last write a row is past a cutoff of "now" for
    /// retention: zero, but a partition's length on a partitioned store
    /// (retention drops whole partitions).
    fn retention_step(&self) -> Duration {
        Duration::ZERO
    }
}

fn consumer<E: Env>(
    env: &E,
    name: &str,
    provider: Arc<Provider>,
    script: Arc<Script>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
) -> Consumer<E::S> {
    let write = E::write();
    Consumer::builder(name, env.store())
        .key(KeySpec::json("/payment_id"))
        .retry(support::fast_retry())
        .lease(Duration::from_millis(300))
        .on_outcome(move |o| outcomes.lock().unwrap().push(o.clone()))
        .handler_fn(move |ctx, tx| {
            let (provider, script) = (Arc::clone(&provider), Arc::clone(&script));
            Box::pin(async move {
                let payload: serde_json::Value =
                    ctx.message.json().map_err(HandlerError::permanent)?;
                let p = Arc::clone(&provider);
                let charge = ctx
                    .effect("charge", |key| async move { p.charge("charge", key).await })
                    .await?;
                if payload["receipt"].as_bool() == Some(true) {
                    let p = Arc::clone(&provider);
                    ctx.effect(
                        "receipt",
                        |key| async move { p.charge("receipt", key).await },
                    )
                    .await?;
                }
                let id = charge["id"].as_str().unwrap_or_default().to_owned();
                write(tx, ctx.consumer, ctx.key, &id).await?;
                match payload["then"].as_str() {
                    Some("fail") if script.first_time(ctx.key) => {
                        Err(HandlerError::retryable("provider answered, then we failed"))
                    }
                    Some("hang") if script.first_time(ctx.key) => {
                        std::future::pending::<()>().await;
                        unreachable!()
                    }
                    _ => Ok(Some(charge)),
                }
            })
        })
        .build()
        .unwrap()
}

fn message(payment_id: &str, extra: serde_json::Value) -> Message {
    support::payment(payment_id, payment_id, 10, extra)
}

fn processed(outcomes: &Mutex<Vec<Outcome>>) -> Vec<(String, Option<serde_json::Value>)> {
    outcomes
        .lock()
        .unwrap()
        .iter()
        .filter_map(|o| match o {
            Outcome::Processed { key, result } => Some((key.clone(), result.clone())),
            _ => None,
        })
        .collect()
}

/// A retryable failure after the effect: the provider is called once, the
/// redelivery gets the journaled result, the business write commits once.
async fn retry_after_effect<E: Env>(env: &E) {
    let name = support::unique("fx_retry");
    let (provider, outcomes) = (Arc::new(Provider::default()), Arc::default());
    let c = consumer(
        env,
        &name,
        Arc::clone(&provider),
        Arc::default(),
        Arc::clone(&outcomes),
    );
    let queue = MemoryQueue::new("payments");
    queue.push(message("p-1", serde_json::json!({ "then": "fail" })));
    queue.close();
    let summary = c.run(queue.source()).await.unwrap();
    assert_eq!(summary.count(OutcomeKind::RetryLater), 1, "{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
    assert_eq!(provider.calls(), 1, "the redelivery must not call again");
    let expected = serde_json::json!({ "id": "charge-1" });
    assert_eq!(
        processed(&outcomes),
        vec![("p-1".to_owned(), Some(expected.clone()))]
    );
    let journal = c.store().journal().expect("the store keeps a journal");
    assert_eq!(
        journal.get(&name, "p-1", "charge").await.unwrap(),
        Some(expected)
    );
    if let Some(rows) = env.ledger(&name).await {
        let mine: Vec<_> = rows.into_iter().filter(|(k, _)| k == "p-1").collect();
        assert_eq!(mine, vec![("p-1".to_owned(), "charge-1".to_owned())]);
    }
}

/// A crash after the effect and before the commit (the consumer task is
/// aborted inside the handler): the redelivery does not call again.
async fn crash_after_effect<E: Env>(env: &E) {
    let name = support::unique("fx_crash");
    let provider = Arc::new(Provider::default());
    let script: Arc<Script> = Arc::default();
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let queue = MemoryQueue::new("payments");
    queue.push(message("p-2", serde_json::json!({ "then": "hang" })));
    queue.close();
    let first = consumer(
        env,
        &name,
        Arc::clone(&provider),
        Arc::clone(&script),
        Arc::clone(&outcomes),
    );
    let source = queue.source();
    let run = tokio::spawn(async move { first.run(source).await });
    assert!(
        support::wait_until(Duration::from_secs(10), || provider.calls() == 1).await,
        "the handler never charged"
    );
    // The handler hangs only after the effect's result is journaled.
    assert!(
        support::wait_until(Duration::from_secs(10), || script.reached("p-2")).await,
        "the handler never reached its hang"
    );
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    assert!(outcomes.lock().unwrap().is_empty(), "nothing was settled");

    let second = consumer(
        env,
        &name,
        Arc::clone(&provider),
        script,
        Arc::clone(&outcomes),
    );
    let summary = tokio::time::timeout(Duration::from_secs(20), second.run(queue.source()))
        .await
        .expect("the redelivery is processed")
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
    assert_eq!(provider.calls(), 1, "the redelivery must not call again");
    assert_eq!(
        processed(&outcomes),
        vec![(
            "p-2".to_owned(),
            Some(serde_json::json!({ "id": "charge-1" }))
        )]
    );
    if let Some(rows) = env.ledger(&name).await {
        let mine: Vec<_> = rows.into_iter().filter(|(k, _)| k == "p-2").collect();
        assert_eq!(mine, vec![("p-2".to_owned(), "charge-1".to_owned())]);
    }
}

/// Two steps get two different keys, each the documented derivation; the
/// journal rows are pruned with the inbox.
async fn two_steps_and_pruning<E: Env>(env: &E) {
    let name = support::unique("fx_steps");
    let (provider, outcomes) = (Arc::new(Provider::default()), Arc::default());
    let c = consumer(env, &name, Arc::clone(&provider), Arc::default(), outcomes);
    let queue = MemoryQueue::new("payments");
    queue.push(message("p-3", serde_json::json!({ "receipt": true })));
    queue.close();
    let summary = c.run(queue.source()).await.unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1, "{summary}");
    let seen = provider.keys_seen.lock().unwrap().clone();
    let charge = idempotency_key(&name, "p-3", "charge");
    let receipt = idempotency_key(&name, "p-3", "receipt");
    assert_ne!(charge, receipt);
    assert_eq!(
        seen,
        vec![
            ("charge".to_owned(), charge),
            ("receipt".to_owned(), receipt)
        ]
    );

    let store = c.store();
    let journal = store.journal().unwrap();
    assert!(journal
        .get(&name, "p-3", "receipt")
        .await
        .unwrap()
        .is_some());
    // Both steps, in step order, each with its stored result.
    let steps = journal.steps(&name, "p-3").await.unwrap();
    let names: Vec<&str> = steps.iter().map(|(step, _)| step.as_str()).collect();
    assert_eq!(names, ["charge", "receipt"]);
    for (step, result) in &steps {
        assert_eq!(
            journal.get(&name, "p-3", step).await.unwrap().as_ref(),
            Some(result)
        );
    }
    // A cutoff in the past keeps everything.
    retention::prune_before(&**store, now_ms() - 60_000, 100, Duration::ZERO)
        .await
        .unwrap();
    assert!(journal.get(&name, "p-3", "charge").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(5) + env.retention_step()).await;
    let pruned = retention::prune_before(&**store, now_ms(), 100, Duration::ZERO)
        .await
        .unwrap();
    assert!(pruned >= 2, "the journal rows went: {pruned}");
    for step in ["charge", "receipt"] {
        assert_eq!(
            journal.get(&name, "p-3", step).await.unwrap(),
            None,
            "{step}"
        );
    }
    assert!(store.inspect(&name, "p-3").await.unwrap().inbox.is_none());
}

async fn all_scenarios<E: Env>(env: &E) {
    retry_after_effect(env).await;
    crash_after_effect(env).await;
    two_steps_and_pruning(env).await;
}

// ---- the stores ----

/// A store whose handler writes are its own (the memory store, the lease
/// stores): no ledger in the claim's transaction to check.
struct OwnWrites<S>(S);

impl<S: Store + StoreAdmin + Clone + Send + Sync + 'static> Env for OwnWrites<S> {
    type S = S;
    fn store(&self) -> S {
        self.0.clone()
    }
    fn write() -> Write<S::Tx> {
        |_, _, _, _| Box::pin(async { Ok(()) })
    }
    fn ledger<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Option<Vec<(String, String)>>> {
        Box::pin(async { None })
    }
}

/// A SQL store under test: the store (and whatever must outlive it, such as
/// SQLite's directory), with the ledger written through the claim's
/// transaction. `$p` numbers the placeholders (`$1`…) or not (`?`).
macro_rules! sql_env {
    ($name:ident, $store:ty, $db:ty, [$p1:literal, $p2:literal, $p3:literal]) => {
        struct $name<Keep: Send + Sync + 'static> {
            store: $store,
            _keep: Keep,
            retention_step: Duration,
        }

        impl<Keep: Send + Sync + 'static> Env for $name<Keep> {
            type S = $store;
            fn store(&self) -> $store {
                self.store.clone()
            }
            fn retention_step(&self) -> Duration {
                self.retention_step
            }
            fn write() -> Write<sqlx::Transaction<'static, $db>> {
                |tx, consumer, key, charge| {
                    Box::pin(async move {
                        sqlx::query(&format!(
                            "INSERT INTO {LEDGER} (consumer, msg_key, charge) VALUES ({}, {}, {})",
                            $p1, $p2, $p3
                        ))
                        .bind(consumer)
                        .bind(key)
                        .bind(charge)
                        .execute(&mut **tx)
                        .await?;
                        Ok(())
                    })
                }
            }
            fn ledger<'a>(
                &'a self,
                consumer: &'a str,
            ) -> BoxFuture<'a, Option<Vec<(String, String)>>> {
                Box::pin(async move {
                    let sql = format!(
                        "SELECT msg_key, charge FROM {LEDGER} WHERE consumer = {} ORDER BY msg_key",
                        $p1
                    );
                    Some(
                        sqlx::query_as(&sql)
                            .bind(consumer)
                            .fetch_all(self.store.pool())
                            .await
                            .unwrap(),
                    )
                })
            }
        }
    };
}

sql_env!(Sqlite, SqliteStore, sqlx::Sqlite, ["?", "?", "?"]);
sql_env!(Postgres, PostgresStore, sqlx::Postgres, ["$1", "$2", "$3"]);
sql_env!(MySql, MySqlStore, sqlx::MySql, ["?", "?", "?"]);

#[tokio::test]
async fn effects_on_the_memory_store() {
    all_scenarios(&OwnWrites(MemoryStore::new())).await;
}

#[tokio::test]
async fn effects_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fx.db").display());
    let store = SqliteStore::connect(&url).await.unwrap();
    store.migrate().await.unwrap();
    sqlx::query(LEDGER_DDL).execute(store.pool()).await.unwrap();
    let env = Sqlite {
        store,
        _keep: dir,
        retention_step: Duration::ZERO,
    };
    all_scenarios(&env).await;
    // The journal lives in a file of its own next to the main one.
    assert!(env._keep.path().join("fx.db-effects").exists());
}

/// Runs every scenario on a server database under a fresh table prefix,
/// then drops its tables.
macro_rules! server_effects_test {
    ($test:ident, $env:ident, $store:ty, $url:expr) => {
        server_effects_test!(
            $test,
            $env,
            $store,
            $url,
            SqlOptions::default(),
            Duration::ZERO
        );
    };
    ($test:ident, $env:ident, $store:ty, $url:expr, $options:expr, $step:expr) => {
        #[tokio::test]
        async fn $test() {
            let prefix = format!("{}_", support::unique("fx"));
            let store = <$store>::connect_with(&$url, $options.table_prefix(&prefix))
                .await
                .unwrap();
            store.migrate().await.unwrap();
            // Concurrent runs may race to create the shared ledger table.
            let _ = sqlx::query(LEDGER_DDL).execute(store.pool()).await;
            let env = $env {
                store,
                _keep: (),
                retention_step: $step,
            };
            all_scenarios(&env).await;
            let t = env.store.tables().clone();
            for table in [
                &t.inbox,
                &t.attempts,
                &t.dead_letters,
                &t.migrations,
                &t.offsets,
                &t.effects,
            ] {
                sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
                    .execute(env.store.pool())
                    .await
                    .unwrap();
            }
            // A partitioned layout's layout row and functions, if any.
            for sql in [
                format!("DROP TABLE IF EXISTS {}_layout", t.inbox),
                format!("DROP TABLE IF EXISTS {}_guard", t.inbox),
                format!("DROP FUNCTION IF EXISTS {}_claim", t.inbox),
                format!("DROP FUNCTION IF EXISTS {}_put", t.effects),
            ] {
                let _ = sqlx::query(&sql).execute(env.store.pool()).await;
            }
        }
    };
}

server_effects_test!(
    effects_on_postgres,
    Postgres,
    PostgresStore,
    support::postgres_url()
);
server_effects_test!(
    effects_on_partitioned_postgres,
    Postgres,
    PostgresStore,
    support::postgres_url(),
    SqlOptions::default().partitioned_inbox(idemq::store::sql::InboxPartitions::every(
        Duration::from_secs(1)
    )),
    Duration::from_millis(1_000)
);
server_effects_test!(effects_on_mysql, MySql, MySqlStore, support::mysql_url());
server_effects_test!(
    effects_on_partitioned_mysql,
    MySql,
    MySqlStore,
    support::mysql_url(),
    SqlOptions::default().partitioned_inbox(idemq::store::sql::InboxPartitions::every(
        Duration::from_secs(1)
    )),
    Duration::from_millis(1_000)
);

#[cfg(feature = "redis")]
#[tokio::test]
async fn effects_on_redis() {
    use idemq::store::redis::{RedisOptions, RedisStore};

    let url = std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let store = RedisStore::connect_with(
        &url,
        RedisOptions::default()
            .prefix(support::unique("fx"))
            .retention(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    all_scenarios(&OwnWrites(store)).await;
}

/// The same scenarios on the MongoDB lease store (FerretDB of
/// `scripts/ferretdb.sh`): its effect journal keeps each step's result.
#[cfg(feature = "mongodb")]
#[tokio::test]
async fn effects_on_mongodb() {
    use idemq::store::mongo::{MongoOptions, MongoStore};

    let url =
        std::env::var("IDEMQ_TEST_MONGODB").unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
    let prefix = format!("{}_", support::unique("fx"));
    let store = MongoStore::connect_with(
        &url,
        MongoOptions::default()
            .database("idemq_test")
            .prefix(prefix),
    )
    .await
    .unwrap();
    store.migrate().await.unwrap();
    all_scenarios(&OwnWrites(store.clone())).await;
    for collection in store.database().list_collection_names().await.unwrap() {
        if collection.starts_with(&store.options().prefix) {
            store
                .database()
                .collection::<mongodb::bson::Document>(&collection)
                .drop()
                .await
                .unwrap();
        }
    }
}
