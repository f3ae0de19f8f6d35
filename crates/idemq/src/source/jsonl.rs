//! The JSON-lines source: a file or stdin, one message per line.
//!
//! A line is either an **envelope** — a JSON object with a `payload` member
//! and no members other than `id`, `key`, `headers` and `payload` —
//! or a **bare payload** (any other JSON value), keyed by a JSON pointer:
//!
//! ```text
//! {"id":"m-1","key":"pay-1","headers":{"event_id":"e-1"},"payload":{"amount":5}}
//! {"payment_id":"pay-2","amount":7}
//! ```
//!
//! In an envelope, `id` and `key` may be strings or numbers, `headers` an
//! object (non-string values are stored as their JSON text), and `payload`
//! any JSON value: a string is taken as the raw payload text, anything else
//! as its compact JSON. A bare line's payload is the line itself.
//!
//! A line that is not JSON, not UTF-8, or a malformed envelope is delivered
//! with a [`defect`](super::Delivery::defect): the engine dead-letters it
//! with its line number and the run goes on. Blank lines are not messages.
//!
//! With a checkpoint file, progress survives restarts: the checkpoint holds
//! the byte offset before the first line not yet settled, so a restarted
//! run continues there. Lines after it that were already settled are read
//! again and answered from the inbox as duplicates: re-running the same
//! file applies nothing twice, with or without a checkpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncSeekExt, BufReader};
use tokio::sync::Notify;

use super::{Acknowledger, Delivery, Source};
use crate::error::{InputError, SourceError};
use crate::message::{DeliveryMeta, Headers, Message};

/// How often, at most, the checkpoint file is rewritten while running.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Checkpoint {
    /// Byte offset where reading resumes.
    offset: u64,
    /// Number of lines before `offset`.
    line: i64,
}

/// The default of [`JsonLinesSource::max_line_bytes`]: 4 MiB.
pub const DEFAULT_MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

#[derive(Debug)]
struct Line {
    number: i64,
    start: u64,
    /// The line, or its first `max_line_bytes` bytes when it was longer.
    bytes: Vec<u8>,
    /// The whole line's length, when it was longer than the limit.
    too_long: Option<u64>,
    delivery_count: u32,
}

#[derive(Debug, Default)]
struct State {
    /// Lines handed out and not yet settled: line number → start offset.
    unsettled: BTreeMap<i64, u64>,
    /// Nacked lines waiting for their redelivery time.
    delayed: Vec<(Instant, Line)>,
    /// Read position after the last line read.
    read: Checkpoint,
    last_written: Option<Instant>,
}

impl State {
    /// Where a restart must resume: before the first unsettled or delayed line.
    fn watermark(&self) -> Checkpoint {
        let first_unsettled = self
            .unsettled
            .iter()
            .next()
            .map(|(&line, &offset)| (line, offset));
        let first_delayed = self.delayed.iter().map(|(_, l)| (l.number, l.start)).min();
        match [first_unsettled, first_delayed].into_iter().flatten().min() {
            Some((line, offset)) => Checkpoint {
                offset,
                line: line - 1,
            },
            None => self.read,
        }
    }
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changed: Notify,
    checkpoint_path: Option<PathBuf>,
    /// Serializes checkpoint writes: an ack's periodic save and the forced
    /// save at the end of the input once raced on the one temp file (the
    /// loser's rename failed) and could write an older watermark last.
    save: tokio::sync::Mutex<()>,
    topic: String,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Writes the checkpoint (atomically: temp file + rename) if due or `force`d.
    async fn save_checkpoint(&self, force: bool) -> Result<(), SourceError> {
        let Some(path) = &self.checkpoint_path else {
            return Ok(());
        };
        let _writing = self.save.lock().await;
        let checkpoint = {
            let mut state = self.state();
            let due = state
                .last_written
                .is_none_or(|t| t.elapsed() >= CHECKPOINT_INTERVAL);
            if !force && !due {
                return Ok(());
            }
            state.last_written = Some(Instant::now());
            state.watermark()
        };
        let text =
            serde_json::to_string(&checkpoint).map_err(|e| SourceError::other(e.to_string()))?;
        let tmp = path.with_extension("checkpoint.tmp");
        tokio::fs::write(&tmp, text).await?;
        tokio::fs::rename(&tmp, path).await?;
        Ok(())
    }
}

