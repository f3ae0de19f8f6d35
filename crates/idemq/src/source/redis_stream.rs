//! Redis Streams: a consumer-group [`Source`] and a [`Publisher`], over the
//! `redis` crate.
//!
//! # How Redis Streams redeliver
//!
//! A stream is an append-only log of entries, each a list of field/value
//! pairs under an id such as `1700000000000-0`. A *consumer group* hands every
//! new entry to one of its consumers (`XREADGROUP … >`) and records it in the
//! group's *pending entries list* (PEL) under that consumer, with a delivery
//! counter, until the entry is acknowledged (`XACK`). Nothing is ever
//! redelivered by itself: an entry whose consumer died stays pending until
//! some consumer *claims* it (`XCLAIM` / `XAUTOCLAIM`, which increments its
//! delivery counter) or the same consumer name re-reads its own PEL
//! (`XREADGROUP … 0`).
//!
//! # How this source maps it
//!
//! - **Startup**: the group is created if missing (`XGROUP CREATE … MKSTREAM`,
//!   from [`RedisStreamConfig::start`]; an existing group is kept). The
//!   source first re-reads *its own* PEL (`XREADGROUP … 0`), so a consumer
//!   that restarts under the same name ([`RedisStreamConfig::consumer`])
//!   gets back at once what it held when it died.
//! - **New entries**: `XREADGROUP … COUNT n BLOCK t STREAMS s >`, in a
//!   background task, so that [`Source::next`] is cancel-safe.
//! - **Dead consumers**: every half [`claim_idle`](RedisStreamConfig::claim_idle)
//!   the source runs `XAUTOCLAIM` for entries pending longer than
//!   `claim_idle` and delivers them. A live consumer keeps the entries it
//!   holds (buffered, in flight, or waiting for a retry) fresh by
//!   `XCLAIM … JUSTID` every quarter `claim_idle`, so only entries of dead (or
//!   stuck) consumers reach that idle time.
//! - **Delivery count**: 1 for a new entry; for a re-read, claimed or retried
//!   entry, the PEL's times-delivered (`XPENDING`). It drives poison
//!   accounting (`RetryPolicy::max_deliveries`).
//! - **Ack** (after the inbox commit): `XACK`.
//! - **Nack(delay)**: Redis has no negative ack. The entry is *not* acked;
//!   the source holds it (still pending, kept fresh) and after the delay
//!   claims it again for itself with `XCLAIM` (which increments the PEL's
//!   delivery counter) and redelivers it. If the process dies meanwhile, the
//!   entry stays pending and is claimed by `XAUTOCLAIM` after `claim_idle`.
//! - **Dead-letter**: with [`dead_letter_stream`](RedisStreamConfig::dead_letter_stream)
//!   set, a copy of the entry's fields plus the field `dead_letter_reason`
//!   (the [`DeadLetterReason::code`]) is `XADD`ed there and the original
//!   `XACK`ed, in one `MULTI`/`EXEC`; without one it is just acked (the
//!   inbox's dead-letter table keeps it).
//! - A delivery dropped unsettled (its task was cancelled) stops being kept
//!   fresh and comes back through `XAUTOCLAIM` after `claim_idle`; so do
//!   entries read but not handed out when the source is dropped.
//!
//! Consumers that died stay listed in the group (`XINFO CONSUMERS`) with no
//! pending entries once their entries were claimed; remove them with
//! `XGROUP DELCONSUMER` if the list matters.
//!
//! # Entry layout
//!
//! [`RedisStreamPublisher`] writes, and the source reads:
//!
//! | field        | [`Message`]                                             |
//! |--------------|---------------------------------------------------------|
//! | `payload`    | [`Message::payload`] (raw bytes; required)              |
//! | `id`         | [`Message::id`] (else the entry id)                     |
//! | `key`        | [`Message::key`]                                        |
//! | `h:<name>`   | the header `<name>`                                     |
//! | other fields | a header of the same name (e.g. `dead_letter_reason`)  |
//!
//! The source adds the header [`ENTRY_ID_HEADER`] with the entry id. An
//! entry without a `payload` field is delivered with a defect (its fields as
//! a JSON object for the payload), which the engine dead-letters.
//! [`DeliveryMeta`] has source `redis-stream`, the stream as topic and no
//! offset.
//!
//! ```no_run
//! use idemq::source::redis_stream::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
//! use idemq::source::Publisher;
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//! use idemq::{Consumer, KeySpec, Message};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = RedisStreamConfig::from_url(
//!     "redis-stream://127.0.0.1:6379/payments?group=billing&claim_idle=30s&dead_letter_stream=payments-dead",
//! )?;
//! let publisher = RedisStreamPublisher::connect(&config).await?;
//! publisher
//!     .publish(&Message::new(r#"{"payment_id":"p-1","amount":5}"#).with_id("m-1"))
//!     .await?;
//!
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/test").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("billing", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(|_ctx, _tx| Box::pin(async move { Ok(None) }))
//!     .build()?;
//! // A stream never ends: run until Ctrl-C.
//! let source = RedisStreamSource::connect(config).await?;
//! consumer
//!     .run_until(source, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::url::{Bare, BrokerUrl};
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::{InputError, SourceError};
use crate::message::{DeliveryMeta, Message};
use crate::store::DeadLetterReason;

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

