//! The Idempotency-Key layer end to end: a real axum server on loopback, a
//! real HTTP client (reqwest), on every store — PostgreSQL, MariaDB, SQLite,
//! Redis and memory. The crash tests start this test binary again as a
//! server process (`IDEMQ_HTTP_CHILD`), kill it with SIGKILL between the
//! handler's work and the stored response, start it again and retry.
//!
//! Services come from `IDEMQ_TEST_POSTGRES`, `IDEMQ_TEST_MYSQL` and
//! `IDEMQ_TEST_REDIS` (defaults: the loopback services of
//! docs/operations.md). Every run uses its own table and key prefixes.

use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use idemq::sqlx;
use idemq::store::memory::{Lease, MemoryStore};
use idemq::store::redis::{RedisLease, RedisOptions, RedisStore};
use idemq::store::sql::mysql::{MySqlStore, MySqlTx};
use idemq::store::sql::postgres::{PostgresStore, PostgresTx};
use idemq::store::sql::sqlite::{SqliteStore, SqliteTx};
use idemq::store::sql::SqlOptions;
use idemq::store::{Store, StoreAdmin};
use idemq::{InFlightPolicy, RetentionPolicy};
use idemq_http::{Idempotency, IdempotencyInfo, InboxTx};

fn postgres_url() -> String {
    std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn mysql_url() -> String {
    std::env::var("IDEMQ_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn redis_url() -> String {
    std::env::var("IDEMQ_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A prefix unique to this process and call.
fn unique(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{name}_{}_{}_{}_",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        fastrand_u32()
    )
}

fn fastrand_u32() -> u32 {
    uuid::Uuid::new_v4().as_u128() as u32
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Memory,
    Sqlite,
    Postgres,
    Mysql,
    Redis,
}

impl Kind {
    fn parse(s: &str) -> Kind {
        match s {
            "memory" => Kind::Memory,
            "sqlite" => Kind::Sqlite,
            "postgres" => Kind::Postgres,
            "mysql" => Kind::Mysql,
            "redis" => Kind::Redis,
            other => panic!("unknown store {other}"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::Sqlite => "sqlite",
            Kind::Postgres => "postgres",
            Kind::Mysql => "mysql",
            Kind::Redis => "redis",
        }
    }

    fn is_sql(self) -> bool {
        matches!(self, Kind::Sqlite | Kind::Postgres | Kind::Mysql)
    }
}

/// Where the handler's effect goes: a row in `{prefix}orders` written
/// through the claim's transaction (SQL stores), or a line appended to a
/// file (lease stores, whose effects are the handler's own).
#[derive(Debug, Clone)]
struct Target {
    kind: Kind,
    prefix: String,
    dir: PathBuf,
}

impl Target {
    fn table(&self) -> String {
        format!("{}orders", self.prefix)
    }

    fn effects_file(&self) -> PathBuf {
        self.dir.join("effects.log")
    }

    fn sqlite_url(&self) -> String {
        format!("sqlite://{}", self.dir.join("inbox.db").display())
    }
}

type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The handler's effect, through what the claim gave it.
trait Effect: Send + 'static {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>>;
    fn fencing(&self) -> Option<u64> {
        None
    }
}

fn append_line(target: &Target, key: &str) -> Result<(), String> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(target.effects_file())
        .map_err(|e| e.to_string())?;
    writeln!(file, "{key}").map_err(|e| e.to_string())
}

impl Effect for SqliteTx {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {} (order_key) VALUES (?)", target.table());
            sqlx::query(&sql)
                .bind(key)
                .execute(&mut **self)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

impl Effect for PostgresTx {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {} (order_key) VALUES ($1)", target.table());
            sqlx::query(&sql)
                .bind(key)
                .execute(&mut **self)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

impl Effect for MySqlTx {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move {
            let sql = format!("INSERT INTO {} (order_key) VALUES (?)", target.table());
            sqlx::query(&sql)
                .bind(key)
                .execute(&mut **self)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

impl Effect for RedisLease {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move { append_line(target, key) })
    }
    fn fencing(&self) -> Option<u64> {
        Some(self.fencing_token())
    }
}

impl Effect for Lease {
    fn apply<'a>(&'a mut self, target: &'a Target, key: &'a str) -> BoxFut<'a, Result<(), String>> {
        Box::pin(async move { append_line(target, key) })
    }
    fn fencing(&self) -> Option<u64> {
        Some(self.fencing_token())
    }
}

/// How many times the effect of `stored_key` happened (committed rows, or lines).
async fn effects(target: &Target, stored_key: &str) -> usize {
    let table = target.table();
    match target.kind {
        Kind::Memory | Kind::Redis => std::fs::read_to_string(target.effects_file())
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == stored_key)
            .count(),
        Kind::Sqlite => {
            let store = SqliteStore::connect(&target.sqlite_url()).await.unwrap();
            let sql = format!("SELECT COUNT(*) FROM {table} WHERE order_key = ?");
            let (n,): (i64,) = sqlx::query_as(&sql)
                .bind(stored_key)
                .fetch_one(store.pool())
                .await
                .unwrap();
            store.pool().close().await;
            n as usize
        }
        Kind::Postgres => {
            let pool = sqlx::PgPool::connect(&postgres_url()).await.unwrap();
            let sql = format!("SELECT COUNT(*) FROM {table} WHERE order_key = $1");
            let (n,): (i64,) = sqlx::query_as(&sql)
                .bind(stored_key)
                .fetch_one(&pool)
                .await
                .unwrap();
            pool.close().await;
            n as usize
        }
        Kind::Mysql => {
            let pool = sqlx::MySqlPool::connect(&mysql_url()).await.unwrap();
            let sql = format!("SELECT COUNT(*) FROM {table} WHERE order_key = ?");
            let (n,): (i64,) = sqlx::query_as(&sql)
                .bind(stored_key)
                .fetch_one(&pool)
                .await
                .unwrap();
            pool.close().await;
            n as usize
        }
    }
}

/// What a test server is configured with.
#[derive(Clone, Copy)]
struct Options {
    in_flight: InFlightPolicy,
    lease: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            in_flight: InFlightPolicy::Reject,
            lease: Duration::from_secs(30),
        }
    }
}

