//! Shared by the broker and lease-store tests (`crate::support`): a PostgreSQL
//! ledger that the handler writes through the claim's transaction, a handler
//! with scripted failures, a workload with both kinds of duplicates and some
//! poison, a source wrapper that "crashes" after the commit and before the
//! ack, and the exactly-once check; for the broker tests also an outcome
//! recorder ([`Tally`]), a delivery recorder ([`Deliveries`]), runners that
//! stop a consumer once enough outcomes are in or when told (and one to
//! kill), publishing, and the checks of dead-letter copies.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use std::future::Future;

use async_trait::async_trait;
use idemq::source::{Acknowledger, Delivery, Publisher, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::{Bind, Column, Dialect, SqlDatabase, SqlOptions, SqlRow, SqlStore};
use idemq::store::{ClaimRequest, DeadLetterRecord, Store, StoreAdmin};
use idemq::DeadLetterReason;
use idemq::{
    handler_fn, Consumer, ConsumerBuilder, HandlerError, HandlerResult, KeySpec, Message, Outcome,
    OutcomeKind, RetryPolicy, SourceError, Summary,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The PostgreSQL store's transaction, which the ledger handler writes through.
pub type PgTx = sqlx::Transaction<'static, sqlx::Postgres>;

/// The PostgreSQL URL of the tests (`IDEMQ_TEST_POSTGRES`).
pub fn postgres_url() -> String {
    std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// The MariaDB/MySQL URL of the tests (`IDEMQ_TEST_MYSQL`).
pub fn mysql_url() -> String {
    std::env::var("IDEMQ_TEST_MYSQL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A local TCP port free right now, for a server about to be started on
/// it. It is drawn from 28000 up to the start of the kernel's ephemeral range
/// (`ip_local_port_range`, 32768 by default): the OS gives out ports of that
/// range to every outgoing connection, so one taken there (as `bind(0)`
/// does) can be taken by another test's connection before the server binds
/// it; below it only another such draw can, one chance in thousands. Above
/// the ports of the test services (27017 is FerretDB's).
pub fn free_port() -> u16 {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .filter(|low| *low > 28_100)
        .unwrap_or(32_768);
    for _ in 0..1000 {
        let port = fastrand::u16(28_000..ephemeral);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in 28000..{ephemeral}");
}

/// A name unique to this process and call, for tables, topics, queues and groups.
pub fn unique(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{name}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        fastrand::u32(..)
    )
}

/// How the ledger handler behaves, by payload fields:
/// `"fail": "retry"` fails retryably `fail_times` times (every time if absent),
/// `"fail": "permanent"` fails permanently, `"sleep_ms": n` sleeps first.
/// The ledger row is written *before* failing, so a missing rollback shows.
#[derive(Default)]
pub struct Plan {
    failures: Mutex<HashMap<String, u32>>,
    /// Handler calls so far.
    pub calls: AtomicU32,
}

impl Plan {
    fn verdict(&self, key: &str, payload: &serde_json::Value) -> HandlerResult {
        match payload["fail"].as_str() {
            Some("retry") => {
                let mut failures = self.failures.lock().unwrap();
                let n = failures.entry(key.to_owned()).or_default();
                *n += 1;
                let limit = payload["fail_times"]
                    .as_u64()
                    .map_or(u32::MAX, |t| t as u32);
                if *n <= limit {
                    return Err(HandlerError::retryable(format!("flaky call {n}")));
                }
            }
            Some("permanent") => return Err(HandlerError::permanent("rejected by business rule")),
            _ => {}
        }
        Ok(Some(serde_json::json!({ "amount": payload["amount"] })))
    }
}

/// A migrated PostgreSQL store with unique tables and a ledger table
/// `{prefix}ledger (seq, msg_key, amount)` without a unique constraint, so a
/// double effect shows as two rows; `seq` numbers the rows in the order they
/// were written.
pub struct Ledger {
    /// The store (cheap to clone).
    pub store: PostgresStore,
    ledger: String,
}

impl Ledger {
    /// Fresh tables for one test.
    pub async fn new() -> Self {
        Self::at(&postgres_url()).await
    }

    /// Fresh tables for one test, on the PostgreSQL of `url`.
    pub async fn at(url: &str) -> Self {
        Self::with_options(url, |options| options).await
    }

    /// Fresh tables for one test with a time-partitioned inbox of
    /// `interval` partitions.
    pub async fn partitioned(interval: Duration) -> Self {
        Self::with_options(&postgres_url(), |options| {
            options.partitioned_inbox(idemq::store::sql::InboxPartitions::every(interval))
        })
        .await
    }

    async fn with_options(url: &str, options: impl FnOnce(SqlOptions) -> SqlOptions) -> Self {
        let prefix = format!("{}_", unique("t"));
        let store =
            PostgresStore::connect_with(url, options(SqlOptions::default().table_prefix(&prefix)))
                .await
                .expect("connect to PostgreSQL");
        store.migrate().await.expect("migrate");
        let ledger = format!("{prefix}ledger");
        sqlx::query(&format!(
            "CREATE TABLE {ledger} (seq BIGSERIAL, msg_key TEXT NOT NULL, amount BIGINT NOT NULL)"
        ))
        .execute(store.pool())
        .await
        .expect("create ledger");
        Self { store, ledger }
    }

    /// A consumer builder with the ledger handler, key `/payment_id` and a
    /// fast retry policy (3 attempts, 50 ms backoff, 100 ms busy delay).
    pub fn consumer(&self, name: &str, plan: Arc<Plan>) -> ConsumerBuilder<PostgresStore> {
        let insert: Arc<str> = format!(
            "INSERT INTO {} (msg_key, amount) VALUES ($1, $2)",
            self.ledger
        )
        .into();
        idemq::Consumer::builder(name, self.store.clone())
            .key(KeySpec::json("/payment_id"))
            .retry(fast_retry())
            .handler(handler_fn(move |ctx, tx: &mut PgTx| {
                let insert = Arc::clone(&insert);
                let plan = Arc::clone(&plan);
                Box::pin(async move {
                    plan.calls.fetch_add(1, Ordering::SeqCst);
                    let payload: serde_json::Value =
                        ctx.message.json().map_err(HandlerError::permanent)?;
                    if let Some(ms) = payload["sleep_ms"].as_u64() {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    sqlx::query(&insert)
                        .bind(ctx.key)
                        .bind(payload["amount"].as_i64().unwrap_or(0))
                        .execute(&mut **tx)
                        .await?;
                    plan.verdict(ctx.key, &payload)
                })
            }))
    }

    /// Ledger rows as (key, amount), ordered by key.
    pub async fn rows(&self) -> Vec<(String, i64)> {
        sqlx::query_as(&format!(
            "SELECT msg_key, amount FROM {} ORDER BY msg_key",
            self.ledger
        ))
        .fetch_all(self.store.pool())
        .await
        .expect("read ledger")
    }

    /// The keys of the ledger rows in the order they were written (a rolled
    /// back attempt leaves no row; its retry is written when it commits).
    pub async fn keys_in_order(&self) -> Vec<String> {
        sqlx::query_scalar(&format!("SELECT msg_key FROM {} ORDER BY seq", self.ledger))
            .fetch_all(self.store.pool())
            .await
            .expect("read ledger")
    }

    /// Every expected key has exactly one ledger row with its amount, and no
    /// other row exists.
    pub async fn assert_exactly_once(&self, expected: &BTreeMap<String, i64>) {
        let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (key, amount) in self.rows().await {
            seen.entry(key).or_default().push(amount);
        }
        let doubled: Vec<_> = seen.iter().filter(|(_, v)| v.len() > 1).collect();
        assert!(doubled.is_empty(), "double effects: {doubled:?}");
        let lost: Vec<_> = expected.keys().filter(|k| !seen.contains_key(*k)).collect();
        assert!(lost.is_empty(), "lost messages: {lost:?}");
        let extra: Vec<_> = seen.keys().filter(|k| !expected.contains_key(*k)).collect();
        assert!(extra.is_empty(), "unexpected effects: {extra:?}");
        for (key, amount) in expected {
            assert_eq!(seen[key], vec![*amount], "amount of {key}");
        }
    }

    /// Dead letters of all consumers, oldest first.
    pub async fn dead_letters(&self) -> Vec<DeadLetterRecord> {
        self.store
            .dead_letters(None, 0, 10_000)
            .await
            .expect("read dead letters")
    }

    /// Waits until `check` holds for the ledger rows, up to `limit`.
    pub async fn wait_for(
        &self,
        limit: Duration,
        check: impl Fn(&[(String, i64)]) -> bool,
    ) -> Vec<(String, i64)> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let rows = self.rows().await;
            if check(&rows) || tokio::time::Instant::now() > deadline {
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Drops the test's tables.
    pub async fn cleanup(self) {
        let prefix = self.store.tables().prefix.clone();
        drop_tables(self.store.pool(), &prefix).await;
    }
}

/// The URL of the test database of `dialect` (PostgreSQL or MariaDB).
pub fn sql_url(dialect: Dialect) -> String {
    match dialect {
        Dialect::MySql => mysql_url(),
        _ => postgres_url(),
    }
}

/// A migrated PostgreSQL or MariaDB store with `options` under a fresh table
/// prefix (`{tag}…_`), and the prefix.
pub async fn sql_store<DB: SqlDatabase>(tag: &str, options: SqlOptions) -> (SqlStore<DB>, String) {
    let prefix = format!("{}_", unique(tag));
    let store = SqlStore::<DB>::connect_with(&sql_url(DB::DIALECT), options.table_prefix(&prefix))
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    (store, prefix)
}

/// Drops what a test made under `prefix`: [`TEST_TABLES`], the journal, and
/// a partitioned layout's tables and functions.
pub async fn drop_tables<DB: SqlDatabase>(pool: &sqlx::Pool<DB>, prefix: &str) {
    let Ok(mut conn) = pool.acquire().await else {
        return;
    };
    let Ok(tables) = idemq::store::sql::Tables::new(prefix) else {
        return;
    };
    let test_tables = TEST_TABLES.iter().map(|t| format!("{prefix}{t}"));
    let layout_tables = tables.partition_tables();
    for table in test_tables
        .chain([tables.effects.clone()])
        .chain(layout_tables)
    {
        let _ = DB::execute(&mut conn, &format!("DROP TABLE IF EXISTS {table}"), &[]).await;
    }
    for function in tables.partition_functions() {
        let sql = format!("DROP FUNCTION IF EXISTS {function}");
        let _ = DB::execute_script(&mut conn, &sql).await;
    }
}

/// Runs `sql` (written with `?` placeholders) on `store`'s pool.
pub async fn sql_exec<DB: SqlDatabase>(store: &SqlStore<DB>, sql: &str, binds: &[Bind<'_>]) {
    let sql = DB::DIALECT.placeholders(sql.to_owned());
    let mut conn = store.pool().acquire().await.expect("a connection");
    DB::execute(&mut conn, &sql, binds).await.expect(&sql);
}

/// The rows of `sql` (written with `?` placeholders) as `columns`.
pub async fn sql_rows<DB: SqlDatabase>(
    store: &SqlStore<DB>,
    sql: &str,
    binds: &[Bind<'_>],
    columns: &[Column],
) -> Vec<SqlRow> {
    let sql = DB::DIALECT.placeholders(sql.to_owned());
    let mut conn = store.pool().acquire().await.expect("a connection");
    DB::fetch(&mut conn, &sql, binds, columns)
        .await
        .expect(&sql)
}

/// The one integer `sql` answers.
pub async fn sql_int<DB: SqlDatabase>(store: &SqlStore<DB>, sql: &str, binds: &[Bind<'_>]) -> i64 {
    let rows = sql_rows(store, sql, binds, &[Column::Int]).await;
    rows.first().expect(sql).int(0).expect(sql)
}

/// A claim of `key` by the consumer `payments` (SQL stores ignore the lease).
pub fn claim_request(key: &str) -> ClaimRequest<'_> {
    ClaimRequest {
        consumer: "payments",
        key,
        fingerprint: "f",
        lease: Duration::from_secs(30),
    }
}

/// The tables of one test under its prefix: the ledger and the store's own.
pub const TEST_TABLES: [&str; 6] = [
    "ledger",
    "inbox",
    "attempts",
    "dead_letters",
    "schema_migrations",
    "offsets",
];

/// 3 attempts, 50 ms backoff without jitter, 100 ms busy delay.
pub fn fast_retry() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(3)
        .with_initial_backoff(Duration::from_millis(50))
        .with_max_backoff(Duration::from_millis(500))
        .with_multiplier(2.0)
        .with_jitter(0.0)
        .with_busy_delay(Duration::from_millis(100))
        .with_max_deliveries(None)
}

/// Test messages: what to publish, and what the ledger must hold afterwards.
pub struct Workload {
    /// In publishing order, duplicates included.
    pub messages: Vec<Message>,
    /// Non-poison key → amount: the ledger must hold exactly these rows.
    pub expected: BTreeMap<String, i64>,
    /// Keys that must end as dead letters.
    pub poison: Vec<String>,
    /// Copies published beyond the first of each key.
    pub duplicates: usize,
}

/// A payment message: id `id`, transport key and header `event_id` set to the
/// payment id, JSON payload `{"payment_id", "amount"}` plus `extra` fields.
pub fn payment(id: &str, payment_id: &str, amount: i64, extra: serde_json::Value) -> Message {
    let mut payload = serde_json::json!({ "payment_id": payment_id, "amount": amount });
    if let (Some(p), Some(e)) = (payload.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            p.insert(k.clone(), v.clone());
        }
    }
    Message::new(payload.to_string())
        .with_id(id)
        .with_key(payment_id)
        .with_header("event_id", payment_id)
}

/// `n` payments `p-0 … p-{n-1}` with amounts 1..=n; every 4th is sent twice
/// with the same id (a redelivery), every 5th once more with a new id (a
/// producer retry); `poison` extra messages fail permanently. Duplicates
/// follow their original at a distance, so they may overlap in flight.
pub fn workload(n: usize, poison: usize) -> Workload {
    let mut messages = Vec::new();
    let mut expected = BTreeMap::new();
    let mut duplicates = 0;
    let mut later = Vec::new();
    for i in 0..n {
        let key = format!("p-{i}");
        let amount = i as i64 + 1;
        let msg = payment(&format!("m-{i}"), &key, amount, serde_json::json!({}));
        messages.push(msg.clone());
        expected.insert(key.clone(), amount);
        if i % 4 == 0 {
            later.push(msg);
            duplicates += 1;
        }
        if i % 5 == 0 {
            later.push(payment(
                &format!("m-{i}-retry"),
                &key,
                amount,
                serde_json::json!({}),
            ));
            duplicates += 1;
        }
        if i % 3 == 2 {
            messages.append(&mut later);
        }
    }
    messages.append(&mut later);
    let mut poison_keys = Vec::new();
    for i in 0..poison {
        let key = format!("poison-{i}");
        messages.push(payment(
            &format!("m-poison-{i}"),
            &key,
            0,
            serde_json::json!({ "fail": "permanent" }),
        ));
        poison_keys.push(key);
    }
    Workload {
        messages,
        expected,
        poison: poison_keys,
        duplicates,
    }
}

/// Asserts that exactly `keys` were dead-lettered (once each) with `reason`.
pub fn assert_dead_lettered(
    letters: &[DeadLetterRecord],
    keys: &[String],
    reason: &DeadLetterReason,
) {
    let mut got: Vec<_> = letters
        .iter()
        .filter(|l| l.reason == reason.code())
        .filter_map(|l| l.key.clone())
        .collect();
    got.sort();
    let mut want = keys.to_vec();
    want.sort();
    assert_eq!(got, want, "dead letters with reason {reason}: {letters:?}");
}

/// Wraps a source so that the settlement of chosen deliveries is swallowed:
/// the engine commits and "acks", but the ack never reaches the broker, as if
/// the consumer died between the two. The real acknowledgers are kept alive
/// (unsettled) until the wrapper is dropped, together with the source.
pub struct SwallowAcks<S> {
    inner: S,
    choose: Box<dyn FnMut(&Delivery) -> bool + Send>,
    held: Arc<Mutex<Vec<Box<dyn Acknowledger>>>>,
    /// How many settlements were swallowed.
    pub swallowed: Arc<AtomicU32>,
}

impl<S: Source> SwallowAcks<S> {
    /// Swallows the settlement of every delivery for which `choose` says yes.
    pub fn new(inner: S, choose: impl FnMut(&Delivery) -> bool + Send + 'static) -> Self {
        Self {
            inner,
            choose: Box::new(choose),
            held: Arc::default(),
            swallowed: Arc::default(),
        }
    }
}

struct Swallowed {
    real: Option<Box<dyn Acknowledger>>,
    held: Arc<Mutex<Vec<Box<dyn Acknowledger>>>>,
    swallowed: Arc<AtomicU32>,
}

impl Swallowed {
    fn hold(&mut self) {
        if let Some(real) = self.real.take() {
            self.held.lock().unwrap().push(real);
            self.swallowed.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[async_trait]
impl Acknowledger for Swallowed {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.hold();
        Ok(())
    }
    async fn nack(mut self: Box<Self>, _delay: Duration) -> Result<(), SourceError> {
        self.hold();
        Ok(())
    }
    async fn forward_dead_letter(
        mut self: Box<Self>,
        _reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        self.hold();
        Ok(())
    }
    fn contiguity(&self) -> idemq::source::Contiguity {
        self.real
            .as_ref()
            .map_or(idemq::source::Contiguity::InOrder, |real| real.contiguity())
    }
}

#[async_trait]
impl<S: Source> Source for SwallowAcks<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let Some(delivery) = self.inner.next().await? else {
            return Ok(None);
        };
        if !(self.choose)(&delivery) {
            return Ok(Some(delivery));
        }
        let (message, meta, defect, real) = delivery.into_parts();
        let acker = Box::new(Swallowed {
            real: Some(real),
            held: Arc::clone(&self.held),
            swallowed: Arc::clone(&self.swallowed),
        });
        let delivery = Delivery::new(message, meta, acker);
        Ok(Some(match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }))
    }

    // A wrapper forwards what the engine tells the source (see `Source`).
    async fn close(&mut self) {
        self.inner.close().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn idemq::source::OffsetLookup>) {
        self.inner.resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.inner.settle_out_of_order(per_partition)
    }
}

/// `n` payments `m-{i}` / `p-{i}` with amounts `i + 1` and the `extra`
/// payload fields, and the ledger they must leave (key → amount).
pub fn payments(n: usize, extra: serde_json::Value) -> (Vec<Message>, BTreeMap<String, i64>) {
    let messages = (0..n)
        .map(|i| {
            payment(
                &format!("m-{i}"),
                &format!("p-{i}"),
                i as i64 + 1,
                extra.clone(),
            )
        })
        .collect();
    let expected = (0..n).map(|i| (format!("p-{i}"), i as i64 + 1)).collect();
    (messages, expected)
}

/// Publishes `messages` in order, then flushes the publisher.
/// The first send is retried for up to 30 s: a broker may still be
/// registering, or creating a new topic's route (RocketMQ answers
/// `broker.operation.failed` until it has).
pub async fn publish_all<P: Publisher + ?Sized>(publisher: &P, messages: &[Message]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for (i, m) in messages.iter().enumerate() {
        loop {
            match publisher.publish(m).await {
                Ok(()) => break,
                Err(e) if i == 0 && Instant::now() < deadline => {
                    eprintln!("first publish failed, retrying: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("publish: {e}"),
            }
        }
    }
    publisher.flush().await.expect("flush the publisher");
}

/// The key an outcome is about, where it has one.
pub fn outcome_key(outcome: &Outcome) -> Option<String> {
    match outcome {
        Outcome::Processed { key, .. } => Some(key.clone()),
        Outcome::Duplicate { record } | Outcome::Conflict { record, .. } => {
            Some(record.key.clone())
        }
        Outcome::RetryLater { key, .. } | Outcome::DeadLettered { key, .. } => key.clone(),
        other => panic!("an outcome this support does not know: {other:?}"),
    }
}

/// Every outcome with its time, shared by the consumers of one test.
#[derive(Clone, Default)]
pub struct Tally(Arc<Mutex<Vec<TallyEntry>>>);

/// When, what, and for which key.
pub type TallyEntry = (Instant, OutcomeKind, Option<String>);

impl Tally {
    /// The `on_outcome` hook that records into this tally.
    pub fn hook(&self) -> impl Fn(&Outcome) + Send + Sync + 'static {
        let all = Arc::clone(&self.0);
        move |o: &Outcome| {
            all.lock()
                .unwrap()
                .push((Instant::now(), o.kind(), outcome_key(o)))
        }
    }

    /// Builds `builder` with this tally's hook on its outcomes.
    pub fn build<S: Store>(&self, builder: ConsumerBuilder<S>) -> Consumer<S> {
        builder.on_outcome(self.hook()).build().unwrap()
    }

    /// All outcomes so far, retry-later included.
    pub fn total(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Outcomes that end a delivery for good (everything but retry-later).
    pub fn finals(&self) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k != OutcomeKind::RetryLater)
            .count()
    }

    /// Outcomes of `kind`.
    pub fn count(&self, kind: OutcomeKind) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k == kind)
            .count()
    }

    /// (time, kind) of every outcome of `key`, in order.
    pub fn of(&self, key: &str) -> Vec<(Instant, OutcomeKind)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, k)| k.as_deref() == Some(key))
            .map(|(t, kind, ..)| (*t, *kind))
            .collect()
    }

    /// The keys processed, in the order of their outcomes.
    pub fn processed_keys(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, k, ..)| *k == OutcomeKind::Processed)
            .filter_map(|(_, _, key)| key.clone())
            .collect()
    }

    /// One outcome per expected key was processed, one per extra copy was a
    /// duplicate, and one per poison message was dead-lettered.
    pub fn assert_workload(&self, work: &Workload) {
        assert_eq!(self.count(OutcomeKind::Processed), work.expected.len());
        assert_eq!(self.count(OutcomeKind::Duplicate), work.duplicates);
        assert_eq!(self.count(OutcomeKind::DeadLettered), work.poison.len());
    }

    /// `key` had `outcomes` outcomes, each one a `gap` after the one before
    /// (the redelivery delay); `cause` names the delay that should have
    /// caused the gaps.
    pub fn assert_gaps(&self, key: &str, outcomes: usize, gap: Range<Duration>, cause: &str) {
        let all = self.of(key);
        assert_eq!(all.len(), outcomes, "{key}: {all:?}");
        for pair in all.windows(2) {
            let after = pair[1].0 - pair[0].0;
            assert!(
                gap.contains(&after),
                "{key}: redelivered after {after:?}, not after {cause}"
            );
        }
    }
}

