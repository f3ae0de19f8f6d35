//! NATS JetStream: a [`Source`] over a durable pull consumer and a
//! [`Publisher`], with `async-nats`.
//!
//! # How JetStream redelivers, and how this source maps it
//!
//! A JetStream *stream* stores the messages published to its subjects; a
//! durable *consumer* on it remembers, on the server, which messages were
//! acknowledged. With the explicit ack policy every delivered message must be
//! acked within the consumer's `ack_wait`, or the server delivers it again,
//! to this or to any other client pulling from the same consumer, with a
//! higher delivery count. A consumer that crashes therefore loses nothing:
//! its unacked messages come back after `ack_wait`. That is at-least-once
//! delivery, and the inbox turns it into exactly-once effects.
//!
//! - **Pull**: batches of up to `batch` messages with a pull request that
//!   expires after `wait`, in a background task so that [`Source::next`] is
//!   cancel-safe; the next pull is requested when the previous one ended.
//!   Several sources on the same durable consumer compete for its messages.
//! - **Delivery count**: the `delivered` count of the message metadata (its
//!   `$JS.ACK…` reply subject) becomes [`DeliveryMeta::delivery_count`], which
//!   the engine uses for poison accounting (`RetryPolicy::max_deliveries`).
//!   The consumer's `max_deliver` is the server's own limit: after that many
//!   deliveries the server stops redelivering the message *without telling
//!   the consumer*, so set the engine's limits (`max_attempts`,
//!   `max_deliveries`) below it for the engine to dead-letter first.
//! - **Ack** (after the inbox commit): `+ACK`, waiting for the server's
//!   confirmation ("double ack"), so an ack that got lost is reported.
//! - **Nack(delay)** (retry later): `-NAK` with the delay, so the server
//!   redelivers the message after the delay and not at once.
//! - **In progress**: from the moment a message is received until it is
//!   settled (or its delivery is dropped), a background task sends `+WPI`
//!   ("work in progress") every third of `ack_wait`, which restarts the
//!   server's ack timer, so a slow handler does not let a competing client
//!   receive the same message. A delivery dropped unsettled (the consumer
//!   crashed or was cancelled) stops this and comes back after `ack_wait`.
//! - **Dead-letter**: with a dead-letter subject configured (`dlq_subject=`),
//!   a copy with the original payload and headers plus the header
//!   [`REASON_HEADER`] (the [`DeadLetterReason::code`]) is published there
//!   with JetStream (a stream must capture that subject; with `create=true` a
//!   stream `<STREAM>_dlq` is created for it if none does), then the original
//!   is terminated (`+TERM`), so it is never redelivered. Without a
//!   dead-letter subject it is just terminated (the inbox's dead-letter table
//!   keeps it).
//! - **Duplicates at the broker**: [`NatsPublisher`] sets `Nats-Msg-Id` to
//!   [`Message::id`], so JetStream itself drops a republish of the same id
//!   within the stream's duplicate window (2 minutes by default); the inbox
//!   catches the rest (redeliveries, producer retries with a new id, copies
//!   outside the window).
//!
//! # Message mapping
//!
//! The payload is the NATS payload. [`Message::id`] is the header
//! `Nats-Msg-Id` ([`ID_HEADER`]); [`Message::key`] is the header `idemq-key`
//! ([`KEY_HEADER`]) if present, else none; every other header becomes a
//! header (NATS headers are text; several values of one name become several
//! headers, names in sorted order). [`DeliveryMeta`] has source `nats`, the
//! message's subject as topic, and its stream sequence as offset.
//! [`NatsPublisher`] writes the same headers.
//!
//! # Configuration
//!
//! `nats://[user:password@]host:4222/STREAM/CONSUMER?subject=orders.>&ack_wait=30s&max_deliver=10&batch=10&wait=5s&dlq_subject=orders.dead&duplicate_window=2m&create=true`
//! (see [`NatsConfig::from_url`]).
//!
//! ```no_run
//! use idemq::source::nats::{NatsConfig, NatsPublisher, NatsSource};
//! use idemq::source::Publisher;
//! use idemq::{Consumer, KeySpec, Message};
//! use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = NatsConfig::from_url(
//!     "nats://127.0.0.1:4222/PAYMENTS/ledger?subject=payments.new&ack_wait=30s&create=true",
//! )?;
//! let publisher = NatsPublisher::connect(config.clone()).await?;
//! publisher
//!     .publish(&Message::new(r#"{"payment_id":"p-1","amount":5}"#).with_id("m-1"))
//!     .await?;
//!
//! let store = SqliteStore::connect("sqlite://ledger.db").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("ledger", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(|_ctx, _tx| Box::pin(async move { Ok(None) }))
//!     .build()?;
//! // A JetStream consumer never ends: run until Ctrl-C.
//! let source = NatsSource::connect(config).await?;
//! let summary = consumer
//!     .run_until(source, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;
use async_trait::async_trait;
use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::url::{redact, Bare, BrokerUrl};
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::SourceError;
use crate::message::{DeliveryMeta, Message};
use crate::store::DeadLetterReason;

