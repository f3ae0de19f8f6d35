//! Parsing of Redis replies (`XREADGROUP`, `XAUTOCLAIM`, `XCLAIM`, `XPENDING`).

use redis::Value;

/// One stream entry: its id and fields (`None` when the entry was deleted
/// from the stream while pending).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Entry {
    pub(super) id: String,
    pub(super) fields: Option<Vec<(String, Vec<u8>)>>,
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn bytes(value: &Value) -> Vec<u8> {
    match value {
        Value::BulkString(b) => b.clone(),
        other => text(other).unwrap_or_default().into_bytes(),
    }
}

fn parse_fields(value: &Value) -> Option<Vec<(String, Vec<u8>)>> {
    match value {
        Value::Array(items) => Some(
            items
                .chunks(2)
                .filter(|pair| pair.len() == 2)
                .map(|pair| (text(&pair[0]).unwrap_or_default(), bytes(&pair[1])))
                .collect(),
        ),
        Value::Map(pairs) => Some(
            pairs
                .iter()
                .map(|(k, v)| (text(k).unwrap_or_default(), bytes(v)))
                .collect(),
        ),
        _ => None,
    }
}

/// Parses an array of `[id, [field, value, …] | nil]` entries.
pub(super) fn parse_entries(value: &Value) -> Vec<Entry> {
    let Value::Array(items) = value else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| match item {
            Value::Array(parts) if !parts.is_empty() => Some(Entry {
                id: text(&parts[0])?,
                fields: parts.get(1).and_then(parse_fields),
            }),
            _ => None,
        })
        .collect()
}

/// Parses an `XREADGROUP` reply (RESP2 arrays or RESP3 maps) for one stream.
pub(super) fn parse_read(value: &Value) -> Vec<Entry> {
    match value {
        Value::Array(streams) => streams
            .iter()
            .filter_map(|s| match s {
                Value::Array(parts) if parts.len() == 2 => Some(parse_entries(&parts[1])),
                _ => None,
            })
            .flatten()
            .collect(),
        Value::Map(streams) => streams
            .iter()
            .flat_map(|(_, entries)| parse_entries(entries))
            .collect(),
        _ => Vec::new(),
    }
}

/// Parses an `XAUTOCLAIM` reply: the next cursor and the claimed entries.
pub(super) fn parse_autoclaim(value: &Value) -> (String, Vec<Entry>) {
    match value {
        Value::Array(parts) if parts.len() >= 2 => (
            text(&parts[0]).unwrap_or_else(|| "0-0".into()),
            parse_entries(&parts[1]),
        ),
        _ => ("0-0".into(), Vec::new()),
    }
}

/// Times-delivered from a one-id `XPENDING` reply.
pub(super) fn parse_pending_count(value: &Value) -> Option<u32> {
    let Value::Array(rows) = value else {
        return None;
    };
    let Some(Value::Array(row)) = rows.first() else {
        return None;
    };
    match row.get(3)? {
        Value::Int(n) => u32::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_replies() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let entry = Value::Array(vec![
            bulk("1-0"),
            Value::Array(vec![bulk("payload"), bulk("{}")]),
        ]);
        let deleted = Value::Array(vec![bulk("2-0"), Value::Nil]);
        let read = Value::Array(vec![Value::Array(vec![
            bulk("s"),
            Value::Array(vec![entry.clone(), deleted]),
        ])]);
        let entries = parse_read(&read);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(
            entries[0].fields,
            Some(vec![("payload".into(), b"{}".to_vec())])
        );
        assert_eq!(entries[1].fields, None);
        assert!(parse_read(&Value::Nil).is_empty());

        let claim = Value::Array(vec![
            bulk("5-0"),
            Value::Array(vec![entry]),
            Value::Array(vec![]),
        ]);
        let (cursor, claimed) = parse_autoclaim(&claim);
        assert_eq!(cursor, "5-0");
        assert_eq!(claimed.len(), 1);

        let pending = Value::Array(vec![Value::Array(vec![
            bulk("1-0"),
            bulk("c"),
            Value::Int(10),
            Value::Int(3),
        ])]);
        assert_eq!(parse_pending_count(&pending), Some(3));
        assert_eq!(parse_pending_count(&Value::Array(vec![])), None);
    }
}
