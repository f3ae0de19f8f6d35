//! Apache RocketMQ: a push-consumer source and a publisher, over
//! `rocketmq-client-rust` 1.0.
//!
//! # RocketMQ's redelivery model
//!
//! A topic has several *queues* (4 by default). The members of a consumer
//! group (clustering mode) share the queues among themselves; the client
//! pulls messages and keeps, per queue, a *consumer offset* that it persists
//! to the broker every few seconds and on shutdown. For a concurrently
//! consumed message the application answers either `ConsumeSuccess` or
//! `ReconsumeLater`. On `ReconsumeLater` the client sends the message back
//! to the broker, which stores a copy in the group's retry topic
//! (`%RETRY%<group>`) with `reconsume_times + 1` and delivers it again after
//! the delay of its *delay level* (10 s, 30 s, 1 min, 2 min, … for the 1st,
//! 2nd, 3rd, 4th retry). After `max_reconsume_times` retries the broker moves
//! it to the dead-letter topic `%DLQ%<group>` instead. The offset of a queue
//! only moves past messages whose consumption has returned, so a consumer
//! that dies while a message is being consumed has that message delivered
//! again (from the original queue) to whichever member gets the queue next.
//!
//! `msg_id()` is the broker's *offset* message id: it changes with every
//! retry copy, so it is never used as an identity here. The producer's
//! unique id (the `UNIQ_KEY` property) is stable across retries.
//!
//! # How this source maps it
//!
//! - The source registers a concurrent listener with the push consumer. The
//!   listener hands each message to [`Source::next`] through a channel and
//!   **blocks until the engine has settled the delivery**; only then does it
//!   return its status to the client. So the consume status is success only
//!   after the inbox transaction has committed (or the message was found to
//!   be a duplicate, or was dead-lettered).
//! - **ack** answers `ConsumeSuccess`.
//! - **nack(delay)** answers `ReconsumeLater`: the broker's retry topic and
//!   `reconsume_times` then drive the backoff. The delay the engine asked
//!   for is *not* honoured exactly: RocketMQ picks the delay level
//!   `3 + reconsume_times` (10 s, 30 s, 1 min, …), whatever the engine's
//!   backoff says. Set [`RocketMqConfig::max_reconsume_times`] above the
//!   engine's `max_attempts` so that the engine's poison limit acts first.
//! - **dead_letter** (after the engine wrote the dead-letter row) publishes a
//!   copy to [`RocketMqConfig::dead_letter_topic`] if one is set, with the
//!   user property [`DEAD_LETTER_REASON_PROPERTY`], then answers
//!   `ConsumeSuccess`. If that publish fails, it answers `ReconsumeLater`.
//! - A delivery **dropped unsettled** (its task was cancelled, or the source
//!   was dropped) answers `ReconsumeLater`. A listener that waits longer than
//!   [`RocketMqConfig::consume_timeout`] also answers `ReconsumeLater`.
//! - [`DeliveryMeta::delivery_count`] is `reconsume_times + 1`: it counts
//!   the trips through the retry topic (every `ReconsumeLater`, including
//!   those for dropped deliveries). A message whose process was killed
//!   outright comes back from its original queue with the *same* count, so
//!   `RetryPolicy::max_deliveries` does not see hard crashes.
//! - At most [`RocketMqConfig::consume_threads`] deliveries are unsettled at
//!   once (one message per listener call); the engine's own `concurrency`
//!   caps this further.
//! - The client persists consumer offsets every 5 s and on shutdown; the
//!   offset never passes a message still being consumed. A process that is
//!   killed has everything since the last persisted offset delivered again,
//!   and the inbox answers "duplicate" for what had committed.
//! - Dropping the source (or [`RocketMqSource::shutdown`]) shuts the push
//!   consumer down in the background: it persists the offsets and leaves the
//!   group, and the broker rebalances the queues to the other members.
//!   Messages still being consumed come back later, and the inbox answers
//!   "duplicate" for those that had committed.
//!
//! Message mapping: the payload is the body; [`Message::key`] is the
//! message's business keys (the `KEYS` property, `keys()`; several keys stay
//! joined by spaces); [`Message::id`] is the producer's unique id (the
//! `UNIQ_KEY` property, `None` if absent); the headers are the user
//! properties (system properties are left out), sorted by name.
//! [`DeliveryMeta`] has source `rocketmq`, the topic (the original topic, also
//! for retry copies), the queue id as partition and the queue offset as
//! offset. [`RocketMqPublisher`] writes messages in the same places.
//!
//! The default business key is [`default_key_spec`]: the keys, else the
//! producer's unique id.
//!
//! The RocketMQ client runs on a small Tokio runtime of its own (the crate
//! insists on owning one), on a thread of its own; each source and publisher
//! has one and shuts it down when dropped. Each is also a client of its own
//! (a unique instance name), so two sources in one process are two members
//! of their group.
//!
//! ```no_run
//! use idemq::source::rocketmq::{default_key_spec, RocketMqConfig, RocketMqSource};
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//! use idemq::Consumer;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/test").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("billing", store)
//!     .key(default_key_spec())
//!     .handler_fn(|ctx, tx| Box::pin(async move {
//!         sqlx::query("INSERT INTO charges (payment_id) VALUES ($1)")
//!             .bind(ctx.key)
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(None)
//!     }))
//!     .build()?;
//! let config = RocketMqConfig::from_url("rocketmq://127.0.0.1:9876/payments?group=billing")?;
//! consumer.run(RocketMqSource::connect(config).await?).await?;
//! # Ok(()) }
//! ```