/// The header that carries [`Message::id`] (JetStream's own deduplication id).
pub const ID_HEADER: &str = "Nats-Msg-Id";
/// The header that carries [`Message::key`].
pub const KEY_HEADER: &str = "idemq-key";
/// The header added to copies published to the dead-letter subject.
pub const REASON_HEADER: &str = "idemq-dead-letter-reason";

/// How long settling waits for an in-progress ack being sent.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// The pause after a pull request failed, before the next one.
const PULL_RETRY_PAUSE: Duration = Duration::from_secs(1);
const MAX_BATCH: usize = 10_000;

/// Where and how to consume a JetStream stream. Build it with
/// [`NatsConfig::new`] and the builder methods, or parse a URL with
/// [`NatsConfig::from_url`].
#[derive(Clone)]
pub struct NatsConfig {
    /// The server URL, e.g. `nats://127.0.0.1:4222` (credentials may be in it).
    pub server: String,
    /// The stream name.
    pub stream: String,
    /// The durable consumer name.
    pub consumer: String,
    /// The subject: the stream's subject when it is created, the consumer's
    /// filter subject, and the subject [`NatsPublisher`] publishes to (which
    /// must then be free of wildcards).
    pub subject: Option<String>,
    /// How long the server waits for an ack before redelivering; while a
    /// delivery is unsettled it is extended every third of this (≥ 1 s).
    pub ack_wait: Duration,
    /// The server's delivery limit per message (`None`: unlimited).
    pub max_deliver: Option<i64>,
    /// Messages per pull request (1 ..= 10000).
    pub batch: usize,
    /// How long a pull request waits for messages (≥ 100 ms).
    pub wait: Duration,
    /// The subject that dead-lettered messages are copied to.
    pub dead_letter_subject: Option<String>,
    /// The duplicate window of a stream this creates (at least 100 ms;
    /// `None`: the server's default of 2 minutes).
    pub duplicate_window: Option<Duration>,
    /// Create the stream (and the consumer, and a dead-letter stream) if missing.
    pub create: bool,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("server", &redact(&self.server))
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("subject", &self.subject)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("batch", &self.batch)
            .field("wait", &self.wait)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("duplicate_window", &self.duplicate_window)
            .field("create", &self.create)
            .finish()
    }
}

