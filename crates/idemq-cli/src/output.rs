//! Output helpers: times, durations, plain-text tables and JSON renderings.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, UNIX_EPOCH};

use idemq::store::{AttemptRecord, DeadLetterRecord, InboxRecord};
use serde_json::{json, Value};

/// A duration as typed (`7d`) and as parsed.
#[derive(Debug, Clone)]
pub struct HumanDuration {
    text: String,
    /// The parsed duration.
    pub value: Duration,
}

impl FromStr for HumanDuration {
    type Err = humantime::DurationError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(Self {
            text: text.trim().to_owned(),
            value: humantime::parse_duration(text)?,
        })
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// RFC 3339 UTC with milliseconds, from ms since the Unix epoch.
pub fn time(ms: i64) -> String {
    let since_epoch = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(UNIX_EPOCH + since_epoch).to_string()
}

/// [`time`] or `-`.
pub fn time_or_dash(ms: Option<i64>) -> String {
    ms.map_or_else(|| "-".to_owned(), time)
}

/// One line of text: control characters escaped, at most `max` characters
/// (with `…` when cut).
pub fn cell(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (count, c) in text.chars().enumerate() {
        if count >= max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A plain table: left-aligned columns separated by two spaces.
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&str]) -> Self {
        Self {
            rows: vec![headers.iter().map(|h| (*h).to_owned()).collect()],
        }
    }

    /// Appends a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|i| {
                self.rows
                    .iter()
                    .filter_map(|r| r.get(i))
                    .map(|c| c.chars().count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        for row in &self.rows {
            let mut line = String::new();
            for (i, c) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(c);
                if i + 1 < row.len() {
                    let pad = widths[i].saturating_sub(c.chars().count());
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            writeln!(f, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A payload for JSON output: `{"payload": text}` when UTF-8, else `{"payload_hex": …}`.
fn payload_fields(payload: &[u8]) -> (Value, Value) {
    match std::str::from_utf8(payload) {
        Ok(text) => (Value::String(text.to_owned()), Value::Null),
        Err(_) => (Value::Null, Value::String(hex(payload))),
    }
}

/// A dead letter as JSON, with its complete message.
pub fn dead_letter_json(d: &DeadLetterRecord) -> Value {
    let (payload, payload_hex) = payload_fields(&d.message.payload);
    json!({
        "id": d.id,
        "consumer": d.consumer,
        "key": d.key,
        "reason": d.reason,
        "error": d.error,
        "attempts": d.attempts,
        "created_at": time(d.created_ms),
        "created_ms": d.created_ms,
        "source": d.meta.source,
        "topic": d.meta.topic,
        "partition": d.meta.partition,
        "offset": d.meta.offset,
        "delivery_count": d.meta.delivery_count,
        "message": {
            "id": d.message.id,
            "key": d.message.key,
            "headers": d.message.headers.to_json(),
            "payload": payload,
            "payload_hex": payload_hex,
        },
    })
}

/// Where a dead letter came from: `source:topic@offset`.
pub fn origin(d: &DeadLetterRecord) -> String {
    let mut out = d.meta.source.clone();
    if let Some(topic) = &d.meta.topic {
        out.push(':');
        out.push_str(topic);
    }
    if let Some(partition) = d.meta.partition {
        out.push_str(&format!("/{partition}"));
    }
    if let Some(offset) = d.meta.offset {
        out.push_str(&format!("@{offset}"));
    }
    out
}

/// An inbox record as JSON.
pub fn inbox_json(r: &InboxRecord) -> Value {
    json!({
        "processed_at": time(r.first_seen_ms),
        "first_seen_ms": r.first_seen_ms,
        "fingerprint": r.fingerprint,
        "result": r.result,
    })
}

/// Failed attempts as JSON.
pub fn attempts_json(a: &AttemptRecord) -> Value {
    json!({
        "attempts": a.attempts,
        "last_error": a.last_error,
        "first_failed_at": time(a.first_failed_ms),
        "last_failed_at": time(a.last_failed_ms),
    })
}

/// A word safe to paste into a shell, quoted if needed.
pub fn shell_word(text: &str) -> String {
    let safe = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.,:/@+=".contains(c));
    if safe {
        text.to_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_cells() {
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(time(1_500), "1970-01-01T00:00:01.500Z");
        assert_eq!(cell("a\nb", 10), "a\\nb");
        assert_eq!(cell("abcdef", 3), "abc…");
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["A", "BB"]);
        t.row(vec!["xyz".into(), "1".into()]);
        assert_eq!(t.to_string(), "A    BB\nxyz  1\n");
    }

    #[test]
    fn shell_words() {
        assert_eq!(shell_word("payments"), "payments");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
    }
}
