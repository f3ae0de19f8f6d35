//! The RabbitMQ (AMQP 0-9-1) source and publisher, over `lapin`.
//!
//! ## Redelivery model
//!
//! RabbitMQ delivers each message of a queue to one consumer and keeps it
//! *unacked* until that consumer acks it. A message that was not acked when
//! its channel or connection closed (the consumer crashed, was killed, or
//! dropped its [`AmqpSource`]) goes back to the queue and is delivered again
//! with the `redelivered` flag; quorum queues also count those returns in
//! the `x-delivery-count` header. So delivery is at-least-once, and the
//! inbox turns it into exactly-once effects.
//!
//! ## How the source maps it
//!
//! - **Ack after commit.** Consuming uses manual acks; the engine acks only
//!   after the inbox transaction committed (or the message was found to be a
//!   duplicate). The number of unacked deliveries per consumer is
//!   `prefetch` (`basic.qos`).
//! - **Delayed retries, no requeue loop.** A retryable failure is not
//!   requeued at once. The delivery is *copied* into a retry queue whose
//!   messages dead-letter back to the work queue after the queue's TTL, the
//!   copy is confirmed by the broker, and only then the original is acked.
//!   A crash between the two leaves two copies; the inbox answers the second
//!   one as a duplicate. Each retry queue has one fixed TTL (a *delay
//!   bucket*, see [`RETRY_DELAYS`]), so every message in it expires in FIFO
//!   order and a long delay never blocks a shorter one (per-message TTLs in
//!   one classic queue would: they only expire at the head). The requested
//!   delay is rounded **up** to the next bucket (capped at the largest).
//! - **Poison.** [`DeliveryMeta::delivery_count`] counts every delivery of
//!   the message: the deliveries of earlier copies (carried in the
//!   [`DELIVERIES_HEADER`] header, written on each retry) plus those of this
//!   copy: `x-delivery-count + 1` on quorum queues, else 1, or 2 when the
//!   broker flags a redelivery. With [`RetryPolicy::max_deliveries`]
//!   a message that kills its consumer every time ends as a `delivery_limit`
//!   dead letter; retryable failures are counted by the inbox store
//!   (`max_attempts`).
//! - **Dead letters** are written to the dead-letter table by the engine,
//!   then published to the queue `<queue>.dead-letter` with the reason code
//!   in the [`REASON_HEADER`] header (confirmed), then acked.
//! - **A dropped delivery** (its task was cancelled) is nacked with requeue;
//!   dropping the source closes its consumer channel, so every unacked
//!   delivery goes back to the queue.
//!
//! ## Topology (declared idempotently by [`AmqpSource::connect`])
//!
//! | queue | kind | purpose |
//! |-------|------|---------|
//! | `<queue>` | durable, classic or quorum | the work queue |
//! | `<queue>.retry.<ms>ms` | durable classic, `x-message-ttl = ms`, dead-letters to `<queue>` | one per delay in [`RETRY_DELAYS`] |
//! | `<queue>.dead-letter` | durable, same type as `<queue>` | dead letters, with [`REASON_HEADER`] |
//!
//! All of them use the default exchange. A work queue that already exists
//! must have been declared with the same arguments (RabbitMQ rejects a
//! re-declaration that differs).
//!
//! ## Message mapping
//!
//! [`Message::payload`] is the body, [`Message::id`] the AMQP `message_id`
//! property, [`Message::key`] the [`KEY_HEADER`] header (`idemq-key`), and
//! [`Message::headers`] the other AMQP headers: strings and byte arrays as
//! their bytes, other typed values as their text (tables and arrays as
//! JSON). The metadata has source `amqp` and the queue name as topic.
//! [`AmqpPublisher`] writes messages in the same places.
//!
//! ## URL
//!
//! `amqp://user:pass@host:port/vhost?queue=NAME[&prefetch=N][&queue_type=classic|quorum]`,
//! with the vhost percent-encoded (`%2f` is `/`, the default when the path
//! is empty). `heartbeat`, `connection_timeout`, `frame_max` and
//! `channel_max` are passed to the connection.
//!
//! ```no_run
//! use idemq::{Consumer, HandlerError, KeySpec};
//! use idemq::source::amqp::{AmqpConfig, AmqpSource};
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/test").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("billing", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(|ctx, _tx| Box::pin(async move {
//!         let _payment = ctx.message.json().map_err(HandlerError::permanent)?;
//!         Ok(None)
//!     }))
//!     .build()?;
//! let config = AmqpConfig::from_url("amqp://guest:guest@127.0.0.1:5672/%2f?queue=payments&prefetch=16")?;
//! let source = AmqpSource::connect(config).await?;
//! consumer.run(source).await?; // runs until the connection fails
//! # Ok(()) }
//! ```
//!
//! [`RetryPolicy::max_deliveries`]: crate::RetryPolicy::max_deliveries

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::url::BrokerUrl;
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::{InputError, SourceError};
use crate::message::{DeliveryMeta, Headers, Message};
use crate::store::DeadLetterReason;

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

