//! Test backends: a store plus a ledger the handler writes to.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use idemq::engine::StateFnHandler;
use idemq::store::memory::{Lease, MemoryStore};
use idemq::store::{Store, StoreAdmin};
use idemq::{Context, Handler, HandlerError, HandlerResult};

/// How the test handler behaves, by payload field `fail`:
/// `"retry"` fails retryably `fail_times` times (all attempts if absent),
/// `"permanent"` fails permanently, `"hang"` never finishes, `"panic"` panics,
/// `"decode"` asks [`Context::decode`] for a type the payload is not.
/// It writes its ledger row *before* failing, so a missing rollback shows.
#[derive(Default)]
pub struct Plan {
    failures: Mutex<HashMap<String, u32>>,
    hung: Mutex<std::collections::HashSet<String>>,
    pub calls: AtomicU32,
}

impl Plan {
    /// Decides whether this call fails, after the effect was written.
    pub fn verdict(&self, ctx: &Context<'_>) -> HandlerResult {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let payload: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
        match payload["fail"].as_str() {
            Some("retry") => {
                let mut failures = self.failures.lock().unwrap();
                let n = failures.entry(ctx.key.to_owned()).or_default();
                *n += 1;
                let limit = payload["fail_times"]
                    .as_u64()
                    .map_or(u32::MAX, |t| t as u32);
                if *n <= limit {
                    return Err(HandlerError::retryable(format!("flaky call {n}")));
                }
            }
            Some("permanent") => return Err(HandlerError::permanent("rejected by business rule")),
            Some("panic") => panic!("handler bug"),
            Some("decode") => {
                /// The payload's amount is a number: it does not decode to text.
                #[derive(serde::Deserialize)]
                struct AmountAsText {
                    #[allow(dead_code)]
                    amount: String,
                }
                ctx.decode::<AmountAsText>()?;
            }
            _ => {}
        }
        Ok(Some(serde_json::json!({ "amount": payload["amount"] })))
    }

    pub fn amount(ctx: &Context<'_>) -> i64 {
        ctx.message
            .json()
            .ok()
            .and_then(|v| v["amount"].as_i64())
            .unwrap_or(0)
    }

    /// Whether the first call for `key` is hanging (or hung) already.
    pub fn has_hung(&self, key: &str) -> bool {
        self.hung.lock().unwrap().contains(key)
    }

    /// `"hang"` hangs the first call for a key only (the "crashed" one).
    pub fn hangs(&self, ctx: &Context<'_>) -> bool {
        let wants = ctx
            .message
            .json()
            .ok()
            .is_some_and(|v| v["fail"].as_str() == Some("hang"));
        wants && self.hung.lock().unwrap().insert(ctx.key.to_owned())
    }
}

/// A store under test with its ledger.
#[async_trait]
pub trait Backend: Sized + Send + Sync + 'static {
    type S: Store + StoreAdmin + Clone;
    /// A fresh store with unique tables, migrated, and an empty ledger.
    async fn fresh() -> Self;
    fn store(&self) -> Self::S;
    /// A handler that appends (key, amount) to the ledger as its effect.
    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<<Self::S as Store>::Tx>>;
    /// The ledger rows.
    async fn ledger(&self) -> Vec<(String, i64)>;
    /// Drops the tables.
    async fn cleanup(self);
    /// How many handler calls got more than one message at once
    /// ([`Handler::handle_batch`]); 0 for handlers that take one at a time.
    /// The granularity of retention, where it is not row by row (a
    /// partitioned inbox drops whole partitions).
    fn retention_step(&self) -> Option<Duration> {
        None
    }
    fn batch_calls(&self) -> u32 {
        0
    }
}

fn unique_prefix() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "t{}_{}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        fastrand::u32(..)
    )
}