const SOURCE_NAME: &str = "redis-stream";
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a transient failure before reading again.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Where and how to consume one stream. Build it with [`RedisStreamConfig::new`]
/// and the public fields, or parse a URL with [`RedisStreamConfig::from_url`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisStreamConfig {
    /// The Redis URL, `redis://[user:password@]host:port[/db]`.
    pub redis_url: String,
    /// The stream key.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// This consumer's name within the group. `None` (the default): a name
    /// unique to each connected source, `idemq-<pid>-<random>`. Set a stable
    /// one to re-read its own pending entries at once after a restart; two
    /// sources must never run under the same name at the same time (each
    /// would re-read what the other holds).
    pub consumer: Option<String>,
    /// Entries pending longer than this are claimed from their (dead)
    /// consumer with `XAUTOCLAIM` (default 30 s, at least 100 ms).
    pub claim_idle: Duration,
    /// How long one `XREADGROUP` blocks waiting for new entries (default 2 s).
    pub block: Duration,
    /// Entries per read or claim (default 10, 1 ..= 1000).
    pub count: usize,
    /// The stream that dead-lettered entries are copied to, if any.
    pub dead_letter_stream: Option<String>,
    /// Where a group created by this source starts: `0` (the whole stream,
    /// default) or `$` (only new entries).
    pub start: String,
}

