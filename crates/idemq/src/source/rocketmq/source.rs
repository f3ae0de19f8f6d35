//! The push-consumer source: [`RocketMqSource`] and the listener bridge
//! that hands messages to it.

use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rocketmq_client_rust::{
    ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus, MessageListenerConcurrently,
};
use rocketmq_model::common::message::message_ext::MessageExt;
use tokio::sync::mpsc;

use super::acker::{Reply, RocketMqAcker};
use super::client::{Client, Connection, ConsumerSetup, Producer};
use super::config::RocketMqConfig;
use super::mapping::incoming;
use crate::error::SourceError;
use crate::message::{DeliveryMeta, Message};
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

/// What the listener answers the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    Success,
    Later,
}

/// One message handed from the listener to [`RocketMqSource::next`].
struct Incoming {
    message: Message,
    meta: DeliveryMeta,
    reply: std_mpsc::Sender<Verdict>,
}

/// The push consumer's listener: hands each message over and waits for its
/// settlement (it runs on the client's blocking lane).
pub(super) struct Listener {
    deliveries: mpsc::UnboundedSender<Incoming>,
    timeout: Duration,
}

impl MessageListenerConcurrently for Listener {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> rocketmq_client_rust::ClientResult<ConsumeConcurrentlyStatus> {
        let deadline = Instant::now() + self.timeout;
        let mut replies = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let (message, meta) = incoming(msg);
            let (reply, answer) = std_mpsc::channel();
            let sent = self.deliveries.send(Incoming {
                message,
                meta,
                reply,
            });
            if sent.is_err() {
                // The source is gone: consume it again later.
                return Ok(ConsumeConcurrentlyStatus::ReconsumeLater);
            }
            replies.push(answer);
        }
        let mut status = ConsumeConcurrentlyStatus::ConsumeSuccess;
        for answer in replies {
            let wait = deadline.saturating_duration_since(Instant::now());
            match answer.recv_timeout(wait) {
                Ok(Verdict::Success) => {}
                Ok(Verdict::Later) => status = ConsumeConcurrentlyStatus::ReconsumeLater,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {
                    tracing::warn!(
                        timeout_ms = self.timeout.as_millis() as u64,
                        "a RocketMQ delivery was not settled in time; it will be consumed again"
                    );
                    status = ConsumeConcurrentlyStatus::ReconsumeLater;
                }
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    status = ConsumeConcurrentlyStatus::ReconsumeLater
                }
            }
        }
        Ok(status)
    }
}

/// A RocketMQ push consumer in a consumer group, as a [`Source`]: see the
/// [module docs](super).
pub struct RocketMqSource {
    deliveries: mpsc::UnboundedReceiver<Incoming>,
    dead_letters: Option<(Producer, String)>,
    client: Option<Client>,
    topic: String,
}

impl std::fmt::Debug for RocketMqSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocketMqSource")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl RocketMqSource {
    /// Starts a push consumer of `config.topic` in `config.group`.
    pub async fn connect(config: RocketMqConfig) -> Result<Self, SourceError> {
        config.validate()?;
        config
            .broker_loss
            .apply("RocketMQ", &super::limits::risks(&config))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let listener = Listener {
            deliveries: tx,
            timeout: config.consume_timeout,
        };
        let dead_letter_topic = config.dead_letter_topic.clone();
        let topic = config.topic.clone();
        let connection = Connection::of(&config);
        let (client, producer) = Client::start(
            connection,
            dead_letter_topic.is_some(),
            Some(ConsumerSetup { config, listener }),
        )
        .await?;
        Ok(Self {
            deliveries: rx,
            dead_letters: producer.zip(dead_letter_topic),
            client: Some(client),
            topic,
        })
    }

    /// Shuts the consumer down and waits until it has persisted its offsets
    /// and left the group. Deliveries not yet settled are consumed again
    /// later (by this group).
    pub async fn shutdown(mut self) {
        self.deliveries.close();
        if let Some(client) = self.client.take() {
            client.shutdown().await;
        }
    }
}

impl Drop for RocketMqSource {
    /// Shuts the consumer down in the background (see [`RocketMqSource::shutdown`]).
    fn drop(&mut self) {
        self.deliveries.close();
        // Dropping the client tells its thread to shut down.
    }
}

#[async_trait]
impl Source for RocketMqSource {
    /// Shuts the consumer down and waits for it, so that the consume
    /// offsets of what was settled reach the broker before the process exits.
    async fn close(&mut self) {
        self.deliveries.close();
        if let Some(client) = self.client.take() {
            client.shutdown().await;
        }
    }

    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let Some(incoming) = self.deliveries.recv().await else {
            return Err(SourceError::broker(format!(
                "the RocketMQ consumer of {:?} stopped",
                self.topic
            )));
        };
        let acker = RocketMqAcker {
            reply: Unsettled::new(Reply(incoming.reply)),
            dead_letters: self.dead_letters.clone(),
            message: incoming.message.clone(),
        };
        Ok(Some(Delivery::new(
            incoming.message,
            incoming.meta,
            Box::new(acker),
        )))
    }
}