use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rocketmq_client_rust::{
    ClientConfig, ClientRuntime, ClientRuntimeConfig, ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus, DefaultMQProducer, DefaultMQPushConsumer, MQPushConsumer,
    MessageListenerConcurrently, TelemetryHandle,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_property::MessagePropertyKey;
use rocketmq_model::common::message::message_single::Message as RmqMessage;
use rocketmq_model::common::message::STRING_HASH_SET;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use tokio::sync::mpsc;

use super::url::{Bare, BrokerUrl};
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::SourceError;
use crate::key::KeySpec;
use crate::message::{DeliveryMeta, Headers, Message};
use crate::store::DeadLetterReason;

/// The user property with the dead-letter reason code on the dead-letter topic.
pub const DEAD_LETTER_REASON_PROPERTY: &str = "idemq_dead_letter_reason";

/// The system property with the message's business keys.
pub const KEYS_PROPERTY: &str = "KEYS";

/// The system property with the producer's unique message id.
pub const UNIQ_KEY_PROPERTY: &str = "UNIQ_KEY";

/// How long a send waits for the broker.
const SEND_TIMEOUT_MS: u64 = 10_000;

/// The default business key for RocketMQ messages: the message's keys
/// (`keys()`), else the producer's unique id (`UNIQ_KEY`, stable across
/// broker redeliveries and retries, unlike `msg_id()`).
pub fn default_key_spec() -> KeySpec {
    KeySpec::transport_key().or(KeySpec::id())
}

/// Where a group without a consumer offset starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StartFrom {
    /// The first message still stored (default): nothing published before the
    /// group first started is skipped.
    #[default]
    Earliest,
    /// The end of each queue.
    Latest,
}

/// How to reach the name server, what to consume, and the consumer tuning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RocketMqConfig {
    /// Name server addresses, `host:port[;host:port…]`.
    pub name_server: String,
    /// The topic to consume.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The tag filter expression (default `*`, every tag).
    pub tags: String,
    /// Listener calls in flight at once, i.e. messages handed to the engine
    /// and not yet settled (default 16).
    pub consume_threads: u32,
    /// Retries before the broker moves a message to `%DLQ%<group>` (default
    /// 16). Keep it above the engine's `max_attempts`.
    pub max_reconsume_times: i32,
    /// How long a delivery may stay unsettled before the listener gives up
    /// and answers `ReconsumeLater` (default 15 min; whole minutes are used
    /// by the client's own expiry check).
    pub consume_timeout: Duration,
    /// Where a new group starts.
    pub start_from: StartFrom,
    /// Where dead-lettered messages are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
}

