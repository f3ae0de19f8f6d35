//! The event-loop driver shared by the source and the publisher: connecting,
//! subscribing, reconnecting, and publishes that wait for their `PUBACK`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttc::v5::mqttbytes::v5::SubscribeReasonCode;
use rumqttc::v5::mqttbytes::v5::{Packet, PubAckReason, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use rumqttc::v5::{AsyncClient, ConnectionError, Event, EventLoop, MqttOptions};
use rumqttc::Outgoing;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::source::Incoming;
use crate::error::SourceError;
use crate::sync::lock;

/// How long connecting (up to the subscription's acknowledgement) may take.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a publish waits for its `PUBACK`.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause between reconnection attempts.
const RECONNECT_PAUSE: Duration = Duration::from_millis(500);
/// Requests queued towards the event loop.
const REQUEST_CAPACITY: usize = 256;

pub(super) fn broker_error(what: &str, e: impl Into<crate::error::BoxError>) -> SourceError {
    crate::source::kit::broker_error("MQTT", what, e)
}

type PubAckResult = Result<(), String>;

/// Publishes waiting for their `PUBACK`: one publish at a time is between
/// its request and its packet id.
#[derive(Default)]
struct Waiters {
    next: Mutex<Option<oneshot::Sender<PubAckResult>>>,
    by_pkid: Mutex<HashMap<u16, oneshot::Sender<PubAckResult>>>,
    /// Told once the event loop wrote a `DISCONNECT` and ended.
    disconnected: tokio::sync::Notify,
}

/// How long the event loop keeps going after it wrote a `DISCONNECT`, for
/// the connection to close.
const DISCONNECT_FLUSH: Duration = Duration::from_secs(2);

/// The client side of one connection: requests, and publishes that wait for their `PUBACK`.
pub(super) struct Link {
    pub(super) client: AsyncClient,
    waiters: Arc<Waiters>,
    publishing: tokio::sync::Mutex<()>,
    pub(super) driver: JoinHandle<()>,
}

impl Link {
    /// Sends `DISCONNECT` after every request queued before it (`PUBACK`s
    /// of settled deliveries among them) and waits, at most `limit`, until
    /// the event loop wrote it. The session stays (its expiry is not
    /// changed): what was not acknowledged comes back at the next connect.
    pub(super) async fn disconnect(&self, limit: Duration) -> Result<(), SourceError> {
        self.client
            .disconnect()
            .await
            .map_err(|e| broker_error("DISCONNECT", e))?;
        tokio::time::timeout(limit, self.waiters.disconnected.notified())
            .await
            .map_err(|_| broker_error("DISCONNECT", format!("not written within {limit:?}")))
    }
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
    pub(super) async fn publish(
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
pub(super) struct Subscription {
    pub(super) filter: String,
    pub(super) deliveries: mpsc::UnboundedSender<Incoming>,
}

/// Connects and starts the event-loop task; returns once connected (and
/// subscribed, for a source).
pub(super) async fn open(
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
            Event::Outgoing(Outgoing::Disconnect) => {
                // Let the connection close, so that the DISCONNECT and
                // everything queued before it are on the wire.
                let _ = tokio::time::timeout(DISCONNECT_FLUSH, async {
                    while eventloop.poll().await.is_ok() {}
                })
                .await;
                waiters.disconnected.notify_one();
                return;
            }
            Event::Incoming(Packet::Disconnect(d)) => {
                tracing::warn!(reason = ?d.reason_code, "the MQTT broker disconnected");
            }
            _ => {}
        }
    }
}

/// A failed connection: refused credentials and a TLS setup or handshake
/// that fails (an unknown CA, a server without TLS) are configuration
/// errors, which no retry fixes; the rest are the broker's.
fn connection_error(e: &ConnectionError) -> SourceError {
    use rumqttc::v5::mqttbytes::v5::ConnectReturnCode as Code;
    use rumqttc::v5::mqttbytes::Error as MqttError;
    use rumqttc::v5::StateError;
    let refused_for_good = match e {
        ConnectionError::ConnectionRefused(
            Code::BadUserNamePassword | Code::NotAuthorized | Code::BadAuthenticationMethod,
        ) => true,
        ConnectionError::Tls(_) => true,
        ConnectionError::Io(io) => io.kind() == std::io::ErrorKind::InvalidData,
        // A TLS alert from the broker (a client certificate it requires or
        // refuses) arrives with the first read, inside the state error.
        ConnectionError::MqttState(StateError::Deserialization(MqttError::Io(io))) => {
            io.kind() == std::io::ErrorKind::InvalidData
        }
        _ => false,
    };
    if refused_for_good {
        SourceError::config(format!("MQTT: connect: {e}"))
    } else {
        broker_error("connect", e.to_string())
    }
}
