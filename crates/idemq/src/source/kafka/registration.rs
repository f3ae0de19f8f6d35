//! Apache Kafka in the broker registry ([`crate::source::registry`]).

use super::{limits, KafkaConfig, KafkaPublisher, KafkaSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;
use crate::source::url::with_default_param;

/// Apache Kafka: how `kafka://` URLs open.
pub const BROKER: Broker =
    Broker::of::<KafkaConfig, KafkaSource, KafkaPublisher>("kafka", "Apache Kafka", &["kafka"])
        .with_watermarks()
        .with_default_key(super::default_key_spec);

impl BrokerConfig for KafkaConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// A producer belongs to no consumer group: the URL may omit it.
    fn publisher_url(url: &str) -> String {
        with_default_param(url, "group", "idemq-produce")
    }

    /// Deletes the topic.
    async fn remove(self) -> Result<(), SourceError> {
        self.delete_topic().await
    }

    /// The topic's configuration (`DescribeConfigs`): its loss risks and
    /// its retention as the horizon.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        match limits::try_describe(&self).await {
            Ok(values) => Ok(BrokerHealth::new(limits::horizon(&self.topic, &values))
                .with_risks(limits::risks(&self, Some(&values)))),
            Err(reason) => Ok(BrokerHealth::new(Horizon::Unknown {
                why: "the topic's configuration could not be read".into(),
            })
            .with_risks(limits::risks(&self, None))
            .with_unchecked(format!("topic {}'s configuration: {reason}", self.topic))),
        }
    }
}

impl ConnectWith<KafkaConfig> for KafkaSource {
    async fn connect_with(config: KafkaConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<KafkaConfig> for KafkaPublisher {
    /// Creates the topic first when the URL asks for it (`create_partitions`).
    async fn connect_with(config: KafkaConfig) -> Result<Self, SourceError> {
        if let Some(partitions) = config.create_partitions {
            config.create_topic(partitions).await?;
        }
        Self::with_config(&config).await
    }
}
