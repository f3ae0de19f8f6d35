//! MQTT 5: a [`Source`] over a persistent session and a [`Publisher`], over
//! `rumqttc` (its `v5` client, without TLS).
//!
//! # How MQTT redelivers
//!
//! With QoS 1 the broker sends a `PUBLISH` and keeps it until the client
//! answers with a `PUBACK`. There is no negative acknowledgement and no
//! redelivery within a connection: an unacknowledged message is sent again
//! (with the `DUP` flag) only when the client *reconnects to the same
//! session*, that is with the same client id, `clean start` off and a
//! session expiry interval that has not run out. A session also queues the
//! messages that arrive while its client is offline.
//!
//! # How this source maps it
//!
//! - **Session**: MQTT 5, `clean start` off and a session expiry interval
//!   ([`MqttConfig::session_expiry`], default 1 day), a fixed
//!   [`client_id`](MqttConfig::client_id), and a QoS 1 subscription to
//!   [`MqttConfig::topic`] (wildcards and shared subscriptions
//!   `$share/group/filter` allowed). The subscription is renewed whenever the
//!   broker reports that the session was lost.
//! - **Manual acknowledgement**: `rumqttc`'s automatic `PUBACK` is off; the
//!   `PUBACK` is sent when the delivery is acked, that is after the inbox
//!   commit (duplicates and dead letters are acked the same way). A crash
//!   before it leaves the message unacknowledged in the session, and the
//!   broker sends it again after the reconnect. Acks go out in the order
//!   deliveries are settled, not in the order of receipt; MQTT 5 allows that
//!   and Mosquitto accepts it.
//! - **Nack(delay)**: there is no MQTT nack. The message is kept (no
//!   `PUBACK`) and handed to the engine again after the delay, with
//!   `delivery_count + 1`. A delivery dropped unsettled (its task was
//!   cancelled) is handed out again at once.
//! - **Delivery count**: counted in the process: 1, or 2 when the broker set
//!   the `DUP` flag (a redelivery after a reconnect), plus one per nack.
//! - **Dead-letter**: with [`MqttConfig::dead_letter_topic`] set, a copy
//!   (payload and user properties, plus the user property
//!   `dead_letter_reason`) is published there with QoS 1 and, once the broker
//!   acknowledged it, the original is acked.
//! - The broker stops sending once its in-flight window for the client is
//!   full of unacknowledged messages (Mosquitto: `max_inflight_messages`,
//!   20 by default), so messages waiting for a retry hold up later ones.
//!
//! # Message mapping
//!
//! The payload is the MQTT payload. [`Message::id`] is the user property
//! `message_id` and [`Message::key`] the user property `key` (both absent
//! without them: the broker's packet id is not a message id); every other
//! user property becomes a header, in order. A business key can also come
//! from the JSON payload (`KeySpec::json`). [`DeliveryMeta`] has source
//! `mqtt` and the message's topic. [`MqttPublisher`] writes the same user
//! properties.
//!
//! ```no_run
//! use idemq::source::mqtt::{MqttConfig, MqttPublisher, MqttSource};
//! use idemq::source::Publisher;
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//! use idemq::{Consumer, KeySpec, Message};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let publisher = MqttPublisher::connect(&MqttConfig::from_url(
//!     "mqtt://127.0.0.1:1883/payments/eu?client_id=producer",
//! )?)
//! .await?;
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
//! let config = MqttConfig::from_url("mqtt://127.0.0.1:1883/payments/#?client_id=billing-1")?;
//! consumer
//!     .run_until(MqttSource::connect(config).await?, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions};
use rumqttc::Outgoing;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::url::{Bare, BrokerUrl};
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::SourceError;
use crate::message::{DeliveryMeta, Message};
use crate::store::DeadLetterReason;

/// The user property that carries [`Message::id`].
pub const ID_PROPERTY: &str = "message_id";
/// The user property that carries [`Message::key`].
pub const KEY_PROPERTY: &str = "key";
/// The user property added to copies on the dead-letter topic.
pub const REASON_PROPERTY: &str = "dead_letter_reason";

const SOURCE_NAME: &str = "mqtt";
/// How long connecting (up to the subscription's acknowledgement) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a publish waits for its `PUBACK`.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between reconnection attempts.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);
/// Requests queued towards the event loop.
const REQUEST_CAPACITY: usize = 256;

