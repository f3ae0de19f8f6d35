//! The publisher: [`NatsPublisher`] and publishing with JetStream.

use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::HeaderMap;
use async_trait::async_trait;

use super::config::{broker_error, has_wildcards, validate_subject, NatsConfig};
use super::mapping::to_headers;
use crate::error::SourceError;
use crate::message::Message;
use crate::source::Publisher;

/// Publishes with JetStream and waits for the stream's ack.
pub(super) async fn publish_and_wait(
    js: &jetstream::Context,
    subject: &str,
    headers: HeaderMap,
    payload: Vec<u8>,
) -> Result<jetstream::publish::PublishAck, SourceError> {
    let ack = js
        .send_publish(
            subject.to_owned(),
            PublishMessage::build()
                .payload(payload.into())
                .headers(headers),
        )
        .await
        .map_err(|e| publish_error(subject, e))?;
    ack.await.map_err(|e| publish_error(subject, e))
}

fn publish_error(subject: &str, e: async_nats::jetstream::context::PublishError) -> SourceError {
    if e.kind() == PublishErrorKind::StreamNotFound {
        broker_error(
            &format!("publishing to {subject}"),
            "no stream captures this subject",
        )
    } else {
        broker_error(&format!("publishing to {subject}"), e)
    }
}

/// Publishes to a JetStream subject and waits for the stream's ack.
///
/// [`Message::id`] goes to the header `Nats-Msg-Id` (so JetStream drops a
/// republish of the same id within the stream's duplicate window),
/// [`Message::key`] to `idemq-key`, every header to a NATS header of its
/// name. NATS headers are text: a header that is not UTF-8 or has a line
/// break is refused with a [`SourceErrorKind::Other`](crate::SourceErrorKind::Other) before anything is sent.
pub struct NatsPublisher {
    js: jetstream::Context,
    subject: String,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// Connects; publishes to [`NatsConfig::subject`], which must be free of
    /// wildcards. With [`NatsConfig::create`] the stream is created if missing.
    pub async fn connect(config: NatsConfig) -> Result<Self, SourceError> {
        let subject = config
            .subject
            .clone()
            .ok_or_else(|| SourceError::config("publishing needs a subject (?subject=…)"))?;
        if has_wildcards(&subject) {
            return Err(SourceError::config(format!(
                "cannot publish to the wildcard subject {subject:?}"
            )));
        }
        let js = config.jetstream().await?;
        if config.create {
            config.stream(&js).await?;
        }
        Ok(Self { js, subject })
    }

    /// Publishes to `subject` instead (no wildcards).
    pub fn with_subject(mut self, subject: impl Into<String>) -> Result<Self, SourceError> {
        let subject = subject.into();
        validate_subject(&subject, false)?;
        self.subject = subject;
        Ok(self)
    }

    /// The subject it publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The JetStream context (for stream administration).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let headers = to_headers(message)?;
        let ack =
            publish_and_wait(&self.js, &self.subject, headers, message.payload.clone()).await?;
        if ack.duplicate {
            tracing::debug!(subject = %self.subject, id = ?message.id, "JetStream dropped a duplicate Nats-Msg-Id");
        }
        Ok(())
    }
}
