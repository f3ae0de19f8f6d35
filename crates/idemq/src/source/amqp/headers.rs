//! The idemq headers and the mapping of AMQP header values.

use std::collections::BTreeMap;

use lapin::types::{AMQPValue, FieldTable, ShortString};

#[cfg(doc)]
use crate::message::Message;

/// The header that carries [`Message::key`].
pub const KEY_HEADER: &str = "idemq-key";
/// The header in which a retried copy carries the number of deliveries of
/// the message before it (see the module docs).
pub const DELIVERIES_HEADER: &str = "idemq-deliveries";
/// The header with the dead-letter reason code on messages in `<queue>.dead-letter`.
pub const REASON_HEADER: &str = "idemq-dead-letter-reason";
/// The header with the name of the work queue on messages in `<queue>.dead-letter`.
pub const QUEUE_HEADER: &str = "idemq-queue";
/// The header quorum queues use to count returned deliveries.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// An integer header value (any integer type, or decimal digits).
pub(super) fn as_u64(value: &AMQPValue) -> Option<u64> {
    match value {
        AMQPValue::ShortShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::ShortInt(v) => u64::try_from(*v).ok(),
        AMQPValue::ShortUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(u64::from(*v)),
        AMQPValue::LongLongInt(v) => u64::try_from(*v).ok(),
        AMQPValue::Timestamp(v) => Some(*v),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok()?.parse().ok(),
        AMQPValue::ShortString(s) => s.as_str().parse().ok(),
        _ => None,
    }
}

/// A header value as bytes: strings and byte arrays as is, others as text.
pub(super) fn value_bytes(value: &AMQPValue) -> Vec<u8> {
    match value {
        AMQPValue::LongString(s) => s.as_bytes().to_vec(),
        AMQPValue::ShortString(s) => s.as_str().as_bytes().to_vec(),
        AMQPValue::ByteArray(b) => b.as_slice().to_vec(),
        AMQPValue::Void => Vec::new(),
        other => match to_json(other) {
            serde_json::Value::String(s) => s.into_bytes(),
            json => json.to_string().into_bytes(),
        },
    }
}

fn to_json(value: &AMQPValue) -> serde_json::Value {
    use serde_json::Value as J;
    match value {
        AMQPValue::Boolean(b) => J::Bool(*b),
        AMQPValue::ShortShortInt(v) => J::from(*v),
        AMQPValue::ShortShortUInt(v) => J::from(*v),
        AMQPValue::ShortInt(v) => J::from(*v),
        AMQPValue::ShortUInt(v) => J::from(*v),
        AMQPValue::LongInt(v) => J::from(*v),
        AMQPValue::LongUInt(v) => J::from(*v),
        AMQPValue::LongLongInt(v) => J::from(*v),
        AMQPValue::Timestamp(v) => J::from(*v),
        AMQPValue::Float(v) => J::from(f64::from(*v)),
        AMQPValue::Double(v) => J::from(*v),
        AMQPValue::DecimalValue(d) => J::from(f64::from(d.value) / 10f64.powi(i32::from(d.scale))),
        AMQPValue::ShortString(s) => J::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => J::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ByteArray(b) => J::String(hex::encode(b.as_slice())),
        AMQPValue::FieldArray(a) => J::Array(a.as_slice().iter().map(to_json).collect()),
        AMQPValue::FieldTable(t) => J::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_owned(), to_json(v)))
                .collect(),
        ),
        AMQPValue::Void => J::Null,
    }
}

/// The headers of a copy: `headers` without `drop`, plus `set`.
pub(super) fn rewrite_headers(
    headers: Option<&FieldTable>,
    drop: &[&str],
    set: Vec<(&str, AMQPValue)>,
) -> FieldTable {
    let mut map: BTreeMap<ShortString, AMQPValue> = headers
        .map(|h| {
            h.inner()
                .iter()
                .filter(|(k, _)| !drop.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    for (k, v) in set {
        map.insert(k.into(), v);
    }
    FieldTable::from(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::amqp::topology::bucket;
    use std::time::Duration;

    #[test]
    fn header_values() {
        assert_eq!(value_bytes(&AMQPValue::LongLongInt(-3)), b"-3");
        assert_eq!(value_bytes(&AMQPValue::Boolean(true)), b"true");
        assert_eq!(
            value_bytes(&AMQPValue::LongString("é".into())),
            "é".as_bytes()
        );
        let arr = AMQPValue::FieldArray(vec![AMQPValue::ShortInt(1)].into());
        assert_eq!(value_bytes(&arr), b"[1]");
        assert_eq!(as_u64(&AMQPValue::LongInt(7)), Some(7));
        assert_eq!(as_u64(&AMQPValue::LongInt(-7)), None);
        assert_eq!(bucket(Duration::ZERO), Duration::from_millis(50));
        assert_eq!(
            bucket(Duration::from_millis(100)),
            Duration::from_millis(100)
        );
    }
}
