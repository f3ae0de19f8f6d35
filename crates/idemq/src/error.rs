//! The typed errors of idemq: bad input, handler failures, store and source failures.

use std::time::Duration;

/// Why a message could not be turned into a scoped key and fingerprint.
///
/// Every variant is a property of the message itself: retrying cannot help,
/// so the engine dead-letters the message with [`code`](Self::code) as the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
    /// The payload does not decode to the type the handler asked for
    /// ([`Context::decode`](crate::Context::decode)).
    #[error("payload does not decode to {type_name}: {error}")]
    Undecodable {
        /// The Rust type the handler asked for.
        type_name: &'static str,
        /// The decoder's error.
        error: String,
    },
    /// The record is larger than a limit: a JSON line longer than
    /// [`JsonLinesSource::max_line_bytes`](crate::source::jsonl::JsonLinesSource::max_line_bytes),
    /// or a message (headers and payload) larger than the consumer's
    /// [`max_message_bytes`](crate::ConsumerBuilder::max_message_bytes);
    /// only its first `max` bytes are kept.
    #[error("record is {len} bytes, larger than the limit of {max}")]
    TooLarge {
        /// Its length in bytes.
        len: u64,
        /// The limit.
        max: usize,
    },
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
            InputError::Undecodable { .. } => "undecodable_payload",
            InputError::TooLarge { .. } => "too_large",
        }
    }
}

/// The parts every kinded error shares: `kind()`, `message()`,
/// `with_source()`, `Display` as `{kind}: {message}`, and the boxed cause as
/// [`source`](std::error::Error::source).
macro_rules! kinded_error {
    ($error:ident, $kind:ident) => {
        impl $error {
            /// What kind of failure it is.
            pub fn kind(&self) -> $kind {
                self.kind
            }

            /// What happened, without the kind's prefix (the text a dead
            /// letter or an outcome keeps).
            pub fn message(&self) -> &str {
                &self.message
            }

            /// The same error with `source` as its cause.
            pub fn with_source(mut self, source: impl Into<BoxError>) -> Self {
                self.source = Some(source.into());
                self
            }
        }

        impl std::fmt::Display for $error {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}: {}", self.kind.prefix(), self.message)
            }
        }

        impl std::error::Error for $error {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.source
                    .as_deref()
                    .map(|e| e as &(dyn std::error::Error + 'static))
            }
        }
    };
}

/// The boxed underlying error of a [`StoreError`], [`HandlerError`] or [`SourceError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What kind of failure a [`HandlerError`] is: whether a retry can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandlerErrorKind {
    /// A transient failure (timeout, deadlock, unavailable service): the
    /// transaction is rolled back and the message retried with backoff.
    Retryable,
    /// A failure that will repeat on every attempt (invalid data, a business
    /// rule): rolled back and dead-lettered at once.
    Permanent,
    /// A downstream system refused the effect because the message's derived
    /// idempotency key was used before with another payload (HTTP 422 under
    /// the Idempotency-Key draft): rolled back and dead-lettered at once
    /// with the reason `conflict`, like a conflict in idemq's own inbox.
    Conflict,
    /// The message itself is bad for this handler (its payload does not
    /// decode to the handler's type, a field it needs is absent): rolled
    /// back and dead-lettered at once with the input error's reason code,
    /// like bad input found before the claim.
    InvalidInput,
}

impl HandlerErrorKind {
    /// How the kind reads at the start of an error message.
    fn prefix(self) -> &'static str {
        match self {
            HandlerErrorKind::Retryable => "retryable",
            HandlerErrorKind::Permanent => "permanent",
            HandlerErrorKind::Conflict => "conflict",
            HandlerErrorKind::InvalidInput => "invalid input",
        }
    }
}

