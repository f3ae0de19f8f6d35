//! The entry layout: the field names, and the mapping between stream entry
//! fields and a [`Message`].

use crate::error::InputError;
use crate::message::Message;

/// The field that carries [`Message::payload`].
pub const PAYLOAD_FIELD: &str = "payload";
/// The field that carries [`Message::id`].
pub const ID_FIELD: &str = "id";
/// The field that carries [`Message::key`].
pub const KEY_FIELD: &str = "key";
/// The prefix of the fields that carry headers (`h:<name>`).
pub const HEADER_PREFIX: &str = "h:";
/// The field added to copies on the dead-letter stream.
pub const REASON_FIELD: &str = "dead_letter_reason";
/// The header in which the source reports the entry id.
pub const ENTRY_ID_HEADER: &str = "redis_stream_id";

/// Maps entry fields to a [`Message`] (see the module docs); a defect when
/// the `payload` field is missing.
pub(super) fn to_message(
    entry_id: &str,
    fields: &[(String, Vec<u8>)],
) -> (Message, Option<InputError>) {
    let mut message = Message::default();
    let mut payload = None;
    for (name, value) in fields {
        match name.as_str() {
            PAYLOAD_FIELD if payload.is_none() => payload = Some(value.clone()),
            ID_FIELD if message.id.is_none() => {
                message.id = Some(String::from_utf8_lossy(value).into_owned())
            }
            KEY_FIELD if message.key.is_none() => {
                message.key = Some(String::from_utf8_lossy(value).into_owned())
            }
            other => {
                let header = other.strip_prefix(HEADER_PREFIX).unwrap_or(other);
                message.headers.insert(header, value.clone());
            }
        }
    }
    message.headers.insert(ENTRY_ID_HEADER, entry_id.as_bytes());
    if message.id.is_none() {
        message.id = Some(entry_id.to_owned());
    }
    match payload {
        Some(p) => {
            message.payload = p;
            (message, None)
        }
        None => {
            let map: serde_json::Map<String, serde_json::Value> = fields
                .iter()
                .map(|(n, v)| {
                    (
                        n.clone(),
                        serde_json::Value::String(String::from_utf8_lossy(v).into_owned()),
                    )
                })
                .collect();
            message.payload = serde_json::Value::Object(map).to_string().into_bytes();
            let defect = InputError::Malformed(format!(
                "stream entry {entry_id} has no {PAYLOAD_FIELD:?} field"
            ));
            (message, Some(defect))
        }
    }
}

/// The fields [`RedisStreamPublisher`](super::RedisStreamPublisher) writes for `message`.
pub(super) fn to_fields(message: &Message) -> Vec<(String, Vec<u8>)> {
    let mut fields = vec![(PAYLOAD_FIELD.to_owned(), message.payload.clone())];
    if let Some(id) = &message.id {
        fields.push((ID_FIELD.to_owned(), id.clone().into_bytes()));
    }
    if let Some(key) = &message.key {
        fields.push((KEY_FIELD.to_owned(), key.clone().into_bytes()));
    }
    for (name, value) in message.headers.iter() {
        if name == ENTRY_ID_HEADER {
            continue; // the source's own annotation of a consumed entry
        }
        fields.push((format!("{HEADER_PREFIX}{name}"), value.to_vec()));
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_fields_both_ways() {
        let message = Message::new(vec![0xff, 0x00])
            .with_id("m-1")
            .with_key("k-1")
            .with_header("event_id", "e-1");
        let fields = to_fields(&message);
        let (back, defect) = to_message("1-0", &fields);
        assert!(defect.is_none());
        assert_eq!(back.id.as_deref(), Some("m-1"));
        assert_eq!(back.key.as_deref(), Some("k-1"));
        assert_eq!(back.payload, vec![0xff, 0x00]);
        assert_eq!(back.headers.get("event_id"), Some(&b"e-1"[..]));
        assert_eq!(back.headers.get(ENTRY_ID_HEADER), Some(&b"1-0"[..]));
        assert_eq!(
            to_fields(&back),
            fields,
            "the entry-id header is not written back"
        );

        let (m, defect) = to_message("2-0", &[("other".into(), b"x".to_vec())]);
        assert!(matches!(defect, Some(InputError::Malformed(_))));
        assert_eq!(m.id.as_deref(), Some("2-0"));
        assert_eq!(m.json().unwrap()["other"], "x");
    }
}
