//! Payments from a RabbitMQ queue, applied exactly once to a PostgreSQL
//! ledger although the queue holds duplicates of both kinds.
//!
//! Run (RabbitMQ and PostgreSQL on localhost):
//! `cargo run -p idemq --features amqp,postgres --example amqp`
//! (`AMQP_URL` and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::amqp::{AmqpConfig, AmqpPublisher, AmqpSource};
use idemq::source::Publisher;
use idemq::KeySpec;

#[path = "common/ledger.rs"]
mod ledger;

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let queue = format!("idemq-example-{}", std::process::id());
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let config = AmqpConfig::from_url(&format!("{url}?queue={queue}&prefetch=8"))?;
    let ledger = ledger::Ledger::create("amqp").await?;

    // The producer: pay-2 is redelivered (same message id) and pay-3 is sent
    // again by a producer retry (new message id, same business key).
    let publisher = AmqpPublisher::connect(config.clone()).await?;
    let messages = ledger::payments();
    for message in &messages {
        publisher.publish(message).await?;
    }

    let settled = ledger::Settled::default();
    let consumer = ledger
        .consumer(queue.as_str())
        .key(KeySpec::json("/payment_id"))
        .on_outcome(settled.hook())
        .build()?;

    // A RabbitMQ queue never ends: stop once every message has an outcome.
    let source = AmqpSource::connect(config.clone()).await?;
    let stop = settled.reached(messages.len(), Duration::from_secs(30));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 2).await?;

    // Clean up the example's queues and table.
    publisher.delete_topology().await?;
    publisher.close().await?;
    ledger.drop_table().await?;
    Ok(())
}
