//! The consumer's lag: the durable consumer's info, polled in the
//! background into the gauge `idemq_source_lag_messages`.
//!
//! The lag is what the consumer has not acknowledged yet: `num_pending`
//! (stream messages matching its filter not delivered yet) plus
//! `num_ack_pending` (delivered, not acknowledged yet), as Kafka's lag
//! counts from the committed offset. Labels: `source="nats"`, `group` the
//! durable consumer's name, `topic` the stream, `partition` empty.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;

use crate::source::lag::{self, LagGauge, Poller};

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How long one consumer-info request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The background task that reads the consumer's lag every interval; it
/// stops when this is dropped (with the source).
pub(super) struct LagPoller {
    /// The task, aborted on drop.
    _task: Poller,
}

impl LagPoller {
    /// Starts polling `consumer` every `every`; `None` when `every` is zero
    /// (turned off).
    pub(super) fn start(consumer: PullConsumer, every: Duration) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self {
            _task: Poller::spawn(poll(consumer, every)),
        })
    }
}

/// Reads the consumer info every `every` and sets the gauge; a failure
/// leaves the last value in place (logged as [`LagGauge::failed`] says).
async fn poll(consumer: PullConsumer, every: Duration) {
    let info = consumer.cached_info();
    let mut gauge = LagGauge::new("nats", info.name.clone(), info.stream_name.clone());
    let mut ticks = lag::ticks(every);
    loop {
        ticks.tick().await;
        match tokio::time::timeout(REQUEST_TIMEOUT, consumer.get_info()).await {
            Ok(Ok(info)) => {
                let lag = info
                    .num_pending
                    .saturating_add(u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX));
                gauge.set("", lag);
                gauge.worked();
            }
            Ok(Err(e)) => gauge.failed(&e),
            Err(_) => gauge.failed(&format_args!("no answer within {REQUEST_TIMEOUT:?}")),
        }
    }
}
