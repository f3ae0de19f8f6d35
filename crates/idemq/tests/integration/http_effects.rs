//! HTTP effects (`idemq::effect::http`) against a real HTTP server started
//! in the test: a payment provider that charges cards, optionally
//! deduplicating by `Idempotency-Key`, and counts its charges per payment.
//!
//! A consumer over a real store (a SQLite file, PostgreSQL) charges every
//! payment through `http::post_json` and writes a ledger row in the claim's
//! transaction. The deliveries carry duplicates of both kinds, and the
//! consumer dies in each crash window once:
//!
//! - (a) between the provider call and the journal write: the provider
//!   charges, then holds its answer; the consumer task is killed while it
//!   waits, so nothing is journaled;
//! - (b) between the journal write and the inbox commit: the handler hangs
//!   after the call and is killed;
//! - (c) after the commit, before the ack: the ack is lost and the message
//!   comes back.
//!
//! With the key honoured, every payment is charged exactly once. With the
//! provider's idempotency off, the journal alone prevents the repeat call
//! in (b) and (c) and for every duplicate; (a) costs exactly one extra
//! charge, the documented limit.

use crate::support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use futures_util::future::BoxFuture;
use idemq::effect::http::{self, reqwest, StoredResponse};
use idemq::source::queue::MemoryQueue;
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::sqlite::SqliteStore;
use idemq::store::sql::SqlOptions;
use idemq::store::{Store, StoreAdmin};
use idemq::{
    idempotency_key, Consumer, HandlerError, HandlerErrorKind, KeySpec, Message, Outcome,
    OutcomeKind,
};
use serde_json::{json, Value};

// ---- the payment provider ----

/// What the provider keeps per idempotency key: the request body and its answer.
struct Recorded {
    body: Bytes,
    response: Value,
}

/// A payment API. `POST /charge` with `{"payment_id", "amount"}` and an
/// `Idempotency-Key` header charges the payment and answers 201 with
/// `{"charge_id", "payment_id", "amount"}`. When `idempotent`, a repeated
/// key gets the first answer back (200, no new charge), and a repeated key
/// with another body gets 422, as the draft says.
struct Provider {
    idempotent: bool,
    /// Every request: (payment id, idempotency key as sent).
    requests: Mutex<Vec<(String, String)>>,
    /// Charges per payment id.
    charges: Mutex<BTreeMap<String, Vec<String>>>,
    by_key: Mutex<HashMap<String, Recorded>>,
    /// Payments whose first answer is held back after the charge (window a).
    hold_first_answer: Mutex<HashSet<String>>,
    next: AtomicU32,
}

impl Provider {
    /// Starts the provider on a free port; returns it and its base URL.
    async fn start(idempotent: bool) -> (Arc<Self>, String) {
        let provider = Arc::new(Self {
            idempotent,
            requests: Mutex::default(),
            charges: Mutex::default(),
            by_key: Mutex::default(),
            hold_first_answer: Mutex::default(),
            next: AtomicU32::new(0),
        });
        let app = Router::new()
            .route("/charge", post(charge))
            .route("/status/{code}", post(status))
            .with_state(Arc::clone(&provider));
        let addr = serve(app).await;
        (provider, format!("http://{addr}"))
    }

    fn charges_of(&self, payment: &str) -> Vec<String> {
        self.charges
            .lock()
            .unwrap()
            .get(payment)
            .cloned()
            .unwrap_or_default()
    }

