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
//! - The client persists consumer offsets every 5 s (one-way); at close the
//!   source commits them and waits for the broker's answers before the
//!   consumer leaves, so a consumer started right after does not get what
//!   was settled again. The offset never passes a message still being
//!   consumed. A process that is killed has everything since the last
//!   persisted offset delivered again, and the inbox answers "duplicate" for
//!   what had committed.
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
//! Lag: every 5 s (`lag_interval=`; `0` turns it off) the client thread sets
//! the gauge
//! `idemq_source_lag_messages{source="rocketmq",group=GROUP,topic=TOPIC,partition="BROKER:QUEUE_ID"}`
//! for each queue this consumer holds: the queue's max offset minus the
//! consumer's own offset (what it has consumed, read from its memory and not
//! from the broker, which would overwrite a newer offset). Queues another
//! member holds are that member's to report.
//!
//! Loss the settings can cause: [`RocketMqSource::connect`] refuses a
//! `max_reconsume_times` not above idemq's default retry attempts (the
//! broker would move a message to `%DLQ%<group>` before idemq's retries
//! are done) and `start_from=latest` (a group without an offset skips what
//! was published before), naming each; `broker_loss=warn` logs them and
//! runs. The broker's own retention (`fileReservedTime`) is read from the
//! topic's master brokers for `idemq doctor` and the retention floor (the
//! `admin` module); see [`crate::source::loss`] and `docs/operations.md`.
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

mod acker;
mod admin;
mod client;
mod config;
mod lag;
mod limits;
mod mapping;
mod publisher;
mod registration;
mod source;

pub use acker::DEAD_LETTER_REASON_PROPERTY;
pub use config::{AclCredentials, RocketMqConfig, StartFrom};
pub use mapping::{default_key_spec, KEYS_PROPERTY, UNIQ_KEY_PROPERTY};
pub use publisher::RocketMqPublisher;
pub use registration::BROKER;
pub use source::RocketMqSource;

// Items the module docs link to.
#[cfg(doc)]
use super::Source;
#[cfg(doc)]
use crate::message::{DeliveryMeta, Message};
