//! Key specs: how the business key is read from a message.
//!
//! A [`KeySpec`] is parsed from a short string (for the CLI) or built in code:
//!
//! | spec | key |
//! |---|---|
//! | `header:NAME` | the UTF-8 value of header `NAME` |
//! | `json:/a/b` | the value at RFC 6901 JSON pointer `/a/b` of the payload (string, number or boolean) |
//! | `key` | the transport key (Kafka record key, JSON-lines envelope `key`) |
//! | `id` | the message id. Weaker: a producer retry gets a new id and slips through |
//! | `hash` | SHA-256 (hex) of the payload: catches producer retries with new ids |
//! | `A+B` | a composite: the parts joined by `+` (a `+` or `\` inside a part is escaped with `\`) |
//! | `A\|B` | the first alternative that is present: `header:event_id\|key` |
//!
//! `+` binds tighter than `|`. The key is always stored scoped by the
//! consumer name, so two consumers of one topic each get their own
//! once-only guarantee. A key is at most [`MAX_KEY_BYTES`] bytes; an empty
//! key, a longer one or a non-UTF-8 header is an [`InputError`], never a truncation.
//!
//! ```
//! use idemq::{KeySpec, Message};
//! let spec: KeySpec = "json:/order_id+json:/type".parse().unwrap();
//! let msg = Message::new(r#"{"order_id": 42, "type": "paid"}"#);
//! assert_eq!(spec.extract(&msg).unwrap(), "42+paid");
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::error::{ConfigError, InputError};
use crate::message::Message;

/// The longest key accepted, in bytes (UTF-8). Longer keys are rejected with
/// [`InputError::KeyTooLong`]; the SQL schemas size their key column to it.
pub const MAX_KEY_BYTES: usize = 512;

/// A custom key function for keys no spec string can express.
pub type KeyFn = Arc<dyn Fn(&Message) -> Result<String, InputError> + Send + Sync>;

/// One source of a key value.
#[derive(Clone)]
pub enum KeyPart {
    /// A header's UTF-8 value.
    Header(String),
    /// The value at an RFC 6901 JSON pointer in the payload.
    Json(String),
    /// The transport-level message key.
    TransportKey,
    /// The message id (weaker: producer retries get new ids).
    Id,
    /// SHA-256 of the payload, hex.
    Hash,
    /// A custom function.
    Custom(KeyFn),
}

impl fmt::Debug for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_string())
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Header(name) => write!(f, "header:{name}"),
            KeyPart::Json(pointer) => write!(f, "json:{pointer}"),
            KeyPart::TransportKey => f.write_str("key"),
            KeyPart::Id => f.write_str("id"),
            KeyPart::Hash => f.write_str("hash"),
            KeyPart::Custom(_) => f.write_str("custom"),
        }
    }
}

/// How to derive the business key of a message: alternatives of composites of parts.
#[derive(Clone, Debug)]
pub struct KeySpec {
    alternatives: Vec<Vec<KeyPart>>,
}

impl KeySpec {
    /// A spec of one part.
    pub fn part(part: KeyPart) -> Self {
        Self {
            alternatives: vec![vec![part]],
        }
    }

    /// The value of header `name`.
    pub fn header(name: impl Into<String>) -> Self {
        Self::part(KeyPart::Header(name.into()))
    }

    /// The value at a JSON pointer of the payload.
    pub fn json(pointer: impl Into<String>) -> Self {
        Self::part(KeyPart::Json(pointer.into()))
    }

    /// The transport-level message key.
    pub fn transport_key() -> Self {
        Self::part(KeyPart::TransportKey)
    }

    /// The message id.
    pub fn id() -> Self {
        Self::part(KeyPart::Id)
    }

    /// SHA-256 of the payload.
    pub fn hash() -> Self {
        Self::part(KeyPart::Hash)
    }

    /// A custom function.
    pub fn custom(
        f: impl Fn(&Message) -> Result<String, InputError> + Send + Sync + 'static,
    ) -> Self {
        Self::part(KeyPart::Custom(Arc::new(f)))
    }

    /// Appends `other` as further parts of a composite key (`self+other`).
    /// Only meaningful when both specs have a single alternative.
    pub fn and(mut self, other: KeySpec) -> Self {
        let mut other_parts = other.alternatives.into_iter().flatten();
        if let Some(last) = self.alternatives.last_mut() {
            last.extend(&mut other_parts);
        }
        self
    }

    /// Adds `other` as a fallback when this spec finds no value (`self|other`).
    pub fn or(mut self, other: KeySpec) -> Self {
        self.alternatives.extend(other.alternatives);
        self
    }

