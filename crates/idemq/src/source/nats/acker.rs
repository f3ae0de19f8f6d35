//! The acknowledger: settling one JetStream delivery.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_trait::async_trait;

use super::config::broker_error;
use super::mapping::REASON_HEADER;
use super::publisher::publish_and_wait;
use super::source::{Progress, Shared};
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// Settles one JetStream delivery.
pub(super) struct NatsAcker {
    pub(super) shared: Arc<Shared>,
    pub(super) progress: Unsettled<Progress>,
    pub(super) message: jetstream::Message,
}

impl Redeliver for Progress {
    /// The in-progress acks stop (with the task): the server redelivers the
    /// message once `ack_wait` has passed.
    fn redeliver(self) {}
}

impl NatsAcker {
    /// Stops the in-progress acks; `false` if already settled.
    async fn stop(&mut self) -> bool {
        match self.progress.take() {
            Some(progress) => {
                progress.stop().await;
                true
            }
            None => false,
        }
    }

    /// Sends `kind` and waits for the server's confirmation.
    async fn settle(&self, kind: AckKind) -> Result<(), SourceError> {
        self.message
            .double_ack_with(kind)
            .await
            .map_err(|e| broker_error(&format!("{kind:?} on {}", self.shared.stream), e))
    }
}

#[async_trait]
impl Acknowledger for NatsAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        self.settle(AckKind::Ack).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        let delay = Some(delay).filter(|d| !d.is_zero());
        self.settle(AckKind::Nak(delay)).await
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        if let Some(subject) = &self.shared.dead_letter_subject {
            let mut headers = self.message.headers.clone().unwrap_or_default();
            headers.insert(REASON_HEADER, reason.code());
            // On failure it is not terminated: the message comes back after ack_wait.
            publish_and_wait(
                &self.shared.js,
                subject,
                headers,
                self.message.payload.to_vec(),
            )
            .await?;
        }
        self.settle(AckKind::Term).await
    }
}
