//! Payments from a NATS JetStream stream, applied exactly once to a
//! PostgreSQL ledger although the stream holds duplicates of both kinds.
//!
//! Run (nats-server with JetStream on 127.0.0.1:4222 and PostgreSQL on
//! localhost):
//! `cargo run -p idemq --features nats,postgres --example nats`
//! (`NATS_URL` and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::nats::{NatsConfig, NatsPublisher, NatsSource};
use idemq::source::Publisher;
use idemq::KeySpec;

#[path = "common/ledger.rs"]
mod ledger;

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let run = std::process::id();
    let stream = format!("IDEMQ_EXAMPLE_{run}");
    let server = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let server = server.trim_end_matches('/');
    let config = NatsConfig::from_url(&format!(
        "{server}/{stream}/ledger?subject=payments.{run}&ack_wait=10s&wait=1s&create=true"
    ))?;
    let ledger = ledger::Ledger::create("nats").await?;

    // The producer: pay-2 is published twice with the same message id, which
    // JetStream itself drops (Nats-Msg-Id, within the duplicate window), and
    // pay-3 is sent again by a producer retry (new message id, same business
    // key), which only the inbox can catch.
    let publisher = NatsPublisher::connect(config.clone()).await?;
    let messages = ledger::payments();
    for message in &messages {
        publisher.publish(message).await?;
    }
    let stored = messages.len() - 1; // the same-id copy was dropped by JetStream

    let settled = ledger::Settled::default();
    let consumer = ledger
        .consumer(stream.as_str())
        .key(KeySpec::json("/payment_id"))
        .on_outcome(settled.hook())
        .build()?;

    // A JetStream consumer never ends: stop once every message has an outcome.
    let source = NatsSource::connect(config.clone()).await?;
    let stop = settled.reached(stored, Duration::from_secs(30));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 1).await?;

    // Clean up the example's stream and table.
    publisher.jetstream().delete_stream(&stream).await?;
    ledger.drop_table().await?;
    Ok(())
}
