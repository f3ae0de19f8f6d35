//! Payments from a Kafka topic applied exactly once to a PostgreSQL ledger,
//! although the producer sends some of them twice.
//!
//! Needs a broker on 127.0.0.1:9092 (`scripts/kafka.sh`) and PostgreSQL
//! (`IDEMQ_POSTGRES`, default `postgres://postgres@127.0.0.1:5432/test`).
//! Run: `cargo run -p idemq --features kafka,postgres --example kafka`
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemq::source::kafka::{default_key_spec, KafkaConfig, KafkaPublisher, KafkaSource};
use idemq::source::Publisher;
use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
use idemq::{Consumer, HandlerError, Message};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;

const BROKERS: &str = "127.0.0.1:9092";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let run = std::process::id();
    let topic = format!("payments-example-{run}");
    let table = format!("kafka_example_ledger_{run}");

    // Kafka-compatible brokers such as tansu do not create topics on first use.
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()?;
    for result in admin
        .create_topics(
            &[NewTopic::new(&topic, 3, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await?
    {
        result.map_err(|(name, code)| format!("creating topic {name}: {code}"))?;
    }

    // At-least-once delivery: pay-2 is sent twice, pay-3 once more by a
    // producer retry with a new message id.
    let publisher = KafkaPublisher::connect(BROKERS, &topic).await?;
    let payment = |id: &str, pay: &str, amount: i64| {
        Message::new(format!(r#"{{"payment_id":"{pay}","amount":{amount}}}"#))
            .with_id(id)
            .with_key(pay)
            .with_header("event_id", pay)
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
    publisher.flush().await?;

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
    let consumer = Consumer::builder(format!("kafka-example-{run}"), store.clone())
        .key(default_key_spec()) // header event_id, else the record key
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

    let config = KafkaConfig::from_url(&format!(
        "kafka://{BROKERS}/{topic}?group=example-{run}&session_timeout_ms=6000"
    ))?;
    let source = KafkaSource::connect(config).await?;
    // A Kafka stream never ends: stop once every record was settled (or after a minute).
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
