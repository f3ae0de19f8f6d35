//! An in-process at-least-once queue: a source for library quick starts,
//! embedded pipelines and tests of handlers.
//!
//! It behaves like a broker queue with competing consumers: a nacked
//! delivery comes back after its delay with a higher delivery count, and a
//! delivery dropped without being settled (its consumer crashed or was
//! cancelled) comes back at once, like an unacked message after a broker
//! connection drops.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::Notify;

use super::{Acknowledger, Delivery, Source};
use crate::error::SourceError;
use crate::message::{DeliveryMeta, Message};

#[derive(Debug, Default)]
struct QueueState {
    ready: VecDeque<(Message, u32, i64)>,
    delayed: Vec<(Instant, Message, u32, i64)>,
    in_flight: usize,
    closed: bool,
    next_offset: i64,
    acked: u64,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<QueueState>,
    changed: Notify,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, QueueState> {
        crate::sync::lock(&self.state)
    }
}

/// A shared in-memory queue. Clone it to hand it to producers and consumers.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use idemq::{source::queue::MemoryQueue, source::Source, Message};
/// let queue = MemoryQueue::new("orders");
/// queue.push(Message::new("{}"));
/// queue.close();
/// let mut source = queue.source();
/// let delivery = source.next().await.unwrap().unwrap();
/// let (_, meta, _, acker) = delivery.into_parts();
/// assert_eq!(meta.delivery_count, 1);
/// acker.ack().await.unwrap();
/// assert!(source.next().await.unwrap().is_none()); // closed, drained, all settled
/// # });
/// ```
#[derive(Debug, Clone)]
pub struct MemoryQueue {
    name: String,
    shared: Arc<Shared>,
}

impl MemoryQueue {
    /// An empty open queue called `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            shared: Arc::default(),
        }
    }

    /// Enqueues a message.
    pub fn push(&self, message: Message) {
        let mut state = self.shared.state();
        state.next_offset += 1;
        let offset = state.next_offset;
        state.ready.push_back((message, 1, offset));
        drop(state);
        self.shared.changed.notify_waiters();
    }

    /// No more messages will be pushed: sources end once everything is settled.
    pub fn close(&self) {
        self.shared.state().closed = true;
        self.shared.changed.notify_waiters();
    }

    /// Messages acked so far.
    pub fn acked(&self) -> u64 {
        self.shared.state().acked
    }

    /// Messages waiting or in flight.
    pub fn pending(&self) -> usize {
        let state = self.shared.state();
        state.ready.len() + state.delayed.len() + state.in_flight
    }

    /// A consumer of this queue; several compete for its messages.
    pub fn source(&self) -> QueueSource {
        QueueSource {
            queue: self.clone(),
        }
    }
}

/// A consumer of a [`MemoryQueue`].
#[derive(Debug)]
pub struct QueueSource {
    queue: MemoryQueue,
}

#[async_trait]
impl Source for QueueSource {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let shared = &self.queue.shared;
        loop {
            let changed = shared.changed.notified();
            let wait = {
                let mut state = shared.state();
                let now = Instant::now();
                if state.delayed.iter().any(|(at, ..)| *at <= now) {
                    // Due deliveries come back in the order they fell due
                    // (nack order for equal delays): a later copy of a key
                    // must not come back before an earlier one.
                    let (mut due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut state.delayed)
                        .into_iter()
                        .partition(|(at, ..)| *at <= now);
                    state.delayed = later;
                    due.sort_by_key(|(at, ..)| *at);
                    for (_, m, count, offset) in due {
                        state.ready.push_back((m, count, offset));
                    }
                }
                if let Some((message, count, offset)) = state.ready.pop_front() {
                    state.in_flight += 1;
                    drop(state);
                    let meta = DeliveryMeta {
                        source: "memory".into(),
                        topic: Some(self.queue.name.clone()),
                        partition: None,
                        offset: Some(offset),
                        delivery_count: count,
                    };
                    let acker = QueueAcker {
                        shared: Arc::clone(shared),
                        message: Some((message.clone(), count, offset)),
                    };
                    return Ok(Some(Delivery::new(message, meta, Box::new(acker))));
                }
                if state.closed && state.delayed.is_empty() && state.in_flight == 0 {
                    return Ok(None);
                }
                state
                    .delayed
                    .iter()
                    .map(|(at, ..)| at.saturating_duration_since(now))
                    .min()
                    .unwrap_or(Duration::from_millis(100))
            };
            let _ = tokio::time::timeout(wait, changed).await;
        }
    }
}

struct QueueAcker {
    shared: Arc<Shared>,
    message: Option<(Message, u32, i64)>,
}

impl QueueAcker {
    fn settle(&mut self, redeliver_after: Option<Duration>) {
        let Some((message, count, offset)) = self.message.take() else {
            return;
        };
        let mut state = self.shared.state();
        state.in_flight = state.in_flight.saturating_sub(1);
        match redeliver_after {
            None => state.acked += 1,
            Some(delay) if delay.is_zero() => state.ready.push_back((message, count + 1, offset)),
            Some(delay) => state
                .delayed
                .push((Instant::now() + delay, message, count + 1, offset)),
        }
        drop(state);
        self.shared.changed.notify_waiters();
    }
}

#[async_trait]
impl Acknowledger for QueueAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        self.settle(None);
        Ok(())
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        self.settle(Some(delay));
        Ok(())
    }
}

impl Drop for QueueAcker {
    /// An unsettled delivery is redelivered, as a broker does when a consumer dies.
    fn drop(&mut self) {
        self.settle(Some(Duration::ZERO));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::MemoryQueue;
    use crate::message::Message;
    use crate::source::Source;

    #[tokio::test]
    async fn nacked_deliveries_come_back_in_the_order_they_fell_due() {
        let queue = MemoryQueue::new("q");
        for name in ["a", "b", "c", "d"] {
            queue.push(Message::new(name));
        }
        let mut source = queue.source();
        for _ in 0..4 {
            let delivery = source.next().await.unwrap().unwrap();
            let (_, _, _, acker) = delivery.into_parts();
            acker.nack(Duration::from_millis(20)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
        let mut order = Vec::new();
        for _ in 0..4 {
            let delivery = source.next().await.unwrap().unwrap();
            assert_eq!(delivery.meta.delivery_count, 2);
            order.push(String::from_utf8(delivery.message.payload.clone()).unwrap());
            let (_, _, _, acker) = delivery.into_parts();
            acker.ack().await.unwrap();
        }
        assert_eq!(order, ["a", "b", "c", "d"]);
    }
}