/// Everything a SQL store needs for the ledger tests.
#[async_trait]
pub trait SqlTestStore: Store + StoreAdmin + Clone + Sized {
    const URL_ENV: &'static str;
    const DEFAULT_URL: &'static str;
    async fn open(url: &str, prefix: &str) -> Self;
    /// A second store on the same pool and tables (another process's view:
    /// nothing it remembers is shared).
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    fn another(&self) -> Self {
        self.with_options(idemq::store::sql::SqlOptions::default())
    }
    /// A store on the same pool with `options` and this store's tables.
    #[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
    fn with_options(&self, options: idemq::store::sql::SqlOptions) -> Self;
    async fn exec(&self, sql: &str);
    fn insert_sql(table: &str) -> String;
    async fn rows(&self, sql: &str) -> Vec<(String, i64)>;
    fn table_prefix(&self) -> String;
    fn write<'a>(
        tx: &'a mut Self::Tx,
        sql: &'a str,
        key: &'a str,
        amount: i64,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
    /// Appends `rows` to `table` in one multi-row `INSERT` (an amount that
    /// is not a number is bound as NULL, which the ledger refuses).
    fn write_many<'a>(
        tx: &'a mut Self::Tx,
        table: &'a str,
        rows: Vec<(String, Option<i64>)>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

macro_rules! sql_test_store {
    ($store:ty, $db:ty, $env:literal, $url:literal, $insert:literal) => {
        #[async_trait]
        impl SqlTestStore for $store {
            const URL_ENV: &'static str = $env;
            const DEFAULT_URL: &'static str = $url;
            async fn open(url: &str, prefix: &str) -> Self {
                let options = idemq::store::sql::SqlOptions::default().table_prefix(prefix);
                <$store>::connect_with(url, options)
                    .await
                    .expect("connect to the test database")
            }
            fn with_options(&self, options: idemq::store::sql::SqlOptions) -> Self {
                let options = options.table_prefix(&self.tables().prefix);
                <$store>::from_pool(self.pool().clone(), options).expect("a second store")
            }
            async fn exec(&self, sql: &str) {
                sqlx::query(sql).execute(self.pool()).await.expect(sql);
            }
            fn insert_sql(table: &str) -> String {
                format!($insert, table)
            }
            async fn rows(&self, sql: &str) -> Vec<(String, i64)> {
                sqlx::query_as::<$db, (String, i64)>(sql)
                    .fetch_all(self.pool())
                    .await
                    .expect(sql)
            }
            fn table_prefix(&self) -> String {
                self.tables().prefix.clone()
            }
            fn write<'a>(
                tx: &'a mut Self::Tx,
                sql: &'a str,
                key: &'a str,
                amount: i64,
            ) -> BoxFuture<'a, Result<(), HandlerError>> {
                Box::pin(async move {
                    sqlx::query(sql)
                        .bind(key)
                        .bind(amount)
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            }
            fn write_many<'a>(
                tx: &'a mut Self::Tx,
                table: &'a str,
                rows: Vec<(String, Option<i64>)>,
            ) -> BoxFuture<'a, Result<(), HandlerError>> {
                Box::pin(async move {
                    let mut insert = sqlx::QueryBuilder::<$db>::new(format!(
                        "INSERT INTO {table} (msg_key, amount) "
                    ));
                    insert.push_values(rows, |mut row, (key, amount)| {
                        row.push_bind(key).push_bind(amount);
                    });
                    insert.build().execute(&mut **tx).await?;
                    Ok(())
                })
            }
        }
    };
}

#[cfg(feature = "postgres")]
sql_test_store!(
    idemq::store::sql::postgres::PostgresStore,
    sqlx::Postgres,
    "IDEMQ_TEST_POSTGRES",
    "postgres://postgres@127.0.0.1:5432/test",
    "INSERT INTO {} (msg_key, amount) VALUES ($1, $2)"
);
#[cfg(feature = "mysql")]
sql_test_store!(
    idemq::store::sql::mysql::MySqlStore,
    sqlx::MySql,
    "IDEMQ_TEST_MYSQL",
    "mysql://root@127.0.0.1:3306/test",
    "INSERT INTO {} (msg_key, amount) VALUES (?, ?)"
);
#[cfg(feature = "sqlite")]
sql_test_store!(
    idemq::store::sql::sqlite::SqliteStore,
    sqlx::Sqlite,
    "IDEMQ_TEST_SQLITE_DIR",
    "",
    "INSERT INTO {} (msg_key, amount) VALUES (?, ?)"
);

