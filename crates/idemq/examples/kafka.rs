//! Payments from a Kafka topic applied exactly once to a PostgreSQL ledger,
//! although the producer sends some of them twice.
//!
//! Needs a broker on 127.0.0.1:9092 (`scripts/kafka.sh`) and PostgreSQL
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
//! Run: `cargo run -p idemq --features kafka,postgres --example kafka`
use std::time::Duration;

use idemq::source::kafka::{
    create_topic, default_key_spec, KafkaConfig, KafkaPublisher, KafkaSource,
};
use idemq::source::Publisher;

#[path = "common/ledger.rs"]
mod ledger;

const BROKERS: &str = "127.0.0.1:9092";

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let run = std::process::id();
    let topic = format!("payments-example-{run}");
    // Locked-down clusters do not create topics on first use; create it explicitly.
    create_topic(BROKERS, &topic, 3).await?;
    let ledger = ledger::Ledger::create("kafka").await?;

    // At-least-once delivery: pay-2 is sent twice, pay-3 once more by a
    // producer retry with a new message id.
    let publisher = KafkaPublisher::connect(BROKERS, &topic).await?;
    let messages = ledger::payments();
    for m in &messages {
        publisher.publish(m).await?;
    }
    publisher.flush().await?;

    let settled = ledger::Settled::default();
    let consumer = ledger
        .consumer(format!("kafka-example-{run}"))
        .key(default_key_spec()) // header event_id, else the record key
        .on_outcome(settled.hook())
        .build()?;

    let config = KafkaConfig::from_url(&format!(
        "kafka://{BROKERS}/{topic}?group=example-{run}&session_timeout_ms=6000"
    ))?;
    let source = KafkaSource::connect(config).await?;
    // A Kafka stream never ends: stop once every record was settled (or after a minute).
    let stop = settled.reached(messages.len(), Duration::from_secs(60));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 2).await?; // processed=3 duplicate=2, ledger total 60, not 110

    ledger.drop_table().await?;
    Ok(())
}
