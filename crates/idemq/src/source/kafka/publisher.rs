//! The publisher ([`KafkaPublisher`]) and topic creation ([`create_topic`]).

use std::time::Duration;

use async_trait::async_trait;
use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;

use super::config::validate_topic;
use super::connection::{fetch_metadata, RefusalContext};
use super::{broker, KafkaConfig, MESSAGE_ID_HEADER};
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Creates `topic` with `partitions` partitions (replication factor 1) on
/// `brokers` unless it exists; whether it was created. For brokers without
/// topic auto-creation (locked-down clusters), tests and demos. A cluster
/// that needs TLS or credentials: [`KafkaConfig::create_topic`].
pub async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<bool, SourceError> {
    KafkaConfig::new(brokers, topic, "")
        .create_topic(partitions)
        .await
}

/// Deletes `topic` with its records; a topic that does not exist is no
/// error. A cluster that needs TLS or credentials: [`KafkaConfig::delete_topic`].
pub async fn delete_topic(brokers: &str, topic: &str) -> Result<(), SourceError> {
    KafkaConfig::new(brokers, topic, "").delete_topic().await
}

impl KafkaConfig {
    /// Creates the topic with `partitions` partitions (replication factor 1)
    /// unless it exists, connecting as this configuration says (TLS,
    /// credentials); whether it was created.
    pub async fn create_topic(&self, partitions: i32) -> Result<bool, SourceError> {
        use rdkafka::admin::{NewTopic, TopicReplication};
        use rdkafka::types::RDKafkaErrorCode;

        validate_topic(&self.topic).map_err(SourceError::config)?;
        let admin = admin_client(self).await?;
        let results = admin
            .create_topics(
                &[NewTopic::new(
                    &self.topic,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &admin_options(),
            )
            .await
            .map_err(broker)?;
        match results.into_iter().next() {
            Some(Ok(_)) => Ok(true),
            Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => Ok(false),
            Some(Err((name, code))) => Err(SourceError::broker(format!(
                "creating topic {name:?}: {code}"
            ))),
        }
    }

    /// Deletes the topic with its records; a topic that does not exist is no error.
    pub async fn delete_topic(&self) -> Result<(), SourceError> {
        use rdkafka::types::RDKafkaErrorCode;

        validate_topic(&self.topic).map_err(SourceError::config)?;
        let admin = admin_client(self).await?;
        let results = admin
            .delete_topics(&[&self.topic], &admin_options())
            .await
            .map_err(broker)?;
        match results.into_iter().next() {
            Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::UnknownTopicOrPartition))) | None => {
                Ok(())
            }
            Some(Err((name, code))) => Err(SourceError::broker(format!(
                "deleting topic {name:?}: {code}"
            ))),
        }
    }
}

fn admin_options() -> rdkafka::admin::AdminOptions {
    rdkafka::admin::AdminOptions::new().request_timeout(Some(Duration::from_secs(30)))
}

/// An admin client for a cluster a producer reached first: nothing polls an
/// admin client's error events, so a refusal would only show as a timeout.
async fn admin_client(
    config: &KafkaConfig,
) -> Result<AdminClient<DefaultClientContext>, SourceError> {
    drop(connected_producer(config).await?);
    config
        .connection()
        .create()
        .map_err(|e| SourceError::config(format!("kafka admin client: {e}")))
}

/// The producer of publishers and dead-letter topics: idempotent, every
/// write acknowledged by all in-sync replicas.
pub(super) type Producer = FutureProducer<RefusalContext>;

/// A [`Producer`] connecting as `config` says, reporting refusals to `refusals`.
pub(super) fn producer(
    config: &KafkaConfig,
    refusals: RefusalContext,
) -> Result<Producer, SourceError> {
    config
        .connection()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create_with_context(refusals)
        .map_err(|e| SourceError::config(format!("kafka producer: {e}")))
}

/// A [`Producer`] once the cluster answered its metadata request (see
/// [`fetch_metadata`]): a refused password or certificate is a
/// configuration error.
async fn connected_producer(config: &KafkaConfig) -> Result<Producer, SourceError> {
    let refusals = RefusalContext::default();
    let producer = producer(config, refusals.clone())?;
    tokio::task::spawn_blocking(move || {
        fetch_metadata(producer.client(), None, || refusals.refusal())?;
        Ok(producer)
    })
    .await
    .map_err(|e| SourceError::other(e.to_string()))?
}

/// Publishes [`Message`]s to a Kafka topic with an idempotent producer.
///
/// The record key is [`Message::key`], the value the payload, and the
/// headers are the message headers plus `message_id` = [`Message::id`] when
/// set, which [`KafkaSource`] reads back as the id.
///
/// [`KafkaSource`]: super::KafkaSource
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: Producer,
    topic: String,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// An idempotent producer for `topic` on `brokers` (`host:port[,…]`).
    /// A cluster that needs TLS or credentials: [`KafkaPublisher::with_config`].
    pub async fn connect(brokers: &str, topic: &str) -> Result<Self, SourceError> {
        Self::with_config(&KafkaConfig::new(brokers, topic, "")).await
    }

    /// An idempotent producer for the configuration's topic, connecting as
    /// it says (TLS, credentials); waits until the cluster answers, and a
    /// refused password or certificate is a configuration error.
    pub async fn with_config(config: &KafkaConfig) -> Result<Self, SourceError> {
        validate_topic(&config.topic).map_err(SourceError::config)?;
        Ok(Self {
            producer: connected_producer(config).await?,
            topic: config.topic.clone(),
        })
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut headers = OwnedHeaders::new();
        for (name, value) in message.headers.iter() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        if let Some(id) = &message.id {
            if message.headers.get(MESSAGE_ID_HEADER).is_none() {
                headers = headers.insert(Header {
                    key: MESSAGE_ID_HEADER,
                    value: Some(id.as_str()),
                });
            }
        }
        let mut record = FutureRecord::to(&self.topic)
            .payload(message.payload.as_slice())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        self.producer
            .send(record, Timeout::After(Duration::from_secs(30)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| SourceError::broker(format!("publishing to {:?}: {e}", self.topic)))
    }

    async fn flush(&self) -> Result<(), SourceError> {
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(30)))
            .await
            .map_err(|e| SourceError::other(e.to_string()))?
            .map_err(broker)
    }
}
