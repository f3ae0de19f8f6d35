//! Apache Kafka in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{KafkaConfig, KafkaPublisher, KafkaSource};
use crate::error::SourceError;
use crate::source::registry::{same_url, Broker};
use crate::source::url::with_default_param;
use crate::source::{Publisher, Source};

/// Apache Kafka: how `kafka://` URLs open.
pub const BROKER: Broker = Broker {
    id: "kafka",
    name: "Apache Kafka",
    schemes: &["kafka"],
    watermarks: true,
    subscribe_before_publish: false,
    default_key: super::default_key_spec,
    check,
    competing_url: same_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    KafkaConfig::from_url(url).map(|_| ())
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = KafkaConfig::from_url(url)?;
        Ok(Box::new(KafkaSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(async move {
        // A producer belongs to no consumer group: the URL may omit it.
        let url = with_default_param(url, "group", "idemq-produce");
        let config = KafkaConfig::from_url(&url)?;
        if let Some(partitions) = config.create_partitions {
            super::create_topic(&config.brokers, &config.topic, partitions).await?;
        }
        let publisher = KafkaPublisher::connect(&config.brokers, &config.topic).await?;
        Ok(Box::new(publisher) as Box<dyn Publisher>)
    })
}
