//! The held lease ([`MongoLease`]): its heartbeat, and its release when
//! dropped while held.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use mongodb::bson::{doc, Bson, Document};

use super::error::map_err;
use super::records::At;
use super::MongoStore;
use crate::error::StoreError;
use crate::sync::lock;

/// What identifies a held lease: the key, its epoch and generation, the token.
#[derive(Debug, Clone)]
pub(super) struct LeaseCore {
    pub(super) consumer: String,
    pub(super) key: String,
    pub(super) epoch: String,
    pub(super) g: i64,
    pub(super) token: String,
    pub(super) first_seen: i64,
    pub(super) lease: Duration,
    /// Server time (ms) until which the last successful write held the lease.
    pub(super) renewed_until: i64,
}

impl LeaseCore {
    /// The lease's own slot.
    pub(super) fn at(&self) -> At<'_> {
        At {
            consumer: &self.consumer,
            key: &self.key,
            epoch: &self.epoch,
            g: self.g,
            first_seen: self.first_seen,
        }
    }

    /// The slot that ends the lease (done, free) or takes it over.
    pub(super) fn next(&self) -> At<'_> {
        At {
            g: self.g + 1,
            ..self.at()
        }
    }

    fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis())
            .unwrap_or(i64::MAX)
            .max(1)
    }

    /// Whether a heartbeat was missed by server time `now`: less than a
    /// third of the lease is left of the last renewal (the heartbeat renews
    /// every third, so at least two thirds are left while it keeps up).
    pub(super) fn may_have_lapsed(&self, now: i64) -> bool {
        self.renewed_until.saturating_sub(now) < self.lease_ms() / 3
    }
}

/// A lease the heartbeat keeps alive, with the flags it reports through.
#[derive(Debug, Clone)]
pub(super) struct Beating {
    pub(super) id: String,
    pub(super) next_id: String,
    pub(super) token: String,
    pub(super) key: String,
    pub(super) lost: Arc<AtomicBool>,
    pub(super) renewed: Arc<AtomicI64>,
}

impl Beating {
    pub(super) fn of(core: &LeaseCore) -> Self {
        Self {
            id: core.at().id(),
            next_id: core.next().id(),
            token: core.token.clone(),
            key: core.key.clone(),
            lost: Arc::new(AtomicBool::new(false)),
            renewed: Arc::new(AtomicI64::new(core.renewed_until)),
        }
    }
}

/// Extends every lease of `leases` to `lease` past the server's now (one
/// update), then (one query) marks as lost those whose next generation
/// exists (taken over, or released by an operator) or whose own slot is
/// gone (the key was pruned while the lease had lapsed: an update of a
/// missing slot changes nothing, so it must not count as a renewal).
pub(super) async fn beat(
    store: &MongoStore,
    leases: &[Beating],
    lease: Duration,
) -> Result<(), StoreError> {
    if leases.is_empty() {
        return Ok(());
    }
    let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX).max(1);
    let until = store.server_now().await.saturating_add(lease_ms);
    let ids: Vec<Bson> = leases.iter().map(|l| Bson::String(l.id.clone())).collect();
    let tokens: Vec<Bson> = leases
        .iter()
        .map(|l| Bson::String(l.token.clone()))
        .collect();
    store
        .inner
        .inbox
        .update_many(
            doc! { "_id": { "$in": ids }, "token": { "$in": tokens } },
            doc! { "$set": { "expires": until } },
        )
        .await
        .map_err(map_err)?;
    let wanted: Vec<Bson> = leases
        .iter()
        .flat_map(|l| [Bson::String(l.id.clone()), Bson::String(l.next_id.clone())])
        .collect();
    let found: HashSet<String> = store
        .inner
        .inbox
        .find(doc! { "_id": { "$in": wanted } })
        .projection(doc! { "_id": 1 })
        .await
        .map_err(map_err)?
        .try_collect::<Vec<Document>>()
        .await
        .map_err(map_err)?
        .iter()
        .filter_map(|d| d.get_str("_id").ok().map(str::to_owned))
        .collect();
    for l in leases {
        let why = if found.contains(&l.next_id) {
            Some("the key was taken over or released")
        } else if !found.contains(&l.id) {
            Some("the lease's record is gone (the key was pruned)")
        } else {
            None
        };
        match why {
            Some(why) => {
                if !l.lost.swap(true, Ordering::SeqCst) {
                    tracing::warn!(key = %l.key, "lease lost: {why}");
                }
            }
            None => l.renewed.store(until, Ordering::SeqCst),
        }
    }
    Ok(())
}

/// Runs the heartbeat of `leases` every `lease / 3` until aborted. A lease
/// found lost leaves the set; if the server cannot be reached for a whole
/// lease, every lease is marked lost and the heartbeat ends.
pub(super) fn spawn_heartbeat(
    store: MongoStore,
    leases: Arc<Mutex<Vec<Beating>>>,
    lease: Duration,
) -> tokio::task::JoinHandle<()> {
    let every = (lease / 3).max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(every).await;
            let snapshot: Vec<Beating> = lock(&leases).clone();
            if snapshot.is_empty() {
                continue;
            }
            match beat(&store, &snapshot, lease).await {
                Ok(()) => {
                    last_ok = Instant::now();
                    lock(&leases).retain(|l| !l.lost.load(Ordering::SeqCst));
                }
                Err(e) => {
                    tracing::warn!(leases = snapshot.len(), error = %e, "lease heartbeat failed");
                    if last_ok.elapsed() >= lease {
                        for l in &snapshot {
                            l.lost.store(true, Ordering::SeqCst);
                        }
                        return;
                    }
                }
            }
        }
    })
}

