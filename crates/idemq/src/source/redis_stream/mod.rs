//! Redis Streams: a consumer-group [`Source`] and a [`Publisher`], over the
//! `redis` crate.
//!
//! # How Redis Streams redeliver
//!
//! A stream is an append-only log of entries, each a list of field/value
//! pairs under an id such as `1700000000000-0`. A *consumer group* hands every
//! new entry to one of its consumers (`XREADGROUP … >`) and records it in the
//! group's *pending entries list* (PEL) under that consumer, with a delivery
//! counter, until the entry is acknowledged (`XACK`). Nothing is ever
//! redelivered by itself: an entry whose consumer died stays pending until
//! some consumer *claims* it (`XCLAIM` / `XAUTOCLAIM`, which increments its
//! delivery counter) or the same consumer name re-reads its own PEL
//! (`XREADGROUP … 0`).
//!
//! # How this source maps it
//!
//! - **Startup**: the group is created if missing (`XGROUP CREATE … MKSTREAM`,
//!   from [`RedisStreamConfig::start`]; an existing group is kept), and
//!   checked for entries removed before it read them (below). The
//!   source first re-reads *its own* PEL (`XREADGROUP … 0`), so a consumer
//!   that restarts under the same name ([`RedisStreamConfig::consumer`])
//!   gets back at once what it held when it died.
//! - **New entries**: `XREADGROUP … COUNT n BLOCK t STREAMS s >`, in a
//!   background task, so that [`Source::next`] is cancel-safe.
//! - **Dead consumers**: every half [`claim_idle`](RedisStreamConfig::claim_idle)
//!   the source runs `XAUTOCLAIM` for entries pending longer than
//!   `claim_idle` and delivers them. A live consumer keeps the entries it
//!   holds (buffered, in flight, or waiting for a retry) fresh by
//!   `XCLAIM … JUSTID` every quarter `claim_idle`, so only entries of dead (or
//!   stuck) consumers reach that idle time.
//! - **Delivery count**: 1 for a new entry; for a re-read, claimed or retried
//!   entry, the PEL's times-delivered (`XPENDING`). It drives poison
//!   accounting (`RetryPolicy::max_deliveries`).
//! - **Ack** (after the inbox commit): `XACK`.
//! - **Nack(delay)**: Redis has no negative ack. The entry is *not* acked;
//!   the source holds it (still pending, kept fresh) and after the delay
//!   claims it again for itself with `XCLAIM` (which increments the PEL's
//!   delivery counter) and redelivers it. If the process dies meanwhile, the
//!   entry stays pending and is claimed by `XAUTOCLAIM` after `claim_idle`.
//! - **Dead-letter**: with [`dead_letter_stream`](RedisStreamConfig::dead_letter_stream)
//!   set, a copy of the entry's fields plus the field `dead_letter_reason`
//!   (the [`DeadLetterReason::code`]) is `XADD`ed there and the original
//!   `XACK`ed, in one `MULTI`/`EXEC`; without one it is just acked (the
//!   inbox's dead-letter table keeps it).
//! - A delivery dropped unsettled (its task was cancelled) stops being kept
//!   fresh and comes back through `XAUTOCLAIM` after `claim_idle`; so do
//!   entries read but not handed out when the source is dropped.
//!
//! Consumers that died stay listed in the group (`XINFO CONSUMERS`) with no
//! pending entries once their entries were claimed; remove them with
//! `XGROUP DELCONSUMER` if the list matters.
//!
//! # Lag
//!
//! Every 5 s (`lag_interval=`; `0` turns it off) a background task runs
//! `XINFO GROUPS` and sets the gauge
//! `idemq_source_lag_messages{source="redis-stream",group=GROUP,topic=STREAM,partition=""}`
//! to the group's `lag` plus its `pending`: the entries not delivered to the
//! group yet plus those delivered and not acknowledged yet. Redis before 7
//! reports no `lag`, nor does Redis 7 after some deletions: those readings
//! are skipped.
//!
//! # Loss the stream can cause
//!
//! Redis has no retention setting: producers trim (`XADD … MAXLEN|MINID`),
//! anyone can `XTRIM` or `XDEL`, and an entry removed before the group read
//! it is lost to it. Redis 7 reports what was removed (`XINFO STREAM`:
//! `max-deleted-entry-id`, `entries-added`, the first entry), and the
//! source compares it with the group's `last-delivered-id` and
//! `entries-read`:
//!
//! - [`RedisStreamSource::connect`] refuses a group that lost entries it has
//!   not read past yet, naming the ids (`broker_loss=warn` logs them and
//!   runs; see [`crate::source::loss`]). Once read past, that loss is no
//!   longer refused.
//! - While running, each lag reading (`lag_interval=`; `0` turns this off
//!   too) looks again and logs each new loss at `error`, once (the process
//!   cannot refuse then). A trim the group reads past between two readings
//!   shows once the group is caught up.
//! - A group this source creates with `start=0` on a stream trimmed before
//!   starts just below the stream's first entry: entries removed before
//!   the group existed are no loss of it.
//!
//! Trim only below the group's last delivered id (`XTRIM MINID
//! <last-delivered-id>`) and below its oldest pending entry, or not at all
//! (a pending entry trimmed is acked with a `warn` when it is re-read or
//! claimed). The details, and the cases the counters cannot tell, are in
//! the source's `limits` module. Redis before 7 tells none of it:
//! nothing is checked there.
//!
//! # Configuration
//!
//! `redis-stream://[user:password@]host:6379/STREAM?group=GROUP&consumer=NAME&claim_idle=30s&block=2s&count=10&dead_letter_stream=NAME&start=0&lag_interval=5s&broker_loss=refuse`
//! (see [`RedisStreamConfig::from_url`]).
//!
//! # Entry layout
//!
//! [`RedisStreamPublisher`] writes, and the source reads:
//!
//! | field        | [`Message`]                                             |
//! |--------------|---------------------------------------------------------|
//! | `payload`    | [`Message::payload`] (raw bytes; required)              |
//! | `id`         | [`Message::id`] (else the entry id)                     |
//! | `key`        | [`Message::key`]                                        |
//! | `h:<name>`   | the header `<name>`                                     |
//! | other fields | a header of the same name (e.g. `dead_letter_reason`)  |
//!
//! The source adds the header [`ENTRY_ID_HEADER`] with the entry id. An
//! entry without a `payload` field is delivered with a defect (its fields as
//! a JSON object for the payload), which the engine dead-letters.
//! [`DeliveryMeta`] has source `redis-stream`, the stream as topic and no
//! offset.
//!
//! ```no_run
//! use idemq::source::redis_stream::{RedisStreamConfig, RedisStreamPublisher, RedisStreamSource};
//! use idemq::source::Publisher;
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//! use idemq::{Consumer, KeySpec, Message};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = RedisStreamConfig::from_url(
//!     "redis-stream://127.0.0.1:6379/payments?group=billing&claim_idle=30s&dead_letter_stream=payments-dead",
//! )?;
//! let publisher = RedisStreamPublisher::connect(&config).await?;
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
//! // A stream never ends: run until Ctrl-C.
//! let source = RedisStreamSource::connect(config).await?;
//! consumer
//!     .run_until(source, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`Source`]: crate::source::Source
//! [`Source::next`]: crate::source::Source::next
//! [`Publisher`]: crate::source::Publisher
//! [`DeadLetterReason::code`]: crate::outcome::DeadLetterReason::code
//! [`Message`]: crate::message::Message
//! [`Message::payload`]: crate::message::Message::payload
//! [`Message::id`]: crate::message::Message::id
//! [`Message::key`]: crate::message::Message::key
//! [`DeliveryMeta`]: crate::message::DeliveryMeta

mod acker;
mod config;
mod conn;
mod entry;
mod lag;
mod limits;
mod pending;
mod publisher;
mod registration;
mod reply;
mod source;

pub use config::RedisStreamConfig;
pub use entry::{ENTRY_ID_HEADER, HEADER_PREFIX, ID_FIELD, KEY_FIELD, PAYLOAD_FIELD, REASON_FIELD};
pub use publisher::RedisStreamPublisher;
pub use registration::BROKER;
pub use source::RedisStreamSource;
