//! The stored documents: slots (the key's lease, done, free and pruned
//! records), failed attempts and dead letters; how they are written and read.

use mongodb::bson::{doc, spec::BinarySubtype, Binary, Bson, DateTime, Document};

use super::error::MongoError;
use super::ids::{self, esc, unesc};
use crate::message::{DeliveryMeta, Headers, Message};
use crate::store::{now_ms, AttemptRecord, DeadLetter, DeadLetterRecord, InboxRecord};

/// The most payload bytes a dead letter keeps (a BSON document holds at
/// most 16 MiB; the engine's default message limit is 4 MiB). A longer
/// payload is cut, and the letter's error text says so.
pub const MAX_DEAD_LETTER_PAYLOAD: usize = 8 * 1024 * 1024;

/// The most bytes of error text kept in a dead letter or an attempt.
const MAX_ERROR_TEXT: usize = 16 * 1024;

/// Slot kinds as stored in the `kind` field.
pub(super) const LEASE: &str = "lease";
pub(super) const DONE: &str = "done";
pub(super) const FREE: &str = "free";
pub(super) const PRUNED: &str = "pruned";

/// An integer field, whichever BSON number type the server returned.
pub(super) fn int(doc: &Document, name: &str) -> Option<i64> {
    match doc.get(name)? {
        Bson::Int64(n) => Some(*n),
        Bson::Int32(n) => Some(i64::from(*n)),
        Bson::Double(f) if f.fract() == 0.0 => Some(*f as i64),
        _ => None,
    }
}

/// A text field, decoded ([`unesc`]).
pub(super) fn text(doc: &Document, name: &str) -> Option<String> {
    match doc.get(name)? {
        Bson::String(s) => Some(unesc(s)),
        _ => None,
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn bounded(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn corrupt(what: &'static str, detail: impl Into<String>) -> MongoError {
    MongoError::Corrupt {
        what,
        detail: detail.into(),
    }
}

/// Parses a stored result (JSON text; anything else is kept as a string).
pub(super) fn parse_result(text: Option<String>) -> Option<serde_json::Value> {
    text.map(|t| serde_json::from_str(&t).unwrap_or(serde_json::Value::String(t)))
}

/// Where a slot sits: the key, its epoch and generation, and its first-seen time.
#[derive(Debug, Clone, Copy)]
pub(super) struct At<'a> {
    pub(super) consumer: &'a str,
    pub(super) key: &'a str,
    pub(super) epoch: &'a str,
    pub(super) g: i64,
    pub(super) first_seen: i64,
}

impl At<'_> {
    /// The slot's `_id`.
    pub(super) fn id(&self) -> String {
        ids::slot(self.consumer, self.key, self.epoch, self.g)
    }

    fn base(&self, kind: &str) -> Document {
        doc! {
            "_id": self.id(),
            "consumer": esc(self.consumer),
            "key": esc(self.key),
            "epoch": self.epoch,
            "g": self.g,
            "kind": kind,
            "first_seen": self.first_seen,
            "created": now_ms(),
        }
    }

    /// A lease held by `token` until `expires` (server time, ms).
    pub(super) fn lease(&self, token: &str, expires: i64) -> Document {
        let mut d = self.base(LEASE);
        d.insert("token", token);
        d.insert("expires", expires);
        d
    }

    /// The done record: fingerprint, result (as JSON text), completion time.
    pub(super) fn done(
        &self,
        fingerprint: &str,
        result: Option<&serde_json::Value>,
        expire_at: Option<DateTime>,
    ) -> Document {
        let mut d = self.base(DONE);
        d.insert("fp", fingerprint);
        d.insert(
            "result",
            result.map_or(Bson::Null, |r| Bson::String(esc(&r.to_string()))),
        );
        d.insert("done_ms", now_ms());
        if let Some(at) = expire_at {
            d.insert("expire_at", at);
        }
        d
    }

    /// The key released: the next claim takes it at once.
    pub(super) fn free(&self) -> Document {
        self.base(FREE)
    }

    /// The key being pruned, until `expires` (server time, ms).
    pub(super) fn pruned(&self, expires: i64) -> Document {
        let mut d = self.base(PRUNED);
        d.insert("expires", expires);
        d
    }
}

/// What a slot says about its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum State {
    /// Held by `token` until `expires` (server time, ms).
    Lease { token: String, expires: i64 },
    /// Processed.
    Done {
        fingerprint: String,
        result: Option<String>,
    },
    /// Released.
    Free,
    /// Being pruned until `expires`.
    Pruned { expires: i64 },
}

