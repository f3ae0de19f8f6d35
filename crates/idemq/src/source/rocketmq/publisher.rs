//! The publisher: [`RocketMqPublisher`].

use async_trait::async_trait;

use super::client::{Client, Connection, Producer};
use super::config::{validate_name, RocketMqConfig};
use super::mapping::outgoing;
#[cfg(doc)]
use super::RocketMqSource;
use crate::error::SourceError;
use crate::message::Message;
use crate::source::kit::BrokerConfig;
use crate::source::Publisher;

/// Publishes [`Message`]s to a RocketMQ topic.
///
/// The keys (`KEYS` property) are [`Message::key`], the body the payload,
/// the user properties the headers (UTF-8 text, non-empty, and not named
/// like a system property). When [`Message::id`] is set it becomes the
/// producer's unique id (the `UNIQ_KEY` property: the producer only generates
/// one when none is set), which [`RocketMqSource`] reads back as the id;
/// otherwise the producer generates one. Messages are sent one at a time,
/// synchronously: [`publish`](Publisher::publish) returns when the broker has
/// stored the message.
pub struct RocketMqPublisher {
    producer: Producer,
    client: Client,
    topic: String,
}

impl std::fmt::Debug for RocketMqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocketMqPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl RocketMqPublisher {
    /// A started producer for `topic` via the name servers `name_server`
    /// (`host:port[;host:port…]`). A cluster with authentication:
    /// [`RocketMqPublisher::with_config`].
    pub async fn connect(name_server: &str, topic: &str) -> Result<Self, SourceError> {
        Self::with_config(&RocketMqConfig::new(name_server, topic, "")).await
    }

    /// A started producer for the configuration's topic via its name
    /// servers, signing with its credentials (if any); the consumer's
    /// settings are ignored.
    pub async fn with_config(config: &RocketMqConfig) -> Result<Self, SourceError> {
        validate_name("topic", &config.topic, 127).map_err(SourceError::config)?;
        if config.name_server.split(';').any(|s| s.trim().is_empty()) {
            return Err(SourceError::config("RocketMQ: no name server address"));
        }
        let connection = Connection::of(config);
        let (client, producer) = Client::start(connection, true, None).await?;
        let producer =
            producer.ok_or_else(|| SourceError::other("the RocketMQ producer did not start"))?;
        Ok(Self {
            producer,
            client,
            topic: config.topic.clone(),
        })
    }

    /// The publisher for the source URL's name servers and topic
    /// (`rocketmq://host:port/topic?…`), parsed by the same rules as
    /// [`RocketMqConfig::from_url`]; the consumer's parameters are ignored
    /// and the group may be left out.
    pub async fn from_url(url: &str) -> Result<Self, SourceError> {
        let config = RocketMqConfig::parse(&RocketMqConfig::publisher_url(url))?;
        Self::with_config(&config).await
    }

    /// Shuts the producer down and waits until it has finished.
    pub async fn shutdown(self) {
        self.client.shutdown().await;
    }
}

#[async_trait]
impl Publisher for RocketMqPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        self.producer
            .send(&self.topic, outgoing(&self.topic, message, &[])?)
            .await
    }
}