/// What a handler returns when it fails: its [`kind`](Self::kind) (whether a
/// retry can help), what happened, an optional delay before the retry, and
/// the underlying error as its [`source`](std::error::Error::source).
///
/// ```
/// use std::time::Duration;
/// use idemq::{HandlerError, HandlerErrorKind};
///
/// let err = HandlerError::retryable("rate limited").with_retry_after(Duration::from_secs(2));
/// assert_eq!(err.kind(), HandlerErrorKind::Retryable);
/// assert_eq!(err.retry_after(), Some(Duration::from_secs(2)));
/// assert_eq!(err.to_string(), "retryable: rate limited");
/// ```
#[derive(Debug)]
pub struct HandlerError {
    kind: HandlerErrorKind,
    message: String,
    retry_after: Option<Duration>,
    input: Option<InputError>,
    source: Option<BoxError>,
}

impl HandlerError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: HandlerErrorKind, message: impl std::fmt::Display) -> Self {
        Self {
            kind,
            message: message.to_string(),
            retry_after: None,
            input: None,
            source: None,
        }
    }

    /// Bad input found by the handler: dead-lettered at once with the
    /// reason [`InputError::code`].
    pub fn invalid_input(error: InputError) -> Self {
        let mut err = Self::new(HandlerErrorKind::InvalidInput, &error);
        err.input = Some(error);
        err
    }

    /// The input error of an [`invalid_input`](Self::invalid_input) error.
    pub fn input_error(&self) -> Option<&InputError> {
        self.input.as_ref()
    }

    /// A retryable failure.
    pub fn retryable(message: impl std::fmt::Display) -> Self {
        Self::new(HandlerErrorKind::Retryable, message)
    }

    /// A permanent failure.
    pub fn permanent(message: impl std::fmt::Display) -> Self {
        Self::new(HandlerErrorKind::Permanent, message)
    }

    /// A downstream conflict: the key was used before with another payload.
    pub fn conflict(message: impl std::fmt::Display) -> Self {
        Self::new(HandlerErrorKind::Conflict, message)
    }

    /// The same error, retried after `delay` instead of the policy's
    /// backoff (retryable errors only; ignored on the others).
    pub fn with_retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The delay the handler asked for before the retry, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether retrying can help.
    pub fn is_retryable(&self) -> bool {
        self.kind == HandlerErrorKind::Retryable
    }
}

kinded_error!(HandlerError, HandlerErrorKind);

impl From<InputError> for HandlerError {
    fn from(error: InputError) -> Self {
        HandlerError::invalid_input(error)
    }
}

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
impl From<sqlx::Error> for HandlerError {
    /// Database errors raised inside a handler: deadlocks, serialization
    /// failures, lock timeouts and lost connections are retryable; anything
    /// else (constraint violations, type errors, syntax) is permanent.
    fn from(err: sqlx::Error) -> Self {
        let kind = if crate::store::sql::is_transient(&err) {
            HandlerErrorKind::Retryable
        } else {
            HandlerErrorKind::Permanent
        };
        HandlerError::new(kind, &err).with_source(err)
    }
}

/// What kind of failure a [`StoreError`] is. The engine and the CLI decide
/// on the kind, never on the message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// A failure that may pass: connection lost, deadlock, lock timeout,
    /// serialization failure, pool exhausted. The message is retried without
    /// counting an attempt.
    Transient,
    /// The lease on a key was lost to another worker before completion.
    LeaseLost,
    /// The store's tables are missing (the migrations were not run).
    MissingSchema,
    /// A configuration error (bad table prefix, bad URL, bad option).
    Config,
    /// Something the store holds could not be read back (a corrupt or
    /// foreign record).
    Corrupt,
    /// Any other store failure.
    Other,
}

impl StoreErrorKind {
    /// How the kind reads at the start of an error message.
    fn prefix(self) -> &'static str {
        match self {
            StoreErrorKind::Transient => "transient store error",
            StoreErrorKind::LeaseLost => "lease lost",
            StoreErrorKind::MissingSchema => "store tables missing",
            StoreErrorKind::Config => "store configuration",
            StoreErrorKind::Corrupt => "unreadable store record",
            StoreErrorKind::Other => "store error",
        }
    }
}