/// How to reach the broker and what to subscribe to. Build it with
/// [`MqttConfig::new`] and the public fields, or parse a URL with
/// [`MqttConfig::from_url`].
#[derive(Clone, PartialEq, Eq)]
pub struct MqttConfig {
    /// Broker host.
    pub host: String,
    /// Broker port (default 1883).
    pub port: u16,
    /// The topic filter to subscribe to (wildcards and `$share/group/…`
    /// allowed); for [`MqttPublisher`], the topic to publish to.
    pub topic: String,
    /// The client id, which names the persistent session: keep it stable
    /// across restarts, and unique among the consumers running at once.
    pub client_id: String,
    /// Keep-alive interval (default 30 s, at least 5 s).
    pub keep_alive: Duration,
    /// How long the broker keeps the session after a disconnect (default 1 day).
    pub session_expiry: Duration,
    /// Where dead-lettered messages are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
    /// Username and password, if the broker requires them.
    pub credentials: Option<(String, String)>,
}

impl std::fmt::Debug for MqttConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("topic", &self.topic)
            .field("client_id", &self.client_id)
            .field("keep_alive", &self.keep_alive)
            .field("session_expiry", &self.session_expiry)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("credentials", &self.credentials.as_ref().map(|(u, _)| u))
            .finish()
    }
}

impl MqttConfig {
    /// Defaults for `topic` on `host:port` as `client_id`.
    pub fn new(
        host: impl Into<String>,
        port: u16,
        topic: impl Into<String>,
        client_id: impl Into<String>,
    ) -> Self {
        Self {
            host: host.into(),
            port,
            topic: topic.into(),
            client_id: client_id.into(),
            keep_alive: Duration::from_secs(30),
            session_expiry: Duration::from_secs(86_400),
            dead_letter_topic: None,
            credentials: None,
        }
    }

