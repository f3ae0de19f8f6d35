//! Settling deliveries: the [`Acknowledger`] of a RocketMQ delivery.

use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use async_trait::async_trait;

use super::client::Producer;
use super::mapping::outgoing;
use super::source::Verdict;
use crate::error::SourceError;
use crate::message::Message;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// The user property with the dead-letter reason code on the dead-letter topic.
pub const DEAD_LETTER_REASON_PROPERTY: &str = "idemq_dead_letter_reason";

/// Settles one RocketMQ delivery by answering its waiting listener call.
pub(super) struct RocketMqAcker {
    pub(super) reply: Unsettled<Reply>,
    pub(super) dead_letters: Option<(Producer, String)>,
    pub(super) message: Message,
}

/// The listener call waiting for a delivery's verdict.
pub(super) struct Reply(pub(super) std_mpsc::Sender<Verdict>);

impl Reply {
    fn send(self, verdict: Verdict) {
        // The listener may have timed out already: then it answered
        // ReconsumeLater itself.
        let _ = self.0.send(verdict);
    }
}

impl Redeliver for Reply {
    /// Consumed again later.
    fn redeliver(self) {
        self.send(Verdict::Later);
    }
}

impl RocketMqAcker {
    fn answer(&mut self, verdict: Verdict) {
        if let Some(reply) = self.reply.take() {
            reply.send(verdict);
        }
    }
}

#[async_trait]
impl Acknowledger for RocketMqAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.answer(Verdict::Success);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, _delay: Duration) -> Result<(), SourceError> {
        // RocketMQ chooses the delay from its delay levels (see the module docs).
        self.answer(Verdict::Later);
        Ok(())
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        if let Some((producer, topic)) = self.dead_letters.clone() {
            let forwarded = match outgoing(
                &topic,
                &self.message,
                &[(DEAD_LETTER_REASON_PROPERTY, reason.code())],
            ) {
                Ok(copy) => producer.send(&topic, copy).await,
                Err(e) => Err(e),
            };
            if let Err(e) = forwarded {
                // Not forwarded: the broker delivers the message again.
                self.answer(Verdict::Later);
                return Err(SourceError::broker(format!(
                    "publishing to the dead-letter topic {topic:?} failed: {e}"
                )));
            }
        }
        self.answer(Verdict::Success);
        Ok(())
    }
}
