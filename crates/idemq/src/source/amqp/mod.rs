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
//! ## Lag
//!
//! Every 5 s (`lag_interval=`; `0` turns it off) a background task declares
//! the work queue passively, on a channel of its own, and sets the gauge
//! `idemq_source_lag_messages{source="amqp",group="",topic=QUEUE,partition=""}`
//! to its `message_count`: the messages ready, not delivered yet. Those
//! delivered and not acknowledged yet (at most the prefetch) are not
//! counted: AMQP does not tell them.
//!
//! ## Loss the queue can cause
//!
//! When it connects, the source reads the work queue's and the dead-letter
//! queue's `x-` arguments and the policies that apply to them from
//! RabbitMQ's management API (AMQP tells a client neither) and refuses to
//! start on a setting that drops messages no consumer processed: a length
//! limit with `overflow: drop-head`, a `message-ttl` or `expires` under
//! `min_retention` (default 1 day), a `delivery-limit` not above idemq's
//! default retry attempts. `broker_loss=warn` logs them and runs;
//! `management_url=` says where the API is (default: the AMQP host on port
//! 15672, 15671 over TLS; `off` skips the check). See
//! [`crate::source::loss`].
//!
//! ## URL
//!
//! `amqp://user:pass@host:port/vhost?queue=NAME[&prefetch=N][&queue_type=classic|quorum][&lag_interval=5s][&management_url=URL|off][&broker_loss=refuse|warn][&min_retention=1d]`,
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

mod acker;
mod channel;
mod config;
mod headers;
mod lag;
mod limits;
mod management;
mod publisher;
mod registration;
mod source;
mod topology;

pub use config::{AmqpConfig, QueueType};
pub use headers::{
    DELIVERIES_HEADER, DELIVERY_COUNT_HEADER, KEY_HEADER, QUEUE_HEADER, REASON_HEADER,
};
pub use publisher::AmqpPublisher;
pub use registration::BROKER;
pub use source::AmqpSource;
pub use topology::RETRY_DELAYS;

#[cfg(doc)]
use crate::message::{DeliveryMeta, Message};
