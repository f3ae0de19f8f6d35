//! The JSON of the stored records: done records, dead letters, failed
//! attempts.

use std::collections::HashMap;

use crate::store::{
    dead_letter_message, now_ms, parse_result, AttemptRecord, DeadLetter, DeadLetterRecord,
    InboxRecord,
};

pub(super) fn done_value(
    fingerprint: &str,
    result: Option<&serde_json::Value>,
    first_seen_ms: i64,
) -> String {
    let json = serde_json::json!({
        "fp": fingerprint,
        "result": result.map(serde_json::Value::to_string),
        "first_seen": first_seen_ms,
        "done_ms": now_ms(),
    });
    format!("done:{json}")
}

/// Parses the JSON of a `done:` record (also used by the cache's Redis filter).
pub(crate) fn parse_done(consumer: &str, key: &str, json: &str) -> Option<InboxRecord> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    Some(InboxRecord {
        consumer: consumer.to_owned(),
        key: key.to_owned(),
        fingerprint: v["fp"].as_str()?.to_owned(),
        result: parse_result(v["result"].as_str().map(str::to_owned)),
        first_seen_ms: v["first_seen"].as_i64().unwrap_or(0),
    })
}

/// The JSON of a `done:` record for `record` (also used by the cache's Redis filter).
pub(crate) fn record_json(record: &InboxRecord) -> String {
    serde_json::json!({
        "fp": record.fingerprint,
        "result": record.result.as_ref().map(serde_json::Value::to_string),
        "first_seen": record.first_seen_ms,
        "done_ms": now_ms(),
    })
    .to_string()
}

pub(super) fn encode_dead_letter(letter: &DeadLetter<'_>) -> String {
    serde_json::json!({
        "consumer": letter.consumer,
        "key": letter.key,
        "reason": letter.reason.code(),
        "error": letter.error,
        "message_id": letter.message.id,
        "transport_key": letter.message.key,
        "headers": letter.message.headers.to_json().to_string(),
        "payload": hex::encode(&letter.message.payload),
        "source": letter.meta.source,
        "topic": letter.meta.topic,
        "partition": letter.meta.partition,
        "offset": letter.meta.offset,
        "delivery_count": letter.meta.delivery_count,
        "attempts": letter.attempts,
        "created_ms": now_ms(),
    })
    .to_string()
}

pub(super) fn decode_dead_letter(id: i64, json: &str) -> Option<DeadLetterRecord> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let s = |name: &str| v[name].as_str().map(str::to_owned);
    let (message, meta) = dead_letter_message(
        s("message_id"),
        s("transport_key"),
        s("headers"),
        hex::decode(v["payload"].as_str().unwrap_or_default()).ok()?,
        s("source").unwrap_or_default(),
        s("topic"),
        v["partition"].as_i64().and_then(|p| i32::try_from(p).ok()),
        v["offset"].as_i64(),
        v["delivery_count"].as_i64().unwrap_or(1),
    );
    Some(DeadLetterRecord {
        id,
        consumer: s("consumer")?,
        key: s("key"),
        reason: s("reason").unwrap_or_default(),
        error: s("error").unwrap_or_default(),
        message,
        meta,
        attempts: v["attempts"]
            .as_u64()
            .and_then(|a| u32::try_from(a).ok())
            .unwrap_or(0),
        created_ms: v["created_ms"].as_i64().unwrap_or(0),
    })
}

pub(super) fn attempt_record(map: &HashMap<String, String>) -> Option<AttemptRecord> {
    let num = |name: &str| map.get(name).and_then(|v| v.parse::<i64>().ok());
    Some(AttemptRecord {
        attempts: u32::try_from(num("attempts")?).unwrap_or(u32::MAX),
        last_error: map.get("last_error").cloned().unwrap_or_default(),
        first_failed_ms: num("first_failed").unwrap_or(0),
        last_failed_ms: num("last_failed").unwrap_or(0),
    })
}
