//! [`MqttAcker`]: `PUBACK`s, in-process retries, and copies to the dead-letter topic.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rumqttc::v5::mqttbytes::v5::PublishProperties;

use super::link::broker_error;
use super::properties::REASON_PROPERTY;
use super::source::{Incoming, Shared};
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// Settles one MQTT delivery.
pub(super) struct MqttAcker {
    pub(super) held: Unsettled<Held>,
}

/// A publish handed out and not acknowledged yet.
pub(super) struct Held {
    pub(super) shared: Arc<Shared>,
    pub(super) incoming: Incoming,
}

impl Held {
    /// Hands the message to the engine again after `delay`, counted as a new delivery.
    fn again_after(self, delay: Duration) {
        let again = self.shared.again.clone();
        let incoming = Incoming {
            delivery_count: self.incoming.delivery_count.saturating_add(1),
            ..self.incoming
        };
        if delay.is_zero() {
            let _ = again.send(incoming);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // unacknowledged: the broker resends it after a reconnect
        };
        runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = again.send(incoming);
        });
    }

    /// Acknowledges the publish to the broker (QoS 1).
    async fn puback(&self) -> Result<(), SourceError> {
        self.shared
            .link
            .client
            .ack(&self.incoming.publish)
            .await
            .map_err(|e| broker_error("PUBACK", e))
    }
}

impl Redeliver for Held {
    /// Handed out again at once (the broker would only resend it after a reconnect).
    fn redeliver(self) {
        self.again_after(Duration::ZERO);
    }
}

#[async_trait]
impl Acknowledger for MqttAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        held.puback().await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        if let Some(held) = self.held.take() {
            held.again_after(delay);
        }
        Ok(())
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        let incoming = &held.incoming;
        if let Some(topic) = &held.shared.dead_letter_topic {
            let mut properties = PublishProperties::default();
            if let Some(p) = &incoming.publish.properties {
                properties.user_properties = p
                    .user_properties
                    .iter()
                    .filter(|(n, _)| n != REASON_PROPERTY)
                    .cloned()
                    .collect();
                properties.content_type = p.content_type.clone();
            }
            properties
                .user_properties
                .push((REASON_PROPERTY.to_owned(), reason.code().to_owned()));
            let copied = held
                .shared
                .link
                .publish(topic, incoming.publish.payload.to_vec(), properties)
                .await;
            if let Err(e) = copied {
                // Not acked: handed out again a little later.
                held.again_after(Duration::from_secs(1));
                return Err(e);
            }
        }
        held.puback().await
    }
}