/// The stored keys whose handler has started in this process.
fn started() -> &'static std::sync::Mutex<std::collections::HashSet<String>> {
    static STARTED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    STARTED.get_or_init(Default::default)
}

/// Waits (30 s at most) until the handler of `stored_key` has started.
async fn handler_started(stored_key: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !started().lock().unwrap().contains(stored_key) {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler of {stored_key} never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The handler: records that it started, sleeps for `x-sleep-ms`, writes the effect through the
/// claim, "crashes" (prints `WORKED`, then hangs until killed) with
/// `x-crash`, answers `x-status` (default 201) with a fresh order id, a
/// `Location`, a custom header and a cookie (which is not stored).
async fn create_order<Tx: Effect>(
    State(target): State<Arc<Target>>,
    info: IdempotencyInfo,
    inbox: InboxTx<Tx>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    started().lock().unwrap().insert(info.stored_key.clone());
    if let Some(ms) = header("x-sleep-ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let fencing = {
        let mut tx = match inbox.lock().await {
            Ok(tx) => tx,
            Err(e) => return e.into_response(),
        };
        if let Err(e) = tx.apply(&target, &info.stored_key).await {
            return (StatusCode::INTERNAL_SERVER_ERROR, e).into_response();
        }
        tx.fencing()
    };
    if header("x-crash").is_some() {
        println!("WORKED {} {}", info.stored_key, fencing.unwrap_or(0));
        std::io::stdout().flush().ok();
        tokio::time::sleep(Duration::from_secs(120)).await;
    }
    let status = header("x-status")
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    let id = uuid::Uuid::new_v4();
    let body = serde_json::json!({
        "order": id.to_string(),
        "key": info.key,
        "fencing": fencing,
        "request_bytes": body.len(),
    });
    (
        status,
        [
            ("location", format!("/orders/{id}")),
            ("x-order-id", id.to_string()),
            ("set-cookie", "session=secret".to_owned()),
            ("content-type", "application/json".to_owned()),
        ],
        body.to_string(),
    )
        .into_response()
}

fn app<S>(store: S, target: Arc<Target>, options: Options) -> Router
where
    S: Store,
    S::Tx: Effect,
{
    let idempotency = Idempotency::builder(store)
        .name("orders-api")
        .scope(|parts| {
            parts
                .headers
                .get("x-tenant")?
                .to_str()
                .ok()
                .map(str::to_owned)
        })
        .in_flight(options.in_flight)
        .lease(options.lease)
        .build()
        .unwrap();
    Router::new()
        .route("/orders", post(create_order::<S::Tx>))
        .route("/other", post(create_order::<S::Tx>))
        .layer(idempotency.layer())
        .with_state(target)
}

async fn serve_on(listener: tokio::net::TcpListener, router: Router) {
    axum::serve(listener, router).await.unwrap();
}

/// Starts a server in this process; its address and task.
async fn start<S>(
    store: S,
    target: Arc<Target>,
    options: Options,
) -> (SocketAddr, tokio::task::JoinHandle<()>)
where
    S: Store,
    S::Tx: Effect,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(serve_on(listener, app(store, target, options)));
    (addr, task)
}

/// Opens the store of `target.kind`, migrated, with its orders table, and
/// starts a server on it.
async fn start_kind(
    target: Arc<Target>,
    options: Options,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let prefix = target.prefix.clone();
    let table = target.table();
    match target.kind {
        Kind::Memory => start(MemoryStore::new(), target, options).await,
        Kind::Redis => {
            let store = RedisStore::connect_with(
                &redis_url(),
                RedisOptions::default().prefix(prefix.trim_end_matches('_')),
            )
            .await
            .unwrap();
            start(store, target, options).await
        }
        Kind::Sqlite => {
            let store = SqliteStore::connect_with(
                &target.sqlite_url(),
                SqlOptions::default().table_prefix(&prefix),
            )
            .await
            .unwrap();
            store.migrate().await.unwrap();
            let sql = format!("CREATE TABLE IF NOT EXISTS {table} (order_key TEXT NOT NULL)");
            sqlx::query(&sql).execute(store.pool()).await.unwrap();
            start(store, target, options).await
        }
        Kind::Postgres => {
            let store = PostgresStore::connect_with(
                &postgres_url(),
                SqlOptions::default().table_prefix(&prefix),
            )
            .await
            .unwrap();
            store.migrate().await.unwrap();
            let sql =
                format!("CREATE TABLE IF NOT EXISTS {table} (order_key VARCHAR(600) NOT NULL)");
            sqlx::query(&sql).execute(store.pool()).await.unwrap();
            start(store, target, options).await
        }
        Kind::Mysql => {
            let store =
                MySqlStore::connect_with(&mysql_url(), SqlOptions::default().table_prefix(&prefix))
                    .await
                    .unwrap();
            store.migrate().await.unwrap();
            let sql =
                format!("CREATE TABLE IF NOT EXISTS {table} (order_key VARCHAR(600) NOT NULL)");
            sqlx::query(&sql).execute(store.pool()).await.unwrap();
            start(store, target, options).await
        }
    }
}

/// Runs `f` with a store of `target.kind` (for expiry).
async fn expire_all(target: &Target) {
    let mut policy = RetentionPolicy::default();
    policy.keep_for = Duration::ZERO;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let pruned = match target.kind {
        Kind::Memory => unreachable!("the memory store is expired in process"),
        Kind::Redis => {
            let store = RedisStore::connect_with(
                &redis_url(),
                RedisOptions::default().prefix(target.prefix.trim_end_matches('_')),
            )
            .await
            .unwrap();
            Idempotency::builder(store)
                .build()
                .unwrap()
                .expire(&policy)
                .await
                .unwrap()
        }
        Kind::Sqlite => {
            let store = SqliteStore::connect_with(
                &target.sqlite_url(),
                SqlOptions::default().table_prefix(&target.prefix),
            )
            .await
            .unwrap();
            Idempotency::builder(store)
                .build()
                .unwrap()
                .expire(&policy)
                .await
                .unwrap()
        }
        Kind::Postgres => {
            let store = PostgresStore::connect_with(
                &postgres_url(),
                SqlOptions::default().table_prefix(&target.prefix),
            )
            .await
            .unwrap();
            Idempotency::builder(store)
                .build()
                .unwrap()
                .expire(&policy)
                .await
                .unwrap()
        }
        Kind::Mysql => {
            let store = MySqlStore::connect_with(
                &mysql_url(),
                SqlOptions::default().table_prefix(&target.prefix),
            )
            .await
            .unwrap();
            Idempotency::builder(store)
                .build()
                .unwrap()
                .expire(&policy)
                .await
                .unwrap()
        }
    };
    assert!(pruned >= 1, "{:?}: nothing expired", target.kind);
}

/// Drops the SQL tables of a run (best effort).
async fn cleanup(target: &Target) {
    let tables = [
        "orders",
        "inbox",
        "attempts",
        "dead_letters",
        "effects",
        "schema_migrations",
        "offsets",
    ];
    match target.kind {
        Kind::Postgres => {
            if let Ok(pool) = sqlx::PgPool::connect(&postgres_url()).await {
                for t in tables {
                    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {}{t}", target.prefix))
                        .execute(&pool)
                        .await;
                }
            }
        }
        Kind::Mysql => {
            if let Ok(pool) = sqlx::MySqlPool::connect(&mysql_url()).await {
                for t in tables {
                    let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {}{t}", target.prefix))
                        .execute(&pool)
                        .await;
                }
            }
        }
        _ => {}
    }
}

fn new_target(kind: Kind, dir: &Path) -> Arc<Target> {
    Arc::new(Target {
        kind,
        prefix: unique(&format!("ih_{}", kind.name())),
        dir: dir.to_owned(),
    })
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    fn problem_type(&self) -> String {
        assert_eq!(self.headers["content-type"], "application/problem+json");
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

async fn send(
    client: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: &str,
    extra: &[(&str, &str)],
) -> Result<Answer, reqwest::Error> {
    let mut req = client
        .post(format!("http://{addr}{path}"))
        .header("x-tenant", "acme")
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    for (n, v) in extra {
        req = req.header(*n, *v);
    }
    let resp = req.send().await?;
    Ok(Answer {
        status: resp.status(),
        headers: resp.headers().clone(),
        body: resp.bytes().await?,
    })
}

/// Sends until the answer is not a 409, honouring nothing but a short pause.
async fn send_until_done(
    client: &reqwest::Client,
    addr: SocketAddr,
    key: &str,
    body: &str,
) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = send(client, addr, "/orders", Some(key), body, &[])
            .await
            .unwrap();
        if a.status != StatusCode::CONFLICT {
            return a;
        }
        assert!(a.headers.contains_key("retry-after"));
        assert!(Instant::now() < deadline, "still 409 after 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 50 clients send one key at once while its handler takes 300 ms.
async fn fifty_concurrent_retries(kind: Kind, dir: &Path, policy: InFlightPolicy) {
    let target = new_target(kind, dir);
    let (addr, server) = start_kind(
        target.clone(),
        Options {
            in_flight: policy,
            ..Options::default()
        },
    )
    .await;
    let client = reqwest::Client::new();
    let key = format!("\"fifty-{}\"", uuid::Uuid::new_v4());
    let body = r#"{"item":"book","qty":1}"#;
    let mut tasks = Vec::new();
    for i in 0..50 {
        let client = client.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            if i == 0 {
                send(
                    &client,
                    addr,
                    "/orders",
                    Some(&key),
                    body,
                    &[("x-sleep-ms", "300")],
                )
                .await
                .unwrap()
            } else {
                tokio::time::sleep(Duration::from_millis(20)).await;
                send_until_done(&client, addr, &key, body).await
            }
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.unwrap());
    }
    let first = &answers[0].body;
    for a in &answers {
        assert_eq!(
            a.status,
            StatusCode::CREATED,
            "{kind:?}: {:?}",
            String::from_utf8_lossy(&a.body)
        );
        assert_eq!(&a.body, first, "{kind:?}: every client gets the same body");
    }
    assert_eq!(
        answers.iter().filter(|a| !a.replayed()).count(),
        1,
        "{kind:?}: one original answer"
    );
    let stored_key = format!("acme/{}", key.trim_matches('"'));
    assert_eq!(
        effects(&target, &stored_key).await,
        1,
        "{kind:?}: the handler ran once"
    );
    server.abort();
    cleanup(&target).await;
}

/// 400, 409, 422, the stored status and headers replayed, release on 5xx,
/// and expiry.
async fn statuses_replay_and_expiry(kind: Kind, dir: &Path) {
    let target = new_target(kind, dir);
    let (addr, server) = start_kind(target.clone(), Options::default()).await;
    let client = reqwest::Client::new();
    let body = r#"{"item":"lamp"}"#;

    // 400: no key; a key that is not a Structured Field string.
    let a = send(&client, addr, "/orders", None, body, &[])
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        a.problem_type(),
        "urn:idemq:problem:idempotency-key-missing"
    );
    assert_eq!(a.json()["status"], 400);
    let a = send(&client, addr, "/orders", Some("unquoted"), body, &[])
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        a.problem_type(),
        "urn:idemq:problem:idempotency-key-invalid"
    );

    // The first answer, then its replay: same status, stored headers, body.
    let key = format!("\"k-{}\"", uuid::Uuid::new_v4());
    let stored_key = format!("acme/{}", key.trim_matches('"'));
    let slow = {
        let client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            send(
                &client,
                addr,
                "/orders",
                Some(&key),
                body,
                &[("x-sleep-ms", "3000"), ("x-status", "202")],
            )
            .await
            .unwrap()
        })
    };
    handler_started(&stored_key).await;
    // 409 while the first is in flight (its handler sleeps 3 s).
    let busy = send(&client, addr, "/orders", Some(&key), body, &[])
        .await
        .unwrap();
    assert_eq!(busy.status, StatusCode::CONFLICT, "{kind:?}");
    assert_eq!(
        busy.problem_type(),
        "urn:idemq:problem:idempotency-key-in-flight"
    );
    assert_eq!(busy.headers["retry-after"], "1");
    let first = slow.await.unwrap();
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert!(!first.replayed());
    assert_eq!(first.headers["set-cookie"], "session=secret");
    let replay = send(
        &client,
        addr,
        "/orders",
        Some(&key),
        body,
        &[("x-status", "500")],
    )
    .await
    .unwrap();
    assert_eq!(
        replay.status,
        StatusCode::ACCEPTED,
        "the stored status, not a new run"
    );
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "byte for byte");
    for h in ["location", "x-order-id", "content-type"] {
        assert_eq!(replay.headers[h], first.headers[h], "{h}");
    }
    assert!(
        !replay.headers.contains_key("set-cookie"),
        "cookies are not stored"
    );
    assert_eq!(
        replay.headers["content-length"],
        first.body.len().to_string()
    );
    assert_eq!(effects(&target, &stored_key).await, 1);

    // 422: the same key with another body, or on another path.
    let a = send(
        &client,
        addr,
        "/orders",
        Some(&key),
        r#"{"item":"sofa"}"#,
        &[],
    )
    .await
    .unwrap();
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(a.problem_type(), "urn:idemq:problem:idempotency-key-reused");
    let a = send(&client, addr, "/other", Some(&key), body, &[])
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::UNPROCESSABLE_ENTITY);
    // Another tenant's same key is its own.
    let other_tenant = client
        .post(format!("http://{addr}/orders"))
        .header("x-tenant", "globex")
        .header("content-type", "application/json")
        .header("idempotency-key", &key)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(other_tenant.status(), StatusCode::CREATED);
    assert!(other_tenant.headers().get("idempotent-replayed").is_none());

    // A 5xx releases the key: SQL stores roll the effect back with it.
    let key5 = format!("\"k5-{}\"", uuid::Uuid::new_v4());
    let stored5 = format!("acme/{}", key5.trim_matches('"'));
    let a = send(
        &client,
        addr,
        "/orders",
        Some(&key5),
        body,
        &[("x-status", "503")],
    )
    .await
    .unwrap();
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        effects(&target, &stored5).await,
        usize::from(!kind.is_sql())
    );
    let a = send(&client, addr, "/orders", Some(&key5), body, &[])
        .await
        .unwrap();
    assert_eq!(a.status, StatusCode::CREATED);
    assert!(!a.replayed(), "the released key runs again");
    assert_eq!(
        effects(&target, &stored5).await,
        if kind.is_sql() { 1 } else { 2 }
    );
    // A 4xx is stored.
    let key4 = format!("\"k4-{}\"", uuid::Uuid::new_v4());
    let a = send(
        &client,
        addr,
        "/orders",
        Some(&key4),
        body,
        &[("x-status", "404")],
    )
    .await
    .unwrap();
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    let b = send(&client, addr, "/orders", Some(&key4), body, &[])
        .await
        .unwrap();
    assert_eq!(b.status, StatusCode::NOT_FOUND);
    assert!(b.replayed());

    // Expiry: the retention machinery forgets the key; a retry runs again.
    if kind == Kind::Memory {
        server.abort();
        return; // the memory store is covered by the in-process expiry test
    }
    expire_all(&target).await;
    let again = send(&client, addr, "/orders", Some(&key), body, &[])
        .await
        .unwrap();
    assert_eq!(
        again.status,
        StatusCode::CREATED,
        "{kind:?}: an expired key runs again"
    );
    assert!(!again.replayed());
    assert_ne!(again.body, first.body);
    assert_eq!(effects(&target, &stored_key).await, 2);
    server.abort();
    cleanup(&target).await;
}

