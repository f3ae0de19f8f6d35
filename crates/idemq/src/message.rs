//! Messages as the engine sees them: the broker-neutral [`Message`] and the
//! [`DeliveryMeta`] that says where and how often it was delivered.

use std::fmt;

/// Message headers: ordered name/value pairs whose values are raw bytes.
///
/// Brokers differ in what a header may hold (Kafka allows arbitrary bytes,
/// AMQP typed values), so values are kept as bytes and decoded as UTF-8 only
/// when a key spec asks for one. A header that is not UTF-8 then becomes a
/// typed [`InputError::HeaderNotUtf8`](crate::InputError::HeaderNotUtf8).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, Vec<u8>)>);

impl Headers {
    /// An empty header set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a header; an existing header of the same name is kept (the first one wins on lookup).
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) {
        self.0.push((name.into(), value.into()));
    }

    /// Builder-style [`insert`](Self::insert).
    pub fn with(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.insert(name, value);
        self
    }

    /// The raw bytes of the first header called `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Iterates over all headers in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_slice()))
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A JSON object of the headers for storage: UTF-8 values as strings,
    /// other values as `{"base64hex": "..."}` so that nothing is lost.
    pub fn to_json(&self) -> serde_json::Value {
        let mut map = serde_json::Map::new();
        for (name, value) in &self.0 {
            let v = match std::str::from_utf8(value) {
                Ok(s) => serde_json::Value::String(s.to_owned()),
                Err(_) => serde_json::json!({ "hex": hex::encode(value) }),
            };
            map.entry(name.clone()).or_insert(v);
        }
        serde_json::Value::Object(map)
    }

    /// The inverse of [`to_json`](Self::to_json); unknown shapes are skipped.
    pub fn from_json(value: &serde_json::Value) -> Self {
        let mut headers = Headers::new();
        if let Some(map) = value.as_object() {
            for (name, v) in map {
                match v {
                    serde_json::Value::String(s) => headers.insert(name.clone(), s.as_bytes()),
                    serde_json::Value::Object(o) => {
                        if let Some(bytes) = o
                            .get("hex")
                            .and_then(|h| h.as_str())
                            .and_then(|h| hex::decode(h).ok())
                        {
                            headers.insert(name.clone(), bytes);
                        }
                    }
                    other => headers.insert(name.clone(), other.to_string().into_bytes()),
                }
            }
        }
        headers
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(
                self.0
                    .iter()
                    .map(|(n, v)| (n, String::from_utf8_lossy(v).into_owned())),
            )
            .finish()
    }
}

/// One message, independent of the broker it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// The broker's or producer's message id, if any. A producer retry gets a
    /// new id, so this is the weaker dedup key (see [`KeySpec`](crate::KeySpec)).
    pub id: Option<String>,
    /// The transport-level message key (Kafka record key, envelope `key`), if any.
    pub key: Option<String>,
    /// Message headers.
    pub headers: Headers,
    /// The payload bytes.
    pub payload: Vec<u8>,
}

impl Message {
    /// A message with this payload and nothing else.
    pub fn new(payload: impl Into<Vec<u8>>) -> Self {
        Self {
            payload: payload.into(),
            ..Self::default()
        }
    }

    /// Sets the message id.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the transport-level key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// The payload parsed as JSON.
    pub fn json(&self) -> Result<serde_json::Value, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }

    /// The message's size as counted against
    /// [`ConsumerBuilder::max_message_bytes`](crate::ConsumerBuilder::max_message_bytes):
    /// its id, transport key, header names and values, and payload, in bytes.
    ///
    /// ```
    /// use idemq::Message;
    /// let message = Message::new("{}").with_key("k").with_header("h", "v");
    /// assert_eq!(message.size_bytes(), 2 + 1 + 2);
    /// ```
    pub fn size_bytes(&self) -> usize {
        let text = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        text(&self.id) + text(&self.key) + headers + self.payload.len()
    }

    /// The first `max` bytes of this message, for a record of one too large
    /// to keep whole: its id and key (each cut at a character boundary if
    /// need be), then its headers in order while each fits whole, then as
    /// much of the payload as is left. `head(max).size_bytes() <= max`.
    ///
    /// ```
    /// use idemq::Message;
    /// let message = Message::new(vec![b'x'; 100]).with_header("trace", "abc");
    /// let head = message.head(16);
    /// assert_eq!(head.headers.get("trace"), Some(&b"abc"[..]));
    /// assert_eq!(head.payload.len(), 16 - 8);
    /// ```
    pub fn head(&self, max: usize) -> Message {
        let mut left = max;
        let mut cut_text = |s: &Option<String>| {
            s.as_ref().map(|s| {
                let mut end = s.len().min(left);
                while !s.is_char_boundary(end) {
                    end -= 1;
                }
                left -= end;
                s[..end].to_owned()
            })
        };
        let id = cut_text(&self.id);
        let key = cut_text(&self.key);
        let mut headers = Headers::new();
        for (name, value) in self.headers.iter() {
            if name.len() + value.len() <= left {
                left -= name.len() + value.len();
                headers.insert(name, value);
            }
        }
        let payload = self.payload[..self.payload.len().min(left)].to_vec();
        Message {
            id,
            key,
            headers,
            payload,
        }
    }
}

/// Where and how a message was delivered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeliveryMeta {
    /// The kind of source, e.g. `jsonl`, `kafka`, `memory`.
    pub source: String,
    /// Topic, queue, stream or file name.
    pub topic: Option<String>,
    /// Partition, where the source has partitions.
    pub partition: Option<i32>,
    /// Offset (or line number for a file) within the topic/partition.
    pub offset: Option<i64>,
    /// How many times this message has been delivered, this time included
    /// (1 on first delivery). Sources that cannot tell report 1.
    pub delivery_count: u32,
}

impl DeliveryMeta {
    /// Metadata for a first delivery from `source`.
    pub fn new(source: impl Into<String>) -> Self {
        Self {
            source: source.into(),
            delivery_count: 1,
            ..Self::default()
        }
    }
}