/// One delivery as a source handed it out.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The message key (empty if none).
    pub key: String,
    /// The delivery count the source reported.
    pub count: u32,
    /// The message headers, as text.
    pub headers: BTreeMap<String, String>,
    /// When the source handed it out.
    pub at: Instant,
}

/// Records the deliveries the sources it wraps hand out.
#[derive(Clone, Default)]
pub struct Deliveries(Arc<Mutex<Vec<Seen>>>);

impl Deliveries {
    /// Wraps `inner` so that its deliveries are recorded here.
    pub fn wrap<S: Source>(&self, inner: S) -> Recorded<S> {
        Recorded {
            inner,
            seen: self.clone(),
        }
    }

    /// (deliveries, highest delivery count) of `key`.
    pub fn get(&self, key: &str) -> (u32, u32) {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.key == key)
            .fold((0, 0), |(n, max), s| (n + 1, max.max(s.count)))
    }

    /// Deliveries of all keys.
    pub fn total(&self) -> u32 {
        self.0.lock().unwrap().len() as u32
    }

    /// Every delivery, in order.
    pub fn log(&self) -> Vec<Seen> {
        self.0.lock().unwrap().clone()
    }
}

/// A source whose deliveries are recorded in a [`Deliveries`].
pub struct Recorded<S> {
    inner: S,
    seen: Deliveries,
}

