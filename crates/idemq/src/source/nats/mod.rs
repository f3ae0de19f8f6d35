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
//! # Lag
//!
//! Every 5 s (`lag_interval=`; `0` turns it off) a background task reads the
//! durable consumer's info and sets the gauge
//! `idemq_source_lag_messages{source="nats",group=CONSUMER,topic=STREAM,partition=""}`
//! to `num_pending + num_ack_pending`: the messages not delivered yet plus
//! those delivered and not acknowledged yet.
//!
//! # Loss the stream can cause
//!
//! A stream with limits (`max_msgs`, `max_bytes`, `max_age`,
//! `max_msgs_per_subject`) and `discard: old` deletes its oldest messages
//! when a limit is reached, whether or not this consumer processed them.
//! [`NatsSource::connect`] reads the stream's configuration and refuses
//! such a stream, naming the limit (`broker_loss=warn` logs it and runs;
//! see [`crate::source::loss`]).
//!
//! # Configuration
//!
//! `nats://[user:password@]host:4222/STREAM/CONSUMER?subject=orders.>&ack_wait=30s&max_deliver=10&batch=10&wait=5s&dlq_subject=orders.dead&duplicate_window=2m&create=true&lag_interval=5s&broker_loss=refuse`
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
//!
//! [`Source`]: crate::source::Source
//! [`Source::next`]: crate::source::Source::next
//! [`Publisher`]: crate::source::Publisher
//! [`DeliveryMeta`]: crate::message::DeliveryMeta
//! [`DeliveryMeta::delivery_count`]: crate::message::DeliveryMeta::delivery_count
//! [`DeadLetterReason::code`]: crate::outcome::DeadLetterReason::code
//! [`Message::id`]: crate::message::Message::id
//! [`Message::key`]: crate::message::Message::key

mod acker;
mod config;
mod lag;
mod limits;
mod mapping;
mod publisher;
mod registration;
mod source;

pub use config::NatsConfig;
pub use mapping::{ID_HEADER, KEY_HEADER, REASON_HEADER};
pub use publisher::NatsPublisher;
pub use registration::BROKER;
pub use source::NatsSource;