    fn requests_of(&self, payment: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == payment)
            .count()
    }
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn charge(
    State(provider): State<Arc<Provider>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Some(key) = headers
        .get(http::HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(http::parse_header_value)
    else {
        return (StatusCode::BAD_REQUEST, "Idempotency-Key missing").into_response();
    };
    let Ok(payment) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "not JSON").into_response();
    };
    let payment_id = payment["payment_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    provider
        .requests
        .lock()
        .unwrap()
        .push((payment_id.clone(), key.clone()));
    let response = {
        let mut by_key = provider.by_key.lock().unwrap();
        match by_key.get(&key) {
            Some(seen) if provider.idempotent && seen.body != body => {
                return (StatusCode::UNPROCESSABLE_ENTITY, "key reused").into_response();
            }
            Some(seen) if provider.idempotent => {
                return (StatusCode::OK, axum::Json(seen.response.clone())).into_response();
            }
            _ => {}
        }
        let n = provider.next.fetch_add(1, Ordering::SeqCst) + 1;
        let charge_id = format!("ch-{n}");
        provider
            .charges
            .lock()
            .unwrap()
            .entry(payment_id.clone())
            .or_default()
            .push(charge_id.clone());
        let response = json!({ "charge_id": charge_id, "payment_id": payment_id, "amount": payment["amount"] });
        by_key.insert(
            key,
            Recorded {
                body,
                response: response.clone(),
            },
        );
        response
    };
    // The charge is done and recorded; the answer may be held back, as if
    // the network or the consumer died before it arrived.
    if provider
        .hold_first_answer
        .lock()
        .unwrap()
        .remove(&payment_id)
    {
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    (StatusCode::CREATED, axum::Json(response)).into_response()
}

/// Answers with the status in the path; 409 and 503 with `Retry-After: 3`;
/// 299 sleeps 2 s first (for the client timeout).
async fn status(Path(code): Path<u16>, headers: HeaderMap) -> Response {
    let key = headers
        .get(http::HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if code == 299 {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let status = StatusCode::from_u16(code).unwrap();
    let body = format!("status {code} for {key}");
    if matches!(code, 409 | 503) {
        (status, [("retry-after", "3")], body).into_response()
    } else {
        (status, body).into_response()
    }
}

// ---- the stores ----

/// Writes (key, amount, charge id) into `table` through the claim's transaction.
type Write<Tx> = for<'a> fn(
    &'a mut Tx,
    &'a str,
    &'a str,
    i64,
    &'a str,
) -> BoxFuture<'a, Result<(), HandlerError>>;

trait Env: Send + Sync + 'static {
    type S: Store + StoreAdmin + Clone;
    fn store(&self) -> Self::S;
    fn ledger_table(&self) -> &str;
    fn write() -> Write<<Self::S as Store>::Tx>;
    /// Ledger rows (payment id, amount, charge id), ordered.
    fn rows(&self) -> BoxFuture<'_, Vec<(String, i64, String)>>;
}

struct Sqlite {
    store: SqliteStore,
    _dir: tempfile::TempDir,
}

impl Sqlite {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("http.db").display());
        let store = SqliteStore::connect(&url).await.unwrap();
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE ledger (payment_id TEXT NOT NULL, amount BIGINT NOT NULL, charge_id TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        Self { store, _dir: dir }
    }
}

impl Env for Sqlite {
    type S = SqliteStore;
    fn store(&self) -> SqliteStore {
        self.store.clone()
    }
    fn ledger_table(&self) -> &str {
        "ledger"
    }
    fn write() -> Write<sqlx::Transaction<'static, sqlx::Sqlite>> {
        |tx, table, key, amount, charge| {
            Box::pin(async move {
                sqlx::query(&format!("INSERT INTO {table} VALUES (?, ?, ?)"))
                    .bind(key)
                    .bind(amount)
                    .bind(charge)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        }
    }
    fn rows(&self) -> BoxFuture<'_, Vec<(String, i64, String)>> {
        Box::pin(async move {
            sqlx::query_as("SELECT payment_id, amount, charge_id FROM ledger ORDER BY payment_id")
                .fetch_all(self.store.pool())
                .await
                .unwrap()
        })
    }
}

struct Postgres {
    store: PostgresStore,
    ledger: String,
}

impl Postgres {
    async fn new() -> Self {
        let prefix = format!("{}_", support::unique("http"));
        let store = PostgresStore::connect_with(
            &support::postgres_url(),
            SqlOptions::default().table_prefix(&prefix),
        )
        .await
        .unwrap();
        store.migrate().await.unwrap();
        let ledger = format!("{prefix}ledger");
        sqlx::query(&format!(
            "CREATE TABLE {ledger} (payment_id TEXT NOT NULL, amount BIGINT NOT NULL, charge_id TEXT NOT NULL)"
        ))
        .execute(store.pool())
        .await
        .unwrap();
        Self { store, ledger }
    }

    async fn drop_tables(self) {
        let t = self.store.tables().clone();
        for table in [
            &self.ledger,
            &t.inbox,
            &t.attempts,
            &t.dead_letters,
            &t.migrations,
            &t.offsets,
            &t.effects,
        ] {
            sqlx::query(&format!("DROP TABLE IF EXISTS {table}"))
                .execute(self.store.pool())
                .await
                .unwrap();
        }
    }
}

