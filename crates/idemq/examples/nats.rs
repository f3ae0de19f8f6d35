//! Payments from a NATS JetStream stream, applied exactly once to a
//! PostgreSQL ledger although the stream holds duplicates of both kinds.
//!
//! Run (nats-server with JetStream on 127.0.0.1:4222 and PostgreSQL on
//! localhost):
//! `cargo run -p idemq --features nats,postgres --example nats`
//! (`NATS_URL` and `DATABASE_URL` override the defaults).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::source::nats::{NatsConfig, NatsPublisher, NatsSource};
use idemq::source::Publisher;
use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = std::process::id();
    let stream = format!("IDEMQ_EXAMPLE_{run}");
    let server = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let server = server.trim_end_matches('/');
    let config = NatsConfig::from_url(&format!(
        "{server}/{stream}/ledger?subject=payments.{run}&ack_wait=10s&wait=1s&create=true"
    ))?;
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());

    let store = PostgresStore::connect(&database).await?;
    store.migrate().await?;
    let ledger = format!("nats_example_ledger_{run}");
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (payment_id TEXT, amount BIGINT)"
    ))
    .execute(store.pool())
    .await?;

    // The producer: pay-2 is published twice with the same message id, which
    // JetStream itself drops (Nats-Msg-Id, within the duplicate window), and
    // pay-3 is sent again by a producer retry (new message id, same business
    // key), which only the inbox can catch.
    let publisher = NatsPublisher::connect(config.clone()).await?;
    let payment = |id: &str, pay: &str, amount: i64| {
        Message::new(format!(r#"{{"payment_id":"{pay}","amount":{amount}}}"#)).with_id(id)
    };
    let messages = [
        payment("m-1", "pay-1", 10),
        payment("m-2", "pay-2", 20),
        payment("m-2", "pay-2", 20),
        payment("m-3", "pay-3", 30),
        payment("m-3-retry", "pay-3", 30),
    ];
    for message in &messages {
        publisher.publish(message).await?;
    }
    let stored = messages.len() - 1; // the same-id copy was dropped by JetStream

    let insert: Arc<str> = format!("INSERT INTO {ledger} VALUES ($1, $2)").into();
    let settled = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(stream.as_str(), store.clone())
        .key(KeySpec::json("/payment_id"))
        .on_outcome({
            let settled = Arc::clone(&settled);
            move |outcome| {
                if outcome.kind() != OutcomeKind::RetryLater {
                    settled.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .handler_fn(move |ctx, tx| {
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
        .build()?;

    // A JetStream consumer never ends: stop once every message has an outcome.
    let source = NatsSource::connect(config.clone()).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let summary = consumer
        .run_until(source, async {
            while settled.load(Ordering::SeqCst) < stored && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await?;
    println!("{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 3);
    assert_eq!(summary.count(OutcomeKind::Duplicate), 1);

    let (total,): (i64,) = sqlx::query_as(&format!(
        "SELECT COALESCE(SUM(amount), 0)::BIGINT FROM {ledger}"
    ))
    .fetch_one(store.pool())
    .await?;
    println!("ledger total: {total}");
    assert_eq!(total, 60);

    // Clean up the example's stream and table.
    publisher.jetstream().delete_stream(&stream).await?;
    sqlx::query(&format!("DROP TABLE {ledger}"))
        .execute(store.pool())
        .await?;
    Ok(())
}
