//! Key lanes: deliveries with the same business key are handled one after
//! the other, in the order the source handed them out; different keys run
//! concurrently.
//!
//! The run loop [admits](KeyLanes::admit) each delivery to the lane of its
//! key before it spawns its task. The task first [waits](LaneTicket::wait)
//! for the previous delivery of that key (if one is still in flight) and
//! learns how it ended; when it is done it [finishes](LaneTicket::finish)
//! its ticket, which wakes the next one. A ticket dropped without finishing
//! (a panicking task) releases the lane as well.
//!
//! Memory is bounded by the loop: a lane exists only while one of its
//! deliveries is admitted and unfinished, and the loop admits at most a
//! fixed number of deliveries at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::outcome::Outcome;
use crate::sync::lock;

/// How the previous delivery of a key ended, as far as the next one cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LaneEnd {
    /// Settled for good (processed, duplicate, conflict, dead-lettered):
    /// the inbox answers the next copy.
    Settled,
    /// Nacked to come back after this delay: nothing of it committed, and
    /// the next copy must not overtake it.
    RetryLater(Duration),
}

/// The lanes of one run loop, by key.
#[derive(Debug, Default)]
pub(crate) struct KeyLanes {
    tails: Mutex<HashMap<String, Tail>>,
}

/// The last admitted delivery of a key.
#[derive(Debug)]
struct Tail {
    ticket: u64,
    ended: watch::Receiver<Option<LaneEnd>>,
}

/// Held by one admitted delivery until it is settled.
#[derive(Debug)]
pub(crate) struct LaneTicket {
    lanes: Arc<KeyLanes>,
    key: String,
    ticket: u64,
    previous: Option<watch::Receiver<Option<LaneEnd>>>,
    ended: watch::Sender<Option<LaneEnd>>,
}

impl KeyLanes {
    /// Admits the next delivery of `key` behind the one admitted before it.
    pub(crate) fn admit(self: &Arc<Self>, key: String) -> LaneTicket {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let ticket = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (ended, receiver) = watch::channel(None);
        let mut tails = lock(&self.tails);
        let previous = tails
            .insert(
                key.clone(),
                Tail {
                    ticket,
                    ended: receiver,
                },
            )
            .map(|tail| tail.ended);
        LaneTicket {
            lanes: Arc::clone(self),
            key,
            ticket,
            previous,
            ended,
        }
    }

    /// Keys with a delivery in flight.
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.tails).len()
    }
}

impl LaneTicket {
    /// Whether an earlier delivery of the key is still in its lane.
    pub(crate) fn waits(&self) -> bool {
        self.previous
            .as_ref()
            .is_some_and(|previous| previous.borrow().is_none())
    }

    /// Waits until the previous delivery of the key (if any) has ended, and
    /// says how. A previous delivery whose task died unsettled counts as
    /// [`LaneEnd::Settled`]: its source redelivers it, and the inbox answers.
    pub(crate) async fn wait(&mut self) -> Option<LaneEnd> {
        let mut previous = self.previous.take()?;
        let end = match previous.wait_for(Option::is_some).await {
            Ok(end) => *end,
            Err(_) => Some(LaneEnd::Settled),
        };
        end
    }

    /// Marks this delivery as ended, waking the next one of its key.
    pub(crate) fn finish(self, end: LaneEnd) {
        self.ended.send_replace(Some(end));
        // Drop releases the lane.
    }
}

impl Drop for LaneTicket {
    fn drop(&mut self) {
        if self.ended.borrow().is_none() {
            self.ended.send_replace(Some(LaneEnd::Settled));
        }
        let mut tails = lock(&self.lanes.tails);
        if tails
            .get(&self.key)
            .is_some_and(|t| t.ticket == self.ticket)
        {
            tails.remove(&self.key);
        }
    }
}

/// What a delivery's processing calls once its outcome is decided, before
/// the delivery is settled with its source: the next delivery of the key
/// may start then. Releasing before the settle matters: a nack can bring the
/// same message straight back, and that redelivery must not queue behind
/// (and be deferred by) its own earlier attempt.
#[derive(Debug, Default)]
pub(crate) struct LaneRelease(Option<LaneTicket>);

impl LaneRelease {
    /// Releases nothing (a delivery outside any lane).
    pub(crate) fn none() -> Self {
        Self(None)
    }

    /// Ends the lane ticket with how `outcome` ends for the next copy.
    pub(crate) fn release(self, outcome: &Outcome) {
        if let Some(ticket) = self.0 {
            ticket.finish(match outcome {
                Outcome::RetryLater { delay, .. } => LaneEnd::RetryLater(*delay),
                _ => LaneEnd::Settled,
            });
        }
    }
}

impl From<LaneTicket> for LaneRelease {
    fn from(ticket: LaneTicket) -> Self {
        Self(Some(ticket))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_second_copy_waits_for_the_first_and_learns_its_end() {
        let lanes = Arc::new(KeyLanes::default());
        let first = lanes.admit("k".into());
        let mut second = lanes.admit("k".into());
        let mut other = lanes.admit("other".into());
        assert_eq!(other.wait().await, None, "another key does not wait");
        let waiter = tokio::spawn(async move {
            let end = second.wait().await;
            (end, second)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "the second copy waits");
        first.finish(LaneEnd::RetryLater(Duration::from_secs(3)));
        let (end, second) = waiter.await.unwrap();
        assert_eq!(end, Some(LaneEnd::RetryLater(Duration::from_secs(3))));
        assert_eq!(lanes.len(), 2);
        second.finish(LaneEnd::Settled);
        drop(other);
        assert_eq!(lanes.len(), 0, "finished lanes are removed");
    }

    #[tokio::test]
    async fn a_ticket_dropped_unfinished_releases_the_next() {
        let lanes = Arc::new(KeyLanes::default());
        let first = lanes.admit("k".into());
        let mut second = lanes.admit("k".into());
        drop(first);
        assert_eq!(second.wait().await, Some(LaneEnd::Settled));
        assert_eq!(lanes.len(), 1, "the second copy still holds the lane");
        drop(second);
        assert_eq!(lanes.len(), 0);
    }

    #[tokio::test]
    async fn three_copies_end_in_admission_order() {
        let lanes = Arc::new(KeyLanes::default());
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3u32 {
            let mut ticket = lanes.admit("k".into());
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                ticket.wait().await;
                // The later copies sleep less: only the lane keeps them in order.
                tokio::time::sleep(Duration::from_millis(u64::from(30 - 10 * i))).await;
                order.lock().unwrap().push(i);
                ticket.finish(LaneEnd::Settled);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(lanes.len(), 0);
    }
}
