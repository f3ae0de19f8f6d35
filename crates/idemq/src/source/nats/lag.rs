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
use tokio::task::JoinHandle;

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How long one consumer-info request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The background task that reads the consumer's lag every interval; it
/// stops when this is dropped (with the source).
pub(super) struct LagPoller(JoinHandle<()>);

impl LagPoller {
    /// Starts polling `consumer` every `every`; `None` when `every` is zero
    /// (turned off).
    pub(super) fn start(consumer: PullConsumer, every: Duration) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self(tokio::spawn(poll(consumer, every))))
    }
}

impl Drop for LagPoller {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads the consumer info every `every` and sets the gauge. A failure is
/// logged at `warn` once (then at `debug` until a reading succeeds again)
/// and leaves the last value in place.
async fn poll(consumer: PullConsumer, every: Duration) {
    let info = consumer.cached_info();
    let (stream, name) = (info.stream_name.clone(), info.name.clone());
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticks.tick().await;
        let failure = match tokio::time::timeout(REQUEST_TIMEOUT, consumer.get_info()).await {
            Ok(Ok(info)) => {
                let lag = info
                    .num_pending
                    .saturating_add(u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX));
                // Looked up at each reading: a recorder installed after the
                // source connected still gets it.
                metrics::gauge!(
                    "idemq_source_lag_messages",
                    "source" => "nats",
                    "group" => name.clone(),
                    "topic" => stream.clone(),
                    "partition" => ""
                )
                .set(lag as f64);
                if failing {
                    tracing::debug!(stream = %stream, consumer = %name, "reading the NATS consumer lag works again");
                }
                failing = false;
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {REQUEST_TIMEOUT:?}"),
        };
        if failing {
            tracing::debug!(stream = %stream, consumer = %name, error = %failure, "reading the NATS consumer lag failed");
        } else {
            tracing::warn!(stream = %stream, consumer = %name, error = %failure, "reading the NATS consumer lag failed; idemq_source_lag_messages keeps its last value");
        }
        failing = true;
    }
}