/// A SQL store under a new table prefix, not migrated: its tables do not
/// exist. Returns the store, the prefix, and the SQLite file's directory.
pub async fn unmigrated<S: SqlTestStore>() -> (S, String, Option<tempfile::TempDir>) {
    let prefix = unique_prefix();
    let (url, dir) = if S::DEFAULT_URL.is_empty() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("test.db").display());
        (url, Some(dir))
    } else {
        (
            std::env::var(S::URL_ENV).unwrap_or_else(|_| S::DEFAULT_URL.to_owned()),
            None,
        )
    };
    let store = S::open(&url, &prefix).await;
    (store, prefix, dir)
}

/// The SQL handler, an `async fn` with state: writes the ledger row through
/// the claim's transaction, then lets the plan decide.
async fn sql_apply<S: SqlTestStore>(
    (plan, insert): &(Arc<Plan>, Arc<str>),
    ctx: &Context<'_>,
    tx: &mut S::Tx,
) -> HandlerResult {
    S::write(tx, insert, ctx.key, Plan::amount(ctx)).await?;
    if plan.hangs(ctx) {
        std::future::pending::<()>().await;
    }
    plan.verdict(ctx)
}

/// The lease stores' handler, an `async fn` with state: a lease store cannot
/// roll back the handler's effects, so the in-process ledger is written only
/// on success.
async fn lease_apply<Tx: Send>(
    (plan, ledger): &(Arc<Plan>, Ledger),
    ctx: &Context<'_>,
    _lease: &mut Tx,
) -> HandlerResult {
    if plan.hangs(ctx) {
        std::future::pending::<()>().await;
    }
    // Give concurrent duplicates a chance to meet the live lease.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let verdict = plan.verdict(ctx)?;
    ledger
        .lock()
        .unwrap()
        .push((ctx.key.to_owned(), Plan::amount(ctx)));
    Ok(verdict)
}

type Ledger = Arc<Mutex<Vec<(String, i64)>>>;

/// A SQL store whose handler writes the ledger through the claim's transaction.
pub struct SqlBackend<S> {
    store: S,
    ledger: String,
    insert: Arc<str>,
    _dir: Option<tempfile::TempDir>,
}

