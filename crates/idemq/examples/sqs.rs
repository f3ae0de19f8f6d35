//! Payments from an SQS queue, applied exactly once to a PostgreSQL ledger
//! although the queue holds duplicates of both kinds.
//!
//! Run (an SQS endpoint such as `scripts/sqs.sh`'s moto on 127.0.0.1:5000,
//! and PostgreSQL on localhost):
//! `cargo run -p idemq --features sqs,postgres --example sqs`
//! (`SQS_ENDPOINT` and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::sqs::{SqsConfig, SqsPublisher, SqsSource};
use idemq::source::Publisher;
use idemq::KeySpec;

#[path = "common/ledger.rs"]
mod ledger;

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let queue = format!("idemq-example-{}", std::process::id());
    let endpoint = std::env::var("SQS_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:5000".into());
    let config = SqsConfig::from_url(&format!(
        "sqs://{queue}?endpoint={endpoint}&region=us-east-1&visibility=10&wait=1&create=true"
    ))?;
    let ledger = ledger::Ledger::create("sqs").await?;

    // The producer: pay-2 is delivered twice (same message id: a standard
    // queue does not deduplicate) and pay-3 is sent again by a producer retry
    // (new message id, same business key).
    let publisher = SqsPublisher::connect(config.clone()).await?;
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

    // An SQS queue never ends: stop once every message has an outcome.
    let source = SqsSource::connect(config.clone()).await?;
    let stop = settled.reached(messages.len(), Duration::from_secs(30));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 2).await?;

    // Clean up the example's queue and table.
    let client = config.client().await?;
    client
        .delete_queue()
        .queue_url(publisher.queue_url())
        .send()
        .await?;
    ledger.drop_table().await?;
    Ok(())
}
