//! The message mapping: user properties to [`Message`] and back.

use rumqttc::v5::mqttbytes::v5::Publish;

#[cfg(doc)]
use super::MqttPublisher;
use crate::error::SourceError;
use crate::message::Message;

/// The user property that carries [`Message::id`].
pub const ID_PROPERTY: &str = "message_id";
/// The user property that carries [`Message::key`].
pub const KEY_PROPERTY: &str = "key";
/// The user property added to copies on the dead-letter topic.
pub const REASON_PROPERTY: &str = "dead_letter_reason";

/// Maps a publish to a [`Message`] (see the module docs).
pub(super) fn to_message(publish: &Publish) -> Message {
    let mut message = Message::new(publish.payload.to_vec());
    if let Some(properties) = &publish.properties {
        for (name, value) in &properties.user_properties {
            match name.as_str() {
                ID_PROPERTY if message.id.is_none() => message.id = Some(value.clone()),
                KEY_PROPERTY if message.key.is_none() => message.key = Some(value.clone()),
                _ => message.headers.insert(name.clone(), value.as_bytes()),
            }
        }
    }
    message
}

/// The user properties [`MqttPublisher`] writes for `message`.
pub(super) fn user_properties(message: &Message) -> Result<Vec<(String, String)>, SourceError> {
    let mut properties = Vec::new();
    if let Some(id) = &message.id {
        properties.push((ID_PROPERTY.to_owned(), id.clone()));
    }
    if let Some(key) = &message.key {
        properties.push((KEY_PROPERTY.to_owned(), key.clone()));
    }
    for (name, value) in message.headers.iter() {
        let value = std::str::from_utf8(value).map_err(|_| {
            SourceError::other(format!(
                "header {name:?} is not UTF-8: MQTT user properties are text"
            ))
        })?;
        properties.push((name.to_owned(), value.to_owned()));
    }
    Ok(properties)
}

#[cfg(test)]
mod tests {
    use rumqttc::v5::mqttbytes::v5::PublishProperties;
    use rumqttc::v5::mqttbytes::QoS;

    use super::*;

    #[test]
    fn maps_user_properties_both_ways() {
        let message = Message::new("{}")
            .with_id("m-1")
            .with_key("k-1")
            .with_header("event_id", "e-1");
        let properties = PublishProperties {
            user_properties: user_properties(&message).unwrap(),
            ..PublishProperties::default()
        };
        let publish = Publish::new("t", QoS::AtLeastOnce, "{}", Some(properties));
        assert_eq!(to_message(&publish), message);
        assert!(user_properties(&Message::new("x").with_header("raw", vec![0xff])).is_err());
        let bare = Publish::new("t", QoS::AtLeastOnce, "x", None);
        assert_eq!(to_message(&bare), Message::new("x"));
    }
}