/// Frees `cores` in the background (a `free` slot each), if a runtime is
/// there to run it; otherwise their leases expire by themselves.
pub(super) fn release_in_background(store: MongoStore, cores: Vec<LeaseCore>) {
    if cores.is_empty() {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        if let Err(e) = store.free_all(&cores).await {
            tracing::warn!(leases = cores.len(), error = %e, "releasing dropped leases failed; they will expire");
        }
    });
}

/// A held lease on a key: what a handler gets from the Mongo store.
///
/// Dropped while held (its handler was cancelled), it stops its heartbeat
/// and releases the key in the background.
#[derive(Debug)]
pub struct MongoLease {
    core: LeaseCore,
    lost: Arc<AtomicBool>,
    renewed: Arc<AtomicI64>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// Set while the lease is held by this handle and not settled.
    release_on_drop: Option<MongoStore>,
}

/// A lease holds no writes: a retry in place has nothing to undo.
impl crate::engine::layers::Rewind for MongoLease {}

impl MongoLease {
    /// A lease with its own heartbeat, released if dropped while held.
    pub(super) fn held(store: &MongoStore, core: LeaseCore) -> Self {
        let beating = Beating::of(&core);
        let (lost, renewed) = (Arc::clone(&beating.lost), Arc::clone(&beating.renewed));
        let heartbeat = spawn_heartbeat(
            store.clone(),
            Arc::new(Mutex::new(vec![beating])),
            core.lease,
        );
        Self {
            core,
            lost,
            renewed,
            heartbeat: Some(heartbeat),
            release_on_drop: Some(store.clone()),
        }
    }

    /// A lease of a unit, whose heartbeat and release are the unit's.
    pub(super) fn grouped(core: LeaseCore, beating: &Beating) -> Self {
        Self {
            core,
            lost: Arc::clone(&beating.lost),
            renewed: Arc::clone(&beating.renewed),
            heartbeat: None,
            release_on_drop: None,
        }
    }

    /// The key's fencing number: the generation of this lease, which rises
    /// with every acquisition of the key (per consumer; it starts again at
    /// 1 after the key was pruned), so a downstream system can refuse
    /// writes carrying a lower number than one it has already seen.
    pub fn fencing_token(&self) -> u64 {
        u64::try_from(self.core.g).unwrap_or(0)
    }

    /// Whether the heartbeat found the lease taken over (or could not renew
    /// it for a whole lease period): the completion will then be refused.
    pub fn lease_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.core.consumer
    }

    /// The business key.
    pub fn key(&self) -> &str {
        &self.core.key
    }

    /// Marks the lease lost (its completion was refused).
    pub(super) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }

    /// Stops the heartbeat and disarms the release on drop (commit and
    /// rollback settle the key themselves); the core, with its last renewal.
    pub(super) fn settle(&mut self) -> LeaseCore {
        self.release_on_drop = None;
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        let mut core = self.core.clone();
        core.renewed_until = self.renewed.load(Ordering::SeqCst);
        if self.lease_lost() {
            // Make the completion check the key's life again.
            core.renewed_until = i64::MIN;
        }
        core
    }
}

impl Drop for MongoLease {
    fn drop(&mut self) {
        let store = self.release_on_drop.take();
        let core = self.settle();
        if let Some(store) = store {
            release_in_background(store, vec![core]);
        }
    }
}

impl MongoStore {
    /// Frees every lease of `cores` (a `free` slot each, one round trip);
    /// a lease taken over already is left alone.
    pub(super) async fn free_all(&self, cores: &[LeaseCore]) -> Result<(), StoreError> {
        let docs: Vec<Document> = cores.iter().map(|c| c.next().free()).collect();
        match docs.len() {
            0 => Ok(()),
            1 => {
                let doc = docs.into_iter().next().unwrap_or_default();
                self.insert_unique(&self.inner.inbox, doc).await.map(|_| ())
            }
            _ => self.insert_all_unique(docs).await.map(|_| ()),
        }
    }

    /// Inserts `docs` into the inbox in one unordered round trip; answers,
    /// per document, whether it was inserted (`false`: its `_id` was taken).
    pub(super) async fn insert_all_unique(
        &self,
        docs: Vec<Document>,
    ) -> Result<Vec<bool>, StoreError> {
        let n = docs.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        match self.inner.inbox.insert_many(docs).ordered(false).await {
            Ok(_) => Ok(vec![true; n]),
            Err(e) => match super::error::duplicate_indexes(&e) {
                Some(refused) => Ok((0..n).map(|i| !refused.contains(&i)).collect()),
                None => Err(map_err(e)),
            },
        }
    }
}
