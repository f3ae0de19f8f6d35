//! Effects outside the database: derived idempotency keys and the effect journal.
//!
//! The inbox makes a handler's *database* writes exactly-once: they commit
//! with the claim or not at all. A call to another system (a payment
//! provider, an e-mail API) is not part of that transaction: when the
//! handler fails after the call, or the process dies before the commit, the
//! redelivery runs the handler again and would call again. Two tools cover
//! that:
//!
//! - **Derived idempotency keys** ([`idempotency_key`],
//!   [`Context::idempotency_key`](crate::Context::idempotency_key)): a UUID
//!   that is the same on every redelivery, in every process, for the same
//!   consumer, message key and step, and different for different steps.
//!   Send it to a provider that deduplicates requests by key (most payment
//!   APIs do), and a repeated call is answered without repeating the effect.
//! - **The effect journal** ([`EffectJournal`],
//!   [`Context::effect`](crate::Context::effect)): runs a call at most once
//!   per (consumer, key, step) *as far as idemq can see*. Right after the
//!   call succeeds its result is written to the journal, committed on its
//!   own (not in the business transaction, which may still roll back); a
//!   redelivery gets the stored result without calling.
//!
//! # The derivation
//!
//! `UUIDv5(namespace, name)` (RFC 9562: SHA-1, version 5, RFC 4122 variant) with
//! - `namespace` = [`NAMESPACE`] = `d6caef88-905d-5ba5-9d16-c4dc82ff176b`
//!   (itself `UUIDv5(URL namespace, "urn:idemq:idempotency-key")`);
//! - `name` = the UTF-8 bytes of the consumer name, one `0x00` byte, the
//!   message key, one `0x00` byte, the step name.
//!
//! Consumer names and step names contain no control characters (so no
//! `0x00`), which makes the encoding unambiguous even for keys that do.
//! Test vector: consumer `billing`, key `pay-1`, step `charge` →
//! `972e9c90-e2be-5b65-bd74-98d4d423507e`.
//!
//! # Guarantees and limits
//!
//! - A call whose result reached the journal is not made again for the same
//!   (consumer, key, step), in any process, until the journal row is pruned
//!   with the inbox ([`retention`](crate::retention)).
//! - A crash *between* the call and the journal write cannot be seen by
//!   idemq: the redelivery calls again, with the same derived key. Only a
//!   provider that honours the key makes that second call harmless.
//! - A failing call (an `Err`) is not journaled: the redelivery calls again.
//! - The stored result is the first one written: if two workers raced
//!   (possible only with lease stores after a lease was lost), both get the
//!   first result.
//!
//! ```
//! use idemq::effect::idempotency_key;
//! let key = idempotency_key("billing", "pay-1", "charge");
//! assert_eq!(key, idempotency_key("billing", "pay-1", "charge"));
//! assert_ne!(key, idempotency_key("billing", "pay-1", "refund"));
//! ```

use std::future::Future;

use async_trait::async_trait;
use uuid::Uuid;

use crate::error::{HandlerError, StoreError};

#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "mongodb")]
pub mod mongo;

/// The namespace of derived idempotency keys:
/// `UUIDv5(URL namespace, "urn:idemq:idempotency-key")`.
pub const NAMESPACE: Uuid = Uuid::from_u128(0xd6caef88_905d_5ba5_9d16_c4dc82ff176b);

/// The longest step name, in bytes.
pub const MAX_STEP_LEN: usize = 128;

/// The idempotency key of `step` for message `key` of `consumer`:
/// `UUIDv5(NAMESPACE, consumer 0x00 key 0x00 step)` (see the module docs).
pub fn idempotency_key(consumer: &str, key: &str, step: &str) -> Uuid {
    let mut name = Vec::with_capacity(consumer.len() + key.len() + step.len() + 2);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(key.as_bytes());
    name.push(0);
    name.extend_from_slice(step.as_bytes());
    Uuid::new_v5(&NAMESPACE, &name)
}

