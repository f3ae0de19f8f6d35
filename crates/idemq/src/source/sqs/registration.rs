//! Amazon SQS in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{SqsConfig, SqsPublisher, SqsSource};
use crate::error::SourceError;
use crate::source::registry::transport_key_or_id;
use crate::source::registry::{same_url, Broker};
use crate::source::{Publisher, Source};

/// Amazon SQS: how `sqs://` URLs open.
pub const BROKER: Broker = Broker {
    id: "sqs",
    name: "Amazon SQS",
    schemes: &["sqs"],
    watermarks: false,
    subscribe_before_publish: false,
    default_key: transport_key_or_id,
    check,
    competing_url: same_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    SqsConfig::from_url(url).map(|_| ())
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = SqsConfig::from_url(url)?;
        Ok(Box::new(SqsSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(async move {
        let config = SqsConfig::from_url(url)?;
        Ok(Box::new(SqsPublisher::connect(config).await?) as Box<dyn Publisher>)
    })
}
