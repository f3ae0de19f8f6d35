//! The group's lag on the queues this consumer holds, read on the client
//! thread (whose objects never leave it) into the gauge
//! `idemq_source_lag_messages`.
//!
//! Per message queue assigned to this consumer: the broker's max offset
//! (the end of the queue) minus the consumer's own offset (its offset store
//! read from memory: what it has consumed, and commits to the broker every
//! few seconds), as Kafka's lag counts per assigned partition. Queues that
//! another member of the group holds are not in the consumer's offset
//! store, and are left to that member. The offset is never read from the
//! broker here: the client would overwrite its own newer offset with it.
//! Labels: `source="rocketmq"`, `group` the consumer group, `topic` the
//! topic, `partition` `BROKER:QUEUE_ID`.

use std::time::Duration;

use rocketmq_client_rust::{DefaultMQPushConsumer, ReadOffsetType};

use crate::source::lag::LagGauge;

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How long one reading (every queue of the topic) may take.
const READING_TIMEOUT: Duration = Duration::from_secs(10);

/// What the client thread keeps between two readings.
pub(super) struct LagReader {
    /// The topic whose queues are read.
    topic: String,
    /// The gauge, labelled with the group and the topic.
    gauge: LagGauge,
}

impl LagReader {
    /// A reader of `group`'s lag on `topic`.
    pub(super) fn new(topic: &str, group: &str) -> Self {
        Self {
            topic: topic.to_owned(),
            gauge: LagGauge::new("rocketmq", group, topic),
        }
    }

    /// Reads the lag of every queue `consumer` holds and sets the gauge; a
    /// failure leaves the last values in place (logged as
    /// [`LagGauge::failed`] says).
    pub(super) async fn read(&mut self, consumer: &mut DefaultMQPushConsumer) {
        match tokio::time::timeout(READING_TIMEOUT, self.read_queues(consumer)).await {
            Ok(Ok(())) => self.gauge.worked(),
            Ok(Err(e)) => self.gauge.failed(&e),
            Err(_) => self
                .gauge
                .failed(&format_args!("no answer within {READING_TIMEOUT:?}")),
        }
    }

    /// Sets the gauge of every queue of the topic that this consumer holds.
    async fn read_queues(&self, consumer: &mut DefaultMQPushConsumer) -> Result<(), String> {
        let Some(store) = consumer.offset_store() else {
            return Err("the consumer has no offset store yet".into());
        };
        let queues = consumer
            .fetch_subscribe_message_queues(&self.topic)
            .await
            .map_err(|e| format!("the topic's queues: {e}"))?;
        for queue in queues {
            let consumed = store
                .read_offset(&queue, ReadOffsetType::ReadFromMemory)
                .await;
            if consumed < 0 {
                continue; // held by another member of the group, or not yet
            }
            let end = consumer
                .max_offset(&queue)
                .await
                .map_err(|e| format!("the max offset of queue {}: {e}", queue.queue_id()))?;
            // Negative (the consumer's offset ahead of a stale end): 0.
            let lag = u64::try_from(end.saturating_sub(consumed)).unwrap_or(0);
            self.gauge
                .set(format!("{}:{}", queue.broker_name(), queue.queue_id()), lag);
        }
        Ok(())
    }
}