/// A failure of the store (database, Redis, memory): its
/// [`kind`](Self::kind), what happened, and the underlying driver error as
/// its [`source`](std::error::Error::source).
///
/// ```
/// use idemq::{StoreError, StoreErrorKind};
///
/// let err = StoreError::new(StoreErrorKind::Transient, "connection reset");
/// assert!(err.is_transient());
/// assert_eq!(err.to_string(), "transient store error: connection reset");
/// ```
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<BoxError>,
}

impl StoreError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// An error of `kind` caused by `source`, described by `source`'s text.
    pub fn from_source(kind: StoreErrorKind, source: impl Into<BoxError>) -> Self {
        let source = source.into();
        Self {
            kind,
            message: source.to_string(),
            source: Some(source),
        }
    }

    /// A transient failure (see [`StoreErrorKind::Transient`]).
    pub fn transient(message: impl Into<String>) -> Self {
        Self::new(StoreErrorKind::Transient, message)
    }

    /// A configuration error.
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(StoreErrorKind::Config, message)
    }

    /// A stored record that could not be read back.
    pub fn corrupt(message: impl Into<String>) -> Self {
        Self::new(StoreErrorKind::Corrupt, message)
    }

    /// The lease on the scoped `key` was lost before completion.
    pub fn lease_lost(key: &str) -> Self {
        Self::new(
            StoreErrorKind::LeaseLost,
            format!("the lease on {key:?} was lost before completion"),
        )
    }

    /// Whether the operation may succeed if retried.
    pub fn is_transient(&self) -> bool {
        matches!(
            self.kind,
            StoreErrorKind::Transient | StoreErrorKind::LeaseLost
        )
    }
}

kinded_error!(StoreError, StoreErrorKind);

/// What kind of failure a [`SourceError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SourceErrorKind {
    /// Reading or acknowledging failed at the I/O level.
    Io,
    /// The source is misconfigured (bad URL, bad option, a message the
    /// broker can never take): retrying cannot help.
    Config,
    /// The broker refused a request or the connection to it failed.
    Broker,
    /// Any other source failure.
    Other,
}

impl SourceErrorKind {
    /// How the kind reads at the start of an error message.
    fn prefix(self) -> &'static str {
        match self {
            SourceErrorKind::Io => "source I/O",
            SourceErrorKind::Config => "source configuration",
            SourceErrorKind::Broker => "broker",
            SourceErrorKind::Other => "source error",
        }
    }
}

/// A failure of a message source or publisher: its [`kind`](Self::kind),
/// what happened, and the underlying client error as its
/// [`source`](std::error::Error::source).
///
/// ```
/// use idemq::{SourceError, SourceErrorKind};
///
/// let err = SourceError::config("missing ?group=");
/// assert_eq!(err.kind(), SourceErrorKind::Config);
/// assert_eq!(err.to_string(), "source configuration: missing ?group=");
/// ```
#[derive(Debug)]
pub struct SourceError {
    kind: SourceErrorKind,
    message: String,
    source: Option<BoxError>,
}

impl SourceError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: SourceErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// A configuration error (see [`SourceErrorKind::Config`]).
    pub fn config(message: impl Into<String>) -> Self {
        Self::new(SourceErrorKind::Config, message)
    }

    /// The broker refused a request or could not be reached.
    pub fn broker(message: impl Into<String>) -> Self {
        Self::new(SourceErrorKind::Broker, message)
    }

    /// Any other failure.
    pub fn other(message: impl Into<String>) -> Self {
        Self::new(SourceErrorKind::Other, message)
    }
}

impl From<std::io::Error> for SourceError {
    fn from(err: std::io::Error) -> Self {
        Self::new(SourceErrorKind::Io, err.to_string()).with_source(err)
    }
}

kinded_error!(SourceError, SourceErrorKind);

/// A configuration error found while building a consumer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
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