    /// Parses
    /// `mqtt://[user:password@]host[:port]/topic/filter?client_id=ID[&qos=1][&keep_alive=30s][&session_expiry=1h][&dead_letter_topic=T]`.
    ///
    /// Everything between the first `/` and the `?` is the topic filter, `#`
    /// and `+` included (they may also be written `%23` and `%2B`).
    /// `client_id` is required; only `qos=1` is supported. Durations take a
    /// unit (`ms`, `s`, `m`, `h`; a bare number is seconds).
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("MQTT", "mqtt", url)?;
        u.require_path("topic")?;
        let (host, port) = u.host_port(1883)?;
        let mut config = Self::new(host, port, u.decoded_path()?, "");
        config.credentials.clone_from(&u.userinfo);
        for p in u.params() {
            match p.name.as_str() {
                "client_id" => config.client_id = p.value,
                "qos" => {
                    p.choice(&["1"])?;
                }
                "keep_alive" => config.keep_alive = p.duration(Bare::Seconds)?,
                "session_expiry" => config.session_expiry = p.duration(Bare::Seconds)?,
                "dead_letter_topic" => config.dead_letter_topic = Some(p.value),
                _ => return Err(p.unknown()),
            }
        }
        if config.client_id.is_empty() {
            return Err(u.missing("client_id"));
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets the session expiry interval.
    pub fn session_expiry(mut self, expiry: Duration) -> Self {
        self.session_expiry = expiry;
        self
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if self.topic.is_empty() {
            return Err(config_error("the topic is empty"));
        }
        if self.client_id.is_empty() {
            return Err(config_error("the client id is empty"));
        }
        if let Some(dlq) = &self.dead_letter_topic {
            validate_publish_topic(dlq)?;
        }
        if self.keep_alive < Duration::from_secs(5) {
            return Err(config_error("keep_alive must be at least 5 s"));
        }
        if self.session_expiry.as_secs() == 0 || self.session_expiry.as_secs() > u64::from(u32::MAX)
        {
            return Err(config_error(
                "session_expiry must be from 1 s to 2^32-1 s (a persistent session)",
            ));
        }
        Ok(())
    }

    fn options(&self, client_id: &str, persistent: bool) -> MqttOptions {
        let mut options = MqttOptions::new(client_id, self.host.clone(), self.port);
        options.set_keep_alive(self.keep_alive);
        options.set_manual_acks(true);
        options.set_connection_timeout(CONNECT_TIMEOUT.as_secs());
        if persistent {
            options.set_clean_start(false);
            options.set_session_expiry_interval(Some(
                u32::try_from(self.session_expiry.as_secs()).unwrap_or(u32::MAX),
            ));
        } else {
            options.set_clean_start(true);
        }
        if let Some((user, password)) = &self.credentials {
            options.set_credentials(user.clone(), password.clone());
        }
        options
    }
}

fn config_error(text: impl Into<String>) -> SourceError {
    SourceError::Config(text.into())
}

fn broker_error(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(format!("MQTT {what}: {e}"))
}

fn validate_publish_topic(topic: &str) -> Result<(), SourceError> {
    if topic.is_empty() || topic.contains(['#', '+']) || topic.starts_with('$') {
        return Err(config_error(format!(
            "{topic:?} is not a topic to publish to (empty, a wildcard or a $ topic)"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The event loop driver, shared by the source and the publisher

type PubAckResult = Result<(), String>;

/// Publishes waiting for their `PUBACK`: one publish at a time is between
/// its request and its packet id.
#[derive(Default)]
struct Waiters {
    next: Mutex<Option<oneshot::Sender<PubAckResult>>>,
    by_pkid: Mutex<HashMap<u16, oneshot::Sender<PubAckResult>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The client side of one connection: requests, and publishes that wait for their `PUBACK`.
struct Link {
    client: AsyncClient,
    waiters: Arc<Waiters>,
    publishing: tokio::sync::Mutex<()>,
    driver: JoinHandle<()>,
}

impl Drop for Link {
    /// Closes the connection without `DISCONNECT`: the session keeps what
    /// was not acknowledged.
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Link {
    /// Publishes with QoS 1 and waits for the broker's `PUBACK`.
    async fn publish(
        &self,
        topic: &str,
        payload: Vec<u8>,
        properties: PublishProperties,
    ) -> Result<(), SourceError> {
        let _one_at_a_time = self.publishing.lock().await;
        let (tx, rx) = oneshot::channel();
        *lock(&self.waiters.next) = Some(tx);
        self.client
            .publish_with_properties(topic, QoS::AtLeastOnce, false, payload, properties)
            .await
            .map_err(|e| broker_error(&format!("publish to {topic}"), e))?;
        match tokio::time::timeout(PUBLISH_TIMEOUT, rx).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(reason))) => Err(broker_error(
                &format!("publish to {topic}"),
                format!("refused: {reason}"),
            )),
            Ok(Err(_)) => Err(broker_error(
                &format!("publish to {topic}"),
                "the connection closed",
            )),
            Err(_) => {
                lock(&self.waiters.next).take();
                Err(broker_error(
                    &format!("publish to {topic}"),
                    format!("no PUBACK within {PUBLISH_TIMEOUT:?}"),
                ))
            }
        }
    }
}

/// What the driver does with a subscription.
struct Subscription {
    filter: String,
    deliveries: mpsc::UnboundedSender<Incoming>,
}

/// Connects and starts the event-loop task; returns once connected (and
/// subscribed, for a source).
async fn open(
    options: MqttOptions,
    subscription: Option<Subscription>,
) -> Result<Link, SourceError> {
    let (client, eventloop) = AsyncClient::new(options, REQUEST_CAPACITY);
    if let Some(s) = &subscription {
        client
            .subscribe(s.filter.clone(), QoS::AtLeastOnce)
            .await
            .map_err(|e| broker_error("subscribe", e))?;
    }
    let waiters = Arc::new(Waiters::default());
    let (ready_tx, ready_rx) = oneshot::channel();
    let driver = tokio::spawn(drive(
        eventloop,
        client.clone(),
        subscription,
        Arc::clone(&waiters),
        ready_tx,
    ));
    let link = Link {
        client,
        waiters,
        publishing: tokio::sync::Mutex::new(()),
        driver,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, ready_rx).await {
        Ok(Ok(Ok(()))) => Ok(link),
        Ok(Ok(Err(e))) => Err(e),
        Ok(Err(_)) => Err(broker_error("connect", "the event loop ended")),
        Err(_) => Err(broker_error(
            "connect",
            format!("not connected within {CONNECT_TIMEOUT:?}"),
        )),
    }
}

async fn drive(
    mut eventloop: EventLoop,
    client: AsyncClient,
    subscription: Option<Subscription>,
    waiters: Arc<Waiters>,
    ready: oneshot::Sender<Result<(), SourceError>>,
) {
    let mut ready = Some(ready);
    let mut connected = false;
    loop {
        let event = match eventloop.poll().await {
            Ok(event) => event,
            Err(e) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(connection_error(&e)));
                    return;
                }
                tracing::warn!(error = %e, "MQTT connection failed; reconnecting");
                // Publishes waiting for a PUBACK: the session resends them.
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        match event {
            Event::Incoming(Packet::ConnAck(connack)) => {
                tracing::debug!(session_present = connack.session_present, "MQTT connected");
                match (&subscription, connected) {
                    (None, false) => {
                        if let Some(ready) = ready.take() {
                            let _ = ready.send(Ok(()));
                        }
                    }
                    (Some(s), true) if !connack.session_present => {
                        tracing::warn!(filter = %s.filter, "the MQTT session was lost; subscribing again");
                        if let Err(e) = client.try_subscribe(s.filter.clone(), QoS::AtLeastOnce) {
                            tracing::error!(error = %e, "subscribing again failed");
                        }
                    }
                    _ => {}
                }
                connected = true;
            }
            Event::Incoming(Packet::SubAck(suback)) => {
                let refused = suback
                    .return_codes
                    .iter()
                    .find(|c| !matches!(c, SubscribeReasonCode::Success(_)));
                let result = match refused {
                    Some(code) => Err(broker_error(
                        "subscribe",
                        format!("refused by the broker: {code:?}"),
                    )),
                    None => Ok(()),
                };
                match ready.take() {
                    Some(ready) => {
                        let failed = result.is_err();
                        let _ = ready.send(result);
                        if failed {
                            return;
                        }
                    }
                    None => {
                        if let Err(e) = result {
                            tracing::error!(error = %e, "MQTT subscription refused");
                        }
                    }
                }
            }
            Event::Incoming(Packet::Publish(publish)) => {
                if let Some(s) = &subscription {
                    let delivery_count = if publish.dup { 2 } else { 1 };
                    let _ = s.deliveries.send(Incoming {
                        publish,
                        delivery_count,
                    });
                }
            }
            Event::Outgoing(Outgoing::Publish(pkid)) => {
                if let Some(tx) = lock(&waiters.next).take() {
                    lock(&waiters.by_pkid).insert(pkid, tx);
                }
            }
            Event::Incoming(Packet::PubAck(puback)) => {
                if let Some(tx) = lock(&waiters.by_pkid).remove(&puback.pkid) {
                    let result = match puback.reason {
                        PubAckReason::Success | PubAckReason::NoMatchingSubscribers => Ok(()),
                        other => Err(format!("{other:?}")),
                    };
                    let _ = tx.send(result);
                }
            }
            Event::Incoming(Packet::Disconnect(d)) => {
                tracing::warn!(reason = ?d.reason_code, "the MQTT broker disconnected");
            }
            _ => {}
        }
    }
}

fn connection_error(e: &ConnectionError) -> SourceError {
    broker_error("connect", e)
}

// ---------------------------------------------------------------------------
// The source

/// A received publish and how often it was delivered.
struct Incoming {
    publish: Publish,
    delivery_count: u32,
}

/// Everything the source and its acknowledgers share.
struct Shared {
    link: Link,
    dead_letter_topic: Option<String>,
    /// Back into the source: nacked and dropped deliveries.
    again: mpsc::UnboundedSender<Incoming>,
}

/// Consumes one topic filter over a persistent MQTT 5 session (see the
/// [module docs](self)).
pub struct MqttSource {
    shared: Arc<Shared>,
    deliveries: mpsc::UnboundedReceiver<Incoming>,
    client_id: String,
}

impl std::fmt::Debug for MqttSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttSource")
            .field("client_id", &self.client_id)
            .finish_non_exhaustive()
    }
}

impl MqttSource {
    /// Connects with `clean start` off, subscribes with QoS 1, and returns
    /// once the broker acknowledged the subscription.
    pub async fn connect(config: MqttConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let link = open(
            config.options(&config.client_id, true),
            Some(Subscription {
                filter: config.topic.clone(),
                deliveries: tx.clone(),
            }),
        )
        .await?;
        tracing::debug!(client_id = %config.client_id, filter = %config.topic, "MQTT source connected");
        Ok(Self {
            shared: Arc::new(Shared {
                link,
                dead_letter_topic: config.dead_letter_topic,
                again: tx,
            }),
            deliveries: rx,
            client_id: config.client_id,
        })
    }

    fn delivery(&self, incoming: Incoming) -> Delivery {
        let message = to_message(&incoming.publish);
        let meta = DeliveryMeta {
            source: SOURCE_NAME.into(),
            topic: Some(String::from_utf8_lossy(&incoming.publish.topic).into_owned()),
            partition: None,
            offset: None,
            delivery_count: incoming.delivery_count.max(1),
        };
        let acker = MqttAcker {
            shared: Arc::clone(&self.shared),
            incoming: Some(incoming),
        };
        Delivery::new(message, meta, Box::new(acker))
    }
}

impl Drop for MqttSource {
    /// Closes the connection without `DISCONNECT` (even while deliveries are
    /// unsettled): the session keeps what was not acknowledged, and the
    /// broker resends it when this client id connects again.
    fn drop(&mut self) {
        self.shared.link.driver.abort();
    }
}

#[async_trait]
impl Source for MqttSource {
    /// The next delivery; never `None` (a subscription does not end). Cancel-safe.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        match self.deliveries.recv().await {
            Some(incoming) => Ok(Some(self.delivery(incoming))),
            None => Err(SourceError::Other("the MQTT event loop ended".into())),
        }
    }
}

