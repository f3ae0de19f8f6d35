//! The library's integration tests, in one binary: one module per subject
//! (a broker, a store, the outbox, the engine's properties…), each gated on
//! the features it needs. One binary instead of one per file, so that a
//! change in the library relinks one test binary, not two dozen that each
//! link every backend (`scripts/test.sh` runs it under cargo-nextest, every
//! test in a process of its own). `sqs_credentials` stays a binary of its
//! own: it sets the process's AWS environment variables.

mod support;

mod amqp;
mod amqp_loss;
mod backends;
mod conformance;
mod effects;
mod engine_properties;
#[cfg(all(feature = "http", feature = "sqlite", feature = "postgres"))]
mod http_effects;
mod in_flight;
mod jsonl;
mod kafka;
mod kafka_loss;
mod kafka_watermark;
mod mqtt;
mod nats;
mod outbox;
mod partitioned_inbox;
mod readme;
mod redis_batch;
mod redis_store;
mod redis_stream;
mod rocketmq;
mod shutdown;
mod sql_postgres;
mod sqs;
mod tls;
