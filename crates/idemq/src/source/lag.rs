//! What the lag readers of the sources other than Kafka share: the gauge
//! `idemq_source_lag_messages` with its labels, the logging of readings
//! that fail, and the background task that polls.
//!
//! Each source's own `lag` module says how it reads the value and what the
//! value measures; this module only records it. A failed reading is logged
//! at `warn` once, then at `debug` until a reading works again (which is
//! logged at `debug`), and leaves the gauge at its last value.

/// The gauge of one source's lag (labels `source`, `group`, `topic`,
/// `partition`), and whether its last reading failed.
pub(crate) struct LagGauge {
    /// The `source` label: the source's name (`nats`, `redis-stream`, …).
    source: &'static str,
    /// The `group` label: the consumer group, empty where there is none.
    group: String,
    /// The `topic` label: the topic, stream or queue read.
    topic: String,
    /// Whether the last reading failed (the next failure logs at `debug`).
    failing: bool,
}

impl LagGauge {
    /// The gauge of `source`'s lag for `group` on `topic` (`group` empty
    /// where the source has no consumer group).
    pub(crate) fn new(
        source: &'static str,
        group: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        Self {
            source,
            group: group.into(),
            topic: topic.into(),
            failing: false,
        }
    }

    /// Sets the gauge of `partition` (empty where the source has none) to
    /// `lag`. Call [`worked`](Self::worked) once the whole reading is done.
    pub(crate) fn set(&self, partition: impl Into<metrics::SharedString>, lag: u64) {
        // Looked up at each reading: a recorder installed after the source
        // connected still gets it.
        metrics::gauge!(
            "idemq_source_lag_messages",
            "source" => self.source,
            "group" => self.group.clone(),
            "topic" => self.topic.clone(),
            "partition" => partition
        )
        .set(lag as f64);
    }

    /// A reading worked: after failures, says so at `debug`.
    pub(crate) fn worked(&mut self) {
        if self.failing {
            tracing::debug!(
                source = self.source,
                topic = %self.topic,
                group = self.group_field(),
                "reading the consumer lag works again"
            );
        }
        self.failing = false;
    }

    /// A reading failed with `error`: logged at `warn` if the last one
    /// worked, else at `debug`. The gauge keeps its last value.
    pub(crate) fn failed(&mut self, error: &dyn std::fmt::Display) {
        if self.failing {
            tracing::debug!(
                source = self.source,
                topic = %self.topic,
                group = self.group_field(),
                error = %error,
                "reading the consumer lag failed"
            );
        } else {
            tracing::warn!(
                source = self.source,
                topic = %self.topic,
                group = self.group_field(),
                error = %error,
                "reading the consumer lag failed; idemq_source_lag_messages keeps its last value"
            );
        }
        self.failing = true;
    }

    /// The group for the logs; none (no field) where the source has no
    /// consumer group.
    fn group_field(&self) -> Option<&str> {
        (!self.group.is_empty()).then_some(self.group.as_str())
    }
}

#[cfg(any(
    feature = "nats",
    feature = "redis-streams",
    feature = "amqp",
    feature = "sqs"
))]
pub(crate) use task::{ticks, Poller};

/// The background task of the sources that poll their lag on a task of
/// its own (RocketMQ reads it on its client thread instead).
#[cfg(any(
    feature = "nats",
    feature = "redis-streams",
    feature = "amqp",
    feature = "sqs"
))]
mod task {
    use std::future::Future;
    use std::time::Duration;

    use tokio::task::JoinHandle;

    /// A lag reader's background task: aborted when this is dropped (with
    /// its source).
    pub(crate) struct Poller(JoinHandle<()>);

    impl Poller {
        /// Spawns `poll` on the current Tokio runtime.
        pub(crate) fn spawn(poll: impl Future<Output = ()> + Send + 'static) -> Self {
            Self(tokio::spawn(poll))
        }
    }

    impl Drop for Poller {
        fn drop(&mut self) {
            self.0.abort();
        }
    }

    /// The ticks of a lag reader: every `every`, the first at once; a tick
    /// that comes late (a slow reading) delays the next ones rather than
    /// firing them in a burst. `every` must not be zero (a zero interval
    /// turns the reading off before this is called).
    pub(crate) fn ticks(every: Duration) -> tokio::time::Interval {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks
    }
}

#[cfg(test)]
mod tests {
    use super::LagGauge;

    /// Only the first failure of a run of them warns; a reading that works
    /// ends the run.
    #[test]
    fn a_failure_warns_once_until_a_reading_works() {
        let mut gauge = LagGauge::new("nats", "g", "t");
        assert!(!gauge.failing);
        gauge.failed(&"down");
        assert!(gauge.failing);
        gauge.failed(&"still down");
        assert!(gauge.failing);
        gauge.set("", 3);
        gauge.worked();
        assert!(!gauge.failing);
    }

    /// No `group` field where the source has no consumer group.
    #[test]
    fn an_empty_group_is_left_out_of_the_logs() {
        assert_eq!(LagGauge::new("sqs", "", "q").group_field(), None);
        assert_eq!(LagGauge::new("nats", "g", "s").group_field(), Some("g"));
    }
}