impl RocketMqConfig {
    /// A configuration with the defaults.
    pub fn new(
        name_server: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            name_server: name_server.into(),
            topic: topic.into(),
            group: group.into(),
            tags: "*".into(),
            consume_threads: 16,
            max_reconsume_times: 16,
            consume_timeout: Duration::from_secs(15 * 60),
            start_from: StartFrom::Earliest,
            dead_letter_topic: None,
        }
    }

    /// Parses `rocketmq://host:port[;host:port…]/topic?group=NAME[&…]`, with
    /// the URL rules every source shares (percent-decoding, durations such
    /// as `90s` or `15m`, errors that hide credentials).
    ///
    /// Query parameters: `group` (required), `tags` (default `*`),
    /// `consume_threads`, `max_reconsume_times`, `consume_timeout` (a bare
    /// number is seconds; `consume_timeout_ms`, a bare number of
    /// milliseconds, is the older spelling), `start_from` (`earliest` or
    /// `latest`) and `dead_letter_topic`. Name servers may also be separated
    /// by commas.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("RocketMQ", "rocketmq", url)?;
        if u.userinfo.is_some() {
            return Err(u.error("credentials in the URL are not supported"));
        }
        let hosts = u.decoded_hosts()?;
        let servers: Vec<&str> = hosts.split([';', ',']).map(str::trim).collect();
        if servers.iter().any(|s| s.is_empty()) {
            return Err(u.error("no name server address"));
        }
        u.require_path("topic")?;
        let topic = match u.segments()?.as_slice() {
            [topic] => topic.clone(),
            _ => return Err(u.error("the path must be one topic name")),
        };
        validate_name("topic", &topic, 127).map_err(|why| u.error(why))?;
        let mut config = RocketMqConfig::new(servers.join(";"), topic, "");
        for p in u.params() {
            match p.name.as_str() {
                "group" => config.group = p.value.clone(),
                "tags" => {
                    if p.value.is_empty() {
                        return Err(p.error("tags must not be empty (use * for every tag)"));
                    }
                    config.tags = p.value.clone();
                }
                "consume_threads" => {
                    config.consume_threads = Some(p.count::<u32>()?)
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or_else(|| p.error("consume_threads must be between 1 and 1000"))?
                }
                "max_reconsume_times" => config.max_reconsume_times = p.count()?,
                "consume_timeout" => config.consume_timeout = p.duration(Bare::Seconds)?,
                "consume_timeout_ms" => config.consume_timeout = p.duration(Bare::Millis)?,
                "start_from" => {
                    config.start_from = match p.choice(&["earliest", "latest"])? {
                        "latest" => StartFrom::Latest,
                        _ => StartFrom::Earliest,
                    }
                }
                "dead_letter_topic" => {
                    validate_name("dead_letter_topic", &p.value, 127)
                        .map_err(|why| p.error(why))?;
                    config.dead_letter_topic = Some(p.value.clone());
                }
                _ => return Err(p.unknown()),
            }
        }
        if config.group.is_empty() {
            return Err(u.missing("group"));
        }
        validate_name("group", &config.group, 255).map_err(|why| u.error(why))?;
        Ok(config)
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets how many retries the broker allows before its own `%DLQ%` topic.
    pub fn max_reconsume_times(mut self, times: i32) -> Self {
        self.max_reconsume_times = times;
        self
    }

    /// Sets how many deliveries may be in flight at once.
    pub fn consume_threads(mut self, threads: u32) -> Self {
        self.consume_threads = threads;
        self
    }

    fn validate(&self) -> Result<(), SourceError> {
        let bad = |why: String| SourceError::Config(format!("RocketMQ: {why}"));
        if self.name_server.split(';').any(|s| s.trim().is_empty()) {
            return Err(bad("no name server address".into()));
        }
        validate_name("topic", &self.topic, 127).map_err(bad)?;
        validate_name("group", &self.group, 255).map_err(bad)?;
        if let Some(dlq) = &self.dead_letter_topic {
            validate_name("dead_letter_topic", dlq, 127).map_err(bad)?;
        }
        if !(1..=1000).contains(&self.consume_threads) {
            return Err(bad("consume_threads must be between 1 and 1000".into()));
        }
        if self.consume_timeout.is_zero() {
            return Err(bad("consume_timeout must be above zero".into()));
        }
        Ok(())
    }
}

fn validate_name(what: &str, name: &str, max: usize) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= max
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '%' | '|' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} must be 1 to {max} characters of [a-zA-Z0-9%|_-]"
        ))
    }
}

fn broker(e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(e.to_string())
}

/// What the consumer side of a client thread needs.
struct ConsumerSetup {
    config: RocketMqConfig,
    listener: Listener,
}

/// A request to the client thread.
struct SendRequest {
    message: RmqMessage,
    topic: String,
    reply: tokio::sync::oneshot::Sender<Result<(), SourceError>>,
}

/// A handle to a producer running on a client thread.
#[derive(Clone)]
struct Producer {
    requests: mpsc::UnboundedSender<SendRequest>,
}

