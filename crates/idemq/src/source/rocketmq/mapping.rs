//! Message mapping: RocketMQ messages to and from idemq [`Message`]s.

use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_property::MessagePropertyKey;
use rocketmq_model::common::message::message_single::Message as RmqMessage;
use rocketmq_model::common::message::STRING_HASH_SET;

use crate::error::SourceError;
use crate::key::KeySpec;
use crate::message::{DeliveryMeta, Headers, Message};

/// The system property with the message's business keys.
pub const KEYS_PROPERTY: &str = "KEYS";

/// The system property with the producer's unique message id.
pub const UNIQ_KEY_PROPERTY: &str = "UNIQ_KEY";

/// The default business key for RocketMQ messages: the message's keys
/// (`keys()`), else the producer's unique id (`UNIQ_KEY`, stable across
/// broker redeliveries and retries, unlike `msg_id()`).
pub fn default_key_spec() -> KeySpec {
    KeySpec::transport_key().or(KeySpec::id())
}

/// Builds the RocketMQ message for `message` on `topic`; `extra` user
/// properties are added after the headers.
pub(super) fn outgoing(
    topic: &str,
    message: &Message,
    extra: &[(&str, &str)],
) -> Result<RmqMessage, SourceError> {
    let bad = |why: String| SourceError::config(format!("RocketMQ message: {why}"));
    let mut builder = RmqMessage::builder()
        .topic(topic)
        .body(message.payload.clone());
    if let Some(key) = &message.key {
        if key.trim().is_empty() {
            return Err(bad("the key is blank".into()));
        }
        check_property_text("key", key).map_err(bad)?;
        builder = builder.key(key.as_str());
    }
    if let Some(id) = &message.id {
        check_property_text("id", id).map_err(bad)?;
        // The producer only generates a UNIQ_KEY when none is set, so the
        // consumer reads this id back as the message id.
        builder = builder.property(MessagePropertyKey::UniqueClientMsgId, id.as_str());
    }
    let mut properties: Vec<(&str, &str)> = Vec::new();
    for (name, value) in message.headers.iter() {
        let value = std::str::from_utf8(value)
            .map_err(|_| bad(format!("header {name:?} is not UTF-8 text")))?;
        properties.push((name, value));
    }
    properties.extend_from_slice(extra);
    let mut seen = std::collections::HashSet::new();
    for (name, value) in properties {
        if !seen.insert(name) {
            continue; // the first header of a name wins, as on lookup
        }
        if name.is_empty() || value.is_empty() {
            return Err(bad(format!(
                "header {name:?}: RocketMQ properties need a non-empty name and value"
            )));
        }
        check_property_text("header name", name).map_err(bad)?;
        check_property_text("header value", value).map_err(bad)?;
        builder = builder
            .raw_property(name, value)
            .map_err(|e| bad(format!("header {name:?}: {e}")))?;
    }
    builder.build().map_err(|e| bad(e.to_string()))
}

/// Property text must not contain the wire format's separators.
fn check_property_text(what: &str, text: &str) -> Result<(), String> {
    if text.contains(['\u{1}', '\u{2}']) {
        Err(format!(
            "the {what} contains a control character RocketMQ uses as a separator"
        ))
    } else {
        Ok(())
    }
}

/// Reads a received RocketMQ message into a [`Message`] and its metadata.
pub(super) fn incoming(msg: &MessageExt) -> (Message, DeliveryMeta) {
    let mut key = None;
    let mut id = None;
    let mut user: Vec<(&str, &str)> = Vec::new();
    for (name, value) in msg.properties() {
        match name.as_str() {
            KEYS_PROPERTY => {
                let keys = value.trim();
                if !keys.is_empty() {
                    key = Some(keys.to_owned());
                }
            }
            UNIQ_KEY_PROPERTY => {
                if !value.is_empty() {
                    id = Some(value.to_string());
                }
            }
            other if STRING_HASH_SET.contains(other) => {}
            other => user.push((other, value.as_str())),
        }
    }
    user.sort_unstable();
    let mut headers = Headers::new();
    for (name, value) in user {
        headers.insert(name, value);
    }
    let message = Message {
        id,
        key,
        headers,
        payload: msg.body().map(|b| b.to_vec()).unwrap_or_default(),
    };
    let meta = DeliveryMeta {
        source: "rocketmq".into(),
        topic: Some(msg.topic().to_string()),
        partition: Some(msg.queue_id()),
        offset: Some(msg.queue_offset()),
        delivery_count: u32::try_from(msg.reconsume_times())
            .unwrap_or(0)
            .saturating_add(1),
    };
    (message, meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rocketmq_model::common::message::MessageTrait;

    #[test]
    fn maps_messages_both_ways() {
        let original = Message::new("{\"a\":1}")
            .with_id("m-1")
            .with_key("p-1")
            .with_header("event_id", "p-1")
            .with_header("a_first", "x");
        let out = outgoing("payments", &original, &[]).unwrap();
        let mut ext = MessageExt::default();
        ext.set_message_inner(out);
        ext.set_queue_id(2);
        ext.set_queue_offset(41);
        ext.set_reconsume_times(1);
        ext.put_property("MIN_OFFSET".into(), "0".into());
        let (message, meta) = incoming(&ext);
        assert_eq!(message.id.as_deref(), Some("m-1"));
        assert_eq!(message.key.as_deref(), Some("p-1"));
        assert_eq!(message.payload, original.payload);
        assert_eq!(
            message.headers,
            Headers::new().with("a_first", "x").with("event_id", "p-1")
        );
        assert_eq!(meta.source, "rocketmq");
        assert_eq!(meta.topic.as_deref(), Some("payments"));
        assert_eq!(meta.partition, Some(2));
        assert_eq!(meta.offset, Some(41));
        assert_eq!(meta.delivery_count, 2);
        assert_eq!(default_key_spec().extract(&message).unwrap(), "p-1");
    }

    #[test]
    fn rejects_unmappable_messages() {
        let not_text = Message::new("x").with_header("h", vec![0xff, 0xfe]);
        assert!(outgoing("t", &not_text, &[]).is_err());
        let system = Message::new("x").with_header("UNIQ_KEY", "u");
        assert!(outgoing("t", &system, &[]).is_err());
        let empty = Message::new("x").with_header("h", "");
        assert!(outgoing("t", &empty, &[]).is_err());
    }
}
