//! The engine: one message from delivery to ack, and the loop that runs a source.
//!
//! For each delivery, in this order:
//! 1. derive the business key and payload fingerprint (bad input → dead letter);
//!    deliveries of one key wait in its lane for the earlier ones (`lanes`);
//! 2. **claim** the key in the store (insert first);
//! 3. run the **handler** with the store's transaction (or lease);
//! 4. store the result and **commit**;
//! 5. only then **ack** the delivery.
//!
//! A duplicate is acked without running anything; a retryable failure rolls
//! back, counts an attempt outside the rolled-back transaction and nacks
//! with backoff; a permanent failure, exhausted retries and bad input are
//! dead-lettered and acked. A crash at any point leaves either nothing or
//! everything committed, and the redelivery sorts it out.
//!
//! [`Consumer::run_batched`] runs the same steps for a whole polled batch in
//! one transaction (SQL stores), with a savepoint per message; see [`batch`];
//! over the Redis lease store it claims and completes a batch in one round
//! trip each; see [`lease_batch`].
//! [`Consumer::run_watermarked`] replaces the per-message inbox row by an
//! offset watermark per partition for partitioned logs; see [`watermark`].

pub mod batch;
mod consumer;
mod handler;
mod lanes;
pub mod lease_batch;
mod run;
pub mod watermark;

pub use batch::{BatchMode, BatchOptions};
pub use consumer::{validate_consumer_name, Consumer, ConsumerBuilder};
pub use handler::{handler_fn, Context, FnHandler, Handler, HandlerResult};
pub use watermark::WatermarkOptions;