#[async_trait]
impl<S: Source> Source for Recorded<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let delivery = self.inner.next().await?;
        if let Some(d) = &delivery {
            self.seen.0.lock().unwrap().push(Seen {
                key: d.message.key.clone().unwrap_or_default(),
                count: d.meta.delivery_count,
                headers: d
                    .message
                    .headers
                    .iter()
                    .map(|(k, v)| (k.to_owned(), String::from_utf8_lossy(v).into_owned()))
                    .collect(),
                at: Instant::now(),
            });
        }
        Ok(delivery)
    }

    // A wrapper forwards what the engine tells the source (see `Source`).
    async fn close(&mut self) {
        self.inner.close().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn idemq::source::OffsetLookup>) {
        self.inner.resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.inner.settle_out_of_order(per_partition)
    }
}

/// Polls `done` every 20 ms until it holds or `limit` passes; whether it held.
pub async fn wait_until(limit: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// Runs `consumer` over `source` until `done` holds, then stops it (the
/// deliveries in flight are finished) and returns its summary; panics if
/// `done` does not hold within `limit`.
pub async fn run_until<S: Store>(
    consumer: &Consumer<S>,
    source: impl Source,
    limit: Duration,
    done: impl Fn() -> bool,
) -> Summary {
    let summary = consumer
        .run_until(source, async {
            wait_until(limit, &done).await;
        })
        .await
        .unwrap();
    assert!(done(), "not done within {limit:?}: {summary}");
    summary
}

/// [`run_until`] `tally` (hooked to `consumer`) holds `n` final outcomes.
pub async fn run_until_settled<S: Store>(
    consumer: &Consumer<S>,
    source: impl Source,
    tally: &Tally,
    n: usize,
    limit: Duration,
) -> Summary {
    run_until(consumer, source, limit, || tally.finals() >= n).await
}

/// Runs every consumer over its source at once, each in a task of its own,
/// until `tally` (hooked to all of them) holds `n` final outcomes; panics if
/// that takes longer than `limit`.
pub async fn run_all_until_settled<S: Source + 'static>(
    runs: Vec<(Consumer<PostgresStore>, S)>,
    tally: &Tally,
    n: usize,
    limit: Duration,
) -> Vec<Summary> {
    let tasks: Vec<_> = runs
        .into_iter()
        .map(|(consumer, source)| {
            let tally = tally.clone();
            tokio::spawn(
                async move { run_until_settled(&consumer, source, &tally, n, limit).await },
            )
        })
        .collect();
    let mut summaries = Vec::new();
    for task in tasks {
        summaries.push(task.await.unwrap());
    }
    summaries
}

