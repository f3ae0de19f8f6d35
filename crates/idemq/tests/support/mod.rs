//! Shared by the broker and lease-store tests (`mod support;`): a PostgreSQL
//! ledger that the handler writes through the claim's transaction, a handler
//! with scripted failures, a workload with both kinds of duplicates and some
//! poison, a source wrapper that "crashes" after the commit and before the
//! ack, and the exactly-once check.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idemq::source::{Acknowledger, Delivery, Source};
use idemq::store::sql::postgres::PostgresStore;
use idemq::store::sql::SqlOptions;
use idemq::store::{DeadLetterReason, DeadLetterRecord, StoreAdmin};
use idemq::{
    handler_fn, ConsumerBuilder, HandlerError, HandlerResult, KeySpec, Message, RetryPolicy,
    SourceError,
};

/// The PostgreSQL store's transaction, which the ledger handler writes through.
pub type PgTx = sqlx::Transaction<'static, sqlx::Postgres>;

/// The PostgreSQL URL of the tests (`IDEMQ_TEST_POSTGRES`).
pub fn postgres_url() -> String {
    std::env::var("IDEMQ_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
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
/// `{prefix}ledger (msg_key, amount)` without a unique constraint, so a
/// double effect shows as two rows.
pub struct Ledger {
    /// The store (cheap to clone).
    pub store: PostgresStore,
    ledger: String,
}

impl Ledger {
    /// Fresh tables for one test.
    pub async fn new() -> Self {
        let prefix = format!("{}_", unique("t"));
        let store = PostgresStore::connect_with(
            &postgres_url(),
            SqlOptions::default().table_prefix(&prefix),
        )
        .await
        .expect("connect to PostgreSQL");
        store.migrate().await.expect("migrate");
        let ledger = format!("{prefix}ledger");
        sqlx::query(&format!(
            "CREATE TABLE {ledger} (msg_key TEXT NOT NULL, amount BIGINT NOT NULL)"
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
        for table in [
            "ledger",
            "inbox",
            "attempts",
            "dead_letters",
            "schema_migrations",
            "offsets",
        ] {
            let _ = sqlx::query(&format!("DROP TABLE IF EXISTS {prefix}{table}"))
                .execute(self.store.pool())
                .await;
        }
    }
}

/// 3 attempts, 50 ms backoff without jitter, 100 ms busy delay.
pub fn fast_retry() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(50),
        multiplier: 2.0,
        max_backoff: Duration::from_millis(500),
        jitter: 0.0,
        busy_delay: Duration::from_millis(100),
        max_deliveries: None,
    }
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
    async fn dead_letter(
        mut self: Box<Self>,
        _reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        self.hold();
        Ok(())
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
}