impl Producer {
    async fn send(&self, topic: &str, message: RmqMessage) -> Result<(), SourceError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let gone = || SourceError::Other("the RocketMQ client has shut down".into());
        self.requests
            .send(SendRequest {
                message,
                topic: topic.to_owned(),
                reply,
            })
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// The RocketMQ client: its own Tokio runtime (the crate insists on owning
/// one) on a thread of its own, with a producer and/or a push consumer.
///
/// The client's objects never leave that thread: their types are too deep
/// for the compiler to prove them `Send` inside `idemq`'s futures, and they
/// are only reached through channels. Dropping the client (or
/// [`Client::shutdown`]) shuts them down there.
struct Client {
    close: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Client {
    /// Starts the client thread and waits until the producer (if
    /// `producer`) and the consumer (if `consumer`) have started.
    async fn start(
        name_server: String,
        producer: bool,
        consumer: Option<ConsumerSetup>,
    ) -> Result<(Self, Option<Producer>), SourceError> {
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let (close, close_rx) = tokio::sync::oneshot::channel();
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let (requests, requests_rx) = mpsc::unbounded_channel();
        let spawned = std::thread::Builder::new()
            .name("idemq-rocketmq".into())
            .spawn(move || {
                client_thread(
                    name_server,
                    producer,
                    consumer,
                    ClientChannels {
                        ready: ready_tx,
                        close: close_rx,
                        requests: requests_rx,
                    },
                );
                let _ = done_tx.send(());
            });
        if let Err(e) = spawned {
            return Err(SourceError::Other(format!(
                "could not start the RocketMQ client thread: {e}"
            )));
        }
        let client = Client {
            close: Some(close),
            done: Some(done),
        };
        match ready.await {
            Ok(Ok(())) => Ok((client, producer.then_some(Producer { requests }))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SourceError::Other(
                "the RocketMQ client thread stopped while starting".into(),
            )),
        }
    }

    /// Shuts the client down and waits until it has finished.
    async fn shutdown(mut self) {
        self.close.take();
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

struct ClientChannels {
    ready: tokio::sync::oneshot::Sender<Result<(), SourceError>>,
    close: tokio::sync::oneshot::Receiver<()>,
    requests: mpsc::UnboundedReceiver<SendRequest>,
}

/// The client thread's body.
fn client_thread(
    name_server: String,
    want_producer: bool,
    consumer: Option<ConsumerSetup>,
    channels: ClientChannels,
) {
    let listeners = consumer
        .as_ref()
        .map_or(1, |c| c.config.consume_threads as usize);
    let listener_timeout = consumer
        .as_ref()
        .map_or(Duration::from_secs(60), |c| c.config.consume_timeout);
    let owner = match runtime_owner(listeners, listener_timeout) {
        Ok(owner) => owner,
        Err(e) => {
            let _ = channels.ready.send(Err(e));
            return;
        }
    };
    owner.block_on(drive(
        name_server,
        want_producer,
        consumer,
        channels,
        &owner,
    ));
    if let Err(e) = owner.shutdown_runtime_blocking_with_timeout(Duration::from_secs(5)) {
        tracing::debug!(error = %e, "RocketMQ client runtime shutdown");
    }
}

/// Builds the client's Tokio runtime; `listeners` listener calls may block
/// at once (they run on the client's metadata blocking lane).
fn runtime_owner(
    listeners: usize,
    listener_timeout: Duration,
) -> Result<RuntimeOwner, SourceError> {
    let mut config = RuntimeConfig::for_parallelism("idemq-rocketmq", 2);
    let lanes = &mut config.blocking_lane_policies;
    // Listener calls block until their delivery is settled: make room for
    // all of them, and do not time them out before the listener's own timeout.
    lanes.metadata_io.max_concurrency = listeners + 4;
    lanes.metadata_io.max_queue_depth = listeners * 4 + 64;
    lanes.metadata_io.queue_timeout = listener_timeout + Duration::from_secs(60);
    lanes.metadata_io.task_timeout = listener_timeout + Duration::from_secs(60);
    let lane_total = lanes.storage_io.max_concurrency
        + lanes.metadata_io.max_concurrency
        + lanes.cpu_crypto.max_concurrency;
    config.max_blocking_threads = (lane_total + 8).min(512);
    RuntimeOwner::plan(config)
        .map_err(|e| SourceError::Config(format!("RocketMQ client runtime: {e}")))?
        .build()
        .map_err(|e| SourceError::Other(format!("RocketMQ client runtime: {e}")))
}

/// A client configuration with a unique instance name, so that every source
/// and publisher is a client (and group member) of its own.
fn client_config(name_server: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set_namesrv_addr(name_server.into());
    config.set_instance_name(
        format!(
            "idemq-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        )
        .into(),
    );
    config
}

async fn drive(
    name_server: String,
    want_producer: bool,
    consumer: Option<ConsumerSetup>,
    channels: ClientChannels,
    owner: &RuntimeOwner,
) {
    let ClientChannels {
        ready,
        mut close,
        mut requests,
    } = channels;
    let client = match ClientRuntime::try_new(
        owner.root_context().component("idemq-rocketmq"),
        ClientRuntimeConfig {
            shutdown_timeout: Duration::from_secs(10),
            ..ClientRuntimeConfig::default()
        },
        TelemetryHandle::noop(),
    ) {
        Ok(client) => client,
        Err(e) => {
            let _ = ready.send(Err(SourceError::Other(format!(
                "RocketMQ client runtime: {e}"
            ))));
            return;
        }
    };

    let mut producer = None;
    let mut push = None;
    let mut started: Result<(), SourceError> = Ok(());
    if want_producer {
        let mut p = DefaultMQProducer::builder(Arc::clone(&client))
            .client_config(client_config(&name_server))
            .producer_group(format!("idemq_producer_{}", uuid::Uuid::new_v4().simple()))
            .send_msg_timeout(SEND_TIMEOUT_MS as u32)
            .build();
        match p.start().await {
            Ok(()) => producer = Some(p),
            Err(e) => started = Err(broker(format!("starting the RocketMQ producer: {e}"))),
        }
    }
    if let (Ok(()), Some(setup)) = (&started, consumer) {
        let config = setup.config;
        let timeout_minutes = config.consume_timeout.as_secs().div_ceil(60).max(1) + 1;
        let mut c = DefaultMQPushConsumer::builder(Arc::clone(&client))
            .client_config(client_config(&name_server))
            .consumer_group(config.group.as_str())
            .consume_from_where(match config.start_from {
                StartFrom::Earliest => ConsumeFromWhere::ConsumeFromFirstOffset,
                StartFrom::Latest => ConsumeFromWhere::ConsumeFromLastOffset,
            })
            .consume_thread_min(config.consume_threads)
            .consume_thread_max(config.consume_threads)
            .consume_message_batch_max_size(1)
            .max_reconsume_times(config.max_reconsume_times)
            .consume_timeout(timeout_minutes)
            .await_termination_millis_when_shutdown(2_000)
            .build();
        let result = async {
            c.subscribe(config.topic.as_str(), config.tags.as_str())
                .await?;
            c.register_message_listener_concurrently(setup.listener);
            c.start().await
        }
        .await;
        match result {
            Ok(()) => push = Some(c),
            Err(e) => {
                started = Err(broker(format!(
                    "starting the RocketMQ consumer of {:?} in group {:?}: {e}",
                    config.topic, config.group
                )));
                c.shutdown().await;
            }
        }
    }

    let ok = started.is_ok();
    if ready.send(started).is_ok() && ok {
        loop {
            tokio::select! {
                _ = &mut close => break,
                request = requests.recv() => {
                    let Some(request) = request else {
                        // No producer handle left (or none made): wait for the close.
                        let _ = (&mut close).await;
                        break;
                    };
                    let result = match &producer {
                        Some(p) => match p.send_with_timeout(request.message, SEND_TIMEOUT_MS).await {
                            Ok(Some(_)) => Ok(()),
                            Ok(None) => Err(broker(format!(
                                "publishing to {:?}: the broker returned no send result",
                                request.topic
                            ))),
                            Err(e) => Err(broker(format!("publishing to {:?}: {e}", request.topic))),
                        },
                        None => Err(SourceError::Other("this RocketMQ client has no producer".into())),
                    };
                    let _ = request.reply.send(result);
                }
            }
        }
    }
    requests.close();
    if let Some(mut c) = push {
        c.shutdown().await;
    }
    if let Some(mut p) = producer {
        p.shutdown().await;
    }
    let report = client.shutdown().await;
    if !report.is_healthy() {
        tracing::debug!(report = %report.to_json(), "RocketMQ client shutdown report");
    }
}

/// Builds the RocketMQ message for `message` on `topic`; `extra` user
/// properties are added after the headers.
fn outgoing(
    topic: &str,
    message: &Message,
    extra: &[(&str, &str)],
) -> Result<RmqMessage, SourceError> {
    let bad = |why: String| SourceError::Config(format!("RocketMQ message: {why}"));
    let mut builder = RmqMessage::builder()
        .topic(topic)
        .body(message.payload.clone());
    if let Some(key) = &message.key {
        if key.trim().is_empty() {
            return Err(bad("the key is blank".into()));
        }
        check_property_text("key", key).map_err(bad)?;
        builder = builder.key(key.as_str());
    }
    if let Some(id) = &message.id {
        check_property_text("id", id).map_err(bad)?;
        // The producer only generates a UNIQ_KEY when none is set, so the
        // consumer reads this id back as the message id.
        builder = builder.property(MessagePropertyKey::UniqueClientMsgId, id.as_str());
    }
    let mut properties: Vec<(&str, &str)> = Vec::new();
    for (name, value) in message.headers.iter() {
        let value = std::str::from_utf8(value)
            .map_err(|_| bad(format!("header {name:?} is not UTF-8 text")))?;
        properties.push((name, value));
    }
    properties.extend_from_slice(extra);
    let mut seen = std::collections::HashSet::new();
    for (name, value) in properties {
        if !seen.insert(name) {
            continue; // the first header of a name wins, as on lookup
        }
        if name.is_empty() || value.is_empty() {
            return Err(bad(format!(
                "header {name:?}: RocketMQ properties need a non-empty name and value"
            )));
        }
        check_property_text("header name", name).map_err(bad)?;
        check_property_text("header value", value).map_err(bad)?;
        builder = builder
            .raw_property(name, value)
            .map_err(|e| bad(format!("header {name:?}: {e}")))?;
    }
    builder.build().map_err(|e| bad(e.to_string()))
}

/// Property text must not contain the wire format's separators.
fn check_property_text(what: &str, text: &str) -> Result<(), String> {
    if text.contains(['\u{1}', '\u{2}']) {
        Err(format!(
            "the {what} contains a control character RocketMQ uses as a separator"
        ))
    } else {
        Ok(())
    }
}

/// Reads a received RocketMQ message into a [`Message`] and its metadata.
fn incoming(msg: &MessageExt) -> (Message, DeliveryMeta) {
    let mut key = None;
    let mut id = None;
    let mut user: Vec<(&str, &str)> = Vec::new();
    for (name, value) in msg.properties() {
        match name.as_str() {
            KEYS_PROPERTY => {
                let keys = value.trim();
                if !keys.is_empty() {
                    key = Some(keys.to_owned());
                }
            }
            UNIQ_KEY_PROPERTY => {
                if !value.is_empty() {
                    id = Some(value.to_string());
                }
            }
            other if STRING_HASH_SET.contains(other) => {}
            other => user.push((other, value.as_str())),
        }
    }
    user.sort_unstable();
    let mut headers = Headers::new();
    for (name, value) in user {
        headers.insert(name, value);
    }
    let message = Message {
        id,
        key,
        headers,
        payload: msg.body().map(|b| b.to_vec()).unwrap_or_default(),
    };
    let meta = DeliveryMeta {
        source: "rocketmq".into(),
        topic: Some(msg.topic().to_string()),
        partition: Some(msg.queue_id()),
        offset: Some(msg.queue_offset()),
        delivery_count: u32::try_from(msg.reconsume_times())
            .unwrap_or(0)
            .saturating_add(1),
    };
    (message, meta)
}

/// What the listener answers the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Success,
    Later,
}

/// One message handed from the listener to [`RocketMqSource::next`].
struct Incoming {
    message: Message,
    meta: DeliveryMeta,
    reply: std_mpsc::Sender<Verdict>,
}

/// The push consumer's listener: hands each message over and waits for its
/// settlement (it runs on the client's blocking lane).
struct Listener {
    deliveries: mpsc::UnboundedSender<Incoming>,
    timeout: Duration,
}

impl MessageListenerConcurrently for Listener {
    fn consume_message(
        &self,
        msgs: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> rocketmq_client_rust::ClientResult<ConsumeConcurrentlyStatus> {
        let deadline = Instant::now() + self.timeout;
        let mut replies = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let (message, meta) = incoming(msg);
            let (reply, answer) = std_mpsc::channel();
            let sent = self.deliveries.send(Incoming {
                message,
                meta,
                reply,
            });
            if sent.is_err() {
                // The source is gone: consume it again later.
                return Ok(ConsumeConcurrentlyStatus::ReconsumeLater);
            }
            replies.push(answer);
        }
        let mut status = ConsumeConcurrentlyStatus::ConsumeSuccess;
        for answer in replies {
            let wait = deadline.saturating_duration_since(Instant::now());
            match answer.recv_timeout(wait) {
                Ok(Verdict::Success) => {}
                Ok(Verdict::Later) => status = ConsumeConcurrentlyStatus::ReconsumeLater,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {
                    tracing::warn!(
                        timeout_ms = self.timeout.as_millis() as u64,
                        "a RocketMQ delivery was not settled in time; it will be consumed again"
                    );
                    status = ConsumeConcurrentlyStatus::ReconsumeLater;
                }
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    status = ConsumeConcurrentlyStatus::ReconsumeLater
                }
            }
        }
        Ok(status)
    }
}

/// A RocketMQ push consumer in a consumer group, as a [`Source`]: see the
/// [module docs](self).
pub struct RocketMqSource {
    deliveries: mpsc::UnboundedReceiver<Incoming>,
    dead_letters: Option<(Producer, String)>,
    client: Option<Client>,
    topic: String,
}

impl std::fmt::Debug for RocketMqSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocketMqSource")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl RocketMqSource {
    /// Starts a push consumer of `config.topic` in `config.group`.
    pub async fn connect(config: RocketMqConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let listener = Listener {
            deliveries: tx,
            timeout: config.consume_timeout,
        };
        let dead_letter_topic = config.dead_letter_topic.clone();
        let topic = config.topic.clone();
        let (client, producer) = Client::start(
            config.name_server.clone(),
            dead_letter_topic.is_some(),
            Some(ConsumerSetup { config, listener }),
        )
        .await?;
        Ok(Self {
            deliveries: rx,
            dead_letters: producer.zip(dead_letter_topic),
            client: Some(client),
            topic,
        })
    }

    /// Shuts the consumer down and waits until it has persisted its offsets
    /// and left the group. Deliveries not yet settled are consumed again
    /// later (by this group).
    pub async fn shutdown(mut self) {
        self.deliveries.close();
        if let Some(client) = self.client.take() {
            client.shutdown().await;
        }
    }
}

impl Drop for RocketMqSource {
    /// Shuts the consumer down in the background (see [`RocketMqSource::shutdown`]).
    fn drop(&mut self) {
        self.deliveries.close();
        // Dropping the client tells its thread to shut down.
    }
}

#[async_trait]
impl Source for RocketMqSource {
    /// Shuts the consumer down and waits for it, so that the consume
    /// offsets of what was settled reach the broker before the process exits.
    async fn close(&mut self) {
        self.deliveries.close();
        if let Some(client) = self.client.take() {
            client.shutdown().await;
        }
    }

    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let Some(incoming) = self.deliveries.recv().await else {
            return Err(SourceError::Broker(format!(
                "the RocketMQ consumer of {:?} stopped",
                self.topic
            )));
        };
        let acker = RocketMqAcker {
            reply: Some(incoming.reply),
            dead_letters: self.dead_letters.clone(),
            message: incoming.message.clone(),
        };
        Ok(Some(Delivery::new(
            incoming.message,
            incoming.meta,
            Box::new(acker),
        )))
    }
}

/// Settles one RocketMQ delivery by answering its waiting listener call.
struct RocketMqAcker {
    /// `None` once answered.
    reply: Option<std_mpsc::Sender<Verdict>>,
    dead_letters: Option<(Producer, String)>,
    message: Message,
}

impl RocketMqAcker {
    fn answer(&mut self, verdict: Verdict) {
        if let Some(reply) = self.reply.take() {
            // The listener may have timed out already: then it answered
            // ReconsumeLater itself.
            let _ = reply.send(verdict);
        }
    }
}

#[async_trait]
impl Acknowledger for RocketMqAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.answer(Verdict::Success);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, _delay: Duration) -> Result<(), SourceError> {
        // RocketMQ chooses the delay from its delay levels (see the module docs).
        self.answer(Verdict::Later);
        Ok(())
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        if let Some((producer, topic)) = self.dead_letters.clone() {
            let forwarded = match outgoing(
                &topic,
                &self.message,
                &[(DEAD_LETTER_REASON_PROPERTY, reason.code())],
            ) {
                Ok(copy) => producer.send(&topic, copy).await,
                Err(e) => Err(e),
            };
            if let Err(e) = forwarded {
                // Not forwarded: the broker delivers the message again.
                self.answer(Verdict::Later);
                return Err(SourceError::Broker(format!(
                    "publishing to the dead-letter topic {topic:?} failed: {e}"
                )));
            }
        }
        self.answer(Verdict::Success);
        Ok(())
    }
}

