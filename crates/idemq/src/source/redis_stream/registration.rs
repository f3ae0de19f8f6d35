//! Redis Streams in the broker registry ([`crate::source::registry`]).

use super::limits::{self, GroupState};
use super::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
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

    /// The stream and the group (`XINFO STREAM`, `XINFO GROUPS`): entries
    /// removed before the group read them are its risks; the horizon is
    /// unbounded (Redis trims by count or id, never by age, and a pending
    /// entry stays until acknowledged or trimmed).
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let mut conn =
            super::conn::connection(&self.redis_url, super::conn::COMMAND_TIMEOUT).await?;
        let mut health = BrokerHealth::new(Horizon::Unbounded {
            why: format!(
                "stream {}: entries stay until trimmed (MAXLEN/MINID), never by age",
                self.stream
            ),
        });
        match super::lag::read_state(&mut conn, &self.stream, &self.group).await {
            Ok(state) => match (state.stream, GroupState::from_info(&state.group)) {
                (Some(stream), Some(group)) => {
                    let losses = limits::unread_losses(&stream, &group);
                    health = health.with_risks(limits::risks(&self.stream, &self.group, &losses));
                }
                _ => {
                    health = health.with_unchecked(format!(
                        "stream {}: Redis before 7 tells no removed entries",
                        self.stream
                    ))
                }
            },
            Err(e) => {
                health = health
                    .with_unchecked(format!("stream {} group {}: {e}", self.stream, self.group))
            }
        }
        Ok(health)
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
