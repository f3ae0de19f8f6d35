//! Payments from a RabbitMQ queue, applied exactly once to a PostgreSQL
//! ledger although the queue holds duplicates of both kinds.
//!
//! Run (RabbitMQ and PostgreSQL on localhost):
//! `cargo run -p idemq --features amqp,postgres --example amqp`
//! (`AMQP_URL` and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::amqp::{AmqpConfig, AmqpPublisher, AmqpSource};
use idemq::source::Publisher;
use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = format!("idemq-example-{}", std::process::id());
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let config = AmqpConfig::from_url(&format!("{url}?queue={queue}&prefetch=8"))?;
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());

    let store = PostgresStore::connect(&database).await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS example_ledger (payment_id TEXT, amount BIGINT)")
        .execute(store.pool())
        .await?;

    // The producer: pay-2 is redelivered (same message id) and pay-3 is sent
    // again by a producer retry (new message id, same business key).
    let publisher = AmqpPublisher::connect(config.clone()).await?;
    let payment = |id: &str, pay: &str, amount: i64| {
        Message::new(format!(r#"{{"payment_id":"{pay}","amount":{amount}}}"#)).with_id(id)
    };
    for message in [
        payment("m-1", "pay-1", 10),
        payment("m-2", "pay-2", 20),
        payment("m-2", "pay-2", 20),
        payment("m-3", "pay-3", 30),
        payment("m-3-retry", "pay-3", 30),
    ] {
        publisher.publish(&message).await?;
    }
    publisher.close().await?;

    let consumer = Consumer::builder(queue.as_str(), store.clone())
        .key(KeySpec::json("/payment_id"))
        .handler_fn(|ctx, tx| {
            Box::pin(async move {
                let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                sqlx::query("INSERT INTO example_ledger VALUES ($1, $2)")
                    .bind(ctx.key)
                    .bind(p["amount"].as_i64())
                    .execute(&mut **tx) // the transaction that claimed the key
                    .await?;
                Ok(None)
            })
        })
        .build()?;

    // A RabbitMQ queue never ends: stop once the queue is idle for a moment.
    let source = AmqpSource::connect(config.clone()).await?;
    let summary = consumer
        .run_until(source, tokio::time::sleep(Duration::from_secs(2)))
        .await?;
    println!("{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 3);
    assert_eq!(summary.count(OutcomeKind::Duplicate), 2);

    let (total,): (i64,) = sqlx::query_as(
        "SELECT COALESCE(SUM(amount), 0)::BIGINT FROM example_ledger WHERE payment_id IN ('pay-1','pay-2','pay-3')",
    )
    .fetch_one(store.pool())
    .await?;
    println!("ledger total: {total}");

    // Clean up the example's queues and rows.
    let cleanup = AmqpPublisher::connect(config.clone()).await?;
    cleanup.delete_topology().await?;
    cleanup.close().await?;
    sqlx::query("DROP TABLE example_ledger")
        .execute(store.pool())
        .await?;
    Ok(())
}