/// A slot as read back.
#[derive(Debug, Clone)]
pub(super) struct Slot {
    pub(super) id: String,
    pub(super) epoch: String,
    pub(super) g: i64,
    pub(super) first_seen: i64,
    pub(super) state: State,
}

impl Slot {
    pub(super) fn parse(doc: &Document) -> Result<Self, MongoError> {
        let id = match doc.get("_id") {
            Some(Bson::String(id)) => id.clone(),
            other => return Err(corrupt("inbox", format!("_id {other:?}"))),
        };
        let field = |name: &'static str| corrupt("inbox", format!("{id}: no {name}"));
        let epoch = doc.get_str("epoch").map_err(|_| field("epoch"))?.to_owned();
        let g = int(doc, "g").ok_or_else(|| field("g"))?;
        let first_seen = int(doc, "first_seen").unwrap_or(0);
        let state = match doc.get_str("kind").map_err(|_| field("kind"))? {
            LEASE => State::Lease {
                token: doc.get_str("token").map_err(|_| field("token"))?.to_owned(),
                expires: int(doc, "expires").ok_or_else(|| field("expires"))?,
            },
            DONE => State::Done {
                fingerprint: doc.get_str("fp").map_err(|_| field("fp"))?.to_owned(),
                result: text(doc, "result"),
            },
            FREE => State::Free,
            PRUNED => State::Pruned {
                expires: int(doc, "expires").ok_or_else(|| field("expires"))?,
            },
            other => return Err(corrupt("inbox", format!("{id}: kind {other:?}"))),
        };
        Ok(Self {
            id,
            epoch,
            g,
            first_seen,
            state,
        })
    }

    /// Whether the slot holds the key at server time `now`: a lease or a
    /// pruning marker that has not expired.
    pub(super) fn is_live(&self, now: i64) -> bool {
        match self.state {
            State::Lease { expires, .. } | State::Pruned { expires } => expires > now,
            State::Done { .. } | State::Free => false,
        }
    }

    /// The inbox record of a done slot.
    pub(super) fn record(&self, consumer: &str, key: &str) -> Option<InboxRecord> {
        let State::Done {
            fingerprint,
            result,
        } = &self.state
        else {
            return None;
        };
        Some(InboxRecord {
            consumer: consumer.to_owned(),
            key: key.to_owned(),
            fingerprint: fingerprint.clone(),
            result: parse_result(result.clone()),
            first_seen_ms: self.first_seen,
        })
    }
}

/// A key's slots, as one query read them: its head, and the top of the
/// head's epoch (slots of other epochs are leftovers of a pruned life).
#[derive(Debug, Clone, Default)]
pub(super) struct KeyView {
    pub(super) head: Option<Slot>,
    pub(super) top: Option<Slot>,
}

/// What a claim does with a key.
#[derive(Debug)]
pub(super) enum Decision {
    /// Processed before.
    Done(InboxRecord),
    /// Held by a live lease (or being pruned).
    Busy,
    /// Free to take: insert generation `g` of `epoch` as a lease.
    Take {
        epoch: String,
        g: i64,
        first_seen: i64,
    },
}

impl KeyView {
    /// The view of `consumer`/`key` from its slot documents.
    pub(super) fn new(consumer: &str, key: &str, docs: &[Document]) -> Result<Self, MongoError> {
        let head_id = ids::head(consumer, key);
        let slots = docs
            .iter()
            .map(Slot::parse)
            .collect::<Result<Vec<_>, _>>()?;
        let head = slots.iter().find(|s| s.id == head_id).cloned();
        let top = head.as_ref().and_then(|h| {
            slots
                .iter()
                .filter(|s| s.epoch == h.epoch)
                .max_by_key(|s| s.g)
                .cloned()
        });
        Ok(Self { head, top })
    }

