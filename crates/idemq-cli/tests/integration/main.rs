//! The `idemq` binary's integration tests, in one test binary: one module
//! per subject (the commands, the console, the relay, the chaos run…), each
//! gated on the features it needs, so that a change relinks one test binary
//! instead of a dozen (`scripts/test.sh` runs it under cargo-nextest, every
//! test in a process of its own).

mod common;

mod batch_sql;
#[cfg(all(feature = "failpoints", feature = "sqlite"))]
mod chaos;
mod cli;
mod config_file;
mod console;
mod doctor;
mod http_sink;
mod lag;
#[cfg(feature = "sqlite")]
mod memory;
#[cfg(all(feature = "mongodb", feature = "nats"))]
mod mongo;
mod ops;
mod proxy;
mod relay;
