//! The publisher: [`RedisStreamPublisher`], `XADD` to one stream.

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::Value;

use super::config::RedisStreamConfig;
use super::conn::{broker_error, connection, COMMAND_TIMEOUT};
use super::entry::to_fields;
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Publishes to one stream with `XADD` in the layout of the module docs
/// (`payload`, `id`, `key`, `h:<name>`).
pub struct RedisStreamPublisher {
    conn: ConnectionManager,
    stream: String,
}

impl std::fmt::Debug for RedisStreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamPublisher")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl RedisStreamPublisher {
    /// Connects to the Redis and stream of `config` (the group is not used).
    pub async fn connect(config: &RedisStreamConfig) -> Result<Self, SourceError> {
        Self::connect_to(&config.redis_url, &config.stream).await
    }

    /// Connects to `stream` on the Redis at `redis_url` (`redis://host:port[/db]`).
    pub async fn connect_to(redis_url: &str, stream: &str) -> Result<Self, SourceError> {
        if stream.is_empty() {
            return Err(SourceError::config("the stream name is empty"));
        }
        Ok(Self {
            conn: connection(redis_url, COMMAND_TIMEOUT).await?,
            stream: stream.to_owned(),
        })
    }
}

#[async_trait]
impl Publisher for RedisStreamPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream).arg("*");
        for (name, value) in to_fields(message) {
            cmd.arg(name).arg(value);
        }
        cmd.query_async::<Value>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("XADD {}", self.stream), e))
    }
}
