//! The Redis connection, and Redis errors mapped to [`SourceError`].

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::RedisError;

use crate::error::SourceError;

pub(super) const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) fn broker_error(what: &str, e: RedisError) -> SourceError {
    crate::source::kit::broker_error("Redis", what, e)
}

pub(super) fn is_transient(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(super) async fn connection(
    url: &str,
    response: Duration,
) -> Result<ConnectionManager, SourceError> {
    let client = crate::redis_client::client(url).map_err(SourceError::config)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(COMMAND_TIMEOUT))
        .set_response_timeout(Some(response))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| broker_error(&format!("connect to {}", crate::redact::redact_url(url)), e))
}
