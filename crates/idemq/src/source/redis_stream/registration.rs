//! Redis Streams in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
use crate::error::SourceError;
use crate::source::registry::transport_key_or_id;
use crate::source::registry::Broker;
use crate::source::url::{competing_with, with_default_param};
use crate::source::{Publisher, Source};

/// Redis Streams: how `redis-stream://` URLs open.
pub const BROKER: Broker = Broker {
    id: "redis-stream",
    name: "Redis Streams",
    schemes: &["redis-stream"],
    watermarks: false,
    subscribe_before_publish: false,
    default_key: transport_key_or_id,
    check,
    competing_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    RedisStreamConfig::from_url(url).map(|_| ())
}

/// Each consumer of a group needs a name of its own.
fn competing_url(url: &str, n: usize) -> String {
    competing_with(url, "consumer", "idemq", n)
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = RedisStreamConfig::from_url(url)?;
        Ok(Box::new(RedisStreamSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(async move {
        // A producer belongs to no consumer group: the URL may omit it.
        let url = with_default_param(url, "group", "idemq-produce");
        let config = RedisStreamConfig::from_url(&url)?;
        Ok(Box::new(RedisStreamPublisher::connect(&config).await?) as Box<dyn Publisher>)
    })
}
