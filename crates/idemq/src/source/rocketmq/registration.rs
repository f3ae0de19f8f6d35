//! Apache RocketMQ in the broker registry ([`crate::source::registry`]).

use super::{RocketMqConfig, RocketMqPublisher, RocketMqSource};
use crate::error::SourceError;
use crate::source::health::BrokerHealth;
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;
use crate::source::url::with_default_param;

/// Apache RocketMQ: how `rocketmq://` URLs open.
pub const BROKER: Broker = Broker::of::<RocketMqConfig, RocketMqSource, RocketMqPublisher>(
    "rocketmq",
    "Apache RocketMQ",
    &["rocketmq"],
)
.with_default_key(super::default_key_spec);

impl BrokerConfig for RocketMqConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// A producer belongs to no consumer group: the URL may omit it.
    fn publisher_url(url: &str) -> String {
        with_default_param(url, "group", "idemq-produce")
    }

    /// The source's own risky settings, and the broker's retention
    /// (`fileReservedTime`) read from the topic's master brokers.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let horizon = super::admin::retention(&self).await;
        Ok(BrokerHealth::new(horizon).with_risks(super::limits::risks(&self)))
    }
}

impl ConnectWith<RocketMqConfig> for RocketMqSource {
    async fn connect_with(config: RocketMqConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<RocketMqConfig> for RocketMqPublisher {
    async fn connect_with(config: RocketMqConfig) -> Result<Self, SourceError> {
        Self::with_config(&config).await
    }
}