impl NatsConfig {
    /// Defaults for `stream` and `consumer` on `nats://127.0.0.1:4222`: no
    /// subject, 30 s `ack_wait`, unlimited deliveries, 10 messages per pull
    /// waiting up to 5 s, no dead-letter subject, nothing created.
    pub fn new(stream: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            server: "nats://127.0.0.1:4222".into(),
            stream: stream.into(),
            consumer: consumer.into(),
            subject: None,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            batch: 10,
            wait: Duration::from_secs(5),
            dead_letter_subject: None,
            duplicate_window: None,
            create: false,
        }
    }

    /// Parses
    /// `nats://[user:password@]host:port/STREAM/CONSUMER?subject=…&ack_wait=30s&max_deliver=10&batch=10&wait=5s&dlq_subject=…&duplicate_window=2m&create=true`.
    ///
    /// Durations are a number with `ms`, `s`, `m` or `h` (a bare number is
    /// seconds). Values may be percent-encoded (`orders.%3E` for `orders.>`;
    /// a plain `>` works too). Unknown parameters and out-of-range values are
    /// a [`SourceError::Config`].
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("NATS", "nats", url)?;
        u.host_list()?;
        let path = u.require_path("STREAM/CONSUMER")?;
        let [stream, consumer]: [String; 2] = u
            .segments()?
            .try_into()
            .map_err(|_| u.error(format!("the path {path:?} must be STREAM/CONSUMER")))?;
        let mut config = NatsConfig::new(stream, consumer);
        config.server = format!("nats://{}", u.authority);
        for p in u.params() {
            match p.name.as_str() {
                "subject" => config.subject = p.non_empty(),
                "ack_wait" => config.ack_wait = p.duration(Bare::Seconds)?,
                "max_deliver" => {
                    config.max_deliver = match p.value.as_str() {
                        "-1" => None,
                        _ => match p.count::<i64>()? {
                            0 => {
                                return Err(
                                    p.error("max_deliver must be at least 1 (or -1 for unlimited)")
                                )
                            }
                            n => Some(n),
                        },
                    }
                }
                "batch" => config.batch = p.count()?,
                "wait" => config.wait = p.duration(Bare::Seconds)?,
                "dlq_subject" => config.dead_letter_subject = p.non_empty(),
                "duplicate_window" => config.duplicate_window = Some(p.duration(Bare::Seconds)?),
                "create" => config.create = p.flag()?,
                _ => return Err(p.unknown()),
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the server URL.
    pub fn server(mut self, server: impl Into<String>) -> Self {
        self.server = server.into();
        self
    }

    /// Sets the subject.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets `ack_wait`.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets the server's delivery limit per message.
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = Some(max_deliver);
        self
    }

    /// Sets the messages per pull request.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// Sets how long a pull request waits for messages.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the dead-letter subject.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Sets the duplicate window of a stream this creates.
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = Some(window);
        self
    }

    /// Whether to create a missing stream, consumer and dead-letter stream.
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if !self.server.starts_with("nats://") && !self.server.starts_with("tls://") {
            return Err(config_error(format!(
                "server {:?} must start with nats:// or tls://",
                redact(&self.server)
            )));
        }
        validate_name("stream", &self.stream)?;
        validate_name("consumer", &self.consumer)?;
        if let Some(subject) = &self.subject {
            validate_subject(subject, true)?;
        } else if self.create {
            return Err(config_error(
                "creating the stream needs a subject (?subject=…)",
            ));
        }
        if let Some(subject) = &self.dead_letter_subject {
            validate_subject(subject, false)?;
            if self
                .subject
                .as_deref()
                .is_some_and(|s| subject_matches(s, subject))
            {
                return Err(config_error(format!(
                    "the dead-letter subject {subject:?} is inside the consumed subject"
                )));
            }
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(config_error(format!(
                "ack_wait must be at least 1 s, not {:?}",
                self.ack_wait
            )));
        }
        if let Some(n) = self.max_deliver {
            if n == 0 || n < -1 {
                return Err(config_error(
                    "max_deliver must be at least 1 (or -1 for unlimited)",
                ));
            }
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(config_error(format!(
                "batch must be from 1 to {MAX_BATCH}, not {}",
                self.batch
            )));
        }
        if self.wait < Duration::from_millis(100) {
            return Err(config_error(format!(
                "wait must be at least 100 ms, not {:?}",
                self.wait
            )));
        }
        if self
            .duplicate_window
            .is_some_and(|w| w < Duration::from_millis(100))
        {
            return Err(config_error(
                "duplicate_window must be at least 100 ms (the server's minimum)",
            ));
        }
        Ok(())
    }

    /// Connects to the server and returns a JetStream context.
    pub async fn jetstream(&self) -> Result<jetstream::Context, SourceError> {
        self.validate()?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(10))
            .connect(self.server.as_str())
            .await
            .map_err(|e| broker_error(&format!("connecting to {}", redact(&self.server)), e))?;
        Ok(jetstream::new(client))
    }

    /// Gets the stream, creating it (subjects: the subject) with `create`.
    async fn stream(
        &self,
        js: &jetstream::Context,
    ) -> Result<jetstream::stream::Stream, SourceError> {
        if self.create {
            let Some(subject) = &self.subject else {
                return Err(config_error("creating the stream needs a subject"));
            };
            let config = jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![subject.clone()],
                duplicate_window: self.duplicate_window.unwrap_or_default(),
                ..Default::default()
            };
            js.get_or_create_stream(config)
                .await
                .map_err(|e| broker_error(&format!("creating the stream {}", self.stream), e))
        } else {
            js.get_stream(&self.stream)
                .await
                .map_err(|e| broker_error(&format!("getting the stream {}", self.stream), e))
        }
    }

    /// With `create` and a dead-letter subject that no stream captures,
    /// creates the stream `<STREAM>_dlq` for it.
    async fn dead_letter_stream(&self, js: &jetstream::Context) -> Result<(), SourceError> {
        let (true, Some(subject)) = (self.create, &self.dead_letter_subject) else {
            return Ok(());
        };
        if js.stream_by_subject(subject.clone()).await.is_ok() {
            return Ok(());
        }
        let name = format!("{}_dlq", self.stream);
        tracing::info!(stream = %name, subject = %subject, "creating the NATS dead-letter stream");
        js.get_or_create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| broker_error(&format!("creating the dead-letter stream {name}"), e))
    }
}