/// Checks a step name: 1 to [`MAX_STEP_LEN`] bytes without control characters.
pub fn validate_step(step: &str) -> Result<(), HandlerError> {
    if step.is_empty() || step.len() > MAX_STEP_LEN || step.chars().any(char::is_control) {
        return Err(HandlerError::permanent(format!(
            "invalid effect step name {step:?}: 1 to {MAX_STEP_LEN} bytes without control characters"
        )));
    }
    Ok(())
}

/// Where the results of effects are kept, each committed on its own.
///
/// Implemented by the SQL stores (table `{prefix}effects`, pruned with the
/// inbox), the memory store and the Redis store (a hash per key with the
/// retention TTL). [`Store::journal`](crate::store::Store::journal) hands it
/// to the engine.
#[async_trait]
pub trait EffectJournal: Send + Sync {
    /// The stored result of `step` for `key` of `consumer`, if any.
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError>;

    /// Stores `result` unless a result is stored already (the first one
    /// wins), committed on its own; returns the stored result.
    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError>;

    /// Every step journaled for `key` of `consumer`, with its result,
    /// ordered by step name (for `idemq inspect`).
    async fn steps(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError>;
}

fn journal_error(step: &str, e: StoreError) -> HandlerError {
    HandlerError::retryable(format!("effect {step:?}: journal: {e}")).with_source(e)
}

/// Runs `call` at most once per (consumer, key, step) as far as `journal`
/// can see; the engine of [`Context::effect`](crate::Context::effect).
pub async fn run<T, F, Fut>(
    journal: Option<&dyn EffectJournal>,
    consumer: &str,
    key: &str,
    step: &str,
    call: F,
) -> Result<serde_json::Value, HandlerError>
where
    T: serde::Serialize,
    F: FnOnce(Uuid) -> Fut,
    Fut: Future<Output = Result<T, HandlerError>>,
{
    validate_step(step)?;
    let journal = journal.ok_or_else(|| {
        HandlerError::permanent(format!(
            "effect {step:?}: the consumer's store keeps no effect journal"
        ))
    })?;
    if let Some(stored) = journal
        .get(consumer, key, step)
        .await
        .map_err(|e| journal_error(step, e))?
    {
        tracing::debug!(consumer, key, step, "effect already journaled: not calling");
        return Ok(stored);
    }
    let value = call(idempotency_key(consumer, key, step)).await?;
    let value = serde_json::to_value(value).map_err(|e| {
        HandlerError::permanent(format!("effect {step:?}: result not serializable: {e}"))
    })?;
    journal
        .put(consumer, key, step, &value)
        .await
        .map_err(|e| journal_error(step, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_is_derived_as_documented() {
        let derived = Uuid::new_v5(&Uuid::NAMESPACE_URL, b"urn:idemq:idempotency-key");
        assert_eq!(NAMESPACE, derived, "{derived}");
    }

    #[test]
    fn test_vector() {
        let key = idempotency_key("billing", "pay-1", "charge");
        assert_eq!(key.to_string(), "972e9c90-e2be-5b65-bd74-98d4d423507e");
        assert_eq!(key.get_version_num(), 5);
        // The same as hashing the documented bytes directly.
        assert_eq!(key, Uuid::new_v5(&NAMESPACE, b"billing\0pay-1\0charge"));
    }

    #[test]
    fn same_inputs_same_key_and_every_input_counts() {
        let key = idempotency_key("billing", "pay-1", "charge");
        assert_eq!(key, idempotency_key("billing", "pay-1", "charge"));
        assert_ne!(key, idempotency_key("billing", "pay-1", "refund"));
        assert_ne!(key, idempotency_key("billing", "pay-2", "charge"));
        assert_ne!(key, idempotency_key("shipping", "pay-1", "charge"));
        // The separators keep the parts apart.
        assert_ne!(
            idempotency_key("a", "bc", "d"),
            idempotency_key("a", "b", "cd")
        );
    }

    #[test]
    fn step_names_are_validated() {
        assert!(validate_step("charge").is_ok());
        assert!(validate_step(&"s".repeat(MAX_STEP_LEN)).is_ok());
        for bad in ["", "a\0b", "line\nbreak", &"s".repeat(MAX_STEP_LEN + 1)] {
            assert!(!validate_step(bad).unwrap_err().is_retryable(), "{bad:?}");
        }
    }
}
