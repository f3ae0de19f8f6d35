//! The queue topology: the retry delay buckets, the derived queue names and their declaration.

use std::time::Duration;

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::Channel;

use super::channel::short;
use super::AmqpConfig;
use crate::error::SourceError;

/// The delays of the retry queues (delay buckets), shortest first. A retry
/// goes to the shortest one at least as long as the requested delay, or to
/// the longest one.
pub const RETRY_DELAYS: [Duration; 13] = [
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_millis(2_500),
    Duration::from_secs(5),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(15 * 60),
    Duration::from_secs(60 * 60),
];

impl AmqpConfig {
    /// The dead-letter queue: `<queue>.dead-letter`.
    pub fn dead_letter_queue(&self) -> String {
        format!("{}.dead-letter", self.queue)
    }

    /// The retry queue a retry after `delay` goes to: `<queue>.retry.<ms>ms`.
    pub fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, bucket(delay).as_millis())
    }

    /// Every queue of the topology: the work queue, the retry queues and the
    /// dead-letter queue.
    pub fn queues(&self) -> Vec<String> {
        let mut all = vec![self.queue.clone()];
        all.extend(RETRY_DELAYS.iter().map(|d| self.retry_queue(*d)));
        all.push(self.dead_letter_queue());
        all
    }

    /// Declares the topology on `channel` (idempotent).
    pub(super) async fn declare(&self, channel: &Channel) -> Result<(), SourceError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let declare = |name: String, args: FieldTable| async move {
            let queue = short(&name)?;
            channel
                .queue_declare(queue, durable, args)
                .await
                .map_err(|e| SourceError::broker(format!("declaring queue {name:?}: {e}")))
        };
        declare(self.queue.clone(), self.queue_type.arguments()).await?;
        declare(self.dead_letter_queue(), self.queue_type.arguments()).await?;
        for delay in RETRY_DELAYS {
            let mut args = FieldTable::default();
            let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(self.queue.as_str().into()),
            );
            declare(self.retry_queue(delay), args).await?;
        }
        Ok(())
    }
}

/// The retry delay bucket for `delay`.
pub(super) fn bucket(delay: Duration) -> Duration {
    RETRY_DELAYS
        .iter()
        .copied()
        .find(|d| *d >= delay)
        .unwrap_or(RETRY_DELAYS[RETRY_DELAYS.len() - 1])
}
