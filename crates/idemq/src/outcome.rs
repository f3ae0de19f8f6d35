//! Outcomes: every message ends as exactly one of these.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::error::InputError;
use crate::store::InboxRecord;

/// Why a message was dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// The message itself is unusable (no key, malformed, too long, ...).
    InvalidInput(InputError),
    /// The key was processed before with a different payload.
    Conflict,
    /// The handler reported a permanent failure.
    PermanentFailure,
    /// The handler failed retryably on every one of the allowed attempts.
    RetriesExhausted,
    /// The broker delivered it more often than the allowed attempts (the consumer
    /// probably crashed while handling it each time).
    DeliveryLimit,
}

impl DeadLetterReason {
    /// The stable code stored in the `reason` column.
    pub fn code(&self) -> &'static str {
        match self {
            DeadLetterReason::InvalidInput(e) => e.code(),
            DeadLetterReason::Conflict => "conflict",
            DeadLetterReason::PermanentFailure => "permanent_failure",
            DeadLetterReason::RetriesExhausted => "retries_exhausted",
            DeadLetterReason::DeliveryLimit => "delivery_limit",
        }
    }
}

impl std::fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.code())
    }
}

/// How one delivery of a message ended.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its effects committed; then the delivery was acked.
    Processed {
        /// The scoped key.
        key: String,
        /// The result the handler stored, if any.
        result: Option<serde_json::Value>,
    },
    /// The key was already processed with the same fingerprint: nothing ran, the delivery was acked.
    Duplicate {
        /// The stored record (first-seen time, stored result).
        record: InboxRecord,
    },
    /// The key was already processed with a *different* payload fingerprint.
    /// Nothing ran; the message was dead-lettered (or acked, per
    /// [`ConflictPolicy`](crate::ConflictPolicy)).
    Conflict {
        /// The stored record.
        record: InboxRecord,
        /// The fingerprint of the message that conflicted.
        fingerprint: String,
    },
    /// Nothing committed; the delivery was nacked to come back after `delay`.
    RetryLater {
        /// The key, where one could be derived.
        key: Option<String>,
        /// Failed handler attempts counted so far (0 for store or in-flight waits).
        attempts: u32,
        /// How long until the redelivery.
        delay: Duration,
        /// Why.
        error: String,
    },
    /// The message was written to the dead-letter table (and the source's dead-letter destination) and acked.
    DeadLettered {
        /// The key, where one could be derived.
        key: Option<String>,
        /// Why.
        reason: DeadLetterReason,
        /// The error text.
        error: String,
    },
}

impl Outcome {
    /// The kind of outcome, for counting. A message dead-lettered because a
    /// downstream system reported a conflict
    /// ([`HandlerErrorKind::Conflict`](crate::HandlerErrorKind::Conflict), e.g. HTTP
    /// 422) counts as a [`OutcomeKind::Conflict`], like a conflict in the inbox.
    pub fn kind(&self) -> OutcomeKind {
        match self {
            Outcome::Processed { .. } => OutcomeKind::Processed,
            Outcome::Duplicate { .. } => OutcomeKind::Duplicate,
            Outcome::Conflict { .. }
            | Outcome::DeadLettered {
                reason: DeadLetterReason::Conflict,
                ..
            } => OutcomeKind::Conflict,
            Outcome::RetryLater { .. } => OutcomeKind::RetryLater,
            Outcome::DeadLettered { .. } => OutcomeKind::DeadLettered,
        }
    }
}

/// The kinds of [`Outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum OutcomeKind {
    /// See [`Outcome::Processed`].
    Processed,
    /// See [`Outcome::Duplicate`].
    Duplicate,
    /// See [`Outcome::Conflict`]; also a downstream conflict, dead-lettered
    /// with the reason `conflict`.
    Conflict,
    /// See [`Outcome::RetryLater`].
    RetryLater,
    /// See [`Outcome::DeadLettered`].
    DeadLettered,
}

impl OutcomeKind {
    /// All kinds, in display order.
    pub const ALL: [OutcomeKind; 5] = [
        OutcomeKind::Processed,
        OutcomeKind::Duplicate,
        OutcomeKind::Conflict,
        OutcomeKind::RetryLater,
        OutcomeKind::DeadLettered,
    ];

    /// The label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeKind::Processed => "processed",
            OutcomeKind::Duplicate => "duplicate",
            OutcomeKind::Conflict => "conflict",
            OutcomeKind::RetryLater => "retry_later",
            OutcomeKind::DeadLettered => "dead_lettered",
        }
    }
}

impl fmt::Display for OutcomeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counts of outcomes over a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    counts: BTreeMap<OutcomeKind, u64>,
    abandoned: u64,
}

impl Summary {
    /// Counts one outcome.
    pub fn record(&mut self, kind: OutcomeKind) {
        *self.counts.entry(kind).or_default() += 1;
    }

    /// How many outcomes of `kind`.
    pub fn count(&self, kind: OutcomeKind) -> u64 {
        self.counts.get(&kind).copied().unwrap_or(0)
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Summary) {
        for (kind, n) in &other.counts {
            *self.counts.entry(*kind).or_default() += n;
        }
        self.abandoned += other.abandoned;
    }

    /// Deliveries still in flight when a stopping run's grace period ended
    /// ([`ConsumerBuilder::shutdown_grace`](crate::ConsumerBuilder::shutdown_grace)):
    /// left unsettled for their source to redeliver; no outcome of theirs
    /// is counted.
    pub fn abandoned(&self) -> u64 {
        self.abandoned
    }

    /// Counts `n` deliveries abandoned at the end of a grace period.
    pub(crate) fn record_abandoned(&mut self, n: u64) {
        self.abandoned += n;
    }

    /// All deliveries handled.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = OutcomeKind::ALL
            .iter()
            .map(|k| format!("{k}={}", self.count(*k)))
            .collect();
        f.write_str(&parts.join(" "))?;
        if self.abandoned > 0 {
            write!(f, " abandoned={}", self.abandoned)?;
        }
        Ok(())
    }
}