    /// Extracts the key from a message.
    ///
    /// The first alternative whose parts are all present wins; if none is
    /// complete, the error of the first alternative is returned.
    pub fn extract(&self, message: &Message) -> Result<String, InputError> {
        let mut parsed_json: Option<Result<serde_json::Value, InputError>> = None;
        let mut first_error = None;
        for parts in &self.alternatives {
            match extract_composite(parts, message, &mut parsed_json) {
                Ok(key) => return check_key(key, &self.to_string()),
                Err(InputError::MissingKey(what)) => {
                    first_error.get_or_insert(InputError::MissingKey(what));
                }
                Err(other) => return Err(other),
            }
        }
        Err(first_error.unwrap_or_else(|| InputError::MissingKey(self.to_string())))
    }
}

fn check_key(key: String, spec: &str) -> Result<String, InputError> {
    if key.is_empty() {
        Err(InputError::EmptyKey(spec.to_owned()))
    } else if key.len() > MAX_KEY_BYTES {
        Err(InputError::KeyTooLong {
            len: key.len(),
            max: MAX_KEY_BYTES,
        })
    } else {
        Ok(key)
    }
}

fn extract_composite(
    parts: &[KeyPart],
    message: &Message,
    parsed_json: &mut Option<Result<serde_json::Value, InputError>>,
) -> Result<String, InputError> {
    if let [single] = parts {
        return extract_part(single, message, parsed_json);
    }
    let mut joined = String::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            joined.push('+');
        }
        let value = extract_part(part, message, parsed_json)?;
        for c in value.chars() {
            if c == '+' || c == '\\' {
                joined.push('\\');
            }
            joined.push(c);
        }
    }
    Ok(joined)
}

fn extract_part(
    part: &KeyPart,
    message: &Message,
    parsed_json: &mut Option<Result<serde_json::Value, InputError>>,
) -> Result<String, InputError> {
    match part {
        KeyPart::Header(name) => {
            let raw = message
                .headers
                .get(name)
                .ok_or_else(|| InputError::MissingKey(part.to_string()))?;
            std::str::from_utf8(raw)
                .map(str::to_owned)
                .map_err(|_| InputError::HeaderNotUtf8(name.clone()))
        }
        KeyPart::Json(pointer) => {
            let json = parsed_json.get_or_insert_with(|| {
                message
                    .json()
                    .map_err(|e| InputError::MalformedJson(e.to_string()))
            });
            let json = json.as_ref().map_err(Clone::clone)?;
            let value = json
                .pointer(pointer)
                .ok_or_else(|| InputError::MissingKey(part.to_string()))?;
            json_scalar_to_key(pointer, value)
        }
        KeyPart::TransportKey => message
            .key
            .clone()
            .ok_or_else(|| InputError::MissingKey(part.to_string())),
        KeyPart::Id => message
            .id
            .clone()
            .ok_or_else(|| InputError::MissingKey(part.to_string())),
        KeyPart::Hash => Ok(hex::encode(Sha256::digest(&message.payload))),
        KeyPart::Custom(f) => f(message),
    }
}

fn json_scalar_to_key(pointer: &str, value: &serde_json::Value) -> Result<String, InputError> {
    use serde_json::Value;
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Null => Err(InputError::InvalidKeyValue {
            pointer: pointer.to_owned(),
            found: "null",
        }),
        Value::Array(_) => Err(InputError::InvalidKeyValue {
            pointer: pointer.to_owned(),
            found: "an array",
        }),
        Value::Object(_) => Err(InputError::InvalidKeyValue {
            pointer: pointer.to_owned(),
            found: "an object",
        }),
    }
}

impl fmt::Display for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, parts) in self.alternatives.iter().enumerate() {
            if i > 0 {
                f.write_str("|")?;
            }
            for (j, part) in parts.iter().enumerate() {
                if j > 0 {
                    f.write_str("+")?;
                }
                write!(f, "{part}")?;
            }
        }
        Ok(())
    }
}

/// Splits `text` on unescaped `sep`, removing the escapes of `sep` and `\`.
fn split_escaped(text: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some(next) if next == sep => out.last_mut().map(|s| s.push(next)),
                // Keep other escapes for the next level of splitting.
                Some(next) => out.last_mut().map(|s| {
                    s.push('\\');
                    s.push(next)
                }),
                None => out.last_mut().map(|s| s.push('\\')),
            };
        } else if c == sep {
            out.push(String::new());
        } else if let Some(s) = out.last_mut() {
            s.push(c);
        }
    }
    out
}

fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(next) = chars.next() {
                out.push(next);
                continue;
            }
        }
        out.push(c);
    }
    out
}

