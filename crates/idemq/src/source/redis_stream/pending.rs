//! Pending-entry bookkeeping: the entries this source holds, what the source,
//! its tasks and its acknowledgers share, and keeping held entries fresh.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, Weak};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::Value;
use tokio::sync::mpsc;

use super::conn::{broker_error, millis};
use super::reply::{parse_entries, parse_pending_count, Entry};
use crate::error::SourceError;

/// An entry ready to be handed out.
#[derive(Debug)]
pub(super) struct Ready {
    pub(super) id: String,
    pub(super) fields: Vec<(String, Vec<u8>)>,
    pub(super) delivery_count: u32,
}

/// Everything the source, its tasks and its acknowledgers share.
pub(super) struct Shared {
    pub(super) conn: ConnectionManager,
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) claim_idle: Duration,
    pub(super) dead_letter_stream: Option<String>,
    /// Entry ids this source holds (buffered, in flight, waiting for a retry):
    /// kept fresh in the PEL, and not delivered a second time by `XAUTOCLAIM`.
    pub(super) held: Mutex<HashSet<String>>,
    /// Nacked entries come back through here after their delay.
    pub(super) retries: mpsc::UnboundedSender<Ready>,
}

impl Shared {
    pub(super) fn held(&self) -> MutexGuard<'_, HashSet<String>> {
        crate::sync::lock(&self.held)
    }

    pub(super) fn release(&self, id: &str) {
        self.held().remove(id);
    }

    pub(super) async fn xack(&self, id: &str) -> Result<(), SourceError> {
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(id)
            .query_async::<Value>(&mut self.conn.clone())
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("XACK {}", self.stream), e))
    }

    /// Claims `id` for this consumer again (incrementing its delivery
    /// counter); `None` if it is no longer pending or no longer in the stream.
    pub(super) async fn reclaim(&self, id: &str) -> Result<Option<Entry>, SourceError> {
        let reply: Value = redis::cmd("XCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(0)
            .arg(id)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| broker_error(&format!("XCLAIM {}", self.stream), e))?;
        Ok(parse_entries(&reply)
            .into_iter()
            .find(|e| e.id == id && e.fields.is_some()))
    }

    /// The PEL's times-delivered of each id (1 where it cannot be read).
    pub(super) async fn delivery_counts(&self, ids: &[&str]) -> HashMap<String, u32> {
        let mut pipe = redis::pipe();
        for id in ids {
            pipe.cmd("XPENDING")
                .arg(&self.stream)
                .arg(&self.group)
                .arg(*id)
                .arg(*id)
                .arg(1);
        }
        let replies: Vec<Value> = match pipe.query_async(&mut self.conn.clone()).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(stream = %self.stream, error = %e, "XPENDING failed; delivery counts unknown");
                Vec::new()
            }
        };
        ids.iter()
            .zip(
                replies
                    .iter()
                    .map(parse_pending_count)
                    .chain(std::iter::repeat(None)),
            )
            .map(|(id, n)| ((*id).to_owned(), n.unwrap_or(1).max(1)))
            .collect()
    }
}

/// Keeps the held entries fresh in the PEL (`XCLAIM … JUSTID`), so that
/// `XAUTOCLAIM` elsewhere leaves them alone.
pub(super) async fn keep_fresh(shared: Weak<Shared>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let ids: Vec<String> = shared.held().iter().cloned().collect();
        if ids.is_empty() {
            continue;
        }
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&shared.stream)
            .arg(&shared.group)
            .arg(&shared.consumer)
            // Only entries not touched for half a period: one that another
            // consumer has just claimed is left to it.
            .arg(millis(every / 2));
        for id in &ids {
            cmd.arg(id);
        }
        cmd.arg("JUSTID");
        if let Err(e) = cmd.query_async::<Value>(&mut shared.conn.clone()).await {
            tracing::warn!(stream = %shared.stream, error = %e, "keeping pending entries fresh failed");
        }
    }
}
