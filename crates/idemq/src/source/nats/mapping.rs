//! Message mapping: a JetStream message to a [`Message`] and back to NATS headers.

use std::str::FromStr;

use async_nats::header::{HeaderName, HeaderValue};
use async_nats::HeaderMap;

use crate::error::SourceError;
use crate::message::Message;

/// The header that carries [`Message::id`] (JetStream's own deduplication id).
pub const ID_HEADER: &str = "Nats-Msg-Id";
/// The header that carries [`Message::key`].
pub const KEY_HEADER: &str = "idemq-key";
/// The header added to copies published to the dead-letter subject.
pub const REASON_HEADER: &str = "idemq-dead-letter-reason";

/// Maps a JetStream message to a [`Message`] (see the module docs).
pub(super) fn to_message(raw: &async_nats::Message) -> Message {
    let mut message = Message::new(raw.payload.to_vec());
    let Some(map) = &raw.headers else {
        return message;
    };
    message.id = map.get(ID_HEADER).map(|v| v.as_str().to_owned());
    message.key = map.get(KEY_HEADER).map(|v| v.as_str().to_owned());
    let mut entries: Vec<(&str, &Vec<HeaderValue>)> = map
        .iter()
        .map(|(name, values)| (name.as_ref(), values))
        .filter(|(name, _)| *name != ID_HEADER && *name != KEY_HEADER)
        .collect();
    entries.sort_by(|a, b| a.0.cmp(b.0)); // a hash map: make the order deterministic
    for (name, values) in entries {
        for value in values {
            message.headers.insert(name, value.as_str());
        }
    }
    message
}

/// NATS headers for `message`: `Nats-Msg-Id`, `idemq-key` and the headers.
pub(super) fn to_headers(message: &Message) -> Result<HeaderMap, SourceError> {
    let mut headers = HeaderMap::new();
    let mut add = |name: &str, value: &[u8]| -> Result<(), SourceError> {
        let header = HeaderName::from_str(name)
            .map_err(|_| SourceError::other(format!("{name:?} cannot be a NATS header name")))?;
        let text = std::str::from_utf8(value).map_err(|_| {
            SourceError::other(format!("header {name:?}: NATS header values are text"))
        })?;
        let value = HeaderValue::from_str(text).map_err(|_| {
            SourceError::other(format!(
                "header {name:?}: NATS header values have no line breaks"
            ))
        })?;
        headers.append(header, value);
        Ok(())
    };
    if let Some(id) = &message.id {
        add(ID_HEADER, id.as_bytes())?;
    }
    if let Some(key) = &message.key {
        add(KEY_HEADER, key.as_bytes())?;
    }
    for (name, value) in message.headers.iter() {
        if name == ID_HEADER || name == KEY_HEADER {
            tracing::warn!(
                header = name,
                "header not sent: it is set from the message id or key"
            );
            continue;
        }
        add(name, value)?;
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn maps_headers_both_ways() {
        let message = Message::new("{}")
            .with_id("m-1")
            .with_key("k-1")
            .with_header("event_id", "e-1")
            .with_header("b", "2");
        let headers = to_headers(&message).unwrap();
        let raw = async_nats::Message {
            subject: "orders.new".into(),
            reply: None,
            payload: "{}".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        let back = to_message(&raw);
        assert_eq!(back.id.as_deref(), Some("m-1"));
        assert_eq!(back.key.as_deref(), Some("k-1"));
        assert_eq!(
            back.headers.iter().collect::<Vec<_>>(),
            vec![("b", &b"2"[..]), ("event_id", &b"e-1"[..])]
        );
        assert!(matches!(
            to_headers(&Message::new("{}").with_header("x", vec![0xff])),
            Err(ref e) if e.kind() == SourceErrorKind::Other
        ));
        assert!(matches!(
            to_headers(&Message::new("{}").with_header("x", "a\r\nb")),
            Err(ref e) if e.kind() == SourceErrorKind::Other
        ));
        assert!(matches!(
            to_headers(&Message::new("{}").with_header("bad:name", "v")),
            Err(ref e) if e.kind() == SourceErrorKind::Other
        ));
    }
}
