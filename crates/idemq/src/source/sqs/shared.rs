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
/// third of the timeout until the lease is stopped or dropped.
pub(super) struct Lease {
    pub(super) receipt: String,
    stopped: Arc<tokio::sync::Mutex<bool>>,
    task: JoinHandle<()>,
}

impl Lease {
    pub(super) fn start(shared: &Arc<Shared>, receipt: String) -> Self {
        let stopped = Arc::new(tokio::sync::Mutex::new(false));
        let task = tokio::spawn(extend(
            Arc::downgrade(shared),
            receipt.clone(),
            Arc::clone(&stopped),
        ));
        Self {
            receipt,
            stopped,
            task,
        }
    }

    /// Stops extending; once this returns, no extension request is sent any more
    /// (one in progress has finished), so a settling request comes after it.
    pub(super) async fn stop(&self) {
        // An extension stuck on the network must not hold up the settlement.
        match tokio::time::timeout(STOP_WAIT, self.stopped.lock()).await {
            Ok(mut stopped) => *stopped = true,
            Err(_) => {
                tracing::warn!("a visibility extension is still in progress; settling anyway")
            }
        }
        self.task.abort();
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
    stopped: Arc<tokio::sync::Mutex<bool>>,
) {
    let Some(visibility) = shared.upgrade().map(|s| s.visibility) else {
        return;
    };
    let every = visibility / 3;
    loop {
        tokio::time::sleep(every).await;
        let guard = stopped.lock().await;
        if *guard {
            return;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match shared
            .change_visibility(&receipt, shared.visibility_secs())
            .await
        {
            Ok(()) => tracing::trace!(queue = %shared.queue.name, "visibility extended"),
            Err(e) => {
                tracing::warn!(queue = %shared.queue.name, error = %e, "extending the visibility failed")
            }
        }
        drop(guard);
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
