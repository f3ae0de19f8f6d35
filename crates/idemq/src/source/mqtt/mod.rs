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

mod acker;
mod config;
mod link;
mod properties;
mod publisher;
mod registration;
mod source;

pub use config::MqttConfig;
pub use properties::{ID_PROPERTY, KEY_PROPERTY, REASON_PROPERTY};
pub use publisher::MqttPublisher;
pub use registration::BROKER;
pub use source::MqttSource;

#[cfg(doc)]
use super::{Publisher, Source};
#[cfg(doc)]
use crate::message::{DeliveryMeta, Message};