impl Env for Postgres {
    type S = PostgresStore;
    fn store(&self) -> PostgresStore {
        self.store.clone()
    }
    fn ledger_table(&self) -> &str {
        &self.ledger
    }
    fn write() -> Write<support::PgTx> {
        |tx, table, key, amount, charge| {
            Box::pin(async move {
                sqlx::query(&format!("INSERT INTO {table} VALUES ($1, $2, $3)"))
                    .bind(key)
                    .bind(amount)
                    .bind(charge)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        }
    }
    fn rows(&self) -> BoxFuture<'_, Vec<(String, i64, String)>> {
        Box::pin(async move {
            sqlx::query_as(&format!(
                "SELECT payment_id, amount, charge_id FROM {} ORDER BY payment_id",
                self.ledger
            ))
            .fetch_all(self.store.pool())
            .await
            .unwrap()
        })
    }
}

// ---- the consumer ----

/// Shared by the consumers of one scenario (each run is a new process).
#[derive(Default)]
struct World {
    /// Keys whose handler already hung once (window b).
    hung: Mutex<HashSet<String>>,
    /// Set when a handler is hanging.
    hanging: AtomicBool,
    outcomes: Mutex<Vec<Outcome>>,
}

impl World {
    fn processed(&self, key: &str) -> bool {
        self.outcomes
            .lock()
            .unwrap()
            .iter()
            .any(|o| matches!(o, Outcome::Processed { key: k, .. } if k == key))
    }

    fn count(&self, kind: OutcomeKind) -> usize {
        self.outcomes
            .lock()
            .unwrap()
            .iter()
            .filter(|o| o.kind() == kind)
            .count()
    }
}

/// The consumer: charge through `http::post_json`, write the ledger row,
/// hang once after the call if the payload says `"crash": "before_commit"`.
fn consumer<E: Env>(
    env: &E,
    name: &str,
    url: &str,
    world: &Arc<World>,
    concurrency: usize,
) -> Consumer<E::S> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let url: Arc<str> = format!("{url}/charge").into();
    let table: Arc<str> = env.ledger_table().into();
    let write = E::write();
    let hook_world = Arc::clone(world);
    let world = Arc::clone(world);
    Consumer::builder(name, env.store())
        .key(KeySpec::json("/payment_id"))
        .retry(support::fast_retry())
        .concurrency(concurrency)
        .on_outcome(move |o| hook_world.outcomes.lock().unwrap().push(o.clone()))
        .handler_fn(move |ctx, tx| {
            let (client, url, table, world) = (
                client.clone(),
                Arc::clone(&url),
                Arc::clone(&table),
                Arc::clone(&world),
            );
            Box::pin(async move {
                let payment: Value = ctx.message.json().map_err(HandlerError::permanent)?;
                let charged: StoredResponse =
                    http::post_json(ctx, "charge", &client, &url, &payment).await?;
                let charge_id = charged.body["charge_id"]
                    .as_str()
                    .ok_or_else(|| HandlerError::permanent("no charge_id"))?
                    .to_owned();
                let amount = payment["amount"].as_i64().unwrap_or_default();
                write(tx, &table, ctx.key, amount, &charge_id).await?;
                if payment["crash"] == "before_commit"
                    && world.hung.lock().unwrap().insert(ctx.key.to_owned())
                {
                    world.hanging.store(true, Ordering::SeqCst);
                    std::future::pending::<()>().await;
                }
                Ok(Some(json!({ "charge_id": charge_id })))
            })
        })
        .build()
        .unwrap()
}

/// Ten payments p-0 … p-9 (amount 100 × (i + 1)); p-5 asks its handler to
/// hang once after the call. Every third is redelivered (same id) right
/// after the next one, and p-0, p-5 and p-7 are sent again by a producer
/// retry (new id) at the end.
fn payments() -> (Vec<Message>, BTreeMap<String, i64>) {
    let msg = |id: &str, i: usize| {
        let extra = if i == 5 {
            json!({ "crash": "before_commit" })
        } else {
            json!({})
        };
        support::payment(id, &format!("p-{i}"), 100 * (i as i64 + 1), extra)
    };
    let mut messages = Vec::new();
    for i in 0..10 {
        messages.push(msg(&format!("m-{i}"), i));
        if i % 3 == 1 {
            messages.push(msg(&format!("m-{}", i - 1), i - 1));
        }
    }
    for i in [0, 5, 7] {
        messages.push(msg(&format!("m-{i}-retry"), i));
    }
    let expected = (0..10)
        .map(|i| (format!("p-{i}"), 100 * (i as i64 + 1)))
        .collect();
    (messages, expected)
}

