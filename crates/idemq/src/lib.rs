//! # idemq — exactly-once effects from at-least-once messaging
//!
//! Every broker redelivers: a consumer crashes after the work but before the
//! ack, an offset commit is lost, a visibility timeout runs out, a producer
//! retries a send. idemq makes those duplicates harmless with the
//! idempotent-consumer (inbox) pattern: the business key of each message is
//! *claimed* in the same database transaction as the handler's writes, and
//! the delivery is acked only after that transaction commits.
//!
//! ```no_run
//! use idemq::{Consumer, HandlerError, KeySpec};
//! use idemq::source::jsonl::JsonLinesSource;
//! use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite://ledger.db").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("ledger", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(|ctx, tx| Box::pin(async move {
//!         let p: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
//!         sqlx::query("INSERT INTO ledger (payment_id, amount) VALUES (?, ?)")
//!             .bind(ctx.key)
//!             .bind(p["amount"].as_i64())
//!             .execute(&mut **tx) // the same transaction as the claim
//!             .await?;
//!         Ok(None)
//!     }))
//!     .build()?;
//! let summary = consumer.run(JsonLinesSource::open("payments.jsonl").await?).await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```
//!
//! The pieces, following one message:
//! - [`source`]: a [`Source`](source::Source) yields [`Delivery`](source::Delivery)s;
//! - [`key`], [`fingerprint`]: the business key and the payload fingerprint;
//! - [`store`]: [`Store::claim`](store::Store::claim) inserts the key first;
//! - [`engine`]: runs the [`Handler`] and commits, then acks;
//! - [`effect`]: derived idempotency keys and the effect journal for calls
//!   to other systems;
//! - [`outcome`]: every message ends as one [`Outcome`];
//! - [`retention`]: pruning old inbox rows.
//!
//! Cargo features: stores `sqlite` (default), `postgres`, `mysql`,
//! `redis`; sources `kafka`, `amqp`, `sqs`, `nats`, `redis-streams`,
//! `mqtt`, `rocketmq`; `http` (effects over HTTP with `Idempotency-Key`);
//! `failpoints` (the named crash points `idemq chaos` uses; off in normal
//! builds).

#![warn(missing_docs)]

pub mod effect;
pub mod engine;
pub mod error;
pub mod failpoint;
pub mod fingerprint;
pub mod key;
pub mod message;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub mod outbox;
pub mod outcome;
pub mod policy;
pub mod redact;
#[cfg(any(feature = "redis", feature = "redis-streams"))]
pub mod redis_client;
pub mod retention;
pub mod source;
pub mod store;
mod sync;
pub mod template;
#[cfg(any(feature = "redis", feature = "redis-streams", feature = "nats"))]
mod tls;

pub use effect::{idempotency_key, EffectJournal};
pub use engine::{handler_fn, layers, Consumer, ConsumerBuilder, Context, Handler, HandlerResult};
pub use error::{
    ConfigError, HandlerError, HandlerErrorKind, InputError, SourceError, SourceErrorKind,
    StoreError, StoreErrorKind,
};
pub use fingerprint::FingerprintSpec;
pub use key::KeySpec;
pub use message::{DeliveryMeta, Headers, Message};
pub use outcome::{DeadLetterReason, Outcome, OutcomeKind, Summary};
pub use policy::{ConflictPolicy, InFlightPolicy, RetentionPolicy, RetryPolicy};

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub use sqlx;
