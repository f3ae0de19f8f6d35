//! RabbitMQ in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{AmqpConfig, AmqpPublisher, AmqpSource};
use crate::error::SourceError;
use crate::source::registry::transport_key_or_id;
use crate::source::registry::{same_url, Broker};
use crate::source::{Publisher, Source};

/// RabbitMQ: how `amqp://` URLs open.
pub const BROKER: Broker = Broker {
    id: "amqp",
    name: "RabbitMQ",
    schemes: &["amqp", "amqps"],
    watermarks: false,
    subscribe_before_publish: false,
    default_key: transport_key_or_id,
    check,
    competing_url: same_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    AmqpConfig::from_url(url).map(|_| ())
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = AmqpConfig::from_url(url)?;
        Ok(Box::new(AmqpSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(async move {
        let config = AmqpConfig::from_url(url)?;
        Ok(Box::new(AmqpPublisher::connect(config).await?) as Box<dyn Publisher>)
    })
}