impl RedisStreamConfig {
    /// Defaults for `stream` and `group` on the Redis at `redis_url`.
    pub fn new(
        redis_url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            redis_url: redis_url.into(),
            stream: stream.into(),
            group: group.into(),
            consumer: None,
            claim_idle: Duration::from_secs(30),
            block: Duration::from_secs(2),
            count: 10,
            dead_letter_stream: None,
            start: "0".into(),
        }
    }

    /// Parses
    /// `redis-stream://[user:password@]host:port/stream?group=NAME[&consumer=NAME][&claim_idle=30s][&block=2s][&count=10][&dead_letter_stream=NAME][&start=0|$][&db=N]`.
    ///
    /// `group` is required. Durations take a unit (`ms`, `s`, `m`, `h`);
    /// unlike the other sources' URLs, a bare number is **milliseconds**, as
    /// in Redis (`block=500` is 500 ms). The stream name and values may be
    /// percent-encoded.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("Redis Streams", "redis-stream", url)?;
        u.require_path("stream")?;
        u.host_list()?;
        let mut group = None;
        let mut db = None;
        let mut config = Self::new(String::new(), u.decoded_path()?, String::new());
        for p in u.params() {
            match p.name.as_str() {
                "group" => group = p.non_empty(),
                "consumer" => config.consumer = Some(p.value),
                "claim_idle" => config.claim_idle = p.duration(Bare::Millis)?,
                "block" => config.block = p.duration(Bare::Millis)?,
                "count" => config.count = p.count()?,
                "dead_letter_stream" => config.dead_letter_stream = Some(p.value),
                "start" => config.start = p.value,
                "db" => db = Some(p.count::<u32>()?),
                _ => return Err(p.unknown()),
            }
        }
        config.group = group.ok_or_else(|| u.missing("group"))?;
        config.redis_url = match db {
            Some(db) => format!("redis://{}/{db}", u.authority),
            None => format!("redis://{}", u.authority),
        };
        config.validate()?;
        Ok(config)
    }

    /// Sets the consumer name.
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = Some(consumer.into());
        self
    }

    /// Sets the idle time after which pending entries are claimed.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// Sets the blocking time of one read.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Sets the dead-letter stream.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter_stream = Some(stream.into());
        self
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if self.stream.is_empty() {
            return Err(config_error("the stream name is empty"));
        }
        if self.group.is_empty() {
            return Err(config_error("the consumer group is empty"));
        }
        if self.consumer.as_deref() == Some("") {
            return Err(config_error("the consumer name is empty"));
        }
        if self.dead_letter_stream.as_deref() == Some("") {
            return Err(config_error("the dead-letter stream name is empty"));
        }
        if self.dead_letter_stream.as_deref() == Some(self.stream.as_str()) {
            return Err(config_error(
                "the dead-letter stream must differ from the stream",
            ));
        }
        if self.claim_idle < Duration::from_millis(100) {
            return Err(config_error(format!(
                "claim_idle must be at least 100ms, not {:?}",
                self.claim_idle
            )));
        }
        if self.block < Duration::from_millis(1) {
            return Err(config_error(
                "block must be at least 1ms (0 would block forever)",
            ));
        }
        if !(1..=1000).contains(&self.count) {
            return Err(config_error(format!(
                "count must be from 1 to 1000, not {}",
                self.count
            )));
        }
        if !matches!(self.start.as_str(), "0" | "$") {
            return Err(config_error(format!(
                "start must be 0 or $, not {:?}",
                self.start
            )));
        }
        Ok(())
    }
}

fn default_consumer_name() -> String {
    format!("idemq-{}-{:08x}", std::process::id(), fastrand::u32(..))
}

fn config_error(text: impl Into<String>) -> SourceError {
    SourceError::Config(text.into())
}

fn broker_error(what: &str, e: RedisError) -> SourceError {
    SourceError::Broker(format!("Redis {what}: {e}"))
}

fn is_transient(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

async fn connection(url: &str, response: Duration) -> Result<ConnectionManager, SourceError> {
    let client = redis::Client::open(url)
        .map_err(|e| config_error(format!("bad Redis URL {url:?}: {e}")))?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(COMMAND_TIMEOUT))
        .set_response_timeout(Some(response))
        .set_number_of_retries(2)
        .set_max_delay(Duration::from_millis(500));
    ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| broker_error(&format!("connect to {url}"), e))
}

// ---------------------------------------------------------------------------
// Reply parsing