/// Maps a publish to a [`Message`] (see the module docs).
fn to_message(publish: &Publish) -> Message {
    let mut message = Message::new(publish.payload.to_vec());
    if let Some(properties) = &publish.properties {
        for (name, value) in &properties.user_properties {
            match name.as_str() {
                ID_PROPERTY if message.id.is_none() => message.id = Some(value.clone()),
                KEY_PROPERTY if message.key.is_none() => message.key = Some(value.clone()),
                _ => message.headers.insert(name.clone(), value.as_bytes()),
            }
        }
    }
    message
}

/// The user properties [`MqttPublisher`] writes for `message`.
fn user_properties(message: &Message) -> Result<Vec<(String, String)>, SourceError> {
    let mut properties = Vec::new();
    if let Some(id) = &message.id {
        properties.push((ID_PROPERTY.to_owned(), id.clone()));
    }
    if let Some(key) = &message.key {
        properties.push((KEY_PROPERTY.to_owned(), key.clone()));
    }
    for (name, value) in message.headers.iter() {
        let value = std::str::from_utf8(value).map_err(|_| {
            SourceError::Other(format!(
                "header {name:?} is not UTF-8: MQTT user properties are text"
            ))
        })?;
        properties.push((name.to_owned(), value.to_owned()));
    }
    Ok(properties)
}

