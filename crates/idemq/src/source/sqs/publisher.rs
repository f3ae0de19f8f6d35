//! [`SqsPublisher`]: publishing to an SQS queue with `SendMessage`.

use std::collections::HashMap;

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageAttributeValue;
use aws_sdk_sqs::Client;

use super::config::SqsConfig;
use super::mapping::{
    binary_attribute, sha256_hex, string_attribute, ID_ATTRIBUTE, KEY_ATTRIBUTE, MAX_ATTRIBUTES,
};
use super::queue::{broker_error, resolve_queue, QueueRef};
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Whether `value` can be a FIFO `MessageGroupId` / `MessageDeduplicationId`
/// as it is: 1 to 128 ASCII letters, digits or punctuation.
fn fits_fifo_id(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 128
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_ascii_punctuation())
}

/// Publishes to one SQS queue with `SendMessage`.
///
/// The body is the payload (which must be UTF-8: SQS bodies are text);
/// [`Message::id`] goes to the string attribute `message_id`, [`Message::key`]
/// to `key`, every header to an attribute of its name (UTF-8 values as
/// `String`, others as `Binary`). SQS allows at most [`MAX_ATTRIBUTES`]
/// attributes: a message needing more is refused with a
/// [`SourceErrorKind::Other`](crate::SourceErrorKind::Other) before anything is sent. On a FIFO queue the
/// `MessageGroupId` is the key (else `default`) and the
/// `MessageDeduplicationId` is the id (else the SHA-256 of the body); a value
/// that SQS would not accept there is replaced by its SHA-256.
pub struct SqsPublisher {
    client: Client,
    queue: QueueRef,
}

impl std::fmt::Debug for SqsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsPublisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl SqsPublisher {
    /// Resolves the queue URL, creating the queue if [`SqsConfig::create_queue`] is set.
    pub async fn connect(config: SqsConfig) -> Result<Self, SourceError> {
        let client = config.client().await?;
        let queue = resolve_queue(&client, &config.queue, config.create_queue).await?;
        Ok(Self { client, queue })
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue.url
    }

    fn attributes(
        message: &Message,
    ) -> Result<HashMap<String, MessageAttributeValue>, SourceError> {
        let mut attributes = HashMap::new();
        if let Some(id) = &message.id {
            attributes.insert(ID_ATTRIBUTE.to_owned(), string_attribute(id)?);
        }
        if let Some(key) = &message.key {
            attributes.insert(KEY_ATTRIBUTE.to_owned(), string_attribute(key)?);
        }
        for (name, value) in message.headers.iter() {
            if attributes.contains_key(name) {
                tracing::warn!(
                    header = name,
                    "header not sent: an attribute of that name is already set"
                );
                continue;
            }
            let value = match std::str::from_utf8(value) {
                Ok(s) => string_attribute(s)?,
                Err(_) => binary_attribute(value)?,
            };
            attributes.insert(name.to_owned(), value);
        }
        if attributes.len() > MAX_ATTRIBUTES {
            return Err(SourceError::other(format!(
                "SQS allows at most {MAX_ATTRIBUTES} message attributes; this message needs {} (message_id, key and headers)",
                attributes.len()
            )));
        }
        Ok(attributes)
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let body = std::str::from_utf8(&message.payload).map_err(|_| {
            SourceError::other("SQS message bodies are text: the payload is not UTF-8")
        })?;
        let attributes = Self::attributes(message)?;
        let mut request = self
            .client
            .send_message()
            .queue_url(&self.queue.url)
            .message_body(body)
            .set_message_attributes(Some(attributes).filter(|a| !a.is_empty()));
        if self.queue.fifo {
            let group = match message.key.as_deref() {
                Some(k) if fits_fifo_id(k) => k.to_owned(),
                Some(k) => sha256_hex(k.as_bytes()),
                None => "default".to_owned(),
            };
            let dedup = match message.id.as_deref() {
                Some(id) if fits_fifo_id(id) => id.to_owned(),
                Some(id) => sha256_hex(id.as_bytes()),
                None => sha256_hex(&message.payload),
            };
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup);
        }
        request
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("SendMessage to {}", self.queue.name), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn too_many_attributes_are_refused() {
        let mut message = Message::new("{}").with_id("m").with_key("k");
        for i in 0..8 {
            message = message.with_header(format!("h{i}"), "v");
        }
        assert_eq!(SqsPublisher::attributes(&message).unwrap().len(), 10);
        let message = message.with_header("h8", "v");
        assert!(matches!(
            SqsPublisher::attributes(&message),
            Err(ref e) if e.kind() == SourceErrorKind::Other
        ));
    }
}