/// One stream entry: its id and fields (`None` when the entry was deleted
/// from the stream while pending).
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    id: String,
    fields: Option<Vec<(String, Vec<u8>)>>,
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
fn parse_entries(value: &Value) -> Vec<Entry> {
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
fn parse_read(value: &Value) -> Vec<Entry> {
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
fn parse_autoclaim(value: &Value) -> (String, Vec<Entry>) {
    match value {
        Value::Array(parts) if parts.len() >= 2 => (
            text(&parts[0]).unwrap_or_else(|| "0-0".into()),
            parse_entries(&parts[1]),
        ),
        _ => ("0-0".into(), Vec::new()),
    }
}

/// Times-delivered from a one-id `XPENDING` reply.
fn parse_pending_count(value: &Value) -> Option<u32> {
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

// ---------------------------------------------------------------------------
// The source

/// An entry ready to be handed out.
#[derive(Debug)]
struct Ready {
    id: String,
    fields: Vec<(String, Vec<u8>)>,
    delivery_count: u32,
}

/// Everything the source, its tasks and its acknowledgers share.
struct Shared {
    conn: ConnectionManager,
    stream: String,
    group: String,
    consumer: String,
    claim_idle: Duration,
    dead_letter_stream: Option<String>,
    /// Entry ids this source holds (buffered, in flight, waiting for a retry):
    /// kept fresh in the PEL, and not delivered a second time by `XAUTOCLAIM`.
    held: Mutex<HashSet<String>>,
    /// Nacked entries come back through here after their delay.
    retries: mpsc::UnboundedSender<Ready>,
}

impl Shared {
    fn held(&self) -> MutexGuard<'_, HashSet<String>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, id: &str) {
        self.held().remove(id);
    }

    async fn xack(&self, id: &str) -> Result<(), SourceError> {
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(id)
            .query_async::<Value>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("XACK {}", self.stream), e))
    }

    /// Claims `id` for this consumer again (incrementing its delivery
    /// counter); `None` if it is no longer pending or no longer in the stream.
    async fn reclaim(&self, id: &str) -> Result<Option<Entry>, SourceError> {
        let reply: Value = redis::cmd("XCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(id)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| broker_error(&format!("XCLAIM {}", self.stream), e))?;
        Ok(parse_entries(&reply)
            .into_iter()
            .find(|e| e.id == id && e.fields.is_some()))
    }

    /// The PEL's times-delivered of each id (1 where it cannot be read).
    async fn delivery_counts(&self, ids: &[&str]) -> HashMap<String, u32> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(*id)
                .arg(*id)
                .arg(1);
        }
        let replies: Vec<Value> = match pipe.query_async(&mut self.conn.clone()).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(stream = %self.stream, error = %e, "XPENDING failed; delivery counts unknown");
                Vec::new()
            }
        };
        ids.iter()
            .zip(
                replies
                    .iter()
                    .map(parse_pending_count)
                    .chain(std::iter::repeat(None)),
            )
            .map(|(id, n)| ((*id).to_owned(), n.unwrap_or(1).max(1)))
            .collect()
    }
}

/// The reading side: owned by the background read task while it runs.
struct Reader {
    conn: ConnectionManager,
    shared: Arc<Shared>,
    block: Duration,
    count: usize,
    /// While re-reading this consumer's own PEL at startup: the id after which to read.
    history: Option<String>,
    claim_cursor: String,
    next_claim: Instant,
}

impl Reader {
    fn claim_every(&self) -> Duration {
        self.shared.claim_idle / 2
    }

