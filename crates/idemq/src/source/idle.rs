//! [`IdleExit`]: ends a source when nothing arrives for a while.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::{Delivery, OffsetLookup, Source};
use crate::error::SourceError;

/// Ends the wrapped source when no delivery arrives for `idle`: for jobs
/// that drain a broker queue and exit (`idemq consume --idle-exit`).
///
/// The cancelled wait takes nothing from the source that is not
/// redelivered: after it the run stops taking deliveries and only settles
/// those in flight. Everything else is forwarded to the wrapped source.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use std::time::Duration;
/// use idemq::source::{idle::IdleExit, queue::MemoryQueue, Source};
/// use idemq::Message;
///
/// let queue = MemoryQueue::new("q"); // never closed: it would wait forever
/// queue.push(Message::new("one"));
/// let mut source = IdleExit::new(queue.source(), Duration::from_millis(50));
/// let delivery = source.next().await.unwrap().expect("one message");
/// let (_, _, _, acker) = delivery.into_parts();
/// acker.ack().await.unwrap();
/// assert!(source.next().await.unwrap().is_none(), "idle: ended");
/// # });
/// ```
#[derive(Debug)]
pub struct IdleExit<S> {
    inner: S,
    idle: Duration,
}

impl<S: Source> IdleExit<S> {
    /// Wraps `inner`, ending it after `idle` without a delivery.
    pub fn new(inner: S, idle: Duration) -> Self {
        Self { inner, idle }
    }
}

#[async_trait]
impl<S: Source> Source for IdleExit<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        match tokio::time::timeout(self.idle, self.inner.next()).await {
            Ok(next) => next,
            Err(_) => {
                tracing::info!(idle = ?self.idle, "no message for the idle time: stopping");
                Ok(None)
            }
        }
    }

    async fn close(&mut self) {
        self.inner.close().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn OffsetLookup>) {
        self.inner.resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.inner.settle_out_of_order(per_partition)
    }
}
