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

/// How often the lag is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How long one reading (every queue of the topic) may take.
const READING_TIMEOUT: Duration = Duration::from_secs(10);

/// What the client thread keeps between two readings.
pub(super) struct LagReader {
    topic: String,
    group: String,
    /// Whether the last reading failed (the next failure logs at `debug`).
    failing: bool,
}

impl LagReader {
    /// A reader of `group`'s lag on `topic`.
    pub(super) fn new(topic: &str, group: &str) -> Self {
        Self {
            topic: topic.to_owned(),
            group: group.to_owned(),
            failing: false,
        }
    }

    /// Reads the lag of every queue `consumer` holds and sets the gauge. A
    /// failure is logged at `warn` once, then at `debug` until a reading
    /// succeeds again, and leaves the last values in place.
    pub(super) async fn read(&mut self, consumer: &mut DefaultMQPushConsumer) {
        let failure = match tokio::time::timeout(READING_TIMEOUT, self.read_queues(consumer)).await
        {
            Ok(Ok(())) => {
                if self.failing {
                    tracing::debug!(topic = %self.topic, group = %self.group, "reading the RocketMQ consumer lag works again");
                }
                self.failing = false;
                return;
            }
            Ok(Err(e)) => e,
            Err(_) => format!("no answer within {READING_TIMEOUT:?}"),
        };
        if self.failing {
            tracing::debug!(topic = %self.topic, group = %self.group, error = %failure, "reading the RocketMQ consumer lag failed");
        } else {
            tracing::warn!(topic = %self.topic, group = %self.group, error = %failure, "reading the RocketMQ consumer lag failed; idemq_source_lag_messages keeps its last values");
        }
        self.failing = true;
    }

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
            // Looked up at each reading: a recorder installed after the
            // source connected still gets it.
            metrics::gauge!(
                "idemq_source_lag_messages",
                "source" => "rocketmq",
                "group" => self.group.clone(),
                "topic" => self.topic.clone(),
                "partition" => format!("{}:{}", queue.broker_name(), queue.queue_id())
            )
            .set(end.saturating_sub(consumed).max(0) as f64);
        }
        Ok(())
    }
}