/// A JSON-lines file or stdin as a source of messages.
pub struct JsonLinesSource {
    reader: Option<Box<dyn AsyncBufRead + Unpin + Send>>,
    /// The bytes of a line read so far: kept across calls, so that a
    /// [`next`](Source::next) cancelled in the middle of a line (a batch's
    /// wait ending, an idle timeout) loses nothing of it.
    partial: Vec<u8>,
    /// Bytes of the current line past `max_line_bytes`: counted, not kept.
    skipped: u64,
    max_line_bytes: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for JsonLinesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonLinesSource")
            .field("topic", &self.shared.topic)
            .field("checkpoint", &self.shared.checkpoint_path)
            .finish_non_exhaustive()
    }
}

impl JsonLinesSource {
    /// Reads `path` from the start, without a checkpoint.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, SourceError> {
        Self::open_with_checkpoint(path, None).await
    }

    /// Reads `path`, resuming from `checkpoint` (a file written as the run
    /// progresses) when it exists. A checkpoint beyond the end of the file
    /// (the file was replaced by a shorter one) is ignored.
    pub async fn open_with_checkpoint(
        path: impl AsRef<Path>,
        checkpoint: Option<PathBuf>,
    ) -> Result<Self, SourceError> {
        let path = path.as_ref();
        let mut file = tokio::fs::File::open(path).await?;
        let len = file.metadata().await?.len();
        let mut start = Checkpoint::default();
        if let Some(cp_path) = &checkpoint {
            match tokio::fs::read_to_string(cp_path).await {
                Ok(text) => match serde_json::from_str::<Checkpoint>(&text) {
                    Ok(cp) if cp.offset <= len => start = cp,
                    Ok(cp) => tracing::warn!(
                        checkpoint = %cp_path.display(), offset = cp.offset, len,
                        "checkpoint is past the end of the file; reading from the start"
                    ),
                    Err(e) => tracing::warn!(
                        checkpoint = %cp_path.display(), error = %e,
                        "unreadable checkpoint; reading from the start"
                    ),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
        }
        if start.offset > 0 {
            file.seek(std::io::SeekFrom::Start(start.offset)).await?;
            tracing::info!(line = start.line + 1, "resuming from checkpoint");
        }
        Ok(Self::build(
            Box::new(BufReader::new(file)),
            path.display().to_string(),
            checkpoint,
            start,
        ))
    }

    /// Reads standard input (no checkpoint: stdin cannot be re-read).
    pub fn stdin() -> Self {
        Self::from_reader(BufReader::new(tokio::io::stdin()), "-")
    }

    /// Reads any buffered reader; `topic` names it in metadata and dead letters.
    pub fn from_reader(reader: impl AsyncBufRead + Unpin + Send + 'static, topic: &str) -> Self {
        Self::build(
            Box::new(reader),
            topic.to_owned(),
            None,
            Checkpoint::default(),
        )
    }

    /// Caps the bytes kept of one line (default
    /// [`DEFAULT_MAX_LINE_BYTES`]): a longer line is read past without being
    /// held in memory, and delivered with its first `max` bytes and the
    /// defect [`InputError::TooLarge`], so the engine dead-letters it and
    /// the run goes on. Memory per line stays bounded by `max`.
    pub fn max_line_bytes(mut self, max: usize) -> Self {
        self.max_line_bytes = max.max(1);
        self
    }

    fn build(
        reader: Box<dyn AsyncBufRead + Unpin + Send>,
        topic: String,
        checkpoint_path: Option<PathBuf>,
        start: Checkpoint,
    ) -> Self {
        Self {
            reader: Some(reader),
            partial: Vec::new(),
            skipped: 0,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    read: start,
                    ..State::default()
                }),
                changed: Notify::new(),
                checkpoint_path,
                save: tokio::sync::Mutex::new(()),
                topic,
            }),
        }
    }

    /// Reads the next non-blank line, or `None` at the end of input.
    /// Cancel-safe: the bytes of a line read before a cancellation stay in
    /// `partial` and the next call completes the line.
    async fn read_line(&mut self) -> Result<Option<Line>, SourceError> {
        let Some(reader) = self.reader.as_mut() else {
            return Ok(None);
        };
        loop {
            // Up to the end of the line, keeping at most `max_line_bytes`.
            loop {
                let buf = reader.fill_buf().await?;
                if buf.is_empty() {
                    break;
                }
                let (chunk, ends) = match buf.iter().position(|b| *b == b'\n') {
                    Some(at) => (&buf[..=at], true),
                    None => (buf, false),
                };
                let taken = chunk.len();
                // Room for the line ending too: it does not count.
                let room = (self.max_line_bytes + 2).saturating_sub(self.partial.len());
                let kept = room.min(taken);
                self.partial.extend_from_slice(&chunk[..kept]);
                self.skipped += (taken - kept) as u64;
                reader.consume(taken);
                if ends {
                    break;
                }
            }
            if self.partial.is_empty() && self.skipped == 0 {
                self.reader = None;
                return Ok(None);
            }
            let mut bytes = std::mem::take(&mut self.partial);
            let skipped = std::mem::take(&mut self.skipped);
            let len = bytes.len() as u64 + skipped;
            let mut state = self.shared.state();
            let start = state.read.offset;
            state.read.offset += len;
            state.read.line += 1;
            let number = state.read.line;
            if skipped == 0 {
                while matches!(bytes.last(), Some(b'\n' | b'\r')) {
                    bytes.pop();
                }
            }
            let too_long = (skipped > 0 || bytes.len() > self.max_line_bytes).then_some(len);
            if too_long.is_some() {
                bytes.truncate(self.max_line_bytes);
            } else if bytes.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Ok(Some(Line {
                number,
                start,
                bytes,
                too_long,
                delivery_count: 1,
            }));
        }
    }

    fn deliver(&self, line: Line) -> Delivery {
        self.shared
            .state()
            .unsettled
            .insert(line.number, line.start);
        let meta = DeliveryMeta {
            source: "jsonl".into(),
            topic: Some(self.shared.topic.clone()),
            partition: None,
            offset: Some(line.number),
            delivery_count: line.delivery_count,
        };
        let parsed = match line.too_long {
            Some(len) => Err(InputError::TooLarge {
                len,
                max: self.max_line_bytes,
            }),
            None => parse_line(&line.bytes)
                .map_err(|reason| InputError::Malformed(format!("line {}: {reason}", line.number))),
        };
        let (message, defect) = match parsed {
            Ok(message) => (message, None),
            Err(defect) => (Message::new(line.bytes.clone()), Some(defect)),
        };
        let acker = LineAcker {
            shared: Arc::clone(&self.shared),
            line: Some(line),
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

#[async_trait]
impl Source for JsonLinesSource {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let shared = Arc::clone(&self.shared);
        loop {
            let changed = shared.changed.notified();
            let due = {
                let mut state = shared.state();
                let now = Instant::now();
                // The earliest due first (the first nacked among equals), and
                // the rest kept in order: a later copy of a key must not come
                // back before an earlier one.
                state
                    .delayed
                    .iter()
                    .enumerate()
                    .filter(|(_, (at, _))| *at <= now)
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(i, _)| i)
                    .map(|i| state.delayed.remove(i).1)
            };
            if let Some(line) = due {
                return Ok(Some(self.deliver(line)));
            }
            if let Some(line) = self.read_line().await? {
                return Ok(Some(self.deliver(line)));
            }
            // End of input: wait for retries and outstanding deliveries.
            let wait = {
                let state = self.shared.state();
                if state.unsettled.is_empty() && state.delayed.is_empty() {
                    None
                } else {
                    let now = Instant::now();
                    Some(
                        state
                            .delayed
                            .iter()
                            .map(|(at, _)| at.saturating_duration_since(now))
                            .min()
                            .unwrap_or(Duration::from_millis(200)),
                    )
                }
            };
            match wait {
                None => {
                    self.shared.save_checkpoint(true).await?;
                    return Ok(None);
                }
                Some(wait) => {
                    let _ = tokio::time::timeout(wait, changed).await;
                }
            }
        }
    }
}

