//! RabbitMQ in the broker registry ([`crate::source::registry`]).

use super::{AmqpConfig, AmqpPublisher, AmqpSource};
use crate::error::SourceError;
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;

/// RabbitMQ: how `amqp://` URLs open.
pub const BROKER: Broker =
    Broker::of::<AmqpConfig, AmqpSource, AmqpPublisher>("amqp", "RabbitMQ", &["amqp", "amqps"]);

impl BrokerConfig for AmqpConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// Deletes every queue of the topology.
    async fn remove(self) -> Result<(), SourceError> {
        let publisher = AmqpPublisher::connect(self).await?;
        publisher.delete_topology().await?;
        publisher.close().await
    }
}

impl ConnectWith<AmqpConfig> for AmqpSource {
    async fn connect_with(config: AmqpConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<AmqpConfig> for AmqpPublisher {
    async fn connect_with(config: AmqpConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}