/// Takes `n` messages from `source` (each within 10 s) and acks them: for
/// reading a dead-letter destination.
pub async fn receive(source: &mut impl Source, n: usize) -> Vec<Message> {
    let mut got = Vec::new();
    while got.len() < n {
        let delivery = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("message in time")
            .unwrap()
            .unwrap();
        let (message, _, _, acker) = delivery.into_parts();
        acker.ack().await.unwrap();
        got.push(message);
    }
    got
}

/// `copies` (read from a dead-letter destination) are the poison payments of
/// [`workload`] with keys `keys`: each with its key, id, `event_id` header
/// and payload, and `reason` in the header `reason_header`.
pub fn assert_dead_letter_copies(
    copies: &[Message],
    keys: &[String],
    reason_header: &str,
    reason: &str,
) {
    let mut copies = copies.to_vec();
    copies.sort_by(|a, b| a.key.cmp(&b.key));
    let mut keys = keys.to_vec();
    keys.sort();
    assert_eq!(copies.len(), keys.len(), "{copies:?}");
    for (copy, key) in copies.iter().zip(&keys) {
        assert_eq!(copy.key.as_deref(), Some(key.as_str()));
        assert_eq!(copy.id, Some(format!("m-{key}")));
        assert_eq!(copy.headers.get(reason_header), Some(reason.as_bytes()));
        assert_eq!(copy.headers.get("event_id"), Some(key.as_bytes()));
        assert_eq!(copy.json().unwrap()["payment_id"], key.as_str());
    }
}