impl Drop for RocketMqAcker {
    /// An unsettled delivery is consumed again later.
    fn drop(&mut self) {
        self.answer(Verdict::Later);
    }
}

/// Publishes [`Message`]s to a RocketMQ topic.
///
/// The keys (`KEYS` property) are [`Message::key`], the body the payload,
/// the user properties the headers (UTF-8 text, non-empty, and not named
/// like a system property). When [`Message::id`] is set it becomes the
/// producer's unique id (the `UNIQ_KEY` property: the producer only generates
/// one when none is set), which [`RocketMqSource`] reads back as the id;
/// otherwise the producer generates one. Messages are sent one at a time,
/// synchronously: [`publish`](Publisher::publish) returns when the broker has
/// stored the message.
pub struct RocketMqPublisher {
    producer: Producer,
    client: Client,
    topic: String,
}

impl std::fmt::Debug for RocketMqPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocketMqPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl RocketMqPublisher {
    /// A started producer for `topic` via the name servers `name_server`
    /// (`host:port[;host:port…]`).
    pub async fn connect(name_server: &str, topic: &str) -> Result<Self, SourceError> {
        validate_name("topic", topic, 127).map_err(SourceError::Config)?;
        if name_server.split(';').any(|s| s.trim().is_empty()) {
            return Err(SourceError::Config(
                "RocketMQ: no name server address".into(),
            ));
        }
        let (client, producer) = Client::start(name_server.to_owned(), true, None).await?;
        let producer = producer
            .ok_or_else(|| SourceError::Other("the RocketMQ producer did not start".into()))?;
        Ok(Self {
            producer,
            client,
            topic: topic.to_owned(),
        })
    }

