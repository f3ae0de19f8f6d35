//! [`MqttSource`]: the persistent session, its subscription, and the deliveries it hands out.

use std::sync::Arc;

use async_trait::async_trait;
use rumqttc::v5::mqttbytes::v5::Publish;
use tokio::sync::mpsc;

use super::acker::{Held, MqttAcker};
use super::link::{open, Link, Subscription};
use super::properties::to_message;
use super::MqttConfig;
use crate::error::SourceError;
use crate::message::DeliveryMeta;
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

const SOURCE_NAME: &str = "mqtt";

/// A received publish and how often it was delivered.
pub(super) struct Incoming {
    pub(super) publish: Publish,
    pub(super) delivery_count: u32,
}

/// Everything the source and its acknowledgers share.
pub(super) struct Shared {
    pub(super) link: Link,
    pub(super) dead_letter_topic: Option<String>,
    /// Back into the source: nacked and dropped deliveries.
    pub(super) again: mpsc::UnboundedSender<Incoming>,
}

/// Consumes one topic filter over a persistent MQTT 5 session (see the
/// [module docs](super)).
pub struct MqttSource {
    shared: Arc<Shared>,
    deliveries: mpsc::UnboundedReceiver<Incoming>,
    client_id: String,
}

impl std::fmt::Debug for MqttSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttSource")
            .field("client_id", &self.client_id)
            .finish_non_exhaustive()
    }
}

impl MqttSource {
    /// Connects with `clean start` off, subscribes with QoS 1, and returns
    /// once the broker acknowledged the subscription.
    pub async fn connect(config: MqttConfig) -> Result<Self, SourceError> {
        config.validate()?;
        config.broker_loss.apply("MQTT", &config.loss_risks())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let link = open(
            config.options(&config.client_id, true)?,
            Some(Subscription {
                filter: config.topic.clone(),
                deliveries: tx.clone(),
            }),
        )
        .await?;
        tracing::debug!(client_id = %config.client_id, filter = %config.topic, "MQTT source connected");
        Ok(Self {
            shared: Arc::new(Shared {
                link,
                dead_letter_topic: config.dead_letter_topic,
                again: tx,
            }),
            deliveries: rx,
            client_id: config.client_id,
        })
    }

    fn delivery(&self, incoming: Incoming) -> Delivery {
        let message = to_message(&incoming.publish);
        let meta = DeliveryMeta {
            source: SOURCE_NAME.into(),
            topic: Some(String::from_utf8_lossy(&incoming.publish.topic).into_owned()),
            partition: None,
            offset: None,
            delivery_count: incoming.delivery_count.max(1),
        };
        let acker = MqttAcker {
            held: Unsettled::new(Held {
                shared: Arc::clone(&self.shared),
                incoming,
            }),
        };
        Delivery::new(message, meta, Box::new(acker))
    }
}

impl Drop for MqttSource {
    /// Closes the connection without `DISCONNECT` (even while deliveries are
    /// unsettled): the session keeps what was not acknowledged, and the
    /// broker resends it when this client id connects again.
    fn drop(&mut self) {
        self.shared.link.driver.abort();
    }
}

/// How long [`Source::close`] waits for the `DISCONNECT` to be written.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

#[async_trait]
impl Source for MqttSource {
    /// Writes the `PUBACK`s of every settled delivery, then `DISCONNECT`
    /// (the session stays: what was not acknowledged comes back at the next
    /// connect). Without it, dropping the source could cut the connection
    /// before queued `PUBACK`s were sent, and the broker would resend
    /// messages that were settled (duplicates the inbox catches, but work).
    async fn close(&mut self) {
        if let Err(e) = self.shared.link.disconnect(CLOSE_TIMEOUT).await {
            tracing::warn!(client_id = %self.client_id, error = %e, "closing the MQTT source");
        }
    }

    /// The next delivery; never `None` (a subscription does not end). Cancel-safe.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        match self.deliveries.recv().await {
            Some(incoming) => Ok(Some(self.delivery(incoming))),
            None => Err(SourceError::other("the MQTT event loop ended")),
        }
    }
}
