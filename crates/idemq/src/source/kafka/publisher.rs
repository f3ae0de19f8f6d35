//! The publisher ([`KafkaPublisher`]) and topic creation ([`create_topic`]).

use std::time::Duration;

use async_trait::async_trait;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;

use super::config::validate_topic;
use super::{broker, MESSAGE_ID_HEADER};
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Creates `topic` with `partitions` partitions (replication factor 1) on
/// `brokers` unless it exists; whether it was created. For brokers without
/// topic auto-creation (locked-down clusters), tests and demos.
pub async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<bool, SourceError> {
    use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
    use rdkafka::types::RDKafkaErrorCode;

    validate_topic(topic).map_err(SourceError::config)?;
    let admin = admin_client(brokers)?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(30))),
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

/// Deletes `topic` with its records; a topic that does not exist is no error.
pub async fn delete_topic(brokers: &str, topic: &str) -> Result<(), SourceError> {
    use rdkafka::admin::AdminOptions;
    use rdkafka::types::RDKafkaErrorCode;

    validate_topic(topic).map_err(SourceError::config)?;
    let admin = admin_client(brokers)?;
    let results = admin
        .delete_topics(
            &[topic],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .map_err(broker)?;
    match results.into_iter().next() {
        Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::UnknownTopicOrPartition))) | None => Ok(()),
        Some(Err((name, code))) => Err(SourceError::broker(format!(
            "deleting topic {name:?}: {code}"
        ))),
    }
}

fn admin_client(
    brokers: &str,
) -> Result<rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext>, SourceError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| SourceError::config(format!("kafka admin client: {e}")))
}

pub(super) fn producer(brokers: &str) -> Result<FutureProducer, SourceError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .map_err(|e| SourceError::config(format!("kafka producer: {e}")))
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
    producer: FutureProducer,
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
    pub async fn connect(brokers: &str, topic: &str) -> Result<Self, SourceError> {
        validate_topic(topic).map_err(SourceError::config)?;
        Ok(Self {
            producer: producer(brokers)?,
            topic: topic.to_owned(),
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