    /// The publisher for the source URL's name servers and topic
    /// (`rocketmq://host:port/topic?…`; the query is ignored).
    pub async fn from_url(url: &str) -> Result<Self, SourceError> {
        let bad = |why: &str| SourceError::Config(format!("invalid RocketMQ URL {url:?}: {why}"));
        let rest = url
            .strip_prefix("rocketmq://")
            .ok_or_else(|| bad("it must start with rocketmq://"))?;
        let location = rest.split_once('?').map_or(rest, |(l, _)| l);
        let (servers, topic) = location
            .split_once('/')
            .ok_or_else(|| bad("no topic: expected rocketmq://namesrv-host:9876/topic"))?;
        let servers: Vec<&str> = servers.split([';', ',']).map(str::trim).collect();
        Self::connect(&servers.join(";"), topic).await
    }

    /// Shuts the producer down and waits until it has finished.
    pub async fn shutdown(self) {
        self.client.shutdown().await;
    }
}

#[async_trait]
impl Publisher for RocketMqPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        self.producer
            .send(&self.topic, outgoing(&self.topic, message, &[])?)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rocketmq_model::common::message::MessageTrait;

    #[test]
    fn parses_urls() {
        let c = RocketMqConfig::from_url(
            "rocketmq://127.0.0.1:9876/payments?group=billing&consume_threads=4&max_reconsume_times=3&dead_letter_topic=payments_dlq&start_from=latest&tags=a||b",
        )
        .unwrap();
        assert_eq!(c.name_server, "127.0.0.1:9876");
        assert_eq!(c.topic, "payments");
        assert_eq!(c.group, "billing");
        assert_eq!(c.consume_threads, 4);
        assert_eq!(c.max_reconsume_times, 3);
        assert_eq!(c.dead_letter_topic.as_deref(), Some("payments_dlq"));
        assert_eq!(c.start_from, StartFrom::Latest);
        assert_eq!(c.tags, "a||b");
        let c = RocketMqConfig::from_url("rocketmq://a:1,b:2/t?group=g").unwrap();
        assert_eq!(c.name_server, "a:1;b:2");
        assert_eq!(c.tags, "*");
        assert_eq!(c.start_from, StartFrom::Earliest);
        assert_eq!(c.consume_timeout, Duration::from_secs(15 * 60));
        // The shared URL rules: percent-decoding and the CLI's durations.
        let c =
            RocketMqConfig::from_url("rocketmq://a:1/%25DLQ%25g?group=g%7Cx&consume_timeout=1m30s")
                .unwrap();
        assert_eq!(c.topic, "%DLQ%g");
        assert_eq!(c.group, "g|x");
        assert_eq!(c.consume_timeout, Duration::from_secs(90));
        let c =
            RocketMqConfig::from_url("rocketmq://a:1/t?group=g&consume_timeout_ms=2500").unwrap();
        assert_eq!(c.consume_timeout, Duration::from_millis(2500));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "rocketmq://127.0.0.1:9876/payments",
            "rocketmq://127.0.0.1:9876/payments?group=",
            "rocketmq://127.0.0.1:9876?group=g",
            "rocketmq:///payments?group=g",
            "http://127.0.0.1:9876/payments?group=g",
            "rocketmq://127.0.0.1:9876/pay.ments?group=g",
            "rocketmq://127.0.0.1:9876/payments?group=g&bogus=1",
            "rocketmq://127.0.0.1:9876/payments?group=g&consume_threads=0",
            "rocketmq://127.0.0.1:9876/payments?group=g&start_from=middle",
            "rocketmq://127.0.0.1:9876/payments?group=g g",
            "rocketmq://127.0.0.1:9876/a/b?group=g",
            "rocketmq://127.0.0.1:9876/payments?group=g&consume_timeout=soon",
            "rocketmq://127.0.0.1:9876/pay%zzments?group=g",
            "rocketmq://user:secret@127.0.0.1:9876/payments?group=g",
        ] {
            assert!(
                matches!(RocketMqConfig::from_url(url), Err(SourceError::Config(_))),
                "{url} should be rejected"
            );
            if let Err(e) = RocketMqConfig::from_url(url) {
                assert!(!e.to_string().contains("secret"), "{e}");
            }
        }
    }

    #[test]
    fn maps_messages_both_ways() {
        let original = Message::new("{\"a\":1}")
            .with_id("m-1")
            .with_key("p-1")
            .with_header("event_id", "p-1")
            .with_header("a_first", "x");
        let out = outgoing("payments", &original, &[]).unwrap();
        let mut ext = MessageExt::default();
        ext.set_message_inner(out);
        ext.set_queue_id(2);
        ext.set_queue_offset(41);
        ext.set_reconsume_times(1);
        ext.put_property("MIN_OFFSET".into(), "0".into());
        let (message, meta) = incoming(&ext);
        assert_eq!(message.id.as_deref(), Some("m-1"));
        assert_eq!(message.key.as_deref(), Some("p-1"));
        assert_eq!(message.payload, original.payload);
        assert_eq!(
            message.headers,
            Headers::new().with("a_first", "x").with("event_id", "p-1")
        );
        assert_eq!(meta.source, "rocketmq");
        assert_eq!(meta.topic.as_deref(), Some("payments"));
        assert_eq!(meta.partition, Some(2));
        assert_eq!(meta.offset, Some(41));
        assert_eq!(meta.delivery_count, 2);
        assert_eq!(default_key_spec().extract(&message).unwrap(), "p-1");
    }

    #[test]
    fn rejects_unmappable_messages() {
        let not_text = Message::new("x").with_header("h", vec![0xff, 0xfe]);
        assert!(outgoing("t", &not_text, &[]).is_err());
        let system = Message::new("x").with_header("UNIQ_KEY", "u");
        assert!(outgoing("t", &system, &[]).is_err());
        let empty = Message::new("x").with_header("h", "");
        assert!(outgoing("t", &empty, &[]).is_err());
    }
}
