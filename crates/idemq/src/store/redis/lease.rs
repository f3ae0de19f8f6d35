//! The held lease ([`RedisLease`]): its heartbeat, and its release when
//! dropped while held.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;

use super::heartbeat::BeatGuard;
use super::{RedisConnection, RedisStore, Scripts};

/// A held lease on a key: what a handler gets from the Redis store.
///
/// Dropping it stops its heartbeat (the lease then expires by itself unless
/// it was committed or rolled back).
#[derive(Debug)]
pub struct RedisLease {
    pub(super) consumer: String,
    pub(super) key: String,
    pub(super) token: String,
    pub(super) fencing: u64,
    pub(super) first_seen_ms: i64,
    /// The lease's length.
    pub(super) lease: Duration,
    pub(super) lost: Arc<AtomicBool>,
    pub(super) heartbeat: Option<BeatGuard>,
    pub(super) release_on_drop: Option<DropRelease>,
}

/// What a lease dropped without commit or rollback needs to release itself.
pub(super) struct DropRelease {
    pub(super) conn: RedisConnection,
    pub(super) scripts: Arc<Scripts>,
    pub(super) rec: String,
    pub(super) token: String,
    /// The TTL of the free record left behind.
    pub(super) ttl_ms: u64,
}

impl std::fmt::Debug for DropRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DropRelease")
            .field("rec", &self.rec)
            .finish()
    }
}

impl DropRelease {
    /// Releases the key in the background (compare-and-delete on the token).
    /// The future is polled once right here, so the command is queued on the
    /// connection before anything sent after the drop (e.g. the redelivery's
    /// claim); a spawned task finishes it.
    fn fire(self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the lease expires by itself
        };
        let mut fut = Box::pin(async move {
            let DropRelease {
                mut conn,
                scripts,
                rec,
                token,
                ttl_ms,
            } = self;
            let r: Result<i64, RedisError> = scripts
                .release
                .key(&rec)
                .arg(&token)
                .arg(ttl_ms)
                .invoke_async(&mut conn)
                .await;
            if let Err(e) = r {
                tracing::warn!(key = %rec, error = %e, "releasing a dropped lease failed; it will expire");
            }
        });
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        if fut.as_mut().poll(&mut cx).is_pending() {
            runtime.spawn(fut);
        }
    }
}

/// A lease holds no writes: a retry in place has nothing to undo.
impl crate::engine::layers::Rewind for RedisLease {}

impl RedisLease {
    /// The key's fencing number: it rises with every acquisition of this key
    /// (per consumer), so a downstream system can refuse writes carrying a
    /// lower number than one it has already seen for the key.
    pub fn fencing_token(&self) -> u64 {
        self.fencing
    }

    /// Whether the heartbeat found the lease taken over (or could not renew
    /// it for a whole lease period): the completion will then be refused.
    pub fn lease_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The business key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Stops the heartbeat and disarms the release on drop (commit and
    /// rollback take care of the record themselves).
    pub(super) fn stop_heartbeat(&mut self) {
        self.release_on_drop = None;
        self.heartbeat = None;
    }
}

impl Drop for RedisLease {
    /// A lease dropped while held (its handler was cancelled, e.g. the task
    /// was aborted) stops its heartbeat and releases the key at once, like a
    /// rollback, so the redelivery need not wait for the lease to expire.
    fn drop(&mut self) {
        let release = self.release_on_drop.take();
        self.stop_heartbeat();
        if let Some(release) = release {
            release.fire();
        }
    }
}

impl RedisStore {
    /// Registers the lease of `token` on the record `rec` (of `key`) with
    /// the store's heartbeat, which extends it every `lease / 3` until the
    /// guard is dropped, or marks it `lost`.
    pub(super) fn start_heartbeat(
        &self,
        rec: &str,
        key: &str,
        token: &str,
        lease: Duration,
        lost: Arc<AtomicBool>,
    ) -> BeatGuard {
        self.heartbeats.register(
            rec.to_owned(),
            key,
            token.to_owned(),
            lease,
            self.record_ttl(lease),
            lost,
        )
    }
}