fn config_error(text: impl Into<String>) -> SourceError {
    SourceError::Config(text.into())
}

fn broker_error(what: &str, err: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(format!("NATS {what}: {err}"))
}

/// Stream and consumer names: 1 to 255 printable characters without
/// whitespace, `.`, `*`, `>`, `/` or `\`.
fn validate_name(what: &str, name: &str) -> Result<(), SourceError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && !".*>/\\".contains(c));
    if ok {
        Ok(())
    } else {
        Err(config_error(format!(
            "invalid NATS {what} name {name:?}: no whitespace, '.', '*', '>', '/' or '\\'"
        )))
    }
}

/// A subject: dot-separated non-empty tokens without whitespace; with
/// `wildcards`, `*` as a whole token and `>` as the whole last token.
fn validate_subject(subject: &str, wildcards: bool) -> Result<(), SourceError> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let last = tokens.len() - 1;
    let ok = tokens.iter().enumerate().all(|(i, t)| {
        let plain = !t.is_empty()
            && t.chars()
                .all(|c| !c.is_whitespace() && !c.is_control() && c != '*' && c != '>');
        plain || (wildcards && (*t == "*" || (*t == ">" && i == last)))
    });
    if ok {
        Ok(())
    } else if wildcards {
        Err(config_error(format!(
            "invalid NATS subject {subject:?}: dot-separated tokens, '*' a whole token, '>' the last one"
        )))
    } else {
        Err(config_error(format!(
            "invalid NATS subject {subject:?}: dot-separated tokens without wildcards"
        )))
    }
}

fn has_wildcards(subject: &str) -> bool {
    subject.split('.').any(|t| t == "*" || t == ">")
}

