//! Apache RocketMQ in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{RocketMqConfig, RocketMqPublisher, RocketMqSource};
use crate::error::SourceError;
use crate::source::registry::{same_url, Broker};
use crate::source::{Publisher, Source};

/// Apache RocketMQ: how `rocketmq://` URLs open.
pub const BROKER: Broker = Broker {
    id: "rocketmq",
    name: "Apache RocketMQ",
    schemes: &["rocketmq"],
    watermarks: false,
    subscribe_before_publish: false,
    default_key: super::default_key_spec,
    check,
    competing_url: same_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    RocketMqConfig::from_url(url).map(|_| ())
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = RocketMqConfig::from_url(url)?;
        Ok(Box::new(RocketMqSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(
        async move { Ok(Box::new(RocketMqPublisher::from_url(url).await?) as Box<dyn Publisher>) },
    )
}