/// Settles one MQTT delivery.
struct MqttAcker {
    shared: Arc<Shared>,
    /// `None` once settled.
    incoming: Option<Incoming>,
}

impl MqttAcker {
    /// Hands the message to the engine again after `delay`, counted as a new delivery.
    fn again_after(&self, incoming: Incoming, delay: Duration) {
        let again = self.shared.again.clone();
        let incoming = Incoming {
            delivery_count: incoming.delivery_count.saturating_add(1),
            ..incoming
        };
        if delay.is_zero() {
            let _ = again.send(incoming);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // unacknowledged: the broker resends it after a reconnect
        };
        runtime.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = again.send(incoming);
        });
    }
}

impl Drop for MqttAcker {
    /// Dropped unsettled: handed out again at once (the broker would only
    /// resend it after a reconnect).
    fn drop(&mut self) {
        if let Some(incoming) = self.incoming.take() {
            self.again_after(incoming, Duration::ZERO);
        }
    }
}

#[async_trait]
impl Acknowledger for MqttAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(incoming) = self.incoming.take() else {
            return Ok(());
        };
        self.shared
            .link
            .client
            .ack(&incoming.publish)
            .await
            .map_err(|e| broker_error("PUBACK", e))
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        if let Some(incoming) = self.incoming.take() {
            self.again_after(incoming, delay);
        }
        Ok(())
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(incoming) = self.incoming.take() else {
            return Ok(());
        };
        if let Some(topic) = &self.shared.dead_letter_topic {
            let mut properties = PublishProperties::default();
            if let Some(p) = &incoming.publish.properties {
                properties.user_properties = p
                    .user_properties
                    .iter()
                    .filter(|(n, _)| n != REASON_PROPERTY)
                    .cloned()
                    .collect();
                properties.content_type = p.content_type.clone();
            }
            properties
                .user_properties
                .push((REASON_PROPERTY.to_owned(), reason.code().to_owned()));
            let copied = self
                .shared
                .link
                .publish(topic, incoming.publish.payload.to_vec(), properties)
                .await;
            if let Err(e) = copied {
                // Not acked: handed out again a little later.
                self.again_after(incoming, Duration::from_secs(1));
                return Err(e);
            }
        }
        self.shared
            .link
            .client
            .ack(&incoming.publish)
            .await
            .map_err(|e| broker_error("PUBACK", e))
    }
}