    /// Reads the next batch (possibly empty). Transient failures are retried.
    async fn read(mut self) -> (Self, Result<Vec<Ready>, SourceError>) {
        loop {
            match self.read_once().await {
                Ok(batch) => return (self, Ok(batch)),
                Err(e) if is_transient(&e) => {
                    tracing::warn!(stream = %self.shared.stream, error = %e, "reading the stream failed; retrying");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Err(e) => {
                    let e = broker_error(&format!("reading stream {}", self.shared.stream), e);
                    return (self, Err(e));
                }
            }
        }
    }

    async fn read_once(&mut self) -> Result<Vec<Ready>, RedisError> {
        let shared = Arc::clone(&self.shared);
        if let Some(after) = self.history.clone() {
            let reply: Value = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&shared.group)
                .arg(&shared.consumer)
                .arg("COUNT")
                .arg(self.count)
                .arg("STREAMS")
                .arg(&shared.stream)
                .arg(&after)
                .query_async(&mut self.conn)
                .await?;
            let entries = parse_read(&reply);
            match entries.last() {
                Some(last) => self.history = Some(last.id.clone()),
                None => {
                    self.history = None;
                    return Ok(Vec::new());
                }
            }
            tracing::debug!(stream = %shared.stream, n = entries.len(), "re-read own pending entries");
            return Ok(self.counted(entries).await);
        }
        let now = Instant::now();
        if now >= self.next_claim {
            let reply: Value = redis::cmd("XAUTOCLAIM")
                .arg(&shared.stream)
                .arg(&shared.group)
                .arg(&shared.consumer)
                .arg(millis(shared.claim_idle))
                .arg(&self.claim_cursor)
                .arg("COUNT")
                .arg(self.count)
                .query_async(&mut self.conn)
                .await?;
            let (cursor, entries) = parse_autoclaim(&reply);
            self.next_claim = if cursor == "0-0" {
                now + self.claim_every()
            } else {
                now // more to scan
            };
            self.claim_cursor = cursor;
            let entries: Vec<Entry> = {
                let held = shared.held();
                entries
                    .into_iter()
                    .filter(|e| !held.contains(&e.id))
                    .collect()
            };
            if !entries.is_empty() {
                tracing::info!(stream = %shared.stream, n = entries.len(), "claimed idle pending entries");
                return Ok(self.counted(entries).await);
            }
        }
        let wait = self
            .block
            .min(self.next_claim.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&shared.group)
            .arg(&shared.consumer)
            .arg("COUNT")
            .arg(self.count)
            .arg("BLOCK")
            .arg(millis(wait))
            .arg("STREAMS")
            .arg(&shared.stream)
            .arg(">")
            .query_async(&mut self.conn)
            .await?;
        let entries = parse_read(&reply);
        let mut held = shared.held();
        Ok(entries
            .into_iter()
            .filter_map(|e| {
                let fields = e.fields?;
                held.insert(e.id.clone());
                Some(Ready {
                    id: e.id,
                    fields,
                    delivery_count: 1,
                })
            })
            .collect())
    }

    /// Marks entries as held and reads their delivery counts from the PEL.
    /// Entries deleted from the stream are acked and skipped.
    async fn counted(&mut self, entries: Vec<Entry>) -> Vec<Ready> {
        let shared = &self.shared;
        let mut live = Vec::new();
        for e in entries {
            match e.fields {
                Some(fields) => live.push((e.id, fields)),
                None => {
                    tracing::warn!(stream = %shared.stream, id = %e.id, "a pending entry was deleted from the stream; acking it");
                    if let Err(err) = shared.xack(&e.id).await {
                        tracing::warn!(stream = %shared.stream, error = %err, "XACK of a deleted entry failed");
                    }
                }
            }
        }
        {
            let mut held = shared.held();
            for (id, _) in &live {
                held.insert(id.clone());
            }
        }
        let ids: Vec<&str> = live.iter().map(|(id, _)| id.as_str()).collect();
        let counts = shared.delivery_counts(&ids).await;
        live.into_iter()
            .map(|(id, fields)| Ready {
                delivery_count: counts.get(&id).copied().unwrap_or(1),
                id,
                fields,
            })
            .collect()
    }
}

/// Keeps the held entries fresh in the PEL (`XCLAIM … JUSTID`), so that
/// `XAUTOCLAIM` elsewhere leaves them alone.
async fn keep_fresh(shared: Weak<Shared>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let ids: Vec<String> = shared.held().iter().cloned().collect();
        if ids.is_empty() {
            continue;
        }
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&shared.stream)
            .arg(&shared.group)
            .arg(&shared.consumer)
            // Only entries not touched for half a period: one that another
            // consumer has just claimed is left to it.
            .arg(millis(every / 2));
        for id in &ids {
            cmd.arg(id);
        }
        cmd.arg("JUSTID");
        if let Err(e) = cmd.query_async::<Value>(&mut shared.conn.clone()).await {
            tracing::warn!(stream = %shared.stream, error = %e, "keeping pending entries fresh failed");
        }
    }
}

/// What the background read task hands back: the reader and a batch.
type ReadOutcome = (Reader, Result<Vec<Ready>, SourceError>);

