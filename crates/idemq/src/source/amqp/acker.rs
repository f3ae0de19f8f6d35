//! [`AmqpAcker`]: acks, delayed retries through the retry queues, and dead letters.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, LongString};
use lapin::BasicProperties;

use super::channel::{publish_confirmed, SETTLE_TIMEOUT};
use super::headers::{
    rewrite_headers, DELIVERIES_HEADER, DELIVERY_COUNT_HEADER, QUEUE_HEADER, REASON_HEADER,
};
use super::source::Shared;
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// Settles one AMQP delivery.
pub(super) struct AmqpAcker {
    pub(super) acker: Unsettled<Held>,
    pub(super) shared: Arc<Shared>,
    pub(super) body: Vec<u8>,
    pub(super) properties: BasicProperties,
    pub(super) delivery_count: u32,
}

impl AmqpAcker {
    async fn ack_original(&mut self) -> Result<(), SourceError> {
        let Some(Held(acker)) = self.acker.take() else {
            return Ok(());
        };
        let acked = tokio::time::timeout(SETTLE_TIMEOUT, acker.ack(BasicAckOptions::default()))
            .await
            .map_err(|_| {
                SourceError::broker(format!(
                    "ack: no answer within {SETTLE_TIMEOUT:?}; the broker redelivers the message"
                ))
            })?;
        match acked {
            Ok(true) => Ok(()),
            Ok(false) => Err(SourceError::broker(
                "the channel closed before the ack; the broker redelivers the message",
            )),
            Err(e) => Err(SourceError::broker(format!("ack: {e}"))),
        }
    }

    fn copy_properties(&self, set: Vec<(&str, AMQPValue)>) -> BasicProperties {
        let headers = rewrite_headers(
            self.properties.headers().as_ref(),
            &[DELIVERY_COUNT_HEADER],
            set,
        );
        self.properties.clone().with_headers(headers)
    }

    fn deliveries_value(&self) -> AMQPValue {
        AMQPValue::LongLongInt(i64::from(self.delivery_count))
    }
}

#[async_trait]
impl Acknowledger for AmqpAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.ack_original().await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let config = &self.shared.config;
        let queue = if delay.is_zero() {
            config.queue.clone()
        } else {
            config.retry_queue(delay)
        };
        let properties = self.copy_properties(vec![(DELIVERIES_HEADER, self.deliveries_value())]);
        publish_confirmed(&self.shared.publish, &queue, &self.body, properties).await?;
        tracing::debug!(queue = %queue, delay_ms = delay.as_millis() as u64, "retry copy published");
        self.ack_original().await
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let config = &self.shared.config;
        let queue = config.dead_letter_queue();
        let properties = self.copy_properties(vec![
            (DELIVERIES_HEADER, self.deliveries_value()),
            (
                REASON_HEADER,
                AMQPValue::LongString(LongString::from(reason.code())),
            ),
            (
                QUEUE_HEADER,
                AMQPValue::LongString(config.queue.as_str().into()),
            ),
        ]);
        publish_confirmed(&self.shared.publish, &queue, &self.body, properties).await?;
        self.ack_original().await
    }
}

/// The channel's handle on one unacknowledged delivery.
pub(super) struct Held(pub(super) lapin::Acker);

impl Redeliver for Held {
    /// Back to the queue at once, as when its channel closes.
    fn redeliver(self) {
        let acker = self.0;
        if !acker.usable() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                if let Err(e) = acker.nack(requeue).await {
                    tracing::debug!(error = %e, "requeueing a dropped delivery failed");
                }
            });
        }
    }
}