/// Whether the concrete `subject` matches `filter` (which may have wildcards).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut filter = filter.split('.');
    let mut subject = subject.split('.');
    loop {
        match (filter.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(f), Some(s)) if f == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Everything the source, its pull task and its acknowledgers share.
struct Shared {
    js: jetstream::Context,
    consumer: PullConsumer,
    stream: String,
    ack_wait: Duration,
    batch: usize,
    wait: Duration,
    dead_letter_subject: Option<String>,
    /// Messages pulled but not handed out yet, each kept in progress.
    buffer: Mutex<VecDeque<Received>>,
    /// Signalled when a pulled message was buffered.
    arrived: Notify,
}

impl Shared {
    fn buffer(&self) -> MutexGuard<'_, VecDeque<Received>> {
        self.buffer.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A pulled message whose ack timer is kept restarted until it is settled.
struct Received {
    message: jetstream::Message,
    progress: Progress,
}

/// Sends `+WPI` for one message every third of `ack_wait` until stopped or dropped.
struct Progress {
    stopped: Arc<tokio::sync::Mutex<bool>>,
    task: JoinHandle<()>,
}

impl Progress {
    fn start(message: jetstream::Message, ack_wait: Duration) -> Self {
        let stopped = Arc::new(tokio::sync::Mutex::new(false));
        let task = tokio::spawn(keep_in_progress(message, ack_wait, Arc::clone(&stopped)));
        Self { stopped, task }
    }

    /// Stops; once this returns no `+WPI` is sent any more (one being sent
    /// has been handed to the connection), so the settling ack comes after it.
    async fn stop(&self) {
        match tokio::time::timeout(STOP_WAIT, self.stopped.lock()).await {
            Ok(mut stopped) => *stopped = true,
            Err(_) => tracing::warn!("an in-progress ack is still being sent; settling anyway"),
        }
        self.task.abort();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep_in_progress(
    message: jetstream::Message,
    ack_wait: Duration,
    stopped: Arc<tokio::sync::Mutex<bool>>,
) {
    let every = ack_wait / 3;
    loop {
        tokio::time::sleep(every).await;
        let guard = stopped.lock().await;
        if *guard {
            return;
        }
        match message.ack_with(AckKind::Progress).await {
            Ok(()) => tracing::trace!(subject = %message.subject, "in-progress ack sent"),
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "sending an in-progress ack failed")
            }
        }
        drop(guard);
    }
}

/// One pull request: buffers each message as it arrives, with its progress started.
async fn pull(shared: Arc<Shared>, room: usize) -> Result<(), SourceError> {
    let mut batch = shared
        .consumer
        .batch()
        .max_messages(room)
        .expires(shared.wait)
        .messages()
        .await
        .map_err(|e| broker_error(&format!("pull request on {}", shared.stream), e))?;
    while let Some(item) = batch.next().await {
        match item {
            Ok(message) => {
                let progress = Progress::start(message.clone(), shared.ack_wait);
                shared.buffer().push_back(Received { message, progress });
                shared.arrived.notify_one();
            }
            Err(e) => {
                // A status such as 409 (leadership change, limits): pull again shortly.
                tracing::warn!(stream = %shared.stream, error = %e, "the pull request ended with an error");
                tokio::time::sleep(PULL_RETRY_PAUSE).await;
                break;
            }
        }
    }
    Ok(())
}

/// Consumes a durable JetStream pull consumer (see the [module docs](self)).
pub struct NatsSource {
    shared: Arc<Shared>,
    pulling: Option<JoinHandle<Result<(), SourceError>>>,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("stream", &self.shared.stream)
            .field("ack_wait", &self.shared.ack_wait)
            .field("dead_letter_subject", &self.shared.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsSource {
    /// Connects and gets the stream and the durable consumer, creating them
    /// (explicit acks, `ack_wait`, `max_deliver`, the subject as filter) and
    /// a dead-letter stream if [`NatsConfig::create`] is set. An existing
    /// consumer is used with its own settings, except `ack_wait`, which must match.
    pub async fn connect(config: NatsConfig) -> Result<Self, SourceError> {
        let js = config.jetstream().await?;
        let stream = config.stream(&js).await?;
        let consumer_config = pull::Config {
            durable_name: Some(config.consumer.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver.unwrap_or(-1),
            filter_subject: config.subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        let consumer: PullConsumer = if config.create {
            stream
                .get_or_create_consumer(&config.consumer, consumer_config)
                .await
                .map_err(|e| {
                    broker_error(&format!("creating the consumer {}", config.consumer), e)
                })?
        } else {
            stream.get_consumer(&config.consumer).await.map_err(|e| {
                broker_error(&format!("getting the consumer {}", config.consumer), e)
            })?
        };
        let ack_wait = consumer.cached_info().config.ack_wait;
        if !ack_wait.is_zero() && ack_wait != config.ack_wait {
            return Err(config_error(format!(
                "the consumer {} has ack_wait {ack_wait:?}, not the configured {:?}",
                config.consumer, config.ack_wait
            )));
        }
        config.dead_letter_stream(&js).await?;
        tracing::debug!(stream = %config.stream, consumer = %config.consumer, "NATS source connected");
        Ok(Self {
            shared: Arc::new(Shared {
                js,
                consumer,
                stream: config.stream,
                ack_wait: config.ack_wait,
                batch: config.batch,
                wait: config.wait,
                dead_letter_subject: config.dead_letter_subject,
                buffer: Mutex::default(),
                arrived: Notify::new(),
            }),
            pulling: None,
        })
    }

    fn delivery(&self, received: Received) -> Delivery {
        let Received { message, progress } = received;
        let (delivery_count, offset) = match message.info() {
            Ok(info) => (
                u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1),
                i64::try_from(info.stream_sequence).ok(),
            ),
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "no JetStream metadata");
                (1, None)
            }
        };
        let meta = DeliveryMeta {
            source: "nats".into(),
            topic: Some(message.subject.to_string()),
            partition: None,
            offset,
            delivery_count,
        };
        let acker = NatsAcker {
            shared: Arc::clone(&self.shared),
            progress: Some(progress),
            message: message.clone(),
        };
        Delivery::new(to_message(&message), meta, Box::new(acker))
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        if let Some(task) = self.pulling.take() {
            task.abort();
        }
        // Messages pulled but never handed out go back at once.
        let buffered: Vec<Received> = self.shared.buffer().drain(..).collect();
        if buffered.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // they come back after ack_wait
        };
        runtime.spawn(async move {
            for received in buffered {
                received.progress.stop().await;
                if let Err(e) = received.message.ack_with(AckKind::Nak(None)).await {
                    tracing::debug!(error = %e, "releasing a buffered message failed");
                }
            }
        });
    }
}

#[async_trait]
impl Source for NatsSource {
    /// The next delivery; never `None` (a JetStream consumer does not end).
    /// Cancel-safe: a pull in progress continues and is picked up by the next call.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let shared = Arc::clone(&self.shared);
            let arrived = shared.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let received = shared.buffer().pop_front();
            if let Some(received) = received {
                return Ok(Some(self.delivery(received)));
            }
            let task = self
                .pulling
                .get_or_insert_with(|| tokio::spawn(pull(Arc::clone(&shared), shared.batch)));
            tokio::select! {
                done = task => {
                    self.pulling = None;
                    match done {
                        Ok(result) => result?,
                        Err(e) => return Err(SourceError::Other(format!("the NATS pull task failed: {e}"))),
                    }
                }
                _ = &mut arrived => {}
            }
        }
    }
}