/// Consumes one stream in a consumer group (see the [module docs](self)).
pub struct RedisStreamSource {
    shared: Arc<Shared>,
    buffer: VecDeque<Ready>,
    reader: Option<Reader>,
    reading: Option<JoinHandle<ReadOutcome>>,
    retries: mpsc::UnboundedReceiver<Ready>,
    keeper: JoinHandle<()>,
}

impl std::fmt::Debug for RedisStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamSource")
            .field("stream", &self.shared.stream)
            .field("group", &self.shared.group)
            .field("consumer", &self.shared.consumer)
            .finish_non_exhaustive()
    }
}

impl RedisStreamSource {
    /// Connects, and creates the group (and the stream) if missing.
    pub async fn connect(config: RedisStreamConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let conn = connection(&config.redis_url, COMMAND_TIMEOUT).await?;
        let reader_conn = connection(&config.redis_url, config.block + COMMAND_TIMEOUT).await?;
        create_group(&conn, &config.stream, &config.group, &config.start).await?;
        let consumer = config
            .consumer
            .clone()
            .unwrap_or_else(default_consumer_name);
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            conn,
            stream: config.stream.clone(),
            group: config.group.clone(),
            consumer: consumer.clone(),
            claim_idle: config.claim_idle,
            dead_letter_stream: config.dead_letter_stream.clone(),
            held: Mutex::default(),
            retries: tx,
        });
        let keeper = tokio::spawn(keep_fresh(Arc::downgrade(&shared), config.claim_idle / 4));
        tracing::debug!(stream = %config.stream, group = %config.group, consumer = %consumer, "Redis Streams source connected");
        Ok(Self {
            reader: Some(Reader {
                conn: reader_conn,
                shared: Arc::clone(&shared),
                block: config.block,
                count: config.count,
                history: Some("0".into()),
                claim_cursor: "0-0".into(),
                next_claim: Instant::now(),
            }),
            shared,
            buffer: VecDeque::new(),
            reading: None,
            retries: rx,
            keeper,
        })
    }

    /// This consumer's name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.shared.consumer
    }

    fn delivery(&self, ready: Ready) -> Delivery {
        let (message, defect) = to_message(&ready.id, &ready.fields);
        let meta = DeliveryMeta {
            source: SOURCE_NAME.into(),
            topic: Some(self.shared.stream.clone()),
            partition: None,
            offset: None,
            delivery_count: ready.delivery_count.max(1),
        };
        let acker = RedisStreamAcker {
            shared: Arc::clone(&self.shared),
            entry: Some(ready),
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

async fn create_group(
    conn: &ConnectionManager,
    stream: &str,
    group: &str,
    start: &str,
) -> Result<(), SourceError> {
    let created = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg(start)
        .arg("MKSTREAM")
        .query_async::<Value>(&mut conn.clone())
        .await;
    match created {
        Ok(_) => {
            tracing::info!(stream, group, "created the consumer group");
            Ok(())
        }
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(()),
        Err(e) => Err(broker_error(&format!("XGROUP CREATE {stream} {group}"), e)),
    }
}

impl Drop for RedisStreamSource {
    /// Stops reading. Entries read but not handed out stay pending and come
    /// back through `XAUTOCLAIM` (or a restart under the same consumer name).
    fn drop(&mut self) {
        if let Some(task) = self.reading.take() {
            task.abort();
        }
        self.keeper.abort();
        let mut held = self.shared.held();
        for ready in self.buffer.drain(..) {
            held.remove(&ready.id);
        }
    }
}

#[async_trait]
impl Source for RedisStreamSource {
    /// The next delivery; never `None` (a stream does not end). Cancel-safe:
    /// a read in progress continues and is picked up by the next call.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            if let Some(ready) = self.buffer.pop_front() {
                return Ok(Some(self.delivery(ready)));
            }
            if let Ok(ready) = self.retries.try_recv() {
                return Ok(Some(self.delivery(ready)));
            }
            if self.reading.is_none() {
                let Some(reader) = self.reader.take() else {
                    return Err(SourceError::Other(
                        "the Redis Streams reader was lost".into(),
                    ));
                };
                self.reading = Some(tokio::spawn(reader.read()));
            }
            let Some(task) = self.reading.as_mut() else {
                continue;
            };
            tokio::select! {
                done = task => {
                    self.reading = None;
                    let (reader, batch) = done.map_err(|e| {
                        SourceError::Other(format!("the Redis Streams read task failed: {e}"))
                    })?;
                    self.reader = Some(reader);
                    self.buffer.extend(batch?);
                }
                Some(ready) = self.retries.recv() => {
                    return Ok(Some(self.delivery(ready)));
                }
            }
        }
    }
}