    /// What a claim at server time `now` does.
    pub(super) fn decide(&self, consumer: &str, key: &str, now: i64) -> Decision {
        let (Some(head), Some(top)) = (&self.head, &self.top) else {
            return Decision::Take {
                epoch: uuid::Uuid::new_v4().simple().to_string(),
                g: 1,
                first_seen: now_ms(),
            };
        };
        if let Some(record) = top.record(consumer, key) {
            return Decision::Done(record);
        }
        if top.is_live(now) {
            return Decision::Busy;
        }
        Decision::Take {
            epoch: head.epoch.clone(),
            g: top.g + 1,
            first_seen: head.first_seen,
        }
    }

    /// The done record, if the key is done.
    pub(super) fn record(&self, consumer: &str, key: &str) -> Option<InboxRecord> {
        self.top.as_ref().and_then(|t| t.record(consumer, key))
    }
}

/// Failed attempt `n` of a key.
pub(super) fn attempt_doc(consumer: &str, key: &str, n: i64, error: &str) -> Document {
    doc! {
        "_id": ids::attempt(consumer, key, n),
        "consumer": esc(consumer),
        "key": esc(key),
        "n": n,
        "error": esc(bounded(error, MAX_ERROR_TEXT)),
        "at": now_ms(),
    }
}

/// The attempt record of a key from its attempt documents.
pub(super) fn attempt_record(docs: &[Document]) -> Option<AttemptRecord> {
    let last = docs.iter().max_by_key(|d| int(d, "n").unwrap_or(0))?;
    let times = docs.iter().filter_map(|d| int(d, "at"));
    Some(AttemptRecord {
        attempts: u32::try_from(int(last, "n").unwrap_or(0)).unwrap_or(u32::MAX),
        last_error: text(last, "error").unwrap_or_default(),
        first_failed_ms: times.clone().min().unwrap_or(0),
        last_failed_ms: times.max().unwrap_or(0),
    })
}

/// A dead letter's document, with id `id`.
pub(super) fn dead_letter_doc(id: i64, letter: &DeadLetter<'_>) -> Document {
    let payload = &letter.message.payload;
    let kept = &payload[..payload.len().min(MAX_DEAD_LETTER_PAYLOAD)];
    let mut error = bounded(letter.error, MAX_ERROR_TEXT).to_owned();
    if kept.len() < payload.len() {
        error.push_str(&format!(
            " (payload cut to its first {} of {} bytes in this dead letter)",
            kept.len(),
            payload.len()
        ));
    }
    let opt = |s: Option<&str>| s.map_or(Bson::Null, |s| Bson::String(esc(s)));
    doc! {
        "_id": id,
        "letter": letter.letter_id(),
        "consumer": esc(letter.consumer),
        "key": opt(letter.key),
        "reason": letter.reason.code(),
        "error": esc(&error),
        "message_id": opt(letter.message.id.as_deref()),
        "transport_key": opt(letter.message.key.as_deref()),
        "headers": esc(&letter.message.headers.to_json().to_string()),
        "payload": Binary { subtype: BinarySubtype::Generic, bytes: kept.to_vec() },
        "source": esc(&letter.meta.source),
        "topic": opt(letter.meta.topic.as_deref()),
        "partition": letter.meta.partition.map_or(Bson::Null, Bson::Int32),
        "offset": letter.meta.offset.map_or(Bson::Null, Bson::Int64),
        "delivery_count": i64::from(letter.meta.delivery_count),
        "attempts": i64::from(letter.attempts),
        "created": now_ms(),
    }
}

