//! Payments from a Redis stream, applied exactly once to a PostgreSQL ledger
//! although the stream holds duplicates of both kinds.
//!
//! Run (Redis on 127.0.0.1:6379 and PostgreSQL on localhost):
//! `cargo run -p idemq --features redis-streams,postgres --example redis_stream`
//! (`REDIS_HOST` (`host:port`) and `DATABASE_URL` override the defaults).
use std::time::Duration;

use idemq::source::redis_stream::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
use idemq::source::Publisher;
use idemq::KeySpec;

#[path = "common/ledger.rs"]
mod ledger;

#[tokio::main]
async fn main() -> Result<(), ledger::Error> {
    let stream = format!("idemq-example-{}", std::process::id());
    let host = std::env::var("REDIS_HOST").unwrap_or_else(|_| "127.0.0.1:6379".into());
    let config = RedisStreamConfig::from_url(&format!(
        "redis-stream://{host}/{stream}?group=billing&claim_idle=30s&block=500ms"
    ))?;
    let ledger = ledger::Ledger::create("redis_stream").await?;

    // The producer: pay-2 is appended twice (same message id: a stream does
    // not deduplicate) and pay-3 is sent again by a producer retry (new
    // message id, same business key).
    let publisher = RedisStreamPublisher::connect(&config).await?;
    let messages = ledger::payments();
    for message in &messages {
        publisher.publish(message).await?;
    }

    let settled = ledger::Settled::default();
    let consumer = ledger
        .consumer(stream.as_str())
        .key(KeySpec::json("/payment_id"))
        .on_outcome(settled.hook())
        .build()?;

    // A stream never ends: stop once every message has an outcome.
    let source = RedisStreamSource::connect(config.clone()).await?;
    let stop = settled.reached(messages.len(), Duration::from_secs(30));
    let summary = consumer.run_until(source, stop).await?;
    ledger.report(&summary, 2).await?;

    // Clean up the example's stream and table.
    let mut redis = redis::Client::open(config.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    redis::cmd("DEL")
        .arg(&stream)
        .query_async::<i64>(&mut redis)
        .await?;
    ledger.drop_table().await?;
    Ok(())
}
