//! Settling one entry: the [`Acknowledger`] of the Redis Streams source.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::Value;

use super::conn::broker_error;
use super::entry::REASON_FIELD;
use super::pending::{Ready, Shared};
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::Acknowledger;

/// Settles one stream entry.
pub(super) struct RedisStreamAcker {
    pub(super) held: Unsettled<Held>,
}

/// An entry handed out and kept fresh until it is settled.
pub(super) struct Held {
    pub(super) shared: Arc<Shared>,
    pub(super) entry: Ready,
}

impl Redeliver for Held {
    /// No longer kept fresh, so `XAUTOCLAIM` brings it back after `claim_idle`.
    fn redeliver(self) {
        self.shared.release(&self.entry.id);
    }
}

#[async_trait]
impl Acknowledger for RedisStreamAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(Held { shared, entry }) = self.held.take() else {
            return Ok(());
        };
        let result = shared.xack(&entry.id).await;
        // On failure the entry stays pending and is claimed again later.
        shared.release(&entry.id);
        result
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let Some(Held { shared, entry }) = self.held.take() else {
            return Ok(());
        };
        // Held (kept fresh) until the delay is over, then claimed again.
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let ready = match shared.reclaim(&entry.id).await {
                Ok(Some(fresh)) => Ready {
                    id: entry.id,
                    fields: fresh.fields.unwrap_or(entry.fields),
                    delivery_count: entry.delivery_count.saturating_add(1),
                },
                Ok(None) => {
                    tracing::debug!(stream = %shared.stream, id = %entry.id, "a nacked entry is no longer pending");
                    shared.release(&entry.id);
                    return;
                }
                Err(e) => {
                    tracing::warn!(stream = %shared.stream, error = %e, "XCLAIM of a nacked entry failed; redelivering it anyway");
                    Ready {
                        delivery_count: entry.delivery_count.saturating_add(1),
                        ..entry
                    }
                }
            };
            let id = ready.id.clone();
            if shared.retries.send(ready).is_err() {
                // The source is gone: the entry stays pending for XAUTOCLAIM.
                shared.release(&id);
            }
        });
        Ok(())
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(Held { shared, entry }) = self.held.take() else {
            return Ok(());
        };
        let result = match &shared.dead_letter_stream {
            Some(dlq) => {
                let mut pipe = redis::pipe();
                pipe.atomic();
                let xadd = pipe.cmd("XADD").arg(dlq).arg("*");
                for (name, value) in &entry.fields {
                    if name != REASON_FIELD {
                        xadd.arg(name).arg(value.as_slice());
                    }
                }
                xadd.arg(REASON_FIELD).arg(reason.code());
                pipe.cmd("XACK")
                    .arg(&shared.stream)
                    .arg(&shared.group)
                    .arg(&entry.id);
                pipe.query_async::<Value>(&mut shared.conn.clone())
                    .await
                    .map(|_| ())
                    .map_err(|e| broker_error(&format!("XADD to dead-letter stream {dlq}"), e))
            }
            None => shared.xack(&entry.id).await,
        };
        shared.release(&entry.id);
        result
    }
}