impl FromStr for KeyPart {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| ConfigError::Spec {
            spec: text.to_owned(),
            reason: reason.to_owned(),
        };
        let text = text.trim();
        match text {
            "id" => return Ok(KeyPart::Id),
            "key" => return Ok(KeyPart::TransportKey),
            "hash" => return Ok(KeyPart::Hash),
            _ => {}
        }
        if let Some(name) = text.strip_prefix("header:") {
            let name = unescape(name);
            if name.is_empty() {
                return Err(invalid("header name is empty"));
            }
            return Ok(KeyPart::Header(name));
        }
        if let Some(pointer) = text.strip_prefix("json:") {
            let pointer = unescape(pointer);
            validate_pointer(&pointer).map_err(|r| invalid(&r))?;
            return Ok(KeyPart::Json(pointer));
        }
        Err(invalid(
            "expected header:NAME, json:/pointer, key, id or hash",
        ))
    }
}

/// Checks that `pointer` is an RFC 6901 JSON pointer: empty, or `/`-prefixed
/// with `~` only in the escapes `~0` and `~1`.
pub fn validate_pointer(pointer: &str) -> Result<(), String> {
    if pointer.is_empty() {
        return Ok(());
    }
    if !pointer.starts_with('/') {
        return Err(format!("JSON pointer {pointer:?} must start with '/'"));
    }
    let mut chars = pointer.chars();
    while let Some(c) = chars.next() {
        if c == '~' && !matches!(chars.next(), Some('0') | Some('1')) {
            return Err(format!(
                "JSON pointer {pointer:?} has '~' not followed by 0 or 1"
            ));
        }
    }
    Ok(())
}

impl FromStr for KeySpec {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.trim().is_empty() {
            return Err(ConfigError::Spec {
                spec: text.to_owned(),
                reason: "empty key spec".to_owned(),
            });
        }
        let alternatives = split_escaped(text, '|')
            .iter()
            .map(|alt| {
                split_escaped(alt, '+')
                    .iter()
                    .map(|p| p.parse::<KeyPart>())
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { alternatives })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg() -> Message {
        Message::new(r#"{"order_id":"A-1","n":7,"flag":true,"obj":{},"nul":null,"a+b":"x"}"#)
            .with_id("m-1")
            .with_key("tk")
            .with_header("event_id", "ev-9")
            .with_header("bin", vec![0xff, 0xfe])
    }

    #[test]
    fn parts_extract() {
        let m = msg();
        let cases = [
            ("header:event_id", "ev-9"),
            ("json:/order_id", "A-1"),
            ("json:/n", "7"),
            ("json:/flag", "true"),
            ("id", "m-1"),
            ("key", "tk"),
            ("json:/order_id+header:event_id", "A-1+ev-9"),
            ("header:missing|json:/n", "7"),
            ("json:/a\\+b", "x"),
        ];
        for (spec, want) in cases {
            let spec: KeySpec = spec.parse().unwrap();
            assert_eq!(spec.extract(&m).unwrap(), want, "{spec}");
        }
        let hash: KeySpec = "hash".parse().unwrap();
        assert_eq!(hash.extract(&m).unwrap().len(), 64);
    }

    #[test]
    fn composite_escapes_separator() {
        let spec: KeySpec = "json:/a+json:/b".parse().unwrap();
        let one = spec
            .extract(&Message::new(r#"{"a":"x+","b":"y"}"#))
            .unwrap();
        let two = spec
            .extract(&Message::new(r#"{"a":"x","b":"+y"}"#))
            .unwrap();
        assert_ne!(one, two);
    }

    #[test]
    fn typed_errors() {
        let m = msg();
        let err = |s: &str| s.parse::<KeySpec>().unwrap().extract(&m).unwrap_err();
        assert!(matches!(err("header:nope"), InputError::MissingKey(_)));
        assert!(matches!(err("header:bin"), InputError::HeaderNotUtf8(_)));
        assert!(matches!(
            err("json:/obj"),
            InputError::InvalidKeyValue { .. }
        ));
        assert!(matches!(
            err("json:/nul"),
            InputError::InvalidKeyValue { .. }
        ));
        let bad = Message::new("not json");
        let spec: KeySpec = "json:/x".parse().unwrap();
        assert!(matches!(
            spec.extract(&bad),
            Err(InputError::MalformedJson(_))
        ));
        let long = Message::new(format!(r#"{{"k":"{}"}}"#, "x".repeat(MAX_KEY_BYTES + 1)));
        let spec: KeySpec = "json:/k".parse().unwrap();
        assert!(matches!(
            spec.extract(&long),
            Err(InputError::KeyTooLong { .. })
        ));
        let empty = Message::new(r#"{"k":""}"#);
        assert!(matches!(spec.extract(&empty), Err(InputError::EmptyKey(_))));
    }

    #[test]
    fn bad_specs_are_config_errors() {
        for spec in ["", "nope", "json:a", "json:/~2", "header:"] {
            assert!(spec.parse::<KeySpec>().is_err(), "{spec}");
        }
    }

    #[test]
    fn display_round_trips() {
        for spec in ["header:event_id|key", "json:/a+json:/b", "hash"] {
            assert_eq!(spec.parse::<KeySpec>().unwrap().to_string(), spec);
        }
    }
}
