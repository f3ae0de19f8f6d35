//! Amazon SQS (and SQS-compatible endpoints): a [`Source`] and a [`Publisher`]
//! over `aws-sdk-sqs`.
//!
//! # How SQS redelivers, and how this source maps it
//!
//! SQS never pushes: a consumer *receives* a message, which makes it
//! invisible to everyone else for the queue's *visibility timeout*, and
//! *deletes* it when done. A message that is not deleted in time becomes
//! visible again and is received once more, with a higher
//! `ApproximateReceiveCount`. A consumer that crashes therefore loses nothing:
//! its messages come back after the timeout. That is at-least-once delivery,
//! and the inbox turns it into exactly-once effects.
//!
//! - **Receive**: long polling (`WaitTimeSeconds`, up to 10 messages per call),
//!   buffered; the receive runs in a background task so that
//!   [`Source::next`] is cancel-safe. `ApproximateReceiveCount` becomes
//!   [`DeliveryMeta::delivery_count`], which the engine uses for poison
//!   accounting (`RetryPolicy::max_deliveries`).
//! - **Ack** (after the inbox commit): `DeleteMessage` with the receipt handle.
//! - **Nack(delay)** (retry later): `ChangeMessageVisibility` to the delay,
//!   rounded *up* to whole seconds and clamped to 0..=43200 s, so the message
//!   comes back after the delay and not at once.
//! - **Visibility extension**: from the moment a message is received until it
//!   is settled (or its delivery is dropped), a background task extends its
//!   visibility by the configured timeout every third of that timeout
//!   (counted from when the previous request was sent), so a slow handler
//!   does not let a second consumer receive the same message.
//!   A delivery dropped unsettled (the consumer crashed or was cancelled)
//!   stops being extended and comes back after the visibility timeout.
//! - **Dead-letter**: with a dead-letter queue configured (`dlq=`), a copy is
//!   sent there with the original body and attributes plus the string
//!   attribute `dead_letter_reason` (the [`DeadLetterReason::code`]), then the
//!   original is deleted; without one it is just deleted (the inbox's
//!   dead-letter table keeps it). This is independent of an SQS redrive
//!   policy, which may still be configured on the queue as a last resort.
//! - **FIFO queues** (names ending in `.fifo`): messages of one
//!   `MessageGroupId` are handed out one at a time, in order; the next one of
//!   the group is handed out only when the previous one is settled. Groups
//!   run concurrently. When a message is nacked or dropped, the later
//!   messages of its group that this source holds are made visible again at
//!   once, so SQS delivers the group again in order. A nacked FIFO message
//!   whose visibility may have run out while it was held (an extension that
//!   came late, on a loaded machine) comes back at once instead of after its
//!   delay: the queue may no longer count it as in flight, and its group's
//!   later messages would otherwise pass it.
//!
//! # Message mapping
//!
//! The payload is the message body. [`Message::id`] is the string message
//! attribute `message_id` if present, else the SQS `MessageId`;
//! [`Message::key`] is the attribute `key` if present (on FIFO queues, else
//! the `MessageGroupId`); every other message attribute becomes a header
//! (string and number attributes as their text, binary ones as their bytes).
//! [`DeliveryMeta`] has source `sqs` and the queue name as topic.
//! [`SqsPublisher`] writes the same attributes.
//!
//! # Lag
//!
//! Every 5 s (`lag_interval=`; `0` turns it off) a background task calls
//! `GetQueueAttributes` and sets the gauge
//! `idemq_source_lag_messages{source="sqs",group="",topic=QUEUE,partition=""}`
//! to the messages not deleted yet: `ApproximateNumberOfMessages`
//! (waiting) plus `ApproximateNumberOfMessagesNotVisible` (received, not
//! deleted yet). Both are approximate, and not read at one instant: a
//! message received meanwhile can count twice.
//!
//! # Loss the broker causes
//!
//! At connect the source reads the queue's `MessageRetentionPeriod` and
//! `RedrivePolicy` and refuses, by default, a retention under
//! `min_retention` (default 1 day; `0` turns the check off) and a redrive
//! policy whose `maxReceiveCount` is not above idemq's default retry
//! attempts (5), naming each (`broker_loss=warn` logs them and runs;
//! attributes that cannot be read are logged at `warn` as not checked).
//!
//! # Configuration and credentials
//!
//! `sqs://queue-name?endpoint=http://127.0.0.1:5000&region=us-east-1&visibility=30&wait=20&dlq=queue-dead&create=true&batch=10&lag_interval=5s&broker_loss=refuse&min_retention=1d`
//! (see [`SqsConfig::from_url`]). Credentials come from
//! [`SqsConfig::credentials`], else from the AWS SDK's standard chain
//! (`aws-config`): the environment (`AWS_ACCESS_KEY_ID` /
//! `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`), the shared config and
//! credentials files (`profile=NAME`, else `AWS_PROFILE`, else `default`),
//! web identity (`AWS_ROLE_ARN` with `AWS_WEB_IDENTITY_TOKEN_FILE`, as on
//! EKS), container credentials (ECS) and the instance role (IMDS). The
//! region is `region=` if given, else the chain's (`AWS_REGION`, the
//! profile's `region`), else `us-east-1`. For a local endpoint (`localhost`,
//! `127.0.0.1`, `::1`) with no credential source configured, the
//! placeholder pair `test`/`test` is used, which local emulators accept.
//!
//! ```no_run
//! use idemq::source::sqs::{SqsConfig, SqsPublisher, SqsSource};
//! use idemq::source::Publisher;
//! use idemq::{Consumer, KeySpec, Message};
//! use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = SqsConfig::from_url(
//!     "sqs://payments?endpoint=http://127.0.0.1:5000&region=us-east-1&visibility=30&create=true",
//! )?;
//! let publisher = SqsPublisher::connect(config.clone()).await?;
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
//! // SQS never ends: run until Ctrl-C.
//! let source = SqsSource::connect(config).await?;
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
mod queue;
mod registration;
mod shared;
mod source;

pub use config::{SqsConfig, MAX_VISIBILITY_SECS};
pub use mapping::{ID_ATTRIBUTE, KEY_ATTRIBUTE, MAX_ATTRIBUTES, REASON_ATTRIBUTE};
pub use publisher::SqsPublisher;
pub use registration::BROKER;
pub use source::SqsSource;
