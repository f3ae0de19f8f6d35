//! Payments over MQTT, applied exactly once to a PostgreSQL ledger although
//! the topic carries duplicates of both kinds.
//!
//! Run (an MQTT 5 broker such as Mosquitto on 127.0.0.1:1883, and
//! PostgreSQL on localhost):
//! `cargo run -p idemq --features mqtt,postgres --example mqtt`
//! (`MQTT_BROKER` (`host:port`) and `DATABASE_URL` override the defaults).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource};
use idemq::source::Publisher;
use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = std::process::id();
    let queue = format!("idemq-example-{run}");
    let broker = std::env::var("MQTT_BROKER").unwrap_or_else(|_| "127.0.0.1:1883".into());
    // The consumer's persistent session (a fixed client id in real use).
    let config = MqttConfig::from_url(&format!(
        "mqtt://{broker}/payments/{queue}?client_id={queue}&session_expiry=60s"
    ))?;
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());

    let store = PostgresStore::connect(&database).await?;
    store.migrate().await?;
    let ledger = format!("mqtt_example_ledger_{run}");
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {ledger} (payment_id TEXT, amount BIGINT)"
    ))
    .execute(store.pool())
    .await?;

    // Subscribe first: MQTT keeps messages only for existing subscriptions.
    let source = MqttSource::connect(config.clone()).await?;
    // The producer: pay-2 is sent twice (same message id, as a QoS 1 resend
    // would) and pay-3 is sent again by a producer retry (new message id,
    // same business key).
    let publisher = MqttPublisher::connect(&config).await?;
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

    let insert: Arc<str> = format!("INSERT INTO {ledger} VALUES ($1, $2)").into();
    let settled = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(queue.as_str(), store.clone())
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

    // A subscription never ends: stop once every message has an outcome.
    let deadline = Instant::now() + Duration::from_secs(30);
    let summary = consumer
        .run_until(source, async {
            while settled.load(Ordering::SeqCst) < messages.len() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await?;
    println!("{summary}");
    assert_eq!(summary.count(OutcomeKind::Processed), 3);
    assert_eq!(summary.count(OutcomeKind::Duplicate), 2);

    let (total,): (i64,) = sqlx::query_as(&format!(
        "SELECT COALESCE(SUM(amount), 0)::BIGINT FROM {ledger}"
    ))
    .fetch_one(store.pool())
    .await?;
    println!("ledger total: {total}");
    assert_eq!(total, 60);

    // Clean up the example's table (the session expires after 60 s).
    sqlx::query(&format!("DROP TABLE {ledger}"))
        .execute(store.pool())
        .await?;
    Ok(())
}