struct LineAcker {
    shared: Arc<Shared>,
    line: Option<Line>,
}

impl LineAcker {
    fn settle(&mut self, retry_after: Option<Duration>) {
        let Some(mut line) = self.line.take() else {
            return;
        };
        let mut state = self.shared.state();
        state.unsettled.remove(&line.number);
        if let Some(delay) = retry_after {
            line.delivery_count += 1;
            state.delayed.push((Instant::now() + delay, line));
        }
        drop(state);
        self.shared.changed.notify_waiters();
    }
}

#[async_trait]
impl Acknowledger for LineAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.settle(None);
        self.shared.save_checkpoint(false).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        self.settle(Some(delay));
        Ok(())
    }
}

impl Drop for LineAcker {
    /// A delivery dropped unsettled (its task was cancelled) is retried at once.
    fn drop(&mut self) {
        self.settle(Some(Duration::ZERO));
    }
}

/// Parses one JSON line into a message, as this source does: an envelope
/// (`id`, `key`, `headers`, `payload`) or a bare payload. `idemq produce`
/// uses it to publish a file to a broker.
///
/// ```
/// use idemq::source::jsonl::parse_message;
/// let m = parse_message(br#"{"id":"m-1","key":"p-1","payload":{"amount":5}}"#).unwrap();
/// assert_eq!(m.key.as_deref(), Some("p-1"));
/// assert_eq!(m.payload, br#"{"amount":5}"#);
/// assert!(parse_message(b"{not json").is_err());
/// ```
pub fn parse_message(line: &[u8]) -> Result<Message, InputError> {
    parse_line(line).map_err(InputError::Malformed)
}