#[async_trait]
impl<S: SqlTestStore> Backend for SqlBackend<S>
where
    S::Tx: Send,
{
    type S = S;

    async fn fresh() -> Self {
        let (store, prefix, dir) = unmigrated::<S>().await;
        Self::migrated(store, prefix, dir).await
    }

    fn store(&self) -> S {
        self.store.clone()
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<S::Tx>> {
        let state = (plan, Arc::clone(&self.insert));
        Box::new(StateFnHandler::new(state, sql_apply::<S>))
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        let mut rows = self
            .store
            .rows(&format!(
                "SELECT msg_key, amount FROM {} ORDER BY msg_key",
                self.ledger
            ))
            .await;
        rows.sort();
        rows
    }

    async fn cleanup(self) {
        let p = self.store.table_prefix();
        for t in [
            "inbox",
            "attempts",
            "dead_letters",
            "schema_migrations",
            "offsets",
            "ledger",
        ] {
            self.store
                .exec(&format!("DROP TABLE IF EXISTS {p}{t}"))
                .await;
        }
    }
}

impl<S: SqlTestStore> SqlBackend<S> {
    /// Migrates `store` (tables of `prefix`) and creates its ledger table.
    async fn migrated(store: S, prefix: String, dir: Option<tempfile::TempDir>) -> Self {
        store.migrate().await.expect("migrate");
        let ledger = format!("{prefix}ledger");
        store
            .exec(&format!(
                "CREATE TABLE {ledger} (msg_key VARCHAR(600) NOT NULL, amount BIGINT NOT NULL)"
            ))
            .await;
        Self {
            insert: S::insert_sql(&ledger).into(),
            store,
            ledger,
            _dir: dir,
        }
    }
}

/// The partition interval of [`Partitioned`].
#[cfg(any(feature = "postgres", feature = "mysql"))]
const PARTITION: Duration = Duration::from_secs(1);

/// PostgreSQL or MariaDB with a time-partitioned inbox of one-second
/// partitions, so that every scenario's claims and duplicates cross
/// partition boundaries.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub struct Partitioned<S>(SqlBackend<S>);

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[async_trait]
impl<S: SqlTestStore> Backend for Partitioned<S>
where
    S::Tx: Send,
{
    type S = S;

    async fn fresh() -> Self {
        use idemq::store::sql::{InboxPartitions, SqlOptions};
        let (plain, prefix, dir) = unmigrated::<S>().await;
        let options =
            SqlOptions::default().partitioned_inbox(InboxPartitions::every(PARTITION).ahead(3));
        Self(SqlBackend::migrated(plain.with_options(options), prefix, dir).await)
    }

    fn store(&self) -> Self::S {
        self.0.store()
    }

    fn retention_step(&self) -> Option<Duration> {
        Some(PARTITION)
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<<Self::S as Store>::Tx>> {
        self.0.handler(plan)
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        self.0.ledger().await
    }

    async fn cleanup(self) {
        let store = self.0.store();
        let p = store.table_prefix();
        self.0.cleanup().await;
        store
            .exec(&format!("DROP TABLE IF EXISTS {p}inbox_layout"))
            .await;
        store
            .exec(&format!("DROP FUNCTION IF EXISTS {p}inbox_claim"))
            .await;
        store
            .exec(&format!("DROP FUNCTION IF EXISTS {p}effects_put"))
            .await;
        for table in ["effects", "inbox_guard"] {
            store
                .exec(&format!("DROP TABLE IF EXISTS {p}{table}"))
                .await;
        }
    }
}

/// A SQL store whose handler writes a batch's ledger rows in one multi-row
/// `INSERT` ([`Handler::handle_batch`]), and one row per call of
/// [`Handler::handle`] (the per-message fallback).
pub struct SetBasedBackend<S> {
    sql: SqlBackend<S>,
    batch_calls: Arc<AtomicU32>,
}

/// The set-based handler: the ledger rows first, then the plan's verdicts.
struct SetBased<S> {
    plan: Arc<Plan>,
    ledger: String,
    calls: Arc<AtomicU32>,
    _store: std::marker::PhantomData<fn() -> S>,
}

impl<S> SetBased<S> {
    fn rows(batch: &[Context<'_>]) -> Vec<(String, Option<i64>)> {
        batch
            .iter()
            .map(|ctx| {
                let amount = ctx.message.json().ok().and_then(|v| v["amount"].as_i64());
                (ctx.key.to_owned(), amount)
            })
            .collect()
    }
}

impl<S: SqlTestStore> Handler<S::Tx> for SetBased<S>
where
    S::Tx: Send,
{
    fn handle<'a>(
        &'a self,
        ctx: &'a Context<'a>,
        tx: &'a mut S::Tx,
    ) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            let mut results = self.handle_batch(std::slice::from_ref(ctx), tx).await?;
            Ok(results.pop().flatten())
        })
    }

    fn handles_batches(&self) -> bool {
        true
    }

    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut S::Tx,
    ) -> BoxFuture<'a, idemq::engine::BatchResult> {
        Box::pin(async move {
            if batch.len() > 1 {
                self.calls.fetch_add(1, Ordering::SeqCst);
            }
            S::write_many(tx, &self.ledger, Self::rows(batch)).await?;
            for ctx in batch {
                if self.plan.hangs(ctx) {
                    std::future::pending::<()>().await;
                }
            }
            batch.iter().map(|ctx| self.plan.verdict(ctx)).collect()
        })
    }
}

