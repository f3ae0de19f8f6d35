//! Settling a delivery: ack (commit the contiguous position), nack
//! (redeliver later), dead-letter (forward, then commit).

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

use super::partition::Record;
use super::source::{KafkaConsumer, Shared};
use super::{broker, DEAD_LETTER_REASON_HEADER};
use crate::error::SourceError;
use crate::outcome::DeadLetterReason;
use crate::source::kit::{Redeliver, Unsettled};
use crate::source::{Acknowledger, Contiguity};

/// Settles one Kafka delivery: see the [module docs](super).
pub(super) struct KafkaAcker {
    pub(super) consumer: Weak<KafkaConsumer>,
    pub(super) dead_letters: Option<(super::publisher::Producer, String)>,
    pub(super) held: Unsettled<Held>,
}

/// A record handed out of a partition (in the generation it was owned in)
/// and in flight there until it is settled.
pub(super) struct Held {
    pub(super) shared: Arc<Shared>,
    pub(super) partition: i32,
    pub(super) generation: u64,
    pub(super) record: Record,
}

impl Held {
    /// Puts the record back for a redelivery after `delay`, if the partition is still ours.
    fn redeliver_after(self, delay: Duration) {
        let Held {
            shared,
            partition,
            generation,
            mut record,
        } = self;
        let mut state = shared.state();
        if let Some(p) = state.partitions.get_mut(&partition) {
            if p.generation == generation && p.in_flight.remove(&record.offset).is_some() {
                record.count = record.count.saturating_add(1);
                p.retries
                    .insert((Instant::now() + delay, record.offset), record);
            }
        }
        drop(state);
        shared.settled.notify_all();
        shared.ready.notify_waiters();
    }
}

impl Redeliver for Held {
    /// Delivered again at once.
    fn redeliver(self) {
        self.redeliver_after(Duration::ZERO);
    }
}

impl KafkaAcker {
    /// Puts the record back for a redelivery after `delay`, if it is still held.
    fn redeliver(&mut self, delay: Duration) {
        if let Some(held) = self.held.take() {
            held.redeliver_after(delay);
        }
    }

    /// Marks the record settled and commits the partition's contiguous
    /// position, if the partition is still ours. Concurrent acks share
    /// commits: each commits, under the commit lock, the position of
    /// everything settled by then, or nothing if an ack before it already
    /// committed that. A revocation takes the same lock, commits what is
    /// settled and forgets the partition; acks after it commit nothing.
    ///
    /// The commit is sent asynchronously (the effect is in the inbox
    /// already; a commit that never lands only brings records back, which
    /// the inbox answers as duplicates): the ack does not wait a round trip
    /// to the group coordinator. A commit the broker refuses makes the
    /// position uncommitted again ([`Shared::commit_failed`]), so the next
    /// ack or the revocation sends it again. Commits leave in offset order
    /// on one connection, and a position never moves back.
    fn commit(
        shared: &Shared,
        consumer: &Weak<KafkaConsumer>,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> Result<(), SourceError> {
        let Some(consumer) = consumer.upgrade() else {
            // The source is gone: the record is redelivered later and the inbox answers.
            release(shared, partition, generation, offset, false);
            return Ok(());
        };
        // Settled first, outside the commit lock, so that acks arriving
        // while a commit is on its way are covered by the next one.
        if !release(shared, partition, generation, offset, true) {
            tracing::debug!(
                partition,
                offset,
                "ack after the partition was revoked: not committed"
            );
            return Ok(());
        }
        let result = {
            let _guard = shared.commit_guard();
            let target = shared
                .state()
                .partitions
                .get(&partition)
                .filter(|p| p.generation == generation)
                .and_then(|p| p.uncommitted);
            let Some(next) = target else {
                // Committed already by a concurrent ack, or a gap below waits.
                return Ok(());
            };
            let result = shared
                .tpl(&[(partition, next)])
                .and_then(|tpl| consumer.commit(&tpl, CommitMode::Async).map_err(broker));
            if result.is_ok() {
                let mut state = shared.state();
                if let Some(p) = state.partitions.get_mut(&partition) {
                    if p.generation == generation {
                        p.committed = Some(p.committed.map_or(next, |c| c.max(next)));
                        if p.uncommitted == Some(next) {
                            p.uncommitted = None;
                        }
                    }
                }
            }
            result
        };
        // The last strong reference may be this one: close the consumer outside the lock.
        drop(consumer);
        result
    }

    async fn settle(mut self) -> Result<(), SourceError> {
        let Some(held) = self.held.take() else {
            return Ok(());
        };
        let Held {
            shared,
            partition,
            generation,
            record,
        } = held;
        let consumer = self.consumer.clone();
        let offset = record.offset;
        tokio::task::spawn_blocking(move || {
            Self::commit(&shared, &consumer, partition, generation, offset)
        })
        .await
        .map_err(|e| SourceError::other(e.to_string()))?
    }
}

/// Clears the in-flight mark of `offset`; when `settled`, counts it as
/// settled, so the partition's contiguous position may move past it.
/// Returns whether the partition is still owned in that generation.
fn release(shared: &Shared, partition: i32, generation: u64, offset: i64, settled: bool) -> bool {
    let mut state = shared.state();
    let owned = match state.partitions.get_mut(&partition) {
        Some(p) if p.generation == generation && p.in_flight.contains_key(&offset) => {
            if settled {
                p.settle(offset);
            } else {
                p.in_flight.remove(&offset);
            }
            true
        }
        _ => false,
    };
    drop(state);
    shared.settled.notify_all();
    shared.ready.notify_waiters();
    owned
}

#[async_trait]
impl Acknowledger for KafkaAcker {
    async fn ack(self: Box<Self>) -> Result<(), SourceError> {
        (*self).settle().await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        self.redeliver(delay);
        Ok(())
    }

    async fn forward_dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let forward = match (&self.dead_letters, self.held.get()) {
            (Some((producer, topic)), Some(held)) => {
                Some((producer.clone(), topic.clone(), held.record.message.clone()))
            }
            _ => None,
        };
        if let Some((producer, topic, message)) = forward {
            let mut headers = OwnedHeaders::new();
            for (name, value) in message.headers.iter() {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            headers = headers.insert(Header {
                key: DEAD_LETTER_REASON_HEADER,
                value: Some(reason.code()),
            });
            let mut out = FutureRecord::to(&topic)
                .payload(message.payload.as_slice())
                .headers(headers);
            if let Some(key) = &message.key {
                out = out.key(key.as_str());
            }
            if let Err((e, _)) = producer
                .send(out, Timeout::After(Duration::from_secs(30)))
                .await
            {
                // Not forwarded: keep the record and try again a little later.
                self.redeliver(Duration::from_secs(1));
                return Err(SourceError::broker(format!(
                    "publishing to the dead-letter topic {topic:?} failed: {e}"
                )));
            }
        }
        (*self).settle().await
    }

    /// Tracked: the records of a partition may be handed out several at
    /// once ([`Source::settle_out_of_order`](crate::source::Source::settle_out_of_order)).
    fn contiguity(&self) -> Contiguity {
        let Some(held) = self.held.get() else {
            return Contiguity::Tracked(None);
        };
        let state = held.shared.state();
        Contiguity::Tracked(
            state
                .partitions
                .get(&held.partition)
                .filter(|p| p.generation == held.generation && !p.revoking)
                .map(|p| p.position_if_settled(held.record.offset)),
        )
    }
}
