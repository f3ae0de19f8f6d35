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
                let canonical = serde_json::to_vec(&values)
                    .map_err(|e| InputError::MalformedJson(e.to_string()))?;
                Ok(hex::encode(Sha256::digest(&canonical)))
            }
        }
    }
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
}
