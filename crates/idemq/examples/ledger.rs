//! A payment ledger that applies each payment exactly once, however often
//! it is delivered. Run: `cargo run -p idemq --example ledger`
use idemq::source::queue::MemoryQueue;
use idemq::store::sql::sqlite::{SqliteStore, SqliteTx};
use idemq::store::StoreAdmin;
use idemq::{Consumer, Context, HandlerResult, KeySpec, Message};

#[derive(serde::Deserialize)]
struct Payment {
    account: String,
    amount: i64,
}

/// Applies one payment, in the transaction that claimed its key.
async fn apply(ctx: &Context<'_>, tx: &mut SqliteTx) -> HandlerResult {
    let payment: Payment = ctx.decode()?; // undecodable → dead letter
    sqlx::query("INSERT INTO ledger VALUES (?, ?, ?)")
        .bind(ctx.key)
        .bind(payment.account)
        .bind(payment.amount)
        .execute(&mut **tx)
        .await?;
    Ok(None)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::connect("sqlite::memory:").await?;
    store.migrate().await?;
    sqlx::query("CREATE TABLE ledger (payment_id TEXT, account TEXT, amount INTEGER)")
        .execute(store.pool())
        .await?;

    let consumer = Consumer::builder("ledger", store.clone())
        .key(KeySpec::json("/payment_id")) // a business key, not the broker's message id
        .handle(apply)
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