#[async_trait]
impl<S: SqlTestStore> Backend for SetBasedBackend<S>
where
    S::Tx: Send,
{
    type S = S;

    async fn fresh() -> Self {
        Self {
            sql: SqlBackend::fresh().await,
            batch_calls: Arc::default(),
        }
    }

    fn store(&self) -> S {
        self.sql.store()
    }

    fn batch_calls(&self) -> u32 {
        self.batch_calls.load(Ordering::SeqCst)
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<S::Tx>> {
        Box::new(SetBased::<S> {
            plan,
            ledger: self.sql.ledger.clone(),
            calls: Arc::clone(&self.batch_calls),
            _store: std::marker::PhantomData,
        })
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        self.sql.ledger().await
    }

    async fn cleanup(self) {
        self.sql.cleanup().await
    }
}

/// The memory lease store; its ledger is in process and written only on
/// success (a lease store cannot roll back the handler's effects).
pub struct MemoryBackend {
    store: MemoryStore,
    ledger: Arc<Mutex<Vec<(String, i64)>>>,
}

#[async_trait]
impl Backend for MemoryBackend {
    type S = MemoryStore;

    async fn fresh() -> Self {
        Self {
            store: MemoryStore::new(),
            ledger: Arc::default(),
        }
    }

    fn store(&self) -> MemoryStore {
        self.store.clone()
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<Lease>> {
        let state = (plan, Arc::clone(&self.ledger));
        Box::new(StateFnHandler::new(state, lease_apply::<Lease>))
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        let mut rows = self.ledger.lock().unwrap().clone();
        rows.sort();
        rows
    }

    async fn cleanup(self) {}
}

/// The Redis lease store on 127.0.0.1:6379 (`IDEMQ_TEST_REDIS`) under a
/// unique key prefix; like the memory backend, its ledger is in process and
/// written only on success.
#[cfg(feature = "redis")]
pub struct RedisBackend {
    store: idemq::store::redis::RedisStore,
    prefix: String,
    ledger: Arc<Mutex<Vec<(String, i64)>>>,
}

#[cfg(feature = "redis")]
#[async_trait]
impl Backend for RedisBackend {
    type S = idemq::store::redis::RedisStore;

    async fn fresh() -> Self {
        let url =
            std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let prefix = unique_prefix();
        let store = idemq::store::redis::RedisStore::connect_with(
            &url,
            idemq::store::redis::RedisOptions::default().prefix(&prefix),
        )
        .await
        .expect("connect to Redis");
        Self {
            store,
            prefix,
            ledger: Arc::default(),
        }
    }

    fn store(&self) -> Self::S {
        self.store.clone()
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<idemq::store::redis::RedisLease>> {
        let state = (plan, Arc::clone(&self.ledger));
        Box::new(StateFnHandler::new(
            state,
            lease_apply::<idemq::store::redis::RedisLease>,
        ))
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        let mut rows = self.ledger.lock().unwrap().clone();
        rows.sort();
        rows
    }

    async fn cleanup(self) {
        let mut conn = self.store.connection().clone();
        unlink_matching(&mut conn, &format!("{}:*", self.prefix)).await;
    }
}

/// The Redis lease store on the Redis Cluster of `scripts/redis-cluster.sh`
/// (127.0.0.1:7000-7005, `IDEMQ_TEST_REDIS_CLUSTER`: nodes separated by
/// commas), under a unique key prefix; the ledger in process, as for
/// [`RedisBackend`].
#[cfg(feature = "redis")]
pub struct RedisClusterBackend(RedisBackend);

#[cfg(feature = "redis")]
#[async_trait]
impl Backend for RedisClusterBackend {
    type S = idemq::store::redis::RedisStore;

    async fn fresh() -> Self {
        let nodes = std::env::var("IDEMQ_TEST_REDIS_CLUSTER").unwrap_or_else(|_| {
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002".into()
        });
        let nodes: Vec<&str> = nodes.split(',').collect();
        let prefix = unique_prefix();
        let store = idemq::store::redis::RedisStore::connect_cluster(
            &nodes,
            idemq::store::redis::RedisOptions::default().prefix(&prefix),
        )
        .await
        .expect("connect to the Redis Cluster (scripts/redis-cluster.sh)");
        Self(RedisBackend {
            store,
            prefix,
            ledger: Arc::default(),
        })
    }

    fn store(&self) -> Self::S {
        self.0.store()
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<idemq::store::redis::RedisLease>> {
        self.0.handler(plan)
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        self.0.ledger().await
    }

    /// Unlinks the prefix's keys on every master (each node's own keys).
    async fn cleanup(self) {
        for port in 7000..=7005 {
            let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
                continue;
            };
            let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                continue;
            };
            let role: Vec<redis::Value> = redis::cmd("ROLE")
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            if matches!(role.first(), Some(redis::Value::BulkString(r)) if r == b"master") {
                unlink_matching(&mut conn, &format!("{}:*", self.0.prefix)).await;
            }
        }
    }
}

/// Unlinks every key matching `pattern` on the node behind `conn`, one key
/// at a time (a cluster node refuses a multi-key command across slots).
#[cfg(feature = "redis")]
async fn unlink_matching(conn: &mut impl redis::aio::ConnectionLike, pattern: &str) {
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await
            .expect("scan");
        for key in keys {
            let _: i64 = redis::cmd("UNLINK")
                .arg(&key)
                .query_async(conn)
                .await
                .expect("unlink");
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
}

/// The Mongo lease store on the MongoDB-wire server of
/// `scripts/ferretdb.sh` (`IDEMQ_TEST_MONGODB`, default
/// `mongodb://127.0.0.1:27017`), database `idemq_test`, under a unique
/// collection prefix; like the other lease stores, its ledger is in process
/// and written only on success.
#[cfg(feature = "mongodb")]
pub struct MongoBackend {
    store: idemq::store::mongo::MongoStore,
    ledger: Arc<Mutex<Vec<(String, i64)>>>,
}

#[cfg(feature = "mongodb")]
#[async_trait]
impl Backend for MongoBackend {
    type S = idemq::store::mongo::MongoStore;

    async fn fresh() -> Self {
        let url = std::env::var("IDEMQ_TEST_MONGODB")
            .unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
        let store = idemq::store::mongo::MongoStore::connect_with(
            &url,
            idemq::store::mongo::MongoOptions::default()
                .database("idemq_test")
                .prefix(unique_prefix()),
        )
        .await
        .expect("connect to the MongoDB-wire server (scripts/ferretdb.sh)");
        store.migrate().await.expect("migrate");
        Self {
            store,
            ledger: Arc::default(),
        }
    }

    fn store(&self) -> Self::S {
        self.store.clone()
    }

    fn handler(&self, plan: Arc<Plan>) -> Box<dyn Handler<idemq::store::mongo::MongoLease>> {
        let state = (plan, Arc::clone(&self.ledger));
        Box::new(StateFnHandler::new(
            state,
            lease_apply::<idemq::store::mongo::MongoLease>,
        ))
    }

    async fn ledger(&self) -> Vec<(String, i64)> {
        let mut rows = self.ledger.lock().unwrap().clone();
        rows.sort();
        rows
    }

    /// Drops the prefix's collections and closes the client.
    async fn cleanup(self) {
        let prefix = &self.store.options().prefix;
        for name in ["inbox", "attempts", "dead_letters", "effects"] {
            self.store
                .database()
                .collection::<mongodb::bson::Document>(&format!("{prefix}{name}"))
                .drop()
                .await
                .expect("drop a test collection");
        }
        self.store.close().await;
    }
}
