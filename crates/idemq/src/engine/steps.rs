//! The steps every mode shares: identify a delivery, call the handler,
//! decide what a failure, a conflict or a dead letter comes to, settle the
//! delivery with its source and report the outcome.

use super::consumer::{Consumer, Identity};
use super::handler::{Context, HandlerResult};
use super::unit::single::PerMessage;
use crate::error::{HandlerError, HandlerErrorKind, InputError};
use crate::message::{DeliveryMeta, Message};
use crate::outcome::{DeadLetterReason, Outcome};
use crate::policy::ConflictPolicy;
use crate::source::{Acknowledger, Delivery};
use crate::store::{ClaimRequest, DeadLetter, Store};

impl<S: Store> Consumer<S> {
    /// Processes one delivery to its outcome and settles it with its source:
    /// ack after commit (processed, duplicate), nack with a delay (retry
    /// later), or dead-letter and ack.
    pub async fn process(&self, delivery: Delivery) -> Outcome {
        self.process_one(PerMessage, delivery).await
    }

    pub(crate) async fn settle(&self, outcome: &Outcome, acker: Box<dyn Acknowledger>) {
        let result = match outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => acker.ack().await,
            Outcome::Conflict { .. } => match self.inner.conflict {
                ConflictPolicy::DeadLetter => {
                    acker.forward_dead_letter(&DeadLetterReason::Conflict).await
                }
                ConflictPolicy::Ignore => acker.ack().await,
            },
            Outcome::RetryLater { delay, .. } => acker.nack(*delay).await,
            Outcome::DeadLettered { reason, .. } => acker.forward_dead_letter(reason).await,
        };
        if let Err(e) = result {
            // Nothing is lost: the source redelivers and the inbox answers.
            tracing::warn!(consumer = %self.inner.name, error = %e, "settling the delivery failed");
        }
    }

    pub(crate) fn report(&self, outcome: &Outcome, meta: &DeliveryMeta) {
        let consumer = self.inner.name.as_str();
        match outcome {
            Outcome::Processed { key, .. } => {
                tracing::info!(consumer, key = %key, offset = ?meta.offset, "processed")
            }
            Outcome::Duplicate { record } => tracing::warn!(
                consumer, key = %record.key, first_seen_ms = record.first_seen_ms,
                "duplicate skipped"
            ),
            Outcome::Conflict {
                record,
                fingerprint,
            } => tracing::error!(
                consumer, key = %record.key, stored = %record.fingerprint, got = %fingerprint,
                "conflict: key reused with another payload"
            ),
            Outcome::RetryLater {
                key,
                attempts,
                delay,
                error,
            } => tracing::warn!(
                consumer, key = ?key, attempts, delay_ms = delay.as_millis() as u64, error = %error,
                "will retry"
            ),
            Outcome::DeadLettered { key, reason, error } => tracing::error!(
                consumer, key = ?key, reason = %reason, error = %error, offset = ?meta.offset,
                "dead-lettered"
            ),
        }
        metrics::counter!(
            "idemq_messages_total",
            "consumer" => self.inner.name.clone(),
            "outcome" => outcome.kind().as_str()
        )
        .increment(1);
        if let Outcome::DeadLettered { reason, .. } = outcome {
            metrics::counter!(
                "idemq_dead_letters_total",
                "consumer" => self.inner.name.clone(),
                "reason" => reason.code()
            )
            .increment(1);
        }
        if let Some(hook) = &self.inner.on_outcome {
            hook(outcome);
        }
    }

    /// The identify step: the business key and fingerprint of a message, or
    /// why it must be dead-lettered (with the key when one was derived). A
    /// source's `defect` (an undecodable record) wins.
    pub(crate) fn identify(&self, message: &Message, defect: Option<&InputError>) -> Identity {
        let inner = &*self.inner;
        if let Some(defect) = defect {
            return Err((None, DeadLetterReason::InvalidInput(defect.clone())));
        }
        let size = message.size_bytes();
        if size > inner.max_message_bytes {
            let too_large = InputError::TooLarge {
                len: size as u64,
                max: inner.max_message_bytes,
            };
            return Err((None, DeadLetterReason::InvalidInput(too_large)));
        }
        let key = inner
            .key
            .extract(message)
            .map_err(|e| (None, DeadLetterReason::InvalidInput(e)))?;
        match inner.fingerprint.compute(message) {
            Ok(fingerprint) => Ok((key, fingerprint)),
            Err(e) => Err((Some(key), DeadLetterReason::InvalidInput(e))),
        }
    }

    /// Why a delivery is past [`RetryPolicy::max_deliveries`], if it is.
    pub(crate) fn over_delivery_limit(&self, meta: &DeliveryMeta) -> Option<String> {
        let max = self.inner.retry.max_deliveries?;
        (meta.delivery_count > max).then(|| {
            format!(
                "delivered {} times, more than max_deliveries {max}",
                meta.delivery_count
            )
        })
    }

    /// Runs the handler, inside its layers, once with `tx`.
    pub(crate) async fn call_handler(
        &self,
        tx: &mut S::Tx,
        req: &ClaimRequest<'_>,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> HandlerResult {
        let ctx = self.context(req, message, meta);
        self.inner.handler.handle(&ctx, tx).await
    }

    /// What the handler knows about a claimed message.
    pub(crate) fn context<'a>(
        &'a self,
        req: &ClaimRequest<'a>,
        message: &'a Message,
        meta: &'a DeliveryMeta,
    ) -> Context<'a> {
        Context {
            consumer: req.consumer,
            key: req.key,
            fingerprint: req.fingerprint,
            message,
            meta,
            attempt: meta.delivery_count.max(1),
            journal: self.inner.store.journal(),
        }
    }

    pub(crate) async fn failed(
        &self,
        key: &str,
        error: HandlerError,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> Outcome {
        let inner = &*self.inner;
        let text = error.message();
        match error.kind() {
            HandlerErrorKind::Conflict => {
                self.dead_letter_with(
                    Some(key),
                    DeadLetterReason::Conflict,
                    text,
                    message,
                    meta,
                    1,
                )
                .await
            }
            HandlerErrorKind::Permanent => {
                self.dead_letter_with(
                    Some(key),
                    DeadLetterReason::PermanentFailure,
                    text,
                    message,
                    meta,
                    1,
                )
                .await
            }
            HandlerErrorKind::InvalidInput => {
                let reason = DeadLetterReason::InvalidInput(
                    error
                        .input_error()
                        .cloned()
                        .unwrap_or_else(|| InputError::Malformed(text.to_owned())),
                );
                self.dead_letter_with(Some(key), reason, text, message, meta, 1)
                    .await
            }
            HandlerErrorKind::Retryable => {
                let attempts = match inner.store.record_failure(&inner.name, key, text).await {
                    Ok(n) => n,
                    Err(e) => {
                        // Counting failed (the store is down): retry without counting.
                        return self.busy(
                            Some(key.to_owned()),
                            format!("{text}; counting the attempt failed: {e}"),
                        );
                    }
                };
                if attempts >= inner.retry.max_attempts {
                    return self
                        .dead_letter_with(
                            Some(key),
                            DeadLetterReason::RetriesExhausted,
                            text,
                            message,
                            meta,
                            attempts,
                        )
                        .await;
                }
                Outcome::RetryLater {
                    key: Some(key.to_owned()),
                    attempts,
                    delay: error
                        .retry_after()
                        .unwrap_or_else(|| inner.retry.backoff(attempts)),
                    error: text.to_owned(),
                }
            }
        }
    }

    pub(crate) async fn conflict(
        &self,
        record: crate::store::InboxRecord,
        fingerprint: String,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> Outcome {
        if self.inner.conflict == ConflictPolicy::DeadLetter {
            let error = format!(
                "key {:?} was processed with fingerprint {}; this message has {}",
                record.key, record.fingerprint, fingerprint
            );
            let outcome = self
                .dead_letter_with(
                    Some(&record.key),
                    DeadLetterReason::Conflict,
                    &error,
                    message,
                    meta,
                    0,
                )
                .await;
            if matches!(outcome, Outcome::RetryLater { .. }) {
                return outcome;
            }
        }
        Outcome::Conflict {
            record,
            fingerprint,
        }
    }

    /// Not this message's fault: retry after the busy delay without counting an attempt.
    pub(crate) fn busy(&self, key: Option<String>, error: String) -> Outcome {
        Outcome::RetryLater {
            key,
            attempts: 0,
            delay: self.inner.retry.busy_delay,
            error,
        }
    }

    pub(crate) async fn dead_letter(
        &self,
        key: Option<&str>,
        reason: DeadLetterReason,
        message: &Message,
        meta: &DeliveryMeta,
        attempts: u32,
    ) -> Outcome {
        let error = match &reason {
            DeadLetterReason::InvalidInput(e) => e.to_string(),
            other => other.code().to_owned(),
        };
        self.dead_letter_with(key, reason, &error, message, meta, attempts)
            .await
    }

    pub(crate) async fn dead_letter_with(
        &self,
        key: Option<&str>,
        reason: DeadLetterReason,
        error: &str,
        message: &Message,
        meta: &DeliveryMeta,
        attempts: u32,
    ) -> Outcome {
        // A message over the limit is kept only up to it.
        let cut;
        let message = match &reason {
            DeadLetterReason::InvalidInput(InputError::TooLarge { max, .. })
                if message.size_bytes() > *max =>
            {
                cut = message.head(*max);
                &cut
            }
            _ => message,
        };
        let letter = DeadLetter {
            consumer: &self.inner.name,
            key,
            reason: &reason,
            error,
            message,
            meta,
            attempts,
        };
        match self.inner.store.dead_letter(&letter).await {
            Ok(()) => Outcome::DeadLettered {
                key: key.map(str::to_owned),
                reason,
                error: error.to_owned(),
            },
            // Never ack what could not be dead-lettered: it comes back.
            Err(e) => self.busy(
                key.map(str::to_owned),
                format!("dead-lettering ({}) failed: {e}", reason.code()),
            ),
        }
    }
}