/// The delays of the retry queues (delay buckets), shortest first. A retry
/// goes to the shortest one at least as long as the requested delay, or to
/// the longest one.
pub const RETRY_DELAYS: [Duration; 13] = [
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_millis(2_500),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(15 * 60),
    Duration::from_secs(60 * 60),
];

/// Longest queue name accepted, so that the derived names stay under AMQP's 255 bytes.
const MAX_QUEUE_NAME: usize = 200;

/// The type of the work queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum QueueType {
    /// A classic queue (the default).
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type = quorum`): replicated, and it counts
    /// returned deliveries in `x-delivery-count`.
    Quorum,
}

impl QueueType {
    fn arguments(self) -> FieldTable {
        let mut args = FieldTable::default();
        if self == QueueType::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args
    }
}

/// Where to connect and which queue to consume.
#[derive(Clone)]
pub struct AmqpConfig {
    uri: AMQPUri,
    queue: String,
    prefetch: u16,
    queue_type: QueueType,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.uri.authority;
        f.debug_struct("AmqpConfig")
            .field("user", &a.userinfo.username)
            .field("host", &a.host)
            .field("port", &a.port)
            .field("vhost", &self.uri.vhost)
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("queue_type", &self.queue_type)
            .finish_non_exhaustive()
    }
}

impl AmqpConfig {
    /// Parses `amqp://user:pass@host:port/vhost?queue=NAME&prefetch=N&queue_type=classic|quorum`.
    ///
    /// User and password default to `guest`, the port to 5672, the vhost to
    /// `/`, `prefetch` to 32 and `queue_type` to `classic`; `queue` is
    /// required. Unknown parameters are an error.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        if url.starts_with("amqps://") {
            return Err(BrokerUrl::parse("AMQP", "amqps", url)?
                .error("amqps (TLS) is not supported by this build"));
        }
        let u = BrokerUrl::parse("AMQP", "amqp", url)?;
        let mut user = AMQPUserInfo::default();
        if let Some((name, pass)) = &u.userinfo {
            user.username.clone_from(name);
            user.password.clone_from(pass);
        }
        let (host, port) = u.host_port(5672)?;
        let mut vhost = u.decoded_path()?;
        if vhost.is_empty() {
            vhost = "/".into();
        }

        let mut queue = None;
        let mut prefetch = 32u16;
        let mut queue_type = QueueType::Classic;
        let mut conn = AMQPQueryString::default();
        for p in u.params() {
            match p.name.as_str() {
                "queue" => queue = Some(p.value),
                "prefetch" => {
                    prefetch = p.count()?;
                    if prefetch == 0 {
                        return Err(p.error("prefetch must be at least 1"));
                    }
                }
                "queue_type" => {
                    queue_type = match p.choice(&["classic", "quorum"])? {
                        "quorum" => QueueType::Quorum,
                        _ => QueueType::Classic,
                    }
                }
                "heartbeat" => conn.heartbeat = Some(p.count()?),
                "connection_timeout" => conn.connection_timeout = Some(p.count()?),
                "frame_max" => conn.frame_max = Some(p.count()?),
                "channel_max" => conn.channel_max = Some(p.count()?),
                _ => return Err(p.unknown()),
            }
        }
        let queue = queue.ok_or_else(|| u.missing("queue"))?;
        let uri = AMQPUri {
            scheme: AMQPScheme::AMQP,
            authority: AMQPAuthority {
                userinfo: user,
                host,
                port,
            },
            vhost,
            query: conn,
        };
        AmqpConfig {
            uri,
            queue: String::new(),
            prefetch,
            queue_type,
        }
        .queue(queue)
    }

    /// Sets the work queue (1 to 200 bytes, not starting with `amq.`).
    pub fn queue(mut self, queue: impl Into<String>) -> Result<Self, SourceError> {
        let queue = queue.into();
        if queue.is_empty() || queue.len() > MAX_QUEUE_NAME || queue.starts_with("amq.") {
            return Err(SourceError::Config(format!(
                "invalid queue name {queue:?}: 1 to {MAX_QUEUE_NAME} bytes, not starting with amq."
            )));
        }
        self.queue = queue;
        Ok(self)
    }

    /// Sets the prefetch count (unacked deliveries per consumer; at least 1).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Sets the type of the work queue.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// The work queue.
    pub fn queue_name(&self) -> &str {
        &self.queue
    }

    /// The prefetch count.
    pub fn prefetch_count(&self) -> u16 {
        self.prefetch
    }

    /// The type of the work queue.
    pub fn work_queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The virtual host.
    pub fn vhost(&self) -> &str {
        &self.uri.vhost
    }

    /// The dead-letter queue: `<queue>.dead-letter`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead-letter", self.queue)
    }

    /// The retry queue a retry after `delay` goes to: `<queue>.retry.<ms>ms`.
    pub fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, bucket(delay).as_millis())
    }

    /// Every queue of the topology: the work queue, the retry queues and the
    /// dead-letter queue.
    pub fn queues(&self) -> Vec<String> {
        let mut all = vec![self.queue.clone()];
        all.extend(RETRY_DELAYS.iter().map(|d| self.retry_queue(*d)));
        all.push(self.dead_letter_queue());
        all
    }

    async fn connect(&self, name: &str) -> Result<Connection, SourceError> {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        Connection::connect_uri(self.uri.clone(), props)
            .await
            .map_err(|e| {
                SourceError::Broker(format!(
                    "connecting to {}:{} vhost {:?}: {e}",
                    self.uri.authority.host, self.uri.authority.port, self.uri.vhost
                ))
            })
    }

    /// Declares the topology on `channel` (idempotent).
    async fn declare(&self, channel: &Channel) -> Result<(), SourceError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let declare = |name: String, args: FieldTable| async move {
            let queue = short(&name)?;
            channel
                .queue_declare(queue, durable, args)
                .await
                .map_err(|e| SourceError::Broker(format!("declaring queue {name:?}: {e}")))
        };
        declare(self.queue.clone(), self.queue_type.arguments()).await?;
        declare(self.dead_letter_queue(), self.queue_type.arguments()).await?;
        for delay in RETRY_DELAYS {
            let mut args = FieldTable::default();
            let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(self.queue.as_str().into()),
            );
            declare(self.retry_queue(delay), args).await?;
        }
        Ok(())
    }
}

