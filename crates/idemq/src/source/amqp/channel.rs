//! Channel helpers: AMQP short strings, `lapin` errors, and publishes confirmed by the broker.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel};

use crate::error::SourceError;

pub(super) fn short(s: &str) -> Result<ShortString, SourceError> {
    ShortString::try_new(s)
        .map_err(|e| SourceError::other(format!("{s:?} is too long for an AMQP short string: {e}")))
}

pub(super) fn broker(what: &str) -> impl Fn(lapin::Error) -> SourceError + '_ {
    move |e| SourceError::broker(format!("{what}: {e}")).with_source(e)
}

/// How long one settle operation on the broker (a confirmed publish, an
/// ack) may take. A connection that died or is being recovered must not
/// hold a delivery's settle, and with it the consumer's drain, forever: past
/// this the settle fails, the delivery stays unacked and the broker
/// redelivers it (the inbox answers the copy).
pub(super) const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes to the default exchange with routing key `queue` (mandatory,
/// persistent) and waits for the broker's confirm, at most
/// [`SETTLE_TIMEOUT`].
pub(super) async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), SourceError> {
    tokio::time::timeout(
        SETTLE_TIMEOUT,
        publish_confirmed_now(channel, queue, body, properties),
    )
    .await
    .map_err(|_| {
        SourceError::broker(format!(
            "publishing to queue {queue:?}: no confirm within {SETTLE_TIMEOUT:?}"
        ))
    })?
}

async fn publish_confirmed_now(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), SourceError> {
    let confirm = channel
        .basic_publish(
            "".into(),
            short(queue)?,
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body,
            properties.with_delivery_mode(2),
        )
        .await
        .map_err(broker("publishing"))?
        .await
        .map_err(broker("waiting for the publisher confirm"))?;
    if !confirm.is_ack() {
        return Err(SourceError::broker(format!(
            "the broker refused the message for queue {queue:?}"
        )));
    }
    if confirm.take_message().is_some() {
        return Err(SourceError::broker(format!(
            "the message was returned unroutable: does queue {queue:?} exist?"
        )));
    }
    Ok(())
}
