//! The engine: one message from delivery to ack, and the loop that runs a source.
//!
//! Every mode runs one pipeline (`pipeline`), in this order:
//! 1. **identify**: derive the business key and payload fingerprint (bad
//!    input → dead letter);
//! 2. **order**: deliveries of one key wait in its lane for the earlier
//!    ones (`lanes`);
//! 3. **claim** the key in the store (insert first);
//! 4. run the **handler** with the store's transaction (or lease);
//! 5. store the result and **complete** (commit);
//! 6. only then **settle** (ack) the delivery, and **report** the outcome.
//!
//! A duplicate is acked without running anything; a retryable failure rolls
//! back, counts an attempt outside the rolled-back transaction and nacks
//! with backoff; a permanent failure, exhausted retries and bad input are
//! dead-lettered and acked. A crash at any point leaves either nothing or
//! everything committed, and the redelivery sorts it out.
//!
//! The modes differ only in what one *unit of work* is (`unit`): one key
//! ([`Consumer::run`]); a whole polled batch in one transaction with a
//! savepoint per message, or over the Redis lease store a batch of leases
//! claimed and completed in one round trip each ([`Consumer::run_batched`],
//! see [`batch`]); one record's offset, where an offset watermark per
//! partition replaces the per-message inbox row ([`Consumer::run_watermarked`],
//! see [`watermark`]).

pub mod batch;
mod consumer;
mod handler;
mod lanes;
mod pipeline;
mod run;
mod steps;
mod unit;
pub mod watermark;

pub use batch::BatchOptions;
pub use consumer::{
    validate_consumer_name, Consumer, ConsumerBuilder, DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_SHUTDOWN_GRACE,
};
pub use handler::layers;
pub use handler::{
    handler_fn, AsyncFnHandler, AsyncHandlerFn, BatchResult, Context, FnHandler, Handler,
    HandlerResult, StateFnHandler, StateHandlerFn,
};
pub use watermark::WatermarkOptions;