/// `fast_retry` with a fixed backoff of `delay` between attempts.
pub fn fixed_backoff(delay: Duration) -> RetryPolicy {
    fast_retry()
        .with_initial_backoff(delay)
        .with_max_backoff(delay)
        .with_multiplier(1.0)
}

/// Two payments for the retry tests: `p-flaky` (amount 3) fails twice and
/// then succeeds, `p-bad` (amount 4) always fails retryably.
pub fn flaky_and_bad() -> [Message; 2] {
    [
        payment(
            "m-flaky",
            "p-flaky",
            3,
            serde_json::json!({ "fail": "retry", "fail_times": 2 }),
        ),
        payment("m-bad", "p-bad", 4, serde_json::json!({ "fail": "retry" })),
    ]
}

/// A consumer running in a task until stopped (or killed).
pub struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<Summary, SourceError>>,
}

pub fn start(consumer: &Consumer<PostgresStore>, source: impl Source + 'static) -> Running {
    let (stop, stopped) = oneshot::channel::<()>();
    let consumer = consumer.clone();
    let task = tokio::spawn(async move {
        consumer
            .run_until(source, async {
                let _ = stopped.await;
            })
            .await
    });
    Running { stop, task }
}

impl Running {
    /// Asks the run to stop and waits for its summary (within its shutdown
    /// grace and the close: a minute at most, or the test fails).
    pub async fn stop(self) -> Summary {
        let _ = self.stop.send(());
        within(Duration::from_secs(60), "a stopping run", self.task)
            .await
            .unwrap()
            .unwrap()
    }

    /// Kills the run mid-flight: its source, connection and in-flight
    /// handlers are dropped without settling anything.
    pub async fn kill(self) {
        self.task.abort();
        let killed = within(Duration::from_secs(60), "a killed run", self.task).await;
        assert!(killed.unwrap_err().is_cancelled());
    }
}

/// `future`'s output, or a panic naming `what` when it takes longer than
/// `limit`: a test that hangs fails instead, and says where.
pub async fn within<F: Future>(limit: Duration, what: &str, future: F) -> F::Output {
    match tokio::time::timeout(limit, future).await {
        Ok(output) => output,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Polls `check` every 50 ms until it holds; panics after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        // A check that hangs (a query that never returns) fails too.
        let left = deadline.saturating_duration_since(Instant::now());
        let what_hung = format!("a check while waiting for {what}");
        if within(left.max(Duration::from_secs(1)), &what_hung, check()).await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
