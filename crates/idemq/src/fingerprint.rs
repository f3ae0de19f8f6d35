//! Payload fingerprints: what tells a true duplicate from a conflicting reuse of a key.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};

use crate::error::{ConfigError, InputError};
use crate::key::validate_pointer;
use crate::message::Message;

/// What the fingerprint covers. Stored with the key; a later message with
/// the same key but another fingerprint is a *conflict*, not a duplicate.
///
/// ```
/// use idemq::{FingerprintSpec, Message};
/// let spec: FingerprintSpec = "json:/amount,json:/currency".parse().unwrap();
/// let a = spec.compute(&Message::new(r#"{"amount":5,"currency":"EUR","sent_at":1}"#)).unwrap();
/// let b = spec.compute(&Message::new(r#"{"amount":5,"currency":"EUR","sent_at":2}"#)).unwrap();
/// assert_eq!(a, b); // only the chosen fields count
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintSpec {
    /// SHA-256 of the whole payload bytes (the default).
    #[default]
    Payload,
    /// SHA-256 over the JSON values at these pointers (absent values count as `null`).
    Pointers(Vec<String>),
}

impl FingerprintSpec {
    /// The hex SHA-256 fingerprint of `message` (64 characters).
    pub fn compute(&self, message: &Message) -> Result<String, InputError> {
        match self {
            FingerprintSpec::Payload => Ok(hex::encode(Sha256::digest(&message.payload))),
            FingerprintSpec::Pointers(pointers) => {
                let json = message
                    .json()
                    .map_err(|e| InputError::MalformedJson(e.to_string()))?;
                let values: Vec<&serde_json::Value> = pointers
                    .iter()
                    .map(|p| json.pointer(p).unwrap_or(&serde_json::Value::Null))
                    .collect();
                let mut canonical = vec![b'['];
                for (i, value) in values.into_iter().enumerate() {
                    if i > 0 {
                        canonical.push(b',');
                    }
                    write_canonical(value, &mut canonical)
                        .map_err(|e| InputError::MalformedJson(e.to_string()))?;
                }
                canonical.push(b']');
                Ok(hex::encode(Sha256::digest(&canonical)))
            }
        }
    }
}

/// Writes `value` as compact JSON with every object's keys in sorted order,
/// whatever order the payload had them in and whether or not another crate in
/// the build turned on serde_json's `preserve_order` (bson does). A fingerprint
/// must not depend on either: the same field values are the same message, and a
/// fingerprint stored by one build must match the one another build computes.
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) -> serde_json::Result<()> {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write_canonical(item, out)?;
            }
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out)?;
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar)?,
    }
    Ok(())
}

impl fmt::Display for FingerprintSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FingerprintSpec::Payload => f.write_str("payload"),
            FingerprintSpec::Pointers(ps) => {
                let parts: Vec<String> = ps.iter().map(|p| format!("json:{p}")).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

impl FromStr for FingerprintSpec {
    type Err = ConfigError;

    /// `payload`, or a comma-separated list of `json:/pointer`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        if text == "payload" {
            return Ok(FingerprintSpec::Payload);
        }
        let pointers = text
            .split(',')
            .map(|part| {
                let pointer =
                    part.trim()
                        .strip_prefix("json:")
                        .ok_or_else(|| ConfigError::Spec {
                            spec: text.to_owned(),
                            reason: "expected `payload` or a comma-separated list of json:/pointer"
                                .into(),
                        })?;
                validate_pointer(pointer).map_err(|reason| ConfigError::Spec {
                    spec: text.to_owned(),
                    reason,
                })?;
                Ok(pointer.to_owned())
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        Ok(FingerprintSpec::Pointers(pointers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_fingerprint_differs_by_byte() {
        let spec = FingerprintSpec::Payload;
        let a = spec.compute(&Message::new("a")).unwrap();
        let b = spec.compute(&Message::new("b")).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn pointer_fingerprint_needs_json() {
        let spec: FingerprintSpec = "json:/a".parse().unwrap();
        assert!(matches!(
            spec.compute(&Message::new("nope")),
            Err(InputError::MalformedJson(_))
        ));
        assert!("json:a".parse::<FingerprintSpec>().is_err());
        assert_eq!(spec.to_string(), "json:/a");
    }

    #[test]
    fn pointer_fingerprint_ignores_object_key_order_and_matches_earlier_builds() {
        let spec: FingerprintSpec = "json:/payer,json:/amount".parse().unwrap();
        let a = spec
            .compute(&Message::new(
                r#"{"payer":{"b":[{"d":"x\u00e9","c":null}],"a":1},"amount":5}"#,
            ))
            .unwrap();
        let b = spec
            .compute(&Message::new(
                r#"{"amount":5,"payer":{"a":1,"b":[{"c":null,"d":"xé"}]}}"#,
            ))
            .unwrap();
        assert_eq!(a, b);
        // SHA-256 of `[{"a":1,"b":[{"c":null,"d":"xé"}]},5]`: what builds without
        // serde_json's preserve_order stored, so their fingerprints still match.
        assert_eq!(
            a,
            "fed7e3a9fc39fdc42f718d5aaea82a986585a2e6f1a7be77c92b047d05146107"
        );
    }
}