/// Parses one line into a message (envelope or bare payload).
fn parse_line(bytes: &[u8]) -> Result<Message, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not valid UTF-8 ({e})"))?;
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    let is_envelope = value.as_object().is_some_and(|o| {
        o.contains_key("payload")
            && o.keys()
                .all(|k| matches!(k.as_str(), "id" | "key" | "headers" | "payload"))
    });
    if !is_envelope {
        return Ok(Message::new(text.trim().as_bytes().to_vec()));
    }
    let serde_json::Value::Object(mut envelope) = value else {
        return Err("envelope is not an object".into());
    };
    let scalar = |name: &str, v: Option<serde_json::Value>| -> Result<Option<String>, String> {
        match v {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s)),
            Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
            Some(other) => Err(format!(
                "envelope {name} must be a string or number, not {other}"
            )),
        }
    };
    let id = scalar("id", envelope.remove("id"))?;
    let key = scalar("key", envelope.remove("key"))?;
    let mut headers = Headers::new();
    match envelope.remove("headers") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(map)) => {
            for (name, v) in map {
                match v {
                    serde_json::Value::String(s) => headers.insert(name, s.into_bytes()),
                    other => headers.insert(name, other.to_string().into_bytes()),
                }
            }
        }
        Some(_) => return Err("envelope headers must be an object".into()),
    }
    let payload = match envelope.remove("payload") {
        Some(serde_json::Value::String(s)) => s.into_bytes(),
        Some(other) => other.to_string().into_bytes(),
        None => return Err("envelope has no payload".into()),
    };
    Ok(Message {
        id,
        key,
        headers,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn nacked_lines_come_back_in_the_order_they_fell_due() {
        let input = "{\"id\":\"a\",\"payload\":1}\n{\"id\":\"b\",\"payload\":2}\n\
                     {\"id\":\"c\",\"payload\":3}\n{\"id\":\"d\",\"payload\":4}\n";
        let mut source = JsonLinesSource::from_reader(
            BufReader::new(std::io::Cursor::new(input.as_bytes().to_vec())),
            "mem",
        );
        for _ in 0..4 {
            let d = source.next().await.unwrap().expect("a delivery");
            d.into_parts()
                .3
                .nack(std::time::Duration::from_millis(20))
                .await
                .unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(40)).await;
        let mut order = Vec::new();
        for _ in 0..4 {
            let d = source.next().await.unwrap().expect("a redelivery");
            order.push(d.message.id.clone().unwrap_or_default());
            d.into_parts().3.ack().await.unwrap();
        }
        assert_eq!(order, ["a", "b", "c", "d"]);
    }

    /// A line longer than the limit is read past without being kept whole:
    /// it comes with its first `max` bytes and the defect `TooLarge`, and
    /// the lines around it are untouched; a line of exactly `max` bytes
    /// (its CRLF not counted) is a message.
    #[tokio::test]
    async fn a_line_over_the_limit_is_a_bounded_defect() {
        const MAX: usize = 64;
        let exact = format!(
            "{{\"id\":\"m-3\",\"payload\":\"{}\"}}",
            "y".repeat(MAX - 25)
        );
        assert_eq!(exact.len(), MAX);
        let big = format!("{{\"id\":\"m-2\",\"payload\":\"{}\"}}", "x".repeat(100_000));
        let input = format!(
            "{{\"id\":\"m-1\",\"payload\":1}}\n{big}\n{exact}\r\n{{\"id\":\"m-4\",\"payload\":4}}"
        );
        let mut source = JsonLinesSource::from_reader(
            BufReader::with_capacity(16, std::io::Cursor::new(input.clone().into_bytes())),
            "mem",
        )
        .max_line_bytes(MAX);
        let mut got = Vec::new();
        for _ in 0..4 {
            let d = source.next().await.unwrap().expect("a delivery");
            got.push((
                d.message.id.clone(),
                d.message.payload.len(),
                d.defect.clone(),
            ));
            d.into_parts().3.ack().await.unwrap();
        }
        assert_eq!(got[0].0.as_deref(), Some("m-1"));
        assert!(got[0].2.is_none());
        assert_eq!(got[1].1, MAX, "only the first bytes are kept");
        assert_eq!(
            got[1].2,
            Some(InputError::TooLarge {
                len: big.len() as u64 + 1,
                max: MAX
            })
        );
        assert_eq!(got[2].0.as_deref(), Some("m-3"), "{:?}", got[2]);
        assert!(got[2].2.is_none(), "{:?}", got[2]);
        assert_eq!(got[3].0.as_deref(), Some("m-4"));
        assert!(source.next().await.unwrap().is_none());
    }

    /// A `next` cancelled while half a line has arrived (as a batch's wait
    /// or an idle timeout cancels it) loses nothing: the next call returns
    /// the whole line, not two torn ones.
    #[tokio::test]
    async fn a_cancelled_read_keeps_the_half_line() {
        let (mut writer, reader) = tokio::io::duplex(64);
        let mut source = JsonLinesSource::from_reader(BufReader::new(reader), "pipe");
        writer
            .write_all(br#"{"id":"m-1","payload":{"ord"#)
            .await
            .unwrap();
        let cut = tokio::time::timeout(Duration::from_millis(50), source.next()).await;
        assert!(cut.is_err(), "no whole line yet: the read is cancelled");
        writer.write_all(b"er_id\":7}}\n").await.unwrap();
        drop(writer);
        let delivery = source.next().await.unwrap().expect("the whole line");
        assert!(delivery.defect.is_none(), "{:?}", delivery.defect);
        assert_eq!(delivery.message.id.as_deref(), Some("m-1"));
        assert_eq!(
            {
                let v: serde_json::Value = delivery.message.json().unwrap();
                v["order_id"].clone()
            },
            7
        );
        let (_, _, _, acker) = delivery.into_parts();
        acker.ack().await.unwrap();
        assert!(source.next().await.unwrap().is_none());
    }

    #[test]
    fn envelopes_and_bare_lines() {
        let m = parse_line(br#"{"id":7,"key":"k","headers":{"a":"b","n":1},"payload":{"x":1}}"#)
            .unwrap();
        assert_eq!(m.id.as_deref(), Some("7"));
        assert_eq!(m.key.as_deref(), Some("k"));
        assert_eq!(m.headers.get("a"), Some(&b"b"[..]));
        assert_eq!(m.headers.get("n"), Some(&b"1"[..]));
        assert_eq!(m.payload, br#"{"x":1}"#);
        let bare = parse_line(br#"{"payment_id":"p","payload":1}"#).unwrap();
        assert_eq!(bare.id, None);
        assert_eq!(bare.payload, br#"{"payment_id":"p","payload":1}"#);
        let text = parse_line(br#"{"payload":"raw text"}"#).unwrap();
        assert_eq!(text.payload, b"raw text");
    }

    /// Concurrent forced saves (an ack's periodic save racing the save at
    /// the end of the input) all succeed, and the file ends with the newest
    /// watermark: without the save lock, two writers shared the temp file
    /// and the loser's rename failed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_checkpoint_saves_all_succeed_and_keep_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("input.checkpoint");
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            checkpoint_path: Some(path.clone()),
            save: tokio::sync::Mutex::new(()),
            topic: "t".into(),
        });
        for round in 1..=20u64 {
            let mut saves = tokio::task::JoinSet::new();
            for n in 0..25u64 {
                let shared = shared.clone();
                saves.spawn(async move {
                    {
                        let mut state = shared.state();
                        let next = round * 100 + n;
                        if next > state.read.offset {
                            state.read = Checkpoint {
                                offset: next,
                                line: next as i64,
                            };
                        }
                    }
                    shared.save_checkpoint(true).await
                });
            }
            while let Some(saved) = saves.join_next().await {
                saved.unwrap().unwrap();
            }
            let on_disk: Checkpoint =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            assert_eq!(on_disk, shared.state().read, "round {round}");
        }
    }

    #[test]
    fn malformed_lines_are_errors() {
        assert!(parse_line(b"{not json").is_err());
        assert!(parse_line(&[0xff, 0xfe]).is_err());
        assert!(parse_line(br#"{"id":{},"payload":1}"#).is_err());
        assert!(parse_line(br#"{"headers":[],"payload":1}"#).is_err());
    }
}
