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
use crate::source::Acknowledger;

/// Settles one MQTT delivery.
pub(super) struct MqttAcker {
    pub(super) shared: Arc<Shared>,
    /// `None` once settled.
    pub(super) incoming: Option<Incoming>,
}

impl MqttAcker {
    /// Hands the message to the engine again after `delay`, counted as a new delivery.
    fn again_after(&self, incoming: Incoming, delay: Duration) {
        let again = self.shared.again.clone();
        let incoming = Incoming {
            delivery_count: incoming.delivery_count.saturating_add(1),
            ..incoming
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
}

impl Drop for MqttAcker {
    /// Dropped unsettled: handed out again at once (the broker would only
    /// resend it after a reconnect).
    fn drop(&mut self) {
        if let Some(incoming) = self.incoming.take() {
            self.again_after(incoming, Duration::ZERO);
        }
    }
}

impl MqttAcker {
    /// Acknowledges the publish to the broker (QoS 1).
    async fn puback(&self, incoming: &Incoming) -> Result<(), SourceError> {
        self.shared
            .link
            .client
            .ack(&incoming.publish)
            .await
            .map_err(|e| broker_error("PUBACK", e))
    }
}

#[async_trait]
impl Acknowledger for MqttAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(incoming) = self.incoming.take() else {
            return Ok(());
        };
        self.puback(&incoming).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        if let Some(incoming) = self.incoming.take() {
            self.again_after(incoming, delay);
        }
        Ok(())
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(incoming) = self.incoming.take() else {
            return Ok(());
        };
        if let Some(topic) = &self.shared.dead_letter_topic {
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
            let copied = self
                .shared
                .link
                .publish(topic, incoming.publish.payload.to_vec(), properties)
                .await;
            if let Err(e) = copied {
                // Not acked: handed out again a little later.
                self.again_after(incoming, Duration::from_secs(1));
                return Err(e);
            }
        }
        self.puback(&incoming).await
    }
}