/// Runs the three crash windows and the redeliveries; returns the provider.
async fn crash_windows<E: Env>(env: &E, idempotent: bool) -> Arc<Provider> {
    let (provider, url) = Provider::start(idempotent).await;
    provider
        .hold_first_answer
        .lock()
        .unwrap()
        .insert("p-2".into());
    let name = support::unique("http_pay");
    let world = Arc::new(World::default());
    let (messages, expected) = payments();
    let queue = MemoryQueue::new("payments");
    for m in &messages {
        queue.push(m.clone());
    }
    let store = env.store();
    let journal = store.journal().expect("SQL stores keep a journal");

    // (a) Killed between the provider call and the journal write: p-2 is
    // charged, its answer never arrives.
    let first = consumer(env, &name, &url, &world, 1);
    let source = queue.source();
    let run = tokio::spawn(async move { first.run(source).await });
    assert!(
        support::wait_until(Duration::from_secs(10), || !provider
            .charges_of("p-2")
            .is_empty())
        .await,
        "p-2 was never charged"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    assert_eq!(journal.get(&name, "p-2", "charge").await.unwrap(), None);
    assert!(store.inspect(&name, "p-2").await.unwrap().inbox.is_none());

    // (b) Killed between the journal write and the commit: p-5's handler
    // hangs after the call and the ledger write.
    let second = consumer(env, &name, &url, &world, 1);
    let source = queue.source();
    let run = tokio::spawn(async move { second.run(source).await });
    assert!(
        support::wait_until(Duration::from_secs(20), || world
            .hanging
            .load(Ordering::SeqCst))
        .await,
        "p-5 never reached its hang"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    assert!(journal.get(&name, "p-5", "charge").await.unwrap().is_some());
    assert!(store.inspect(&name, "p-5").await.unwrap().inbox.is_none());
    assert_eq!(provider.requests_of("p-5"), 1);

    // (c) Committed, then the ack is lost: p-7's ack is swallowed and the
    // consumer stops; the queue gets p-7 back.
    let third = consumer(env, &name, &url, &world, 1);
    let source =
        support::SwallowAcks::new(queue.source(), |d| d.message.key.as_deref() == Some("p-7"));
    let swallowed = Arc::clone(&source.swallowed);
    support::run_until(&third, source, Duration::from_secs(20), || {
        world.processed("p-7")
    })
    .await;
    assert!(swallowed.load(Ordering::SeqCst) >= 1);
    assert!(store.inspect(&name, "p-7").await.unwrap().inbox.is_some());

    // Everything left, with four workers, to the end of the queue.
    queue.close();
    let fourth = consumer(env, &name, &url, &world, 4);
    let summary = tokio::time::timeout(Duration::from_secs(30), fourth.run(queue.source()))
        .await
        .expect("the rest is processed")
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 0, "{summary}");
    assert_eq!(world.count(OutcomeKind::Processed), expected.len());

    // Everything delivered once more: all duplicates, no call.
    let requests = provider.requests.lock().unwrap().len();
    let again = MemoryQueue::new("payments-again");
    for m in &messages {
        again.push(m.clone());
    }
    again.close();
    let fifth = consumer(env, &name, &url, &world, 4);
    let summary = fifth.run(again.source()).await.unwrap();
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        messages.len() as u64,
        "{summary}"
    );
    assert_eq!(provider.requests.lock().unwrap().len(), requests);

    // The ledger is exact: one row per payment, with its amount and the
    // charge the journal holds.
    let rows = env.rows().await;
    let got: BTreeMap<String, i64> = rows.iter().map(|(p, a, _)| (p.clone(), *a)).collect();
    assert_eq!(rows.len(), expected.len(), "double ledger rows: {rows:?}");
    assert_eq!(got, expected);
    for (payment, _, charge_id) in &rows {
        let stored = journal
            .get(&name, payment, "charge")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored["body"]["charge_id"], charge_id.as_str(), "{payment}");
        assert_eq!(
            provider.charges_of(payment).last(),
            Some(charge_id),
            "{payment}"
        );
    }
    // Every request carried the derived key of its payment's "charge" step.
    for (payment, key) in provider.requests.lock().unwrap().iter() {
        assert_eq!(
            *key,
            idempotency_key(&name, payment, "charge").to_string(),
            "{payment}"
        );
    }
    // The journal stopped the repeat call in windows (b) and (c) and for
    // every duplicate; only (a) sent a second request.
    for payment in expected.keys() {
        let want = if payment == "p-2" { 2 } else { 1 };
        assert_eq!(
            provider.requests_of(payment),
            want,
            "requests for {payment}"
        );
    }
    provider
}