/// Maps entry fields to a [`Message`] (see the module docs); a defect when
/// the `payload` field is missing.
fn to_message(entry_id: &str, fields: &[(String, Vec<u8>)]) -> (Message, Option<InputError>) {
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

/// The fields [`RedisStreamPublisher`] writes for `message`.
fn to_fields(message: &Message) -> Vec<(String, Vec<u8>)> {
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

/// Settles one stream entry.
struct RedisStreamAcker {
    shared: Arc<Shared>,
    /// `None` once settled.
    entry: Option<Ready>,
}

impl Drop for RedisStreamAcker {
    /// Dropped unsettled: no longer kept fresh, so `XAUTOCLAIM` brings it back
    /// after `claim_idle`.
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.shared.release(&entry.id);
        }
    }
}

#[async_trait]
impl Acknowledger for RedisStreamAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(entry) = self.entry.take() else {
            return Ok(());
        };
        let result = self.shared.xack(&entry.id).await;
        // On failure the entry stays pending and is claimed again later.
        self.shared.release(&entry.id);
        result
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let Some(entry) = self.entry.take() else {
            return Ok(());
        };
        let shared = Arc::clone(&self.shared);
        // Held (kept fresh) until the delay is over, then claimed again.
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let ready = match shared.reclaim(&entry.id).await {
                Ok(Some(fresh)) => Ready {
                    id: entry.id,
                    fields: fresh.fields.unwrap_or(entry.fields),
                    delivery_count: entry.delivery_count.saturating_add(1),
                },
                Ok(None) => {
                    tracing::debug!(stream = %shared.stream, id = %entry.id, "a nacked entry is no longer pending");
                    shared.release(&entry.id);
                    return;
                }
                Err(e) => {
                    tracing::warn!(stream = %shared.stream, error = %e, "XCLAIM of a nacked entry failed; redelivering it anyway");
                    Ready {
                        delivery_count: entry.delivery_count.saturating_add(1),
                        ..entry
                    }
                }
            };
            let id = ready.id.clone();
            if shared.retries.send(ready).is_err() {
                // The source is gone: the entry stays pending for XAUTOCLAIM.
                shared.release(&id);
            }
        });
        Ok(())
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(entry) = self.entry.take() else {
            return Ok(());
        };
        let shared = Arc::clone(&self.shared);
        let result = match &shared.dead_letter_stream {
            Some(dlq) => {
                let mut pipe = redis::pipe();
                pipe.atomic();
                let xadd = pipe.cmd("XADD").arg(dlq).arg("*");
                for (name, value) in &entry.fields {
                    if name != REASON_FIELD {
                        xadd.arg(name).arg(value.as_slice());
                    }
                }
                xadd.arg(REASON_FIELD).arg(reason.code());
                pipe.cmd("XACK")
                    .arg(&shared.stream)
                    .arg(&shared.group)
                    .arg(&entry.id);
                pipe.query_async::<Value>(&mut shared.conn.clone())
                    .await
                    .map(|_| ())
                    .map_err(|e| broker_error(&format!("XADD to dead-letter stream {dlq}"), e))
            }
            None => shared.xack(&entry.id).await,
        };
        shared.release(&entry.id);
        result
    }
}

