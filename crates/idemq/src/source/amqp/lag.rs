//! The queue's depth: a passive `queue.declare` of the work queue, polled in
//! the background on a channel of its own into the gauge
//! `idemq_source_lag_messages`.
//!
//! The value is the declare's `message_count`: the messages *ready* in the
//! queue, not delivered yet. Messages delivered and not acknowledged yet
//! (at most the prefetch) are not in it: AMQP does not tell them (only
//! RabbitMQ's management API does). Retry copies waiting in the retry
//! queues are not counted either. Labels: `source="amqp"`, `group` empty
//! (a queue has no consumer group), `topic` the queue, `partition` empty.
//!
//! The channel is the poller's own: a passive declare of a queue that is
//! gone closes the channel it ran on, which must never be the consuming one.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::Channel;

use super::channel::short;
use crate::source::lag::{self, LagGauge, Poller};

/// How often the queue depth is read unless the URL says otherwise
/// (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// The shortest interval between two readings (but zero: off).
pub(super) const MIN_LAG_INTERVAL: Duration = Duration::from_secs(1);
/// How long one passive declare may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The background task that reads the queue depth every interval; it stops
/// when this is dropped (with the source).
pub(super) struct LagPoller {
    /// The task, aborted on drop.
    _task: Poller,
}

impl LagPoller {
    /// Starts polling `queue` on `channel` (which nothing else may use)
    /// every `every`.
    pub(super) fn start(channel: Channel, queue: String, every: Duration) -> Self {
        Self {
            _task: Poller::spawn(poll(channel, queue, every.max(MIN_LAG_INTERVAL))),
        }
    }
}

/// Reads the queue depth every `every` and sets the gauge; a failure
/// leaves the last value in place (logged as [`LagGauge::failed`] says),
/// and once the channel is closed (the queue was deleted, the connection
/// lost) the polling ends.
async fn poll(channel: Channel, queue: String, every: Duration) {
    let name = match short(&queue) {
        Ok(name) => name,
        Err(e) => {
            tracing::warn!(queue = %queue, error = %e, "no AMQP queue depth");
            return;
        }
    };
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let mut gauge = LagGauge::new("amqp", "", queue.as_str());
    let mut ticks = lag::ticks(every);
    loop {
        ticks.tick().await;
        if !channel.status().connected() {
            tracing::warn!(queue = %queue, "the AMQP channel that reads the queue depth is closed; idemq_source_lag_messages is no longer updated");
            return;
        }
        let declared = channel.queue_declare(name.clone(), passive, FieldTable::default());
        match tokio::time::timeout(REQUEST_TIMEOUT, declared).await {
            Ok(Ok(declared)) => {
                gauge.set("", u64::from(declared.message_count()));
                gauge.worked();
            }
            Ok(Err(e)) => gauge.failed(&e),
            Err(_) => gauge.failed(&format_args!("no answer within {REQUEST_TIMEOUT:?}")),
        }
    }
}