/// With the key honoured: every payment charged exactly once.
async fn exactly_once<E: Env>(env: &E) {
    let provider = crash_windows(env, true).await;
    let charges = provider.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), 10);
    for (payment, ids) in &charges {
        assert_eq!(ids.len(), 1, "charges of {payment}: {ids:?}");
    }
}

/// With the provider's idempotency off: the journal alone covers every
/// window but (a), which costs exactly one extra charge.
async fn journal_alone<E: Env>(env: &E) {
    let provider = crash_windows(env, false).await;
    let charges = provider.charges.lock().unwrap().clone();
    assert_eq!(charges.len(), 10);
    for (payment, ids) in &charges {
        let want = if payment == "p-2" { 2 } else { 1 };
        assert_eq!(ids.len(), want, "charges of {payment}: {ids:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_provider_honours_the_key_every_payment_charged_once() {
    exactly_once(&Sqlite::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_provider_without_idempotency_one_extra_charge_in_window_a() {
    journal_alone(&Sqlite::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_provider_honours_the_key_every_payment_charged_once() {
    let env = Postgres::new().await;
    exactly_once(&env).await;
    env.drop_tables().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_provider_without_idempotency_one_extra_charge_in_window_a() {
    let env = Postgres::new().await;
    journal_alone(&env).await;
    env.drop_tables().await;
}

/// `http::send` against the real server: the header as the draft spells it,
/// and each status class (plus a timeout and a refused connection) mapped
/// as documented.
#[tokio::test]
async fn statuses_and_transport_errors_map_as_documented() {
    let (_provider, url) = Provider::start(true).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let key = idempotency_key("billing", "pay-1", "charge");
    let send = |code: u16| http::send(client.post(format!("{url}/status/{code}")).body("{}"), key);

    let ok = send(201).await.unwrap();
    assert_eq!(ok.status, 201);
    // The server saw `"<uuid>"`, the sf-string form.
    assert_eq!(
        ok.body,
        json!(format!(
            "status 201 for \"972e9c90-e2be-5b65-bd74-98d4d423507e\""
        ))
    );
    match send(409).await.unwrap_err() {
        e if e.kind() == HandlerErrorKind::Retryable => {
            let (retry_after, message) = (e.retry_after(), e.message());
            assert_eq!(retry_after, Some(Duration::from_secs(3)));
            assert!(
                message.contains("409") && message.contains("in flight"),
                "{message}"
            );
        }
        other => panic!("409: {other:?}"),
    }
    let conflict = send(422).await.unwrap_err();
    assert!(!conflict.is_retryable());
    assert!(conflict.to_string().contains("conflict"), "{conflict}");
    for code in [500, 503, 429] {
        let err = send(code).await.unwrap_err();
        assert!(err.is_retryable(), "{code}: {err}");
    }
    for code in [400, 404] {
        let err = send(code).await.unwrap_err();
        assert!(!err.is_retryable(), "{code}: {err}");
        assert!(
            err.to_string().contains(&format!("status {code} for")),
            "{err}"
        );
    }
    let timeout = send(299).await.unwrap_err();
    assert!(timeout.is_retryable(), "{timeout}");
    assert!(timeout.to_string().contains("timed out"), "{timeout}");

    // A port nobody listens on: connection refused, retryable.
    let closed = std::net::SocketAddr::from(([127, 0, 0, 1], support::free_port()));
    let refused = http::send(client.post(format!("http://{closed}/x")), key)
        .await
        .unwrap_err();
    assert!(refused.is_retryable(), "{refused}");
    let invalid = http::send(client.post("not a url"), key).await.unwrap_err();
    assert!(!invalid.is_retryable(), "{invalid}");
}

/// A 2xx answer longer than a stored result may be is kept as its first
/// `MAX_RESULT_BODY` bytes, marked as cut, and the rest is not read into
/// memory.
#[tokio::test]
async fn a_huge_answer_is_stored_cut_to_its_first_mebibyte() {
    let huge = "x".repeat(3 * http::MAX_RESULT_BODY);
    let app = Router::new().route("/huge", post(move || async move { huge }));
    let url = format!("http://{}/huge", serve(app).await);
    let key = idempotency_key("billing", "pay-1", "charge");
    let stored = http::send(reqwest::Client::new().post(&url).body("{}"), key)
        .await
        .unwrap();
    assert_eq!(stored.status, 200);
    assert_eq!(stored.body["truncated_to_bytes"], http::MAX_RESULT_BODY);
    assert_eq!(
        stored.body["text"].as_str().map(str::len),
        Some(http::MAX_RESULT_BODY)
    );
}
