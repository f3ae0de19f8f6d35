//! Message mapping: the message attributes this source reads and writes, and
//! an SQS message as a [`Message`].

use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName};
use sha2::{Digest, Sha256};

use crate::error::SourceError;
use crate::message::{Headers, Message};

/// The message attribute that carries [`Message::id`].
pub const ID_ATTRIBUTE: &str = "message_id";
/// The message attribute that carries [`Message::key`].
pub const KEY_ATTRIBUTE: &str = "key";
/// The message attribute added to copies sent to the dead-letter queue.
pub const REASON_ATTRIBUTE: &str = "dead_letter_reason";
/// SQS accepts at most this many message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;

/// Maps an SQS message to a [`Message`] (see the module docs).
pub(super) fn to_message(raw: &aws_sdk_sqs::types::Message, fifo: bool) -> Message {
    let attributes = raw.message_attributes();
    let string_attr = |name: &str| {
        attributes
            .and_then(|a| a.get(name))
            .and_then(|v| v.string_value())
            .map(str::to_owned)
    };
    let id = string_attr(ID_ATTRIBUTE).or_else(|| raw.message_id().map(str::to_owned));
    let mut key = string_attr(KEY_ATTRIBUTE);
    if key.is_none() && fifo {
        key = raw
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .cloned();
    }
    let mut headers = Headers::new();
    if let Some(attributes) = attributes {
        let mut names: Vec<&String> = attributes
            .keys()
            .filter(|n| n.as_str() != ID_ATTRIBUTE && n.as_str() != KEY_ATTRIBUTE)
            .collect();
        names.sort(); // SQS does not keep the order; make it deterministic
        for name in names {
            let value = &attributes[name];
            if let Some(s) = value.string_value() {
                headers.insert(name.clone(), s.as_bytes());
            } else if let Some(b) = value.binary_value() {
                headers.insert(name.clone(), b.as_ref());
            }
        }
    }
    Message {
        id,
        key,
        headers,
        payload: raw.body().unwrap_or_default().as_bytes().to_vec(),
    }
}

pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

pub(super) fn string_attribute(value: &str) -> Result<MessageAttributeValue, SourceError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| SourceError::other(format!("building an SQS message attribute: {e}")))
}

pub(super) fn binary_attribute(value: &[u8]) -> Result<MessageAttributeValue, SourceError> {
    MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(Blob::new(value))
        .build()
        .map_err(|e| SourceError::other(format!("building an SQS message attribute: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_messages() {
        let raw = aws_sdk_sqs::types::Message::builder()
            .message_id("sqs-id")
            .body("{\"a\":1}")
            .attributes(MessageSystemAttributeName::MessageGroupId, "g1")
            .message_attributes("event_id", string_attribute("e-1").unwrap())
            .message_attributes("raw", binary_attribute(&[0xff, 0]).unwrap())
            .build();
        let m = to_message(&raw, true);
        assert_eq!(m.id.as_deref(), Some("sqs-id"));
        assert_eq!(m.key.as_deref(), Some("g1"));
        assert_eq!(m.headers.get("event_id"), Some(&b"e-1"[..]));
        assert_eq!(m.headers.get("raw"), Some(&[0xff, 0][..]));
        assert_eq!(to_message(&raw, false).key, None);
    }
}