/// A dead letter read back.
pub(super) fn parse_dead_letter(doc: &Document) -> Result<DeadLetterRecord, MongoError> {
    let id = int(doc, "_id").ok_or_else(|| corrupt("dead letter", "no numeric _id"))?;
    let payload = match doc.get("payload") {
        Some(Bson::Binary(b)) => b.bytes.clone(),
        Some(Bson::String(s)) => s.clone().into_bytes(),
        _ => Vec::new(),
    };
    let headers = text(doc, "headers")
        .and_then(|h| serde_json::from_str::<serde_json::Value>(&h).ok())
        .map(|v| Headers::from_json(&v))
        .unwrap_or_default();
    let count = |name: &str| u32::try_from(int(doc, name).unwrap_or(0)).unwrap_or(u32::MAX);
    Ok(DeadLetterRecord {
        id,
        consumer: text(doc, "consumer")
            .ok_or_else(|| corrupt("dead letter", format!("{id}: no consumer")))?,
        key: text(doc, "key"),
        reason: text(doc, "reason").unwrap_or_default(),
        error: text(doc, "error").unwrap_or_default(),
        message: Message {
            id: text(doc, "message_id"),
            key: text(doc, "transport_key"),
            headers,
            payload,
        },
        meta: DeliveryMeta {
            source: text(doc, "source").unwrap_or_default(),
            topic: text(doc, "topic"),
            partition: int(doc, "partition").and_then(|p| i32::try_from(p).ok()),
            offset: int(doc, "offset"),
            delivery_count: count("delivery_count").max(1),
        },
        attempts: count("attempts"),
        created_ms: int(doc, "created").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outcome::DeadLetterReason;

    fn at(g: i64) -> At<'static> {
        At {
            consumer: "c",
            key: "k",
            epoch: "e1",
            g,
            first_seen: 5,
        }
    }

    #[test]
    fn the_top_of_the_heads_epoch_decides() {
        let docs = vec![
            at(1).lease("t1", 10),
            at(2).free(),
            // A leftover of another life of the key.
            At {
                epoch: "e0",
                g: 9,
                ..at(9)
            }
            .done("old", None, None),
        ];
        let view = KeyView::new("c", "k", &docs).unwrap();
        assert_eq!(view.top.as_ref().map(|t| t.g), Some(2));
        match view.decide("c", "k", 0) {
            Decision::Take {
                epoch,
                g,
                first_seen,
            } => {
                assert_eq!((epoch.as_str(), g, first_seen), ("e1", 3, 5))
            }
            other => panic!("{other:?}"),
        }
        let live = KeyView::new("c", "k", &[at(1).lease("t", 100)]).unwrap();
        assert!(matches!(live.decide("c", "k", 99), Decision::Busy));
        assert!(matches!(
            live.decide("c", "k", 100),
            Decision::Take { g: 2, .. }
        ));
        let result = serde_json::json!({"amount": 5});
        let done = KeyView::new(
            "c",
            "k",
            &[at(1).lease("t", 1), at(2).done("fp", Some(&result), None)],
        )
        .unwrap();
        match done.decide("c", "k", 0) {
            Decision::Done(r) => {
                assert_eq!(
                    (r.fingerprint.as_str(), r.result, r.first_seen_ms),
                    ("fp", Some(result), 5)
                )
            }
            other => panic!("{other:?}"),
        }
        let headless = KeyView::new(
            "c",
            "k",
            &[At {
                epoch: "e0",
                ..at(2)
            }
            .free()],
        )
        .unwrap();
        assert!(matches!(
            headless.decide("c", "k", 0),
            Decision::Take { g: 1, .. }
        ));
    }

    #[test]
    fn dead_letters_round_trip_and_cut_long_payloads() {
        let message = Message::new(vec![0u8; MAX_DEAD_LETTER_PAYLOAD + 3])
            .with_id("m\0id")
            .with_header("h", b"v".to_vec());
        let meta = DeliveryMeta::new("test");
        let reason = DeadLetterReason::PermanentFailure;
        let letter = DeadLetter {
            consumer: "c%",
            key: Some("k\0"),
            reason: &reason,
            error: "boom",
            message: &message,
            meta: &meta,
            attempts: 2,
        };
        let back = parse_dead_letter(&dead_letter_doc(7, &letter)).unwrap();
        assert_eq!(back.id, 7);
        assert_eq!(
            (back.consumer.as_str(), back.key.as_deref()),
            ("c%", Some("k\0"))
        );
        assert_eq!(back.message.id.as_deref(), Some("m\0id"));
        assert_eq!(back.message.headers, message.headers);
        assert_eq!(back.message.payload.len(), MAX_DEAD_LETTER_PAYLOAD);
        assert!(
            back.error.starts_with("boom (payload cut"),
            "{}",
            back.error
        );
        assert_eq!(back.attempts, 2);
    }
}
