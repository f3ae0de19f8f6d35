//! [`AmqpPublisher`]: publishing to the work queue with publisher confirms.

use std::collections::BTreeMap;
use std::fmt;

use async_trait::async_trait;
use lapin::options::{ConfirmSelectOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};

use super::channel::{broker, publish_confirmed, short};
use super::headers::KEY_HEADER;
use super::AmqpConfig;
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Publishes messages to the work queue of an [`AmqpConfig`] through the
/// default exchange: persistent, with publisher confirms, `message_id` =
/// [`Message::id`], header [`KEY_HEADER`] = [`Message::key`], and the other
/// headers as byte strings.
pub struct AmqpPublisher {
    channel: Channel,
    config: AmqpConfig,
    connection: Connection,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("queue", &self.config.queue)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Connects, enables publisher confirms and declares the topology.
    pub async fn connect(config: AmqpConfig) -> Result<Self, SourceError> {
        let connection = config.connect("idemq-publisher").await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker("enabling publisher confirms"))?;
        config.declare(&channel).await?;
        Ok(Self {
            channel,
            config,
            connection,
        })
    }

    /// Deletes every queue of the topology ([`AmqpConfig::queues`]) with
    /// the messages in them: for tests and examples.
    pub async fn delete_topology(&self) -> Result<(), SourceError> {
        for queue in self.config.queues() {
            self.channel
                .queue_delete(short(&queue)?, QueueDeleteOptions::default())
                .await
                .map_err(broker("deleting a queue"))?;
        }
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) -> Result<(), SourceError> {
        self.connection
            .close(200, "closing".into())
            .await
            .map_err(broker("closing the connection"))
    }
}

#[async_trait]
impl Publisher for AmqpPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut map = BTreeMap::new();
        for (name, value) in message.headers.iter() {
            map.entry(short(name)?)
                .or_insert_with(|| AMQPValue::LongString(value.into()));
        }
        if let Some(key) = &message.key {
            map.insert(
                KEY_HEADER.into(),
                AMQPValue::LongString(key.as_str().into()),
            );
        }
        let mut properties = BasicProperties::default().with_headers(FieldTable::from(map));
        if let Some(id) = &message.id {
            properties = properties.with_message_id(short(id)?);
        }
        publish_confirmed(
            &self.channel,
            &self.config.queue,
            &message.payload,
            properties,
        )
        .await
    }

    async fn flush(&self) -> Result<(), SourceError> {
        self.channel
            .wait_for_confirms()
            .await
            .map_err(broker("waiting for confirms"))?;
        Ok(())
    }
}
