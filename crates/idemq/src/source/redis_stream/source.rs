//! The consumer-group source: [`RedisStreamSource`] and its
//! `XREADGROUP`/`XAUTOCLAIM` receive loop.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::ConnectionManager;
use redis::{RedisError, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::acker::{Held, RedisStreamAcker};
use super::config::{default_consumer_name, RedisStreamConfig};
use super::conn::{broker_error, connection, is_transient, millis, COMMAND_TIMEOUT};
use super::entry::to_message;
use super::lag::{read_state, LagPoller};
use super::limits::{self, GroupState, StreamState, Watch};
use super::pending::{keep_fresh, Ready, Shared};
use super::reply::{parse_autoclaim, parse_read, Entry};
use crate::error::SourceError;
use crate::message::DeliveryMeta;
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

/// The source's name in [`DeliveryMeta::source`] and the lag gauge's labels.
pub(super) const SOURCE_NAME: &str = "redis-stream";
/// Pause after a transient failure before reading again.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

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

/// What the background read task hands back: the reader and a batch.
type ReadOutcome = (Reader, Result<Vec<Ready>, SourceError>);

/// Consumes one stream in a consumer group (see the [module docs](super)).
pub struct RedisStreamSource {
    shared: Arc<Shared>,
    buffer: VecDeque<Ready>,
    reader: Option<Reader>,
    reading: Option<JoinHandle<ReadOutcome>>,
    retries: mpsc::UnboundedReceiver<Ready>,
    keeper: JoinHandle<()>,
    /// Reads the group's lag in the background (stopped with the source).
    _lag: Option<LagPoller>,
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
    /// Connects, and creates the group (and the stream) if missing. Fails
    /// (a config error) when entries above the group's last delivered id
    /// were removed before it read them, unless
    /// [`broker_loss`](RedisStreamConfig::broker_loss) is
    /// [`LossPolicy::Warn`](crate::source::loss::LossPolicy::Warn) (see the
    /// [module docs](super)).
    pub async fn connect(config: RedisStreamConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let conn = connection(&config.redis_url, COMMAND_TIMEOUT).await?;
        let reader_conn = connection(&config.redis_url, config.block + COMMAND_TIMEOUT).await?;
        let created = create_group(&conn, &config.stream, &config.group, &config.start).await?;
        let watch = check_losses(&conn, &config, created).await?;
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
        let lag = LagPoller::start(
            shared.conn.clone(),
            config.stream.clone(),
            config.group.clone(),
            config.lag_interval,
            watch,
        );
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
            _lag: lag,
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
            held: Unsettled::new(Held {
                shared: Arc::clone(&self.shared),
                entry: ready,
            }),
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

/// Creates the group unless it exists, where [`limits::creation`] says
/// (entries trimmed before it existed are not its loss); whether it created it.
async fn create_group(
    conn: &ConnectionManager,
    stream: &str,
    group: &str,
    start: &str,
) -> Result<bool, SourceError> {
    // No stream yet (or another error, which XGROUP CREATE reports): the
    // group starts at `start`.
    let state = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async::<Value>(&mut conn.clone())
        .await
        .ok()
        .and_then(StreamState::parse);
    let at = limits::creation(start, state.as_ref());
    let mut create = redis::cmd("XGROUP");
    create
        .arg("CREATE")
        .arg(stream)
        .arg(group)
        .arg(&at.id)
        .arg("MKSTREAM");
    if let Some(n) = at.entries_read {
        create.arg("ENTRIESREAD").arg(n);
    }
    match create.query_async::<Value>(&mut conn.clone()).await {
        Ok(_) => {
            tracing::info!(stream, group, id = %at.id, "created the consumer group");
            Ok(true)
        }
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(false),
        Err(e) => Err(broker_error(&format!("XGROUP CREATE {stream} {group}"), e)),
    }
}

/// Looks for entries removed before the group read them and applies
/// [`RedisStreamConfig::broker_loss`] to them, unless this source just
/// created the group (what was removed before is not its loss). What it
/// found is where the lag poller's [`Watch`] starts; `None` before Redis 7.
async fn check_losses(
    conn: &ConnectionManager,
    config: &RedisStreamConfig,
    created: bool,
) -> Result<Option<Watch>, SourceError> {
    let state = read_state(&mut conn.clone(), &config.stream, &config.group).await?;
    let (Some(stream), Some(group)) = (state.stream, GroupState::from_info(&state.group)) else {
        tracing::debug!(stream = %config.stream, "XINFO STREAM tells no max-deleted-entry-id or entries-added (Redis before 7): removed entries are not checked");
        return Ok(None);
    };
    let losses = limits::unread_losses(&stream, &group);
    if created {
        for loss in &losses {
            tracing::debug!(stream = %config.stream, group = %config.group, "before the group was created: {loss}");
        }
    } else {
        let risks = limits::risks(&config.stream, &config.group, &losses);
        config.broker_loss.apply("Redis Streams", &risks)?;
    }
    Ok(Some(Watch::new(&stream, &group)))
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
                    return Err(SourceError::other("the Redis Streams reader was lost"));
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
                        SourceError::other(format!("the Redis Streams read task failed: {e}"))
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
