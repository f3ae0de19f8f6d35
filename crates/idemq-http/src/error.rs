//! Errors of the layer.

/// Why an `Idempotency-Key` header was refused (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header appeared more than once.
    #[error("the Idempotency-Key header appears more than once")]
    Repeated,
    /// The Item's bare item is not a String (e.g. an unquoted token).
    #[error("the Idempotency-Key header must be a Structured Field string (in double quotes)")]
    NotAString,
    /// The String is empty.
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// The key (with its scope) is longer than a store keeps.
    #[error("the Idempotency-Key is too long: {len} bytes with its scope, at most {max}")]
    TooLong {
        /// Bytes of the scoped key.
        len: usize,
        /// The most a store keeps.
        max: usize,
    },
    /// Not a valid Structured Field Item.
    #[error("the Idempotency-Key header is not a valid Structured Field item: {0}")]
    Syntax(&'static str),
}

/// A configuration the builder refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The name under which keys are stored is not a valid consumer name.
    #[error("invalid layer name: {0}")]
    Name(#[from] idemq::ConfigError),
    /// Another option is out of range.
    #[error("invalid option: {0}")]
    Option(String),
}

/// The inbox transaction could not be handed to the handler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TxError {
    /// The request did not go through the idempotency layer with a key (no
    /// claim was made for it), so there is no transaction.
    #[error("no idempotency claim for this request (no Idempotency-Key, or the route is not behind the layer)")]
    Missing,
    /// The claim's transaction was already taken back by the layer: the
    /// response was produced, or a task kept the handle past it.
    #[error("the idempotency claim's transaction is no longer available")]
    Gone,
}
