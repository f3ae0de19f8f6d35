//! Kafka: a consumer-group source and a publisher, over `rdkafka` (a
//! statically built librdkafka).
//!
//! # Kafka's redelivery model
//!
//! A Kafka partition is an ordered log. A consumer group remembers, per
//! partition, one *committed offset*: the next record to read. Everything at
//! or after it is delivered again to whichever group member owns the
//! partition after a restart or a rebalance. There is no per-message ack: a
//! record is "acked" by committing an offset past it, which also acks every
//! earlier record of the partition.
//!
//! # How this source maps it
//!
//! - Auto-commit and the automatic offset store are off. When a delivery is
//!   acked (after the inbox transaction committed; duplicates and
//!   dead-lettered records alike), the partition's **contiguous position**
//!   is committed synchronously: the lowest offset still unsettled, or one
//!   past the highest settled offset when nothing is. A commit never skips
//!   an unsettled record. Acks that arrive together share one commit.
//! - By default at most **one unsettled delivery per partition** is handed
//!   out, so the partition is processed in offset order. The engine's
//!   per-message loop ([`Consumer::run`](crate::Consumer::run)) keeps the
//!   order of each business key itself (key lanes) and asks for more
//!   ([`Source::settle_out_of_order`]): then up to that many records of one
//!   partition are in flight at once, different keys concurrently, copies of
//!   one key in offset order — Confluent's parallel consumer, by key. Batch
//!   mode asks the same; offset-watermark mode asks only with
//!   `concurrent_records`, and then stores the contiguous position its
//!   ackers report ([`Acknowledger::contiguity`](crate::source::Acknowledger::contiguity)),
//!   else it keeps one per partition. The rest of a
//!   partition waits in a buffer (the partition is paused when the buffer
//!   grows past [`KafkaConfig::max_buffered`]); different partitions are
//!   processed concurrently.
//! - A nack (retry later) delivers the *same* record again after the delay,
//!   with `delivery_count + 1`; the partition's position does not move past
//!   it (with one delivery per partition, nothing later is handed out until
//!   it settles). A delivery dropped unsettled (its task was cancelled) is
//!   redelivered at once.
//! - A dead-lettered record is published to the optional dead-letter topic
//!   ([`KafkaConfig::dead_letter_topic`]) with the header
//!   `idemq_dead_letter_reason`, then committed like an ack.
//! - On a rebalance, before revoked partitions go, the source waits up to
//!   [`KafkaConfig::revoke_grace`] for their in-flight deliveries to settle,
//!   commits what is settled, and discards their buffered records. A later ack
//!   of a delivery from a revoked partition commits nothing: the new owner
//!   redelivers the record and the inbox answers "duplicate".
//! - Dropping the source stops polling and closes the consumer in the
//!   background: it commits what is settled and leaves the group. Anything
//!   unsettled is redelivered later. Offsets are committed at every ack, so a
//!   process that exits before the close finishes loses nothing either; the
//!   group then waits for the session timeout before it rebalances.
//!
//! - In offset-watermark mode ([`Consumer::run_watermarked`](crate::Consumer::run_watermarked))
//!   the engine hands the source the store's watermarks
//!   ([`Source::resume_from`]). Every partition assigned from then on starts
//!   at its watermark (the offsets are set in the assignment itself, looked
//!   up in the rebalance callback), and partitions already assigned are
//!   sought to it at once, their buffered records below it dropped; so
//!   records already applied are not even fetched, whatever offset the group
//!   committed. Partitions without a watermark start at the committed offset.
//!   If the lookup fails or takes more than 10 s, the committed offset is
//!   used and the engine's per-record check answers what was applied.
//!   [`KafkaSource::counters`] counts records fetched and partitions positioned.
//!
//! # Loss the topic can cause
//!
//! Kafka deletes records by the topic's configuration whether or not a
//! group read them: `cleanup.policy` with `compact` keeps only the latest
//! record of each key, `retention.bytes` deletes a partition's oldest
//! segments past a size, `retention.ms` deletes records past an age. And a
//! consumer with `auto.offset.reset=latest` starts a partition without a
//! committed offset at its end, skipping what was published before.
//! [`KafkaSource::connect`] reads the topic's configuration
//! (`DescribeConfigs`) and refuses compaction, any `retention.bytes`, a
//! `retention.ms` under `min_retention` (default 1 day) and `latest`,
//! naming the setting (`broker_loss=warn` logs it and runs; see
//! [`crate::source::loss`]). A cluster that does not let the client read
//! the topic's configuration is logged at `warn` as not checked.
//!
//! Message mapping: the payload is the record value; [`Message::key`] is the
//! record key (a key that is not UTF-8 turns the delivery into a defect that
//! the engine dead-letters); the headers are the record headers;
//! [`Message::id`] is the header `message_id` (set by [`KafkaPublisher`]),
//! else `"{topic}-{partition}@{offset}"`. [`DeliveryMeta`] carries the topic,
//! partition, offset and the in-process delivery count (1 on first delivery).
//!
//! The default business key for Kafka is [`default_key_spec`]: the header
//! `event_id`, else the record key.
//!
//! ```no_run
//! use idemq::source::kafka::{default_key_spec, KafkaConfig, KafkaSource};
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
//! let config = KafkaConfig::from_url("kafka://127.0.0.1:9092/payments?group=billing")?;
//! consumer.run(KafkaSource::connect(config).await?).await?;
//! # Ok(()) }
//! ```
//!
//! [`Source::settle_out_of_order`]: crate::source::Source::settle_out_of_order
//! [`Source::resume_from`]: crate::source::Source::resume_from
//! [`Message::key`]: crate::message::Message::key
//! [`Message::id`]: crate::message::Message::id
//! [`DeliveryMeta`]: crate::message::DeliveryMeta

mod acker;
mod config;
mod connection;
mod limits;
mod partition;
mod poller;
mod publisher;
mod registration;
mod source;

pub use config::{default_key_spec, KafkaConfig, DEAD_LETTER_REASON_HEADER, MESSAGE_ID_HEADER};
pub use publisher::{create_topic, delete_topic, KafkaPublisher};
pub use registration::BROKER;
pub use source::{KafkaCounters, KafkaSource};

use crate::error::SourceError;

fn broker(e: impl std::error::Error + Send + Sync + 'static) -> SourceError {
    SourceError::broker(e.to_string()).with_source(e)
}

#[cfg(test)]
mod broker_error_tests {
    use super::*;

    #[test]
    fn a_broker_error_keeps_the_client_error_as_its_source() {
        let err = broker(rdkafka::error::KafkaError::Canceled);
        assert_eq!(err.kind(), crate::SourceErrorKind::Broker);
        assert!(std::error::Error::source(&err).is_some(), "{err:?}");
    }
}
