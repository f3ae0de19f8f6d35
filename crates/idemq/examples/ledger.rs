//! A payment ledger that applies each payment exactly once, however often
//! it is delivered. Run: `cargo run -p idemq --example ledger`
use idemq::source::queue::MemoryQueue;
use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
use idemq::{Consumer, HandlerError, KeySpec, Message};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE ledger (payment_id TEXT, account TEXT, amount INTEGER)")
        .execute(store.pool())
        .await?;

    let consumer = Consumer::builder("ledger", store.clone())
        .key(KeySpec::json("/payment_id")) // a business key, not the broker's message id
        .handler_fn(|ctx, tx| {
            Box::pin(async move {
                let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                sqlx::query("INSERT INTO ledger VALUES (?, ?, ?)")
                    .bind(ctx.key)
                    .bind(p["account"].as_str())
                    .bind(p["amount"].as_i64())
                    .execute(&mut **tx) // the transaction that claimed the key
                    .await?;
                Ok(None)
            })
        })
        .build()?;

    // At-least-once delivery: the same payment arrives three times.
    let queue = MemoryQueue::new("payments");
    for _ in 0..3 {
        queue.push(Message::new(
            r#"{"payment_id":"pay-1","account":"alice","amount":120}"#,
        ));
    }
    queue.close();
    let summary = consumer.run(queue.source()).await?;
    println!("{summary}"); // processed=1 duplicate=2 conflict=0 retry_later=0 dead_lettered=0

    let (balance,): (i64,) = sqlx::query_as("SELECT SUM(amount) FROM ledger")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(balance, 120);
    println!("alice: {balance}");
    Ok(())
}
