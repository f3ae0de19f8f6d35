//! Payments from a RocketMQ topic applied exactly once to a PostgreSQL
//! ledger, although the producer sends some of them twice.
//!
//! Needs a name server on 127.0.0.1:9876 and a broker (`scripts/rocketmq.sh`)
//! and PostgreSQL (`IDEMQ_POSTGRES`, default
//! `postgres://postgres@127.0.0.1:5432/test`).
//! Run: `cargo run -p idemq --features rocketmq,postgres --example rocketmq`
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemq::source::rocketmq::{
    default_key_spec, RocketMqConfig, RocketMqPublisher, RocketMqSource,
};
use idemq::source::Publisher;
use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, HandlerError, Message};

const NAME_SERVER: &str = "127.0.0.1:9876";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = std::process::id();
    let topic = format!("payments_example_{run}");
    let table = format!("rocketmq_example_ledger_{run}");

    // At-least-once delivery: pay-2 is sent twice with the same producer id
    // (UNIQ_KEY), pay-3 once more by a producer retry with a new id. The
    // broker creates the topic on first use.
    let publisher = RocketMqPublisher::connect(NAME_SERVER, &topic).await?;
    let payment = |id: &str, pay: &str, amount: i64| {
        Message::new(format!(r#"{{"payment_id":"{pay}","amount":{amount}}}"#))
            .with_id(id) // becomes UNIQ_KEY
            .with_key(pay) // becomes the message keys
    };
    let messages = [
        payment("m-1", "pay-1", 100),
        payment("m-2", "pay-2", 20),
        payment("m-2", "pay-2", 20),
        payment("m-3", "pay-3", 3),
        payment("m-3-retry", "pay-3", 3),
    ];
    for m in &messages {
        publisher.publish(m).await?;
    }
    publisher.shutdown().await;

    let url = std::env::var("IDEMQ_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let store = PostgresStore::connect(&url).await?;
    store.migrate().await?;
    sqlx::query(&format!(
        "CREATE TABLE {table} (payment_id TEXT NOT NULL, amount BIGINT NOT NULL)"
    ))
    .execute(store.pool())
    .await?;

    let settled = Arc::new(AtomicUsize::new(0));
    let insert = format!("INSERT INTO {table} (payment_id, amount) VALUES ($1, $2)");
    let consumer = Consumer::builder(format!("rocketmq-example-{run}"), store.clone())
        .key(default_key_spec()) // the message keys, else UNIQ_KEY; never msg_id()
        .on_outcome({
            let settled = Arc::clone(&settled);
            move |_| {
                settled.fetch_add(1, Ordering::SeqCst);
            }
        })
        .handler_fn(move |ctx, tx| {
            let insert = insert.clone();
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
        .build()?;

    let config = RocketMqConfig::from_url(&format!(
        "rocketmq://{NAME_SERVER}/{topic}?group=example_{run}"
    ))?;
    let source = RocketMqSource::connect(config).await?;
    // A RocketMQ stream never ends: stop once every message was settled (or after a minute).
    let summary = consumer
        .run_until(source, async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while settled.load(Ordering::SeqCst) < messages.len()
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await?;
    println!("{summary}"); // processed=3 duplicate=2 ...

    let (total,): (Option<i64>,) =
        sqlx::query_as(&format!("SELECT SUM(amount)::BIGINT FROM {table}"))
            .fetch_one(store.pool())
            .await?;
    println!("ledger total: {}", total.unwrap_or(0)); // 123, not 146
    sqlx::query(&format!("DROP TABLE {table}"))
        .execute(store.pool())
        .await?;
    Ok(())
}