/// The retry delay bucket for `delay`.
fn bucket(delay: Duration) -> Duration {
    RETRY_DELAYS
        .iter()
        .copied()
        .find(|d| *d >= delay)
        .unwrap_or(RETRY_DELAYS[RETRY_DELAYS.len() - 1])
}

fn short(s: &str) -> Result<ShortString, SourceError> {
    ShortString::try_new(s)
        .map_err(|e| SourceError::Other(format!("{s:?} is too long for an AMQP short string: {e}")))
}

fn broker(what: &str) -> impl Fn(lapin::Error) -> SourceError + '_ {
    move |e| SourceError::Broker(format!("{what}: {e}"))
}

/// An integer header value (any integer type, or decimal digits).
fn as_u64(value: &AMQPValue) -> Option<u64> {
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
fn value_bytes(value: &AMQPValue) -> Vec<u8> {
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
fn rewrite_headers(
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

/// Publishes to the default exchange with routing key `queue` (mandatory,
/// persistent) and waits for the broker's confirm.
async fn publish_confirmed(
    channel: &Channel,
    queue: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), SourceError> {
    let confirm = channel
        .basic_publish(
            "".into(),
            short(queue)?,
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body,
            properties.with_delivery_mode(2),
        )
        .await
        .map_err(broker("publishing"))?
        .await
        .map_err(broker("waiting for the publisher confirm"))?;
    if !confirm.is_ack() {
        return Err(SourceError::Broker(format!(
            "the broker refused the message for queue {queue:?}"
        )));
    }
    if confirm.take_message().is_some() {
        return Err(SourceError::Broker(format!(
            "the message was returned unroutable: does queue {queue:?} exist?"
        )));
    }
    Ok(())
}

/// What the acknowledgers of one source share.
struct Shared {
    /// A channel in confirm mode for retry copies and dead letters.
    publish: Channel,
    config: AmqpConfig,
}

/// Consumes one RabbitMQ queue (see the [module docs](self)).
pub struct AmqpSource {
    shared: Arc<Shared>,
    consumer: lapin::Consumer,
    // Kept so the consumer channel lives as long as the source.
    _channel: Channel,
    connection: Connection,
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSource")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl AmqpSource {
    /// Connects, declares the topology, sets the prefetch and starts consuming
    /// the work queue with manual acks.
    pub async fn connect(config: AmqpConfig) -> Result<Self, SourceError> {
        let connection = config.connect("idemq-consumer").await?;
        let publish = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker("enabling publisher confirms"))?;
        config.declare(&publish).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions { global: false })
            .await
            .map_err(broker("setting the prefetch"))?;
        let consumer = channel
            .basic_consume(
                short(&config.queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("starting the consumer"))?;
        tracing::info!(queue = %config.queue, prefetch = config.prefetch, "consuming");
        Ok(Self {
            shared: Arc::new(Shared { publish, config }),
            consumer,
            _channel: channel,
            connection,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpConfig {
        &self.shared.config
    }

    /// Closes the connection: every delivery not acked yet goes back to the queue.
    pub async fn close(self) -> Result<(), SourceError> {
        self.connection
            .close(200, "closing".into())
            .await
            .map_err(broker("closing the connection"))
    }

    fn delivery(&self, d: lapin::message::Delivery) -> Delivery {
        let config = &self.shared.config;
        let lapin::message::Delivery {
            redelivered,
            properties,
            data,
            acker,
            ..
        } = d;
        let table = properties.headers().as_ref();
        let header = |name: &str| table.and_then(|t| t.inner().get(name));

        let earlier = header(DELIVERIES_HEADER).and_then(as_u64).unwrap_or(0);
        let this = match header(DELIVERY_COUNT_HEADER).and_then(as_u64) {
            Some(returned) => returned.saturating_add(1),
            None if redelivered => 2,
            None => 1,
        };
        let delivery_count = u32::try_from(earlier.saturating_add(this)).unwrap_or(u32::MAX);

        let mut defect = None;
        let mut message = Message::new(data.clone());
        message.id = properties.message_id().as_ref().map(|id| id.to_string());
        if let Some(value) = header(KEY_HEADER) {
            match String::from_utf8(value_bytes(value)) {
                Ok(key) => message.key = Some(key),
                Err(_) => defect = Some(InputError::HeaderNotUtf8(KEY_HEADER.into())),
            }
        }
        let mut headers = Headers::new();
        for (name, value) in table.into_iter().flat_map(|t| t.inner()) {
            if name.as_str() != KEY_HEADER && name.as_str() != DELIVERIES_HEADER {
                headers.insert(name.as_str(), value_bytes(value));
            }
        }
        message.headers = headers;

        let meta = DeliveryMeta {
            source: "amqp".into(),
            topic: Some(config.queue.clone()),
            partition: None,
            offset: None,
            delivery_count,
        };
        let acker = AmqpAcker {
            acker: Some(acker),
            shared: Arc::clone(&self.shared),
            body: data,
            properties,
            delivery_count,
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

#[async_trait]
impl Source for AmqpSource {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        match self.consumer.next().await {
            Some(Ok(d)) => Ok(Some(self.delivery(d))),
            Some(Err(e)) => Err(SourceError::Broker(format!("consuming: {e}"))),
            None => Err(SourceError::Broker(format!(
                "the consumer of queue {:?} was cancelled (queue deleted?)",
                self.shared.config.queue
            ))),
        }
    }
}

/// Settles one AMQP delivery.
struct AmqpAcker {
    acker: Option<lapin::Acker>,
    shared: Arc<Shared>,
    body: Vec<u8>,
    properties: BasicProperties,
    delivery_count: u32,
}

impl AmqpAcker {
    async fn ack_original(&mut self) -> Result<(), SourceError> {
        let Some(acker) = self.acker.take() else {
            return Ok(());
        };
        match acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(SourceError::Broker(
                "the channel closed before the ack; the broker redelivers the message".into(),
            )),
            Err(e) => Err(SourceError::Broker(format!("ack: {e}"))),
        }
    }

    fn copy_properties(&self, set: Vec<(&str, AMQPValue)>) -> BasicProperties {
        let headers = rewrite_headers(
            self.properties.headers().as_ref(),
            &[DELIVERY_COUNT_HEADER],
            set,
        );
        self.properties.clone().with_headers(headers)
    }

    fn deliveries_value(&self) -> AMQPValue {
        AMQPValue::LongLongInt(i64::from(self.delivery_count))
    }
}

#[async_trait]
impl Acknowledger for AmqpAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.ack_original().await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let config = &self.shared.config;
        let queue = if delay.is_zero() {
            config.queue.clone()
        } else {
            config.retry_queue(delay)
        };
        let properties = self.copy_properties(vec![(DELIVERIES_HEADER, self.deliveries_value())]);
        publish_confirmed(&self.shared.publish, &queue, &self.body, properties).await?;
        tracing::debug!(queue = %queue, delay_ms = delay.as_millis() as u64, "retry copy published");
        self.ack_original().await
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let config = &self.shared.config;
        let queue = config.dead_letter_queue();
        let properties = self.copy_properties(vec![
            (DELIVERIES_HEADER, self.deliveries_value()),
            (
                REASON_HEADER,
                AMQPValue::LongString(LongString::from(reason.code())),
            ),
            (
                QUEUE_HEADER,
                AMQPValue::LongString(config.queue.as_str().into()),
            ),
        ]);
        publish_confirmed(&self.shared.publish, &queue, &self.body, properties).await?;
        self.ack_original().await
    }
}

impl Drop for AmqpAcker {
    /// A delivery dropped unsettled (its task was cancelled) goes back to the
    /// queue at once, as it would when its channel closes.
    fn drop(&mut self) {
        let Some(acker) = self.acker.take() else {
            return;
        };
        if !acker.usable() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                if let Err(e) = acker.nack(requeue).await {
                    tracing::debug!(error = %e, "requeueing a dropped delivery failed");
                }
            });
        }
    }
}

/// Publishes messages to the work queue of an [`AmqpConfig`] through the
/// default exchange: persistent, with publisher confirms, `message_id` =
/// [`Message::id`], header [`KEY_HEADER`] = [`Message::key`], and the other
/// headers as byte strings.
pub struct AmqpPublisher {
    channel: Channel,
    config: AmqpConfig,
    connection: Connection,
}

impl fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("queue", &self.config.queue)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// Connects, enables publisher confirms and declares the topology.
    pub async fn connect(config: AmqpConfig) -> Result<Self, SourceError> {
        let connection = config.connect("idemq-publisher").await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker("enabling publisher confirms"))?;
        config.declare(&channel).await?;
        Ok(Self {
            channel,
            config,
            connection,
        })
    }

    /// Deletes every queue of the topology ([`AmqpConfig::queues`]) with
    /// the messages in them: for tests and examples.
    pub async fn delete_topology(&self) -> Result<(), SourceError> {
        for queue in self.config.queues() {
            self.channel
                .queue_delete(short(&queue)?, QueueDeleteOptions::default())
                .await
                .map_err(broker("deleting a queue"))?;
        }
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) -> Result<(), SourceError> {
        self.connection
            .close(200, "closing".into())
            .await
            .map_err(broker("closing the connection"))
    }
}

