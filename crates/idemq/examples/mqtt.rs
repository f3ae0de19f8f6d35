//! Payments over MQTT, applied exactly once to a PostgreSQL ledger although
//! the topic carries duplicates of both kinds.
//!
//! Run (an MQTT 5 broker such as Mosquitto on 127.0.0.1:1883, and
//! PostgreSQL on localhost):
//! `cargo run -p idemq --features mqtt,postgres --example mqtt`
//! (`MQTT_BROKER` (`host:port`) and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource};
use idemq::source::Publisher;
use idemq::KeySpec;

#[path = "common/ledger.rs"]
mod ledger;

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let queue = format!("idemq-example-{}", std::process::id());
    let broker = std::env::var("MQTT_BROKER").unwrap_or_else(|_| "127.0.0.1:1883".into());
    // The consumer's persistent session (a fixed client id in real use).
    let config = MqttConfig::from_url(&format!(
        "mqtt://{broker}/payments/{queue}?client_id={queue}&session_expiry=60s"
    ))?;
    let ledger = ledger::Ledger::create("mqtt").await?;

    // Subscribe first: MQTT keeps messages only for existing subscriptions.
    let source = MqttSource::connect(config.clone()).await?;
    // The producer: pay-2 is sent twice (same message id, as a QoS 1 resend
    // would) and pay-3 is sent again by a producer retry (new message id,
    // same business key).
    let publisher = MqttPublisher::connect(&config).await?;
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

    // A subscription never ends: stop once every message has an outcome.
    let stop = settled.reached(messages.len(), Duration::from_secs(30));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 2).await?;

    // Clean up the example's table (the session expires after 60 s).
    ledger.drop_table().await?;
    Ok(())
}
