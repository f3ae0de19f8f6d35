//! The heartbeats of one store's per-message leases ([`Heartbeats`]): one
//! task for all of them, which moves the deadlines of the leases that are
//! due — every `lease / 3` each — in one script per round (one per key on
//! a Redis Cluster), instead of a task spawned and aborted per lease.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::batch::{extend, Held};
use super::{RedisConnection, Scripts};
use crate::sync::lock;

/// How long the heartbeat task waits with nothing to extend before it
/// checks whether its store is gone.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// One registered lease.
struct Beat {
    held: Held,
    key: String,
    lease: Duration,
    lease_ms: u64,
    ttl_ms: u64,
    due: Instant,
    last_ok: Instant,
}

/// The registry of a store's held per-message leases and its one
/// heartbeat task (started on the first lease, in the runtime of that
/// claim; started again if that runtime went away).
pub(super) struct Heartbeats {
    beats: Mutex<HashMap<u64, Beat>>,
    next_id: AtomicU64,
    wake: Arc<Notify>,
    /// When the task will next look at the leases (`None`: not asleep on a
    /// deadline), so a new lease wakes it only if it is due before that.
    planned: Arc<Mutex<Option<Instant>>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
    conn: RedisConnection,
    scripts: Arc<Scripts>,
}

impl std::fmt::Debug for Heartbeats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeats")
            .field("leases", &lock(&self.beats).len())
            .finish_non_exhaustive()
    }
}

/// A lease's registration: dropping it stops the lease's heartbeat.
pub(super) struct BeatGuard {
    id: u64,
    heartbeats: Arc<Heartbeats>,
}

impl std::fmt::Debug for BeatGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BeatGuard").field("id", &self.id).finish()
    }
}

impl Drop for BeatGuard {
    fn drop(&mut self) {
        lock(&self.heartbeats.beats).remove(&self.id);
    }
}

fn every(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

impl Heartbeats {
    pub(super) fn new(conn: RedisConnection, scripts: Arc<Scripts>) -> Arc<Self> {
        Arc::new(Self {
            beats: Mutex::default(),
            next_id: AtomicU64::new(0),
            wake: Arc::new(Notify::new()),
            planned: Arc::default(),
            task: Mutex::new(None),
            conn,
            scripts,
        })
    }

    /// Extends the lease of `token` on `rec` (of `key`) every `lease / 3`
    /// until the guard is dropped, or marks it `lost`: taken over, or
    /// Redis unreachable for a whole lease.
    pub(super) fn register(
        self: &Arc<Self>,
        rec: String,
        key: &str,
        token: String,
        lease: Duration,
        ttl_ms: u64,
        lost: Arc<AtomicBool>,
    ) -> BeatGuard {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let due = now + every(lease);
        lock(&self.beats).insert(
            id,
            Beat {
                held: Held { rec, token, lost },
                key: key.to_owned(),
                lease,
                lease_ms: super::millis(lease),
                ttl_ms,
                due,
                last_ok: now,
            },
        );
        self.ensure_task(due);
        BeatGuard {
            id,
            heartbeats: Arc::clone(self),
        }
    }

    /// Starts the task if it is not running; wakes it if a lease is `due`
    /// before it planned to look.
    fn ensure_task(self: &Arc<Self>, due: Instant) {
        let mut task = lock(&self.task);
        if task.as_ref().is_some_and(|t| !t.is_finished()) {
            if lock(&self.planned).is_none_or(|planned| due < planned) {
                self.wake.notify_one();
            }
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the leases expire by themselves
        };
        *task = Some(runtime.spawn(run(
            Arc::downgrade(self),
            Arc::clone(&self.wake),
            Arc::clone(&self.planned),
        )));
    }

    /// Extends every lease that is due; answers when the next one is.
    async fn round(&self) -> Option<Instant> {
        let now = Instant::now();
        let due: Vec<(u64, Held, u64, u64)> = lock(&self.beats)
            .iter()
            .filter(|(_, b)| b.due <= now)
            .map(|(id, b)| (*id, b.held.clone(), b.lease_ms, b.ttl_ms))
            .collect();
        let mut groups: HashMap<(u64, u64), Vec<(u64, Held)>> = HashMap::new();
        for (id, held, lease_ms, ttl_ms) in due {
            groups
                .entry((lease_ms, ttl_ms))
                .or_default()
                .push((id, held));
        }
        for ((lease_ms, ttl_ms), members) in groups {
            let helds: Vec<Held> = members.iter().map(|(_, h)| h.clone()).collect();
            let mut conn = self.conn.clone();
            let answer = extend(&mut conn, &self.scripts, &helds, lease_ms, ttl_ms).await;
            let after = Instant::now();
            let mut beats = lock(&self.beats);
            for (n, (id, _)) in members.iter().enumerate() {
                let Some(beat) = beats.get_mut(id) else {
                    continue; // completed meanwhile
                };
                let lost = match &answer {
                    Ok(flags) if flags.get(n).copied().unwrap_or(false) => {
                        beat.last_ok = after;
                        false
                    }
                    Ok(_) => {
                        tracing::warn!(key = %beat.key, "lease lost: the key is held by another token");
                        true
                    }
                    Err(e) => {
                        tracing::warn!(key = %beat.key, error = %e, "lease heartbeat failed");
                        beat.last_ok.elapsed() >= beat.lease
                    }
                };
                if lost {
                    beat.held.lost.store(true, Ordering::SeqCst);
                    beats.remove(id);
                } else {
                    beat.due = after + every(beat.lease);
                }
            }
        }
        lock(&self.beats).values().map(|b| b.due).min()
    }
}

/// The heartbeat task: rounds until its store is gone.
async fn run(
    heartbeats: Weak<Heartbeats>,
    wake: Arc<Notify>,
    planned: Arc<Mutex<Option<Instant>>>,
) {
    loop {
        *lock(&planned) = None;
        let next = {
            let Some(heartbeats) = heartbeats.upgrade() else {
                return;
            };
            heartbeats.round().await
        };
        // With no lease held (`None`) any new one wakes the task.
        *lock(&planned) = next;
        let until = next.unwrap_or_else(|| Instant::now() + IDLE_CHECK);
        tokio::select! {
            () = tokio::time::sleep_until(until.into()) => {}
            () = wake.notified() => {}
        }
    }
}