#[async_trait]
impl Publisher for AmqpPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut map = BTreeMap::new();
        for (name, value) in message.headers.iter() {
            map.entry(short(name)?)
                .or_insert_with(|| AMQPValue::LongString(value.into()));
        }
        if let Some(key) = &message.key {
            map.insert(
                KEY_HEADER.into(),
                AMQPValue::LongString(key.as_str().into()),
            );
        }
        let mut properties = BasicProperties::default().with_headers(FieldTable::from(map));
        if let Some(id) = &message.id {
            properties = properties.with_message_id(short(id)?);
        }
        publish_confirmed(
            &self.channel,
            &self.config.queue,
            &message.payload,
            properties,
        )
        .await
    }

    async fn flush(&self) -> Result<(), SourceError> {
        self.channel
            .wait_for_confirms()
            .await
            .map_err(broker("waiting for confirms"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = AmqpConfig::from_url(
            "amqp://guest:g%40st@127.0.0.1:5673/%2f?queue=orders&prefetch=4&queue_type=quorum&heartbeat=10",
        )
        .unwrap();
        assert_eq!(c.uri.authority.userinfo.password, "g@st");
        assert_eq!(c.uri.authority.host, "127.0.0.1");
        assert_eq!(c.uri.authority.port, 5673);
        assert_eq!(c.vhost(), "/");
        assert_eq!(c.queue_name(), "orders");
        assert_eq!(c.prefetch_count(), 4);
        assert_eq!(c.work_queue_type(), QueueType::Quorum);
        assert_eq!(c.uri.query.heartbeat, Some(10));
        assert!(!format!("{c:?}").contains("g@st"));

        let c = AmqpConfig::from_url("amqp://rabbit/prod?queue=q").unwrap();
        assert_eq!(
            (c.uri.authority.port, c.vhost(), c.prefetch_count()),
            (5672, "prod", 32)
        );
        assert_eq!(c.dead_letter_queue(), "q.dead-letter");
        assert_eq!(c.retry_queue(Duration::from_millis(120)), "q.retry.250ms");
        assert_eq!(
            c.retry_queue(Duration::from_secs(86_400)),
            "q.retry.3600000ms"
        );
        assert_eq!(c.queues().len(), RETRY_DELAYS.len() + 2);
        assert_eq!(
            AmqpConfig::from_url("amqp://h:1/?queue=q").unwrap().vhost(),
            "/"
        );

        for bad in [
            "amqp://h/%2f",
            "http://h/?queue=q",
            "amqps://h/?queue=q",
            "amqp://h:x/?queue=q",
            "amqp://h/?queue=q&prefetch=0",
            "amqp://h/?queue=q&queue_type=stream",
            "amqp://h/?queue=q&bogus=1",
            "amqp://h/%zz?queue=q",
            "amqp:///?queue=q",
            "amqp://h/?queue=amq.x",
        ] {
            assert!(
                matches!(AmqpConfig::from_url(bad), Err(SourceError::Config(_))),
                "{bad}"
            );
        }
    }

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