/// Maps a JetStream message to a [`Message`] (see the module docs).
fn to_message(raw: &async_nats::Message) -> Message {
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
fn to_headers(message: &Message) -> Result<HeaderMap, SourceError> {
    let mut headers = HeaderMap::new();
    let mut add = |name: &str, value: &[u8]| -> Result<(), SourceError> {
        let header = HeaderName::from_str(name)
            .map_err(|_| SourceError::Other(format!("{name:?} cannot be a NATS header name")))?;
        let text = std::str::from_utf8(value).map_err(|_| {
            SourceError::Other(format!("header {name:?}: NATS header values are text"))
        })?;
        let value = HeaderValue::from_str(text).map_err(|_| {
            SourceError::Other(format!(
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

/// Publishes with JetStream and waits for the stream's ack.
async fn publish_and_wait(
    js: &jetstream::Context,
    subject: &str,
    headers: HeaderMap,
    payload: Vec<u8>,
) -> Result<jetstream::publish::PublishAck, SourceError> {
    let ack = js
        .send_publish(
            subject.to_owned(),
            PublishMessage::build()
                .payload(payload.into())
                .headers(headers),
        )
        .await
        .map_err(|e| publish_error(subject, e))?;
    ack.await.map_err(|e| publish_error(subject, e))
}

fn publish_error(subject: &str, e: async_nats::jetstream::context::PublishError) -> SourceError {
    if e.kind() == PublishErrorKind::StreamNotFound {
        broker_error(
            &format!("publishing to {subject}"),
            "no stream captures this subject",
        )
    } else {
        broker_error(&format!("publishing to {subject}"), e)
    }
}

/// Settles one JetStream delivery.
struct NatsAcker {
    shared: Arc<Shared>,
    progress: Option<Progress>,
    message: jetstream::Message,
}

impl NatsAcker {
    /// Stops the in-progress acks; `false` if already settled.
    async fn stop(&mut self) -> bool {
        match self.progress.take() {
            Some(progress) => {
                progress.stop().await;
                true
            }
            None => false,
        }
    }

    /// Sends `kind` and waits for the server's confirmation.
    async fn settle(&self, kind: AckKind) -> Result<(), SourceError> {
        self.message
            .double_ack_with(kind)
            .await
            .map_err(|e| broker_error(&format!("{kind:?} on {}", self.shared.stream), e))
    }
}

#[async_trait]
impl Acknowledger for NatsAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        self.settle(AckKind::Ack).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        let delay = Some(delay).filter(|d| !d.is_zero());
        self.settle(AckKind::Nak(delay)).await
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        if !self.stop().await {
            return Ok(());
        }
        if let Some(subject) = &self.shared.dead_letter_subject {
            let mut headers = self.message.headers.clone().unwrap_or_default();
            headers.insert(REASON_HEADER, reason.code());
            // On failure it is not terminated: the message comes back after ack_wait.
            publish_and_wait(
                &self.shared.js,
                subject,
                headers,
                self.message.payload.to_vec(),
            )
            .await?;
        }
        self.settle(AckKind::Term).await
    }
}

/// Publishes to a JetStream subject and waits for the stream's ack.
///
/// [`Message::id`] goes to the header `Nats-Msg-Id` (so JetStream drops a
/// republish of the same id within the stream's duplicate window),
/// [`Message::key`] to `idemq-key`, every header to a NATS header of its
/// name. NATS headers are text: a header that is not UTF-8 or has a line
/// break is refused with a [`SourceError::Other`] before anything is sent.
pub struct NatsPublisher {
    js: jetstream::Context,
    subject: String,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

impl NatsPublisher {
    /// Connects; publishes to [`NatsConfig::subject`], which must be free of
    /// wildcards. With [`NatsConfig::create`] the stream is created if missing.
    pub async fn connect(config: NatsConfig) -> Result<Self, SourceError> {
        let subject = config
            .subject
            .clone()
            .ok_or_else(|| config_error("publishing needs a subject (?subject=…)"))?;
        if has_wildcards(&subject) {
            return Err(config_error(format!(
                "cannot publish to the wildcard subject {subject:?}"
            )));
        }
        let js = config.jetstream().await?;
        if config.create {
            config.stream(&js).await?;
        }
        Ok(Self { js, subject })
    }

    /// Publishes to `subject` instead (no wildcards).
    pub fn with_subject(mut self, subject: impl Into<String>) -> Result<Self, SourceError> {
        let subject = subject.into();
        validate_subject(&subject, false)?;
        self.subject = subject;
        Ok(self)
    }

    /// The subject it publishes to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The JetStream context (for stream administration).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let headers = to_headers(message)?;
        let ack =
            publish_and_wait(&self.js, &self.subject, headers, message.payload.clone()).await?;
        if ack.duplicate {
            tracing::debug!(subject = %self.subject, id = ?message.id, "JetStream dropped a duplicate Nats-Msg-Id");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::url::parse_duration;

    #[test]
    fn parses_urls() {
        let c = NatsConfig::from_url(
            "nats://127.0.0.1:4222/ORDERS/billing?subject=orders.>&ack_wait=2s&max_deliver=5&batch=4&wait=500ms&dlq_subject=dead.orders&duplicate_window=1m&create=true",
        )
        .unwrap();
        assert_eq!(c.server, "nats://127.0.0.1:4222");
        assert_eq!(c.stream, "ORDERS");
        assert_eq!(c.consumer, "billing");
        assert_eq!(c.subject.as_deref(), Some("orders.>"));
        assert_eq!(c.ack_wait, Duration::from_secs(2));
        assert_eq!(c.max_deliver, Some(5));
        assert_eq!(c.batch, 4);
        assert_eq!(c.wait, Duration::from_millis(500));
        assert_eq!(c.dead_letter_subject.as_deref(), Some("dead.orders"));
        assert_eq!(c.duplicate_window, Some(Duration::from_secs(60)));
        assert!(c.create);

        let c = NatsConfig::from_url("nats://u:p@nats.local/S/C/?subject=a.%3E&max_deliver=-1")
            .unwrap();
        assert_eq!(c.server, "nats://u:p@nats.local");
        assert_eq!(c.subject.as_deref(), Some("a.>"));
        assert_eq!(c.max_deliver, None);
        assert_eq!(c.ack_wait, Duration::from_secs(30));
        assert!(!c.create);
        assert!(!format!("{c:?}").contains("u:p"));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://x/S/C",
            "nats://127.0.0.1:4222",
            "nats://127.0.0.1:4222/S",
            "nats://127.0.0.1:4222/S/C/D",
            "nats:///S/C",
            "nats://h/S.x/C",
            "nats://h/S/C?create=true",
            "nats://h/S/C?subject=a..b",
            "nats://h/S/C?subject=a.>.b",
            "nats://h/S/C?subject=a&ack_wait=500ms",
            "nats://h/S/C?subject=a&ack_wait=abc",
            "nats://h/S/C?subject=a&max_deliver=0",
            "nats://h/S/C?subject=a&batch=0",
            "nats://h/S/C?subject=a&wait=10ms",
            "nats://h/S/C?subject=a.>&dlq_subject=a.dead",
            "nats://h/S/C?subject=a&dlq_subject=dead.*",
            "nats://h/S/C?subject=a&duplicate_window=50ms",
            "nats://h/S/C?subject=a&bogus=1",
            "nats://h/S/C?subject=a&create=maybe",
        ] {
            assert!(
                matches!(NatsConfig::from_url(url), Err(SourceError::Config(_))),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn durations() {
        // NATS durations: a bare number is seconds (the common rule).
        let parse_duration = |name, value| parse_duration(name, value, Bare::Seconds);
        assert_eq!(
            parse_duration("x", "250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_duration("x", "3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("x", "2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            parse_duration("x", "1h").unwrap(),
            Duration::from_secs(3600)
        );
        assert_eq!(
            parse_duration("x", "1d").unwrap(),
            Duration::from_secs(86_400)
        );
        assert!(parse_duration("x", "1y").is_err());
        assert!(parse_duration("x", "s").is_err());
    }

    #[test]
    fn subjects_match() {
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(!subject_matches("a.b", "a"));
        assert!(subject_matches("a.b", "a.b"));
    }

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
            Err(SourceError::Other(_))
        ));
        assert!(matches!(
            to_headers(&Message::new("{}").with_header("x", "a\r\nb")),
            Err(SourceError::Other(_))
        ));
        assert!(matches!(
            to_headers(&Message::new("{}").with_header("bad:name", "v")),
            Err(SourceError::Other(_))
        ));
    }
}
