//! [`SqsAcker`]: settling one SQS delivery (delete, change visibility, copy to the dead-letter queue).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;

use super::config::MAX_VISIBILITY_SECS;
use super::mapping::{
    sha256_hex, string_attribute, ID_ATTRIBUTE, KEY_ATTRIBUTE, MAX_ATTRIBUTES, REASON_ATTRIBUTE,
};
use super::queue::{broker_error, QueueRef};
use super::shared::{release_now, Lease, Shared, Stopped};
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// Settles one SQS delivery.
pub(super) struct SqsAcker {
    pub(super) shared: Arc<Shared>,
    pub(super) lease: Unsettled<Lease>,
    /// The FIFO group this delivery keeps busy.
    pub(super) group: Option<String>,
    pub(super) raw: aws_sdk_sqs::types::Message,
}

impl SqsAcker {
    /// Stops the visibility extension; the receipt handle, and how the lease
    /// kept the message.
    async fn stop(&mut self) -> Option<(String, Stopped)> {
        let lease = self.lease.take()?;
        let stopped = lease.stop().await;
        Some((lease.receipt.clone(), stopped))
    }

    /// Frees the FIFO group. With `redeliver`, the group's later messages that
    /// this source holds go back to the queue too, so SQS redelivers the group in order.
    fn release_group(&mut self, redeliver: bool) {
        let Some(group) = self.group.take() else {
            return;
        };
        let mut state = self.shared.state();
        let mut siblings = Vec::new();
        if redeliver {
            let mut i = 0;
            while i < state.buffer.len() {
                if state.buffer[i].group() == Some(group.as_str()) {
                    if let Some(r) = state.buffer.remove(i) {
                        siblings.push(r);
                    }
                } else {
                    i += 1;
                }
            }
        }
        state.busy_groups.remove(&group);
        drop(state);
        release_now(&self.shared, siblings);
        self.shared.released.notify_one();
    }

    async fn delete_and_release(&mut self, receipt: &str) -> Result<(), SourceError> {
        let result = self.shared.delete(receipt).await;
        self.release_group(result.is_err());
        result
    }

    /// Sends a copy of the message to the dead-letter queue.
    async fn copy_to_dead_letter_queue(
        &self,
        dlq: &QueueRef,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let mut attributes = self.raw.message_attributes().cloned().unwrap_or_default();
        if attributes.len() >= MAX_ATTRIBUTES {
            // Make room for the reason; the inbox's dead-letter row keeps everything.
            let mut droppable: Vec<String> = attributes
                .keys()
                .filter(|n| n.as_str() != ID_ATTRIBUTE && n.as_str() != KEY_ATTRIBUTE)
                .cloned()
                .collect();
            droppable.sort();
            while attributes.len() >= MAX_ATTRIBUTES {
                let Some(name) = droppable.pop() else { break };
                tracing::warn!(queue = %dlq.name, attribute = %name, "attribute not copied to the dead-letter queue (SQS allows 10)");
                attributes.remove(&name);
            }
        }
        attributes.insert(
            REASON_ATTRIBUTE.to_owned(),
            string_attribute(reason.code())?,
        );
        let mut request = self
            .shared
            .client
            .send_message()
            .queue_url(&dlq.url)
            .message_body(self.raw.body().unwrap_or_default())
            .set_message_attributes(Some(attributes));
        if dlq.fifo {
            let group = self
                .raw
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                .cloned()
                .unwrap_or_else(|| "default".to_owned());
            let dedup = self
                .raw
                .message_id()
                .map(str::to_owned)
                .unwrap_or_else(|| sha256_hex(self.raw.body().unwrap_or_default().as_bytes()));
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup);
        }
        request.send().await.map(|_| ()).map_err(|e| {
            broker_error(
                &format!("SendMessage to the dead-letter queue {}", dlq.name),
                e,
            )
        })
    }
}

impl Redeliver for Lease {
    /// The extension stops: the message comes back after the visibility timeout.
    fn redeliver(self) {}
}

impl Drop for SqsAcker {
    /// A FIFO group is freed, also when an act was cancelled half-way (the
    /// lease, taken by the act, is dropped with it).
    fn drop(&mut self) {
        self.release_group(true);
    }
}

#[async_trait]
impl Acknowledger for SqsAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some((receipt, _)) = self.stop().await else {
            return Ok(());
        };
        self.delete_and_release(&receipt).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let Some((receipt, stopped)) = self.stop().await else {
            return Ok(());
        };
        let secs = delay_secs(delay);
        let mut result = self.shared.change_visibility(&receipt, secs).await;
        if self.group.is_some() && secs > 0 && stopped.may_have_lapsed() {
            // The message was visible for a moment while held: the queue may
            // no longer count it as in flight, so while it waits out the delay
            // nothing holds its group back, and the later messages released
            // below would pass it. It comes back now instead, ahead of them.
            tracing::debug!(queue = %self.shared.queue.name, "the visibility may have run out: a FIFO retry comes back at once");
            result = self.shared.change_visibility(&receipt, 0).await;
        }
        self.release_group(true);
        result
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some((receipt, _)) = self.stop().await else {
            return Ok(());
        };
        if let Some(dlq) = self.shared.dead_letter.clone() {
            if let Err(e) = self.copy_to_dead_letter_queue(&dlq, reason).await {
                // Not deleted: the message comes back after the visibility timeout.
                self.release_group(true);
                return Err(e);
            }
        }
        self.delete_and_release(&receipt).await
    }
}

/// The delay as SQS visibility seconds: rounded up, at most 12 hours.
fn delay_secs(delay: Duration) -> i32 {
    let mut secs = delay.as_secs();
    if delay.subsec_nanos() > 0 {
        secs += 1;
    }
    i32::try_from(secs.min(MAX_VISIBILITY_SECS)).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_round_up() {
        assert_eq!(delay_secs(Duration::ZERO), 0);
        assert_eq!(delay_secs(Duration::from_millis(50)), 1);
        assert_eq!(delay_secs(Duration::from_secs(2)), 2);
        assert_eq!(delay_secs(Duration::from_secs(1_000_000)), 43_200);
    }
}
