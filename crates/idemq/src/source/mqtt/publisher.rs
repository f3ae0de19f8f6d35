//! [`MqttPublisher`]: publishing to one topic over a clean session.

use async_trait::async_trait;
use rumqttc::v5::mqttbytes::v5::PublishProperties;

use super::config::validate_publish_topic;
use super::link::{open, Link};
use super::properties::user_properties;
use super::MqttConfig;
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Publishes to one topic with QoS 1 and waits for each `PUBACK`.
///
/// [`Message::id`] goes to the user property `message_id`, [`Message::key`]
/// to `key`, every header to a user property of its name (headers must be
/// UTF-8). It connects with a clean session under the client id
/// `<client_id>-pub-<random>`.
pub struct MqttPublisher {
    link: Link,
    topic: String,
}

impl std::fmt::Debug for MqttPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl MqttPublisher {
    /// Connects to the broker of `config` to publish to [`MqttConfig::topic`]
    /// (which must be a plain topic, without wildcards).
    pub async fn connect(config: &MqttConfig) -> Result<Self, SourceError> {
        validate_publish_topic(&config.topic)?;
        let client_id = format!("{}-pub-{:08x}", config.client_id, fastrand::u32(..));
        let link = open(config.options(&client_id, false)?, None).await?;
        Ok(Self {
            link,
            topic: config.topic.clone(),
        })
    }
}

#[async_trait]
impl Publisher for MqttPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let properties = PublishProperties {
            user_properties: user_properties(message)?,
            ..PublishProperties::default()
        };
        self.link
            .publish(&self.topic, message.payload.clone(), properties)
            .await
    }
}
