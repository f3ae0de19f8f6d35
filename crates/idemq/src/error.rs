//! The typed errors of idemq: bad input, handler failures, store and source failures.

use std::time::Duration;

/// Why a message could not be turned into a scoped key and fingerprint.
///
/// Every variant is a property of the message itself: retrying cannot help,
/// so the engine dead-letters the message with [`code`](Self::code) as the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    /// The key spec found no value (missing header, JSON field, id or transport key).
    #[error("no key: {0} is absent")]
    MissingKey(String),
    /// The key resolved to an empty string.
    #[error("empty key from {0}")]
    EmptyKey(String),
    /// The key is longer than [`MAX_KEY_BYTES`](crate::key::MAX_KEY_BYTES).
    #[error("key is {len} bytes, longer than the limit of {max}")]
    KeyTooLong {
        /// Length of the offending key in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A header named by the key spec is not valid UTF-8.
    #[error("header {0:?} is not valid UTF-8")]
    HeaderNotUtf8(String),
    /// A JSON pointer points at a value that cannot be a key (object, array, null).
    #[error("value at {pointer} is {found}, not a string, number or boolean")]
    InvalidKeyValue {
        /// The JSON pointer.
        pointer: String,
        /// The JSON type found there.
        found: &'static str,
    },
    /// The payload is not JSON but the key spec or fingerprint needs JSON.
    #[error("payload is not valid JSON: {0}")]
    MalformedJson(String),
    /// A value the handler needs (e.g. a SQL template parameter) is absent.
    #[error("missing field: {0} is absent")]
    MissingField(String),
    /// The source could not decode the raw record (e.g. a bad JSON-lines envelope).
    #[error("malformed record: {0}")]
    Malformed(String),
}

impl InputError {
    /// A short stable code for the dead-letter table's `reason` column.
    pub fn code(&self) -> &'static str {
        match self {
            InputError::MissingKey(_) => "missing_key",
            InputError::EmptyKey(_) => "empty_key",
            InputError::KeyTooLong { .. } => "key_too_long",
            InputError::HeaderNotUtf8(_) => "header_not_utf8",
            InputError::InvalidKeyValue { .. } => "invalid_key_value",
            InputError::MalformedJson(_) => "malformed_json",
            InputError::MissingField(_) => "missing_field",
            InputError::Malformed(_) => "malformed_record",
        }
    }
}

/// What a handler returns when it fails: whether a retry can help.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// A transient failure (timeout, deadlock, unavailable service): the
    /// transaction is rolled back and the message retried with backoff.
    #[error("retryable: {message}")]
    Retryable {
        /// What went wrong.
        message: String,
        /// Overrides the policy's backoff for this retry.
        retry_after: Option<Duration>,
    },
    /// A failure that will repeat on every attempt (invalid data, a business
    /// rule): rolled back and dead-lettered at once.
    #[error("permanent: {0}")]
    Permanent(String),
    /// A downstream system refused the effect because the message's derived
    /// idempotency key was used before with another payload (HTTP 422 under
    /// the Idempotency-Key draft): rolled back and dead-lettered at once
    /// with the reason `conflict`, like a conflict in idemq's own inbox.
    #[error("conflict: {0}")]
    Conflict(String),
}

impl HandlerError {
    /// A retryable failure.
    pub fn retryable(message: impl std::fmt::Display) -> Self {
        HandlerError::Retryable {
            message: message.to_string(),
            retry_after: None,
        }
    }

    /// A permanent failure.
    pub fn permanent(message: impl std::fmt::Display) -> Self {
        HandlerError::Permanent(message.to_string())
    }

    /// A downstream conflict: the key was used before with another payload.
    pub fn conflict(message: impl std::fmt::Display) -> Self {
        HandlerError::Conflict(message.to_string())
    }

    /// Whether retrying can help.
    pub fn is_retryable(&self) -> bool {
        matches!(self, HandlerError::Retryable { .. })
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl From<sqlx::Error> for HandlerError {
    /// Database errors raised inside a handler: deadlocks, serialization
    /// failures, lock timeouts and lost connections are retryable; anything
    /// else (constraint violations, type errors, syntax) is permanent.
    fn from(err: sqlx::Error) -> Self {
        if crate::store::sql::is_transient(&err) {
            HandlerError::retryable(err)
        } else {
            HandlerError::permanent(err)
        }
    }
}

/// A failure of the store (database, Redis, memory).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A failure that may pass: connection lost, deadlock, lock timeout,
    /// serialization failure. The message is retried without counting an attempt.
    #[error("transient store error: {0}")]
    Transient(String),
    /// The lease on a key was lost to another worker before completion.
    #[error("lease on {key:?} was lost before completion")]
    LeaseLost {
        /// The scoped key.
        key: String,
    },
    /// A configuration error (bad table prefix, bad URL).
    #[error("store configuration: {0}")]
    Config(String),
    /// Any other store failure.
    #[error("store error: {0}")]
    Other(String),
}

impl StoreError {
    /// Whether the operation may succeed if retried.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            StoreError::Transient(_) | StoreError::LeaseLost { .. }
        )
    }
}

/// A failure of a message source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// Reading or acknowledging failed at the I/O level.
    #[error("source I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The source is misconfigured.
    #[error("source configuration: {0}")]
    Config(String),
    /// The broker refused a request or the connection to it failed.
    #[error("broker: {0}")]
    Broker(String),
    /// Any other source failure.
    #[error("source error: {0}")]
    Other(String),
}

/// A configuration error found while building a consumer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The consumer name is empty, too long or contains control characters.
    #[error("invalid consumer name {0:?}: 1 to 128 bytes, no control characters")]
    ConsumerName(String),
    /// A key or fingerprint spec could not be parsed.
    #[error("invalid spec {spec:?}: {reason}")]
    Spec {
        /// The spec text.
        spec: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A table prefix is not a plain SQL identifier.
    #[error("invalid table prefix {0:?}: letters, digits and '_', starting with a letter or '_', at most 40 bytes")]
    TablePrefix(String),
    /// A policy value is out of range.
    #[error("invalid policy: {0}")]
    Policy(String),
}