/// Publishes to one topic with QoS 1 and waits for each `PUBACK`.
///
/// [`Message::id`] goes to the user property `message_id`, [`Message::key`]
/// to `key`, every header to a user property of its name (headers must be
/// UTF-8). It connects with a clean session under the client id
/// `<client_id>-pub-<random>`.
pub struct MqttPublisher {
    link: Link,
    topic: String,
}

impl std::fmt::Debug for MqttPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl MqttPublisher {
    /// Connects to the broker of `config` to publish to [`MqttConfig::topic`]
    /// (which must be a plain topic, without wildcards).
    pub async fn connect(config: &MqttConfig) -> Result<Self, SourceError> {
        validate_publish_topic(&config.topic)?;
        let client_id = format!("{}-pub-{:08x}", config.client_id, fastrand::u32(..));
        let link = open(config.options(&client_id, false), None).await?;
        Ok(Self {
            link,
            topic: config.topic.clone(),
        })
    }
}

#[async_trait]
impl Publisher for MqttPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let properties = PublishProperties {
            user_properties: user_properties(message)?,
            ..PublishProperties::default()
        };
        self.link
            .publish(&self.topic, message.payload.clone(), properties)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = MqttConfig::from_url(
            "mqtt://u:p%40ss@127.0.0.1:1884/orders/#?client_id=c1&qos=1&keep_alive=10s&session_expiry=1h&dead_letter_topic=orders-dead",
        )
        .unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 1884);
        assert_eq!(c.topic, "orders/#");
        assert_eq!(c.client_id, "c1");
        assert_eq!(c.keep_alive, Duration::from_secs(10));
        assert_eq!(c.session_expiry, Duration::from_secs(3600));
        assert_eq!(c.dead_letter_topic.as_deref(), Some("orders-dead"));
        assert_eq!(c.credentials, Some(("u".into(), "p@ss".into())));

        let c = MqttConfig::from_url("mqtt://broker/%24share/g/a%2Bb?client_id=x").unwrap();
        assert_eq!(c.port, 1883);
        assert_eq!(c.topic, "$share/g/a+b");
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "tcp://h:1883/t?client_id=c",
            "mqtt://h:1883/t",
            "mqtt://h:1883?client_id=c",
            "mqtt://h:1883/?client_id=c",
            "mqtt://:1883/t?client_id=c",
            "mqtt://h:x/t?client_id=c",
            "mqtt://h/t?client_id=c&qos=0",
            "mqtt://h/t?client_id=c&keep_alive=1s",
            "mqtt://h/t?client_id=c&session_expiry=0",
            "mqtt://h/t?client_id=c&dead_letter_topic=a/%23",
            "mqtt://h/t?client_id=c&bogus=1",
        ] {
            assert!(
                matches!(MqttConfig::from_url(url), Err(SourceError::Config(_))),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn maps_user_properties_both_ways() {
        let message = Message::new("{}")
            .with_id("m-1")
            .with_key("k-1")
            .with_header("event_id", "e-1");
        let properties = PublishProperties {
            user_properties: user_properties(&message).unwrap(),
            ..PublishProperties::default()
        };
        let publish = Publish::new("t", QoS::AtLeastOnce, "{}", Some(properties));
        assert_eq!(to_message(&publish), message);
        assert!(user_properties(&Message::new("x").with_header("raw", vec![0xff])).is_err());
        let bare = Publish::new("t", QoS::AtLeastOnce, "x", None);
        assert_eq!(to_message(&bare), Message::new("x"));
    }
}