/// Publishes to one stream with `XADD` in the layout of the module docs
/// (`payload`, `id`, `key`, `h:<name>`).
pub struct RedisStreamPublisher {
    conn: ConnectionManager,
    stream: String,
}

impl std::fmt::Debug for RedisStreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamPublisher")
            .field("stream", &self.stream)
            .finish_non_exhaustive()
    }
}

impl RedisStreamPublisher {
    /// Connects to the Redis and stream of `config` (the group is not used).
    pub async fn connect(config: &RedisStreamConfig) -> Result<Self, SourceError> {
        Self::connect_to(&config.redis_url, &config.stream).await
    }

    /// Connects to `stream` on the Redis at `redis_url` (`redis://host:port[/db]`).
    pub async fn connect_to(redis_url: &str, stream: &str) -> Result<Self, SourceError> {
        if stream.is_empty() {
            return Err(config_error("the stream name is empty"));
        }
        Ok(Self {
            conn: connection(redis_url, COMMAND_TIMEOUT).await?,
            stream: stream.to_owned(),
        })
    }
}

#[async_trait]
impl Publisher for RedisStreamPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.stream).arg("*");
        for (name, value) in to_fields(message) {
            cmd.arg(name).arg(value);
        }
        cmd.query_async::<Value>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("XADD {}", self.stream), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::url::parse_duration;

    #[test]
    fn parses_urls() {
        let c = RedisStreamConfig::from_url(
            "redis-stream://127.0.0.1:6379/orders?group=g&consumer=c1&claim_idle=30s&block=500&count=5&dead_letter_stream=orders-dead&start=%24&db=2",
        )
        .unwrap();
        assert_eq!(c.redis_url, "redis://127.0.0.1:6379/2");
        assert_eq!(c.stream, "orders");
        assert_eq!(c.group, "g");
        assert_eq!(c.consumer.as_deref(), Some("c1"));
        assert_eq!(c.claim_idle, Duration::from_secs(30));
        assert_eq!(c.block, Duration::from_millis(500));
        assert_eq!(c.count, 5);
        assert_eq!(c.dead_letter_stream.as_deref(), Some("orders-dead"));
        assert_eq!(c.start, "$");

        let c =
            RedisStreamConfig::from_url("redis-stream://u:p@localhost:6379/a%3Ab?group=g").unwrap();
        assert_eq!(c.redis_url, "redis://u:p@localhost:6379");
        assert_eq!(c.stream, "a:b");
        assert_eq!(c.consumer, None);
        assert_eq!(c.claim_idle, Duration::from_secs(30));
        assert_ne!(default_consumer_name(), default_consumer_name());
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "redis://127.0.0.1/orders?group=g",
            "redis-stream://127.0.0.1:6379/orders",
            "redis-stream://127.0.0.1:6379/orders?group=",
            "redis-stream://127.0.0.1:6379?group=g",
            "redis-stream:///orders?group=g",
            "redis-stream://h/orders?group=g&claim_idle=10ms",
            "redis-stream://h/orders?group=g&claim_idle=3x",
            "redis-stream://h/orders?group=g&block=0",
            "redis-stream://h/orders?group=g&count=0",
            "redis-stream://h/orders?group=g&start=5",
            "redis-stream://h/orders?group=g&dead_letter_stream=orders",
            "redis-stream://h/orders?group=g&bogus=1",
        ] {
            assert!(
                matches!(
                    RedisStreamConfig::from_url(url),
                    Err(SourceError::Config(_))
                ),
                "{url} should be rejected"
            );
        }
    }

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

    #[test]
    fn parses_durations() {
        // Redis Streams keeps its own rule: a bare number is milliseconds.
        let parse_duration = |name, value| parse_duration(name, value, Bare::Millis);
        assert_eq!(
            parse_duration("x", "250").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_duration("x", "2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("x", "3m").unwrap(), Duration::from_secs(180));
        assert!(parse_duration("x", "s").is_err());
        assert!(parse_duration("x", "1.5s").is_err());
    }
}
