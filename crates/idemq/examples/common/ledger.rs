//! The PostgreSQL side of the broker examples, the same for every broker:
//! a payment ledger table written through the transaction that claimed the
//! message's key, the payments they publish (with duplicates of both kinds),
//! and a count of the messages settled so far. An example includes it with
//! `#[path = "common/ledger.rs"] mod ledger;`; `examples/ledger.rs` shows the
//! same handler in one self-contained file.
#![allow(dead_code)] // each example uses what it needs

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, ConsumerBuilder, HandlerError, Message, Outcome, OutcomeKind, Summary};

/// The examples' error type.
pub type Error = Box<dyn std::error::Error>;

/// What the ledger totals when each payment is applied once (10 + 20 + 30),
/// although 110 was sent.
pub const TOTAL: i64 = 60;

/// The producer's side of at-least-once delivery: pay-2 is sent twice with
/// the same message id (a redelivery) and pay-3 again by a producer retry
/// (a new message id, the same business key). The payment id is also the
/// transport key and the `event_id` header.
pub fn payments() -> [Message; 5] {
    let payment = |id: &str, pay: &str, amount: i64| {
        Message::new(format!(r#"{{"payment_id":"{pay}","amount":{amount}}}"#))
            .with_id(id)
            .with_key(pay)
            .with_header("event_id", pay)
    };
    [
        payment("m-1", "pay-1", 10),
        payment("m-2", "pay-2", 20),
        payment("m-2", "pay-2", 20),
        payment("m-3", "pay-3", 30),
        payment("m-3-retry", "pay-3", 30),
    ]
}

/// The idemq tables and a ledger table of this run in PostgreSQL
/// (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
pub struct Ledger {
    /// The idemq store.
    pub store: PostgresStore,
    table: String,
}

impl Ledger {
    /// Connects, migrates the idemq tables and creates the ledger table
    /// `{name}_example_ledger_{pid}`.
    pub async fn create(name: &str) -> Result<Self, Error> {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let store = PostgresStore::connect(&url).await?;
        store.migrate().await?;
        let table = format!("{name}_example_ledger_{}", std::process::id());
        sqlx::query(&format!(
            "CREATE TABLE {table} (payment_id TEXT NOT NULL, amount BIGINT NOT NULL)"
        ))
        .execute(store.pool())
        .await?;
        Ok(Self { store, table })
    }

    /// A consumer called `name` whose handler books the payment under the
    /// message's key, in the transaction that claimed the key: the row and
    /// the inbox record commit together, or neither does.
    pub fn consumer(&self, name: impl Into<String>) -> ConsumerBuilder<PostgresStore> {
        let insert: Arc<str> = format!("INSERT INTO {} VALUES ($1, $2)", self.table).into();
        Consumer::builder(name, self.store.clone()).handler_fn(move |ctx, tx| {
            let insert = Arc::clone(&insert);
            Box::pin(async move {
                let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                sqlx::query(&insert)
                    .bind(ctx.key)
                    .bind(p["amount"].as_i64())
                    .execute(&mut **tx) // the transaction that claimed the key
                    .await?;
                Ok(None)
            })
        })
    }

    /// Prints the run's summary and the ledger total, and checks both: three
    /// payments processed, `duplicates` copies answered as duplicates, and
    /// [`TOTAL`] booked.
    pub async fn report(&self, summary: &Summary, duplicates: u64) -> Result<(), Error> {
        println!("{summary}");
        assert_eq!(summary.count(OutcomeKind::Processed), 3);
        assert_eq!(summary.count(OutcomeKind::Duplicate), duplicates);
        let (total,): (i64,) = sqlx::query_as(&format!(
            "SELECT COALESCE(SUM(amount), 0)::BIGINT FROM {}",
            self.table
        ))
        .fetch_one(self.store.pool())
        .await?;
        println!("ledger total: {total}");
        assert_eq!(total, TOTAL);
        Ok(())
    }

    /// Drops the ledger table.
    pub async fn drop_table(self) -> Result<(), Error> {
        sqlx::query(&format!("DROP TABLE {}", self.table))
            .execute(self.store.pool())
            .await?;
        Ok(())
    }
}

/// Counts the messages that reached a final outcome (all but retry-later).
#[derive(Clone, Default)]
pub struct Settled(Arc<AtomicUsize>);

impl Settled {
    /// The consumer's `on_outcome` hook.
    pub fn hook(&self) -> impl Fn(&Outcome) + Send + Sync + 'static {
        let settled = Arc::clone(&self.0);
        move |outcome| {
            if outcome.kind() != OutcomeKind::RetryLater {
                settled.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// Completes once `n` messages are settled, or after `limit`: a stop
    /// signal for `Consumer::run_until` over a stream that never ends.
    pub fn reached(&self, n: usize, limit: Duration) -> impl Future<Output = ()> {
        let settled = Arc::clone(&self.0);
        async move {
            let deadline = Instant::now() + limit;
            while settled.load(Ordering::SeqCst) < n && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
