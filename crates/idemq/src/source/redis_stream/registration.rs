//! Redis Streams in the broker registry ([`crate::source::registry`]).

use super::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
use crate::error::SourceError;
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;
use crate::source::url::{competing_with, with_default_param};

/// Redis Streams: how `redis-stream://` URLs open.
pub const BROKER: Broker =
    Broker::of::<RedisStreamConfig, RedisStreamSource, RedisStreamPublisher>(
        "redis-stream",
        "Redis Streams",
        &["redis-stream"],
    )
    .with_competing_url(competing_url);

/// Each consumer of a group needs a name of its own.
fn competing_url(url: &str, n: usize) -> String {
    competing_with(url, "consumer", "idemq", n)
}

impl BrokerConfig for RedisStreamConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// A producer belongs to no consumer group: the URL may omit it.
    fn publisher_url(url: &str) -> String {
        with_default_param(url, "group", "idemq-produce")
    }

    /// Deletes the stream key (and with it its consumer groups).
    async fn remove(self) -> Result<(), SourceError> {
        let mut conn =
            super::conn::connection(&self.redis_url, super::conn::COMMAND_TIMEOUT).await?;
        redis::cmd("DEL")
            .arg(&self.stream)
            .query_async::<i64>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| super::conn::broker_error(&format!("DEL {}", self.stream), e))
    }
}

impl ConnectWith<RedisStreamConfig> for RedisStreamSource {
    async fn connect_with(config: RedisStreamConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<RedisStreamConfig> for RedisStreamPublisher {
    async fn connect_with(config: RedisStreamConfig) -> Result<Self, SourceError> {
        Self::connect(&config).await
    }
}
