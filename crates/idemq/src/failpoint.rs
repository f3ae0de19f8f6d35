//! Named fail points of the protocol, for fault injection (`idemq chaos`).
//!
//! `failpoint!` marks a point of the engine by name. Without the
//! `failpoints` cargo feature it expands to nothing: normal builds carry no
//! trace of it. With the feature it is the [`fail`](https://docs.rs/fail)
//! crate's `fail_point!`, which a process arms at run time with
//! `fail::cfg` / `fail::cfg_callback` (the `idemq` CLI arms them from
//! `IDEMQ_CHAOS_KILL` to SIGKILL itself there).
//!
//! The points, in every mode (per-message, batch, lease batch, offset
//! watermark):
//!
//! | name | where |
//! |---|---|
//! | `after_claim` | the key (batch: every key; watermark: the offset) was claimed; the handler has not run |
//! | `after_handler` | a handler returned (success or failure); nothing committed |
//! | `before_commit` | about to commit the claim and the handler's writes |
//! | `after_commit_before_ack` | committed; the delivery is not acked yet |
//!
//! They mark states of new work, as they did before the one pipeline: a
//! unit whose members were all answered by the store (duplicates) passes
//! none of them, and `before_commit` and `after_commit_before_ack` are
//! passed only by a unit with a handler's work to commit
//! (`failpoint!("name", if condition)`).

/// The names of the fail points, in protocol order.
pub const NAMES: [&str; 4] = [
    "after_claim",
    "after_handler",
    "before_commit",
    "after_commit_before_ack",
];

/// Marks a named fail point (see the module docs); a no-op without the
/// `failpoints` feature.
#[cfg(feature = "failpoints")]
macro_rules! failpoint {
    ($name:literal) => {
        fail::fail_point!($name)
    };
    ($name:literal, if $cond:expr) => {
        if $cond {
            fail::fail_point!($name)
        }
    };
}

/// Marks a named fail point (see the module docs); a no-op without the
/// `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
macro_rules! failpoint {
    ($name:literal) => {};
    ($name:literal, if $cond:expr) => {};
}

pub(crate) use failpoint;
