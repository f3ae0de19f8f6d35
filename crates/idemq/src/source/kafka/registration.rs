//! Apache Kafka in the broker registry ([`crate::source::registry`]).

use super::{KafkaConfig, KafkaPublisher, KafkaSource};
use crate::error::SourceError;
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
