//! The state the source, its receive task and its acknowledgers share: the
//! buffered messages, the busy FIFO groups, and the leases that keep received
//! messages invisible (visibility extension).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use aws_sdk_sqs::types::MessageSystemAttributeName;
use aws_sdk_sqs::Client;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::queue::{broker_error, QueueRef};
use crate::error::SourceError;

/// How long settling waits for a visibility extension in progress.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Everything the source, its receive task and its acknowledgers share.
pub(super) struct Shared {
    pub(super) client: Client,
    pub(super) queue: QueueRef,
    pub(super) dead_letter: Option<QueueRef>,
    pub(super) visibility: Duration,
    pub(super) wait: Duration,
    pub(super) batch: i32,
    pub(super) state: Mutex<State>,
    /// Signalled when a FIFO group is released.
    pub(super) released: Notify,
}

impl Shared {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    pub(super) fn visibility_secs(&self) -> i32 {
        i32::try_from(self.visibility.as_secs()).unwrap_or(i32::MAX)
    }

    pub(super) async fn change_visibility(
        &self,
        receipt: &str,
        secs: i32,
    ) -> Result<(), SourceError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.queue.url)
            .receipt_handle(receipt)
            .visibility_timeout(secs)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error("ChangeMessageVisibility", e))
    }

    pub(super) async fn delete(&self, receipt: &str) -> Result<(), SourceError> {
        self.client
            .delete_message()
            .queue_url(&self.queue.url)
            .receipt_handle(receipt)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error("DeleteMessage", e))
    }
}

/// Received messages not handed out yet, and (FIFO) the groups with a
/// delivery handed out and unsettled.
#[derive(Default)]
pub(super) struct State {
    pub(super) buffer: VecDeque<Received>,
    pub(super) busy_groups: HashSet<String>,
}

/// A received message whose visibility is kept extended until it is settled.
pub(super) struct Received {
    pub(super) message: aws_sdk_sqs::types::Message,
    pub(super) lease: Lease,
}

impl Received {
    pub(super) fn group(&self) -> Option<&str> {
        self.message
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .map(String::as_str)
    }
}

/// Keeps one receipt handle invisible: a task extends its visibility every
/// third of the timeout until the lease is stopped or dropped, and notes
/// whether the visibility may have run out in between.
pub(super) struct Lease {
    pub(super) receipt: String,
    cover: Arc<tokio::sync::Mutex<Cover>>,
    task: JoinHandle<()>,
}

/// What the extension task and a settlement share, under one lock.
struct Cover {
    /// No extension is sent any more.
    stopped: bool,
    /// Until when the message is surely invisible: when the receive or the
    /// last extension that succeeded was *sent*, plus the visibility timeout.
    until: Instant,
    /// An extension succeeded only after `until`: the message was visible for
    /// a moment. The queue may have counted it as back then (moto takes it out
    /// of its in-flight groups, and a later visibility change does not put it
    /// back), so its group is no longer held back by it.
    lapsed: bool,
}

/// How a stopped [`Lease`] had kept its message.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stopped {
    /// `None`: an extension was still on its way when the stop gave up.
    until: Option<Instant>,
    lapsed: bool,
}

impl Stopped {
    /// Whether the message may have been visible at some moment since it was
    /// received, as far as is known now (ask after the settling request).
    pub(super) fn may_have_lapsed(&self) -> bool {
        self.lapsed || self.until.is_none_or(|until| Instant::now() > until)
    }
}

impl Lease {
    /// `sent`: when the receive that returned the message was sent (its
    /// visibility timeout started no earlier).
    pub(super) fn start(shared: &Arc<Shared>, receipt: String, sent: Instant) -> Self {
        let cover = Arc::new(tokio::sync::Mutex::new(Cover {
            stopped: false,
            until: sent + shared.visibility,
            lapsed: false,
        }));
        let task = tokio::spawn(extend(
            Arc::downgrade(shared),
            receipt.clone(),
            Arc::clone(&cover),
            sent,
        ));
        Self {
            receipt,
            cover,
            task,
        }
    }

    /// Stops extending; once this returns, no extension request is sent any more
    /// (one in progress has finished), so a settling request comes after it.
    pub(super) async fn stop(&self) -> Stopped {
        // An extension stuck on the network must not hold up the settlement.
        let stopped = match tokio::time::timeout(STOP_WAIT, self.cover.lock()).await {
            Ok(mut cover) => {
                cover.stopped = true;
                Stopped {
                    until: Some(cover.until),
                    lapsed: cover.lapsed,
                }
            }
            Err(_) => {
                tracing::warn!("a visibility extension is still in progress; settling anyway");
                Stopped {
                    until: None,
                    lapsed: true,
                }
            }
        };
        self.task.abort();
        stopped
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn extend(
    shared: std::sync::Weak<Shared>,
    receipt: String,
    cover: Arc<tokio::sync::Mutex<Cover>>,
    received: Instant,
) {
    let Some(visibility) = shared.upgrade().map(|s| s.visibility) else {
        return;
    };
    let every = visibility / 3;
    // A third after the previous request was *sent*: the queue's countdown
    // starts no earlier, so a slow answer must not stretch the period.
    let mut next = received + every;
    loop {
        tokio::time::sleep_until(next).await;
        let mut held = cover.lock().await;
        if held.stopped {
            return;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let sent = Instant::now();
        next = sent + every;
        match shared
            .change_visibility(&receipt, shared.visibility_secs())
            .await
        {
            Ok(()) => {
                if Instant::now() > held.until {
                    held.lapsed = true;
                    tracing::debug!(queue = %shared.queue.name, "a visibility extension came after the timeout");
                }
                held.until = sent + visibility;
                tracing::trace!(queue = %shared.queue.name, "visibility extended")
            }
            Err(e) => {
                tracing::warn!(queue = %shared.queue.name, error = %e, "extending the visibility failed")
            }
        }
        drop(held);
    }
}

/// Makes the given received messages visible again at once (best effort, in
/// the background): they were never handed out, or must be redelivered in order.
///
/// Each lease is stopped first, waiting for an extension already sent: an
/// extension that reached the queue after the release would hide the message
/// again while its group's later messages are delivered (moto then hands out
/// the group out of order; SQS holds the whole group back).
pub(super) fn release_now(shared: &Arc<Shared>, released: Vec<Received>) {
    if released.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return; // dropped with their leases: they come back after the visibility timeout
    };
    let shared = Arc::clone(shared);
    runtime.spawn(async move {
        for received in released {
            received.lease.stop().await;
            let receipt = &received.lease.receipt;
            if let Err(e) = shared.change_visibility(receipt, 0).await {
                tracing::debug!(queue = %shared.queue.name, error = %e, "releasing a buffered message failed");
            }
        }
    });
}