async fn suite(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    statuses_replay_and_expiry(kind, dir.path()).await;
    fifty_concurrent_retries(kind, dir.path(), InFlightPolicy::Reject).await;
    fifty_concurrent_retries(
        kind,
        dir.path(),
        InFlightPolicy::wait(Duration::from_secs(10)),
    )
    .await;
    eprintln!("{kind:?}: suite in {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layer_on_memory() {
    suite(Kind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layer_on_sqlite() {
    suite(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layer_on_postgres() {
    suite(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layer_on_mariadb() {
    suite(Kind::Mysql).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn layer_on_redis() {
    suite(Kind::Redis).await;
}

/// The memory store's expiry, in process (its keys die with the process).
#[tokio::test]
async fn memory_keys_expire_with_retention() {
    let dir = tempfile::tempdir().unwrap();
    let target = new_target(Kind::Memory, dir.path());
    let store = MemoryStore::new();
    let (addr, server) = start(store.clone(), target.clone(), Options::default()).await;
    let client = reqwest::Client::new();
    let a = send(&client, addr, "/orders", Some("\"m\""), "{}", &[])
        .await
        .unwrap();
    let b = send(&client, addr, "/orders", Some("\"m\""), "{}", &[])
        .await
        .unwrap();
    assert!(b.replayed());
    assert_eq!(a.body, b.body);
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut policy = RetentionPolicy::default();
    policy.keep_for = Duration::ZERO;
    assert_eq!(idemq::retention::prune(&store, &policy).await.unwrap(), 1);
    let c = send(&client, addr, "/orders", Some("\"m\""), "{}", &[])
        .await
        .unwrap();
    assert!(!c.replayed());
    assert_ne!(c.body, a.body);
    assert_eq!(effects(&target, "acme/m").await, 2);
    server.abort();
}

// ---------------------------------------------------------------------------
// Crash between the handler's work and the stored response: a real process,
// killed with SIGKILL.

const CHILD: &str = "IDEMQ_HTTP_CHILD";

/// In a child process: serve until killed. Prints `LISTENING <addr>`.
fn child_server() {
    let kind = Kind::parse(&std::env::var(CHILD).unwrap());
    let target = Arc::new(Target {
        kind,
        prefix: std::env::var("IDEMQ_HTTP_CHILD_PREFIX").unwrap(),
        dir: PathBuf::from(std::env::var("IDEMQ_HTTP_CHILD_DIR").unwrap()),
    });
    let lease_ms: u64 = std::env::var("IDEMQ_HTTP_CHILD_LEASE_MS")
        .unwrap()
        .parse()
        .unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async move {
        let options = Options {
            lease: Duration::from_millis(lease_ms),
            ..Options::default()
        };
        let (addr, server) = start_kind(target, options).await;
        println!("LISTENING {addr}");
        std::io::stdout().flush().unwrap();
        server.await.unwrap();
    });
}

struct ChildServer {
    child: Child,
    lines: std::io::Lines<BufReader<ChildStdout>>,
    addr: SocketAddr,
}

impl ChildServer {
    fn spawn(test: &str, target: &Target, lease: Duration) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, target.kind.name())
            .env("IDEMQ_HTTP_CHILD_PREFIX", &target.prefix)
            .env("IDEMQ_HTTP_CHILD_DIR", &target.dir)
            .env("IDEMQ_HTTP_CHILD_LEASE_MS", lease.as_millis().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the child server exited").unwrap();
            if let Some(addr) = line.split("LISTENING ").nth(1) {
                break addr.parse().unwrap();
            }
        };
        ChildServer { child, lines, addr }
    }

    /// Blocks until the child printed `WORKED <key> <fencing>`; returns both.
    fn wait_worked(&mut self) -> (String, u64) {
        loop {
            let line = self.lines.next().expect("the child server exited").unwrap();
            if let Some(worked) = line.split("WORKED ").nth(1) {
                let (key, fencing) = worked.rsplit_once(' ').unwrap();
                return (key.to_owned(), fencing.parse().unwrap());
            }
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for ChildServer {
    /// A failed assertion must not leave the child server running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start a server process, send a request whose handler does its work and
/// then hangs, SIGKILL the process, start a new one, retry.
fn crash_between_work_and_stored_response(test: &str, kind: Kind) {
    if std::env::var_os(CHILD).is_some() {
        return child_server();
    }
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let target = new_target(kind, dir.path());
    let lease = Duration::from_millis(1500);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let client = reqwest::Client::new();
    let key = format!("\"crash-{}\"", uuid::Uuid::new_v4());
    let stored_key = format!("acme/{}", key.trim_matches('"'));
    let body = r#"{"item":"piano"}"#;

    let mut server = ChildServer::spawn(test, &target, lease);
    let addr = server.addr;
    let pending = {
        let client = client.clone();
        let key = key.clone();
        runtime.spawn(async move {
            send(
                &client,
                addr,
                "/orders",
                Some(&key),
                body,
                &[("x-crash", "1")],
            )
            .await
        })
    };
    let (worked, dead_fencing) = server.wait_worked();
    assert_eq!(worked, stored_key);
    let killed_at = Instant::now();
    server.kill();
    assert!(
        runtime.block_on(pending).unwrap().is_err(),
        "the client saw the connection die"
    );

    let server = ChildServer::spawn(test, &target, lease);
    let addr = server.addr;
    runtime.block_on(async {
        match kind {
            Kind::Sqlite | Kind::Postgres | Kind::Mysql => {
                // Nothing was committed: no effect, no claim. The retry runs once.
                assert_eq!(effects(&target, &stored_key).await, 0, "{kind:?}");
                let a = send(&client, addr, "/orders", Some(&key), body, &[])
                    .await
                    .unwrap();
                assert_eq!(a.status, StatusCode::CREATED, "{kind:?}");
                assert!(!a.replayed());
                assert_eq!(effects(&target, &stored_key).await, 1, "{kind:?}");
                let b = send(&client, addr, "/orders", Some(&key), body, &[])
                    .await
                    .unwrap();
                assert!(b.replayed());
                assert_eq!(b.body, a.body);
            }
            Kind::Redis => {
                // The dead holder's effect stays and its lease holds the key
                // until it expires: 409 meanwhile, then the retry runs the
                // handler again (a second effect, with a higher fencing token).
                assert_eq!(effects(&target, &stored_key).await, 1);
                let a = send(&client, addr, "/orders", Some(&key), body, &[])
                    .await
                    .unwrap();
                if killed_at.elapsed() < lease - Duration::from_millis(200) {
                    assert_eq!(
                        a.status,
                        StatusCode::CONFLICT,
                        "the dead holder's lease still holds"
                    );
                }
                let a = send_until_done(&client, addr, &key, body).await;
                assert!(
                    killed_at.elapsed() >= lease - Duration::from_millis(50),
                    "not before the lease expired"
                );
                assert_eq!(a.status, StatusCode::CREATED);
                assert!(!a.replayed());
                let fencing = a.json()["fencing"].as_u64().unwrap();
                assert!(
                    fencing > dead_fencing && dead_fencing > 0,
                    "a new acquisition, fenced above the dead one: {fencing} > {dead_fencing}"
                );
                assert_eq!(
                    effects(&target, &stored_key).await,
                    2,
                    "lease stores repeat the effect"
                );
                let b = send(&client, addr, "/orders", Some(&key), body, &[])
                    .await
                    .unwrap();
                assert!(b.replayed());
                assert_eq!(b.body, a.body);
            }
            Kind::Memory => {
                // The store died with the process: the key is new again.
                assert_eq!(effects(&target, &stored_key).await, 1);
                let a = send(&client, addr, "/orders", Some(&key), body, &[])
                    .await
                    .unwrap();
                assert_eq!(a.status, StatusCode::CREATED);
                assert!(!a.replayed());
                assert_eq!(effects(&target, &stored_key).await, 2);
            }
        }
        cleanup(&target).await;
    });
    server.kill();
    eprintln!("{kind:?}: crash test in {:?}", started.elapsed());
}

#[test]
fn crash_on_postgres() {
    crash_between_work_and_stored_response("crash_on_postgres", Kind::Postgres);
}

#[test]
fn crash_on_mariadb() {
    crash_between_work_and_stored_response("crash_on_mariadb", Kind::Mysql);
}

#[test]
fn crash_on_sqlite() {
    crash_between_work_and_stored_response("crash_on_sqlite", Kind::Sqlite);
}

#[test]
fn crash_on_redis() {
    crash_between_work_and_stored_response("crash_on_redis", Kind::Redis);
}

#[test]
fn crash_on_memory() {
    crash_between_work_and_stored_response("crash_on_memory", Kind::Memory);
}

/// A client that goes away mid-request: hyper drops the request's future,
/// which releases the key (and on SQL stores rolls the claim back), so the
/// retry runs the handler as the first time.
async fn dropped_connection_releases_the_key(kind: Kind) {
    let dir = tempfile::tempdir().unwrap();
    let target = new_target(kind, dir.path());
    let (addr, server) = start_kind(target.clone(), Options::default()).await;
    let key = format!("\"gone-{}\"", uuid::Uuid::new_v4());
    let stored_key = format!("acme/{}", key.trim_matches('"'));
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()
        .unwrap();
    let r = send(
        &impatient,
        addr,
        "/orders",
        Some(&key),
        "{}",
        &[("x-sleep-ms", "600")],
    )
    .await;
    assert!(r.is_err(), "the client gave up");
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(
        effects(&target, &stored_key).await,
        0,
        "{kind:?}: the handler was cancelled"
    );
    let client = reqwest::Client::new();
    let a = send(&client, addr, "/orders", Some(&key), "{}", &[])
        .await
        .unwrap();
    assert_eq!(
        a.status,
        StatusCode::CREATED,
        "{kind:?}: the key was released"
    );
    assert!(!a.replayed());
    assert_eq!(effects(&target, &stored_key).await, 1);
    server.abort();
    cleanup(&target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_on_memory() {
    dropped_connection_releases_the_key(Kind::Memory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_on_postgres() {
    dropped_connection_releases_the_key(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_connection_on_redis() {
    dropped_connection_releases_the_key(Kind::Redis).await;
}
