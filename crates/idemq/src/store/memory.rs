//! The in-memory lease store: the same outcomes as the durable stores, for
//! quick starts, unit tests of handlers, and single-process tools.
//!
//! A claim is a lease: `in-flight(token, expiry)` until the handler's
//! completion turns it into `done(fingerprint, result)` by compare-and-set on
//! the token. A lease that expires (the worker died or stalled) can be taken
//! over by another claim; the stale holder's completion is then refused with
//! [`StoreErrorKind::LeaseLost`](crate::StoreErrorKind::LeaseLost). Nothing survives the process: use a SQL store
//! (or Redis) for a real exactly-once guarantee across restarts.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use async_trait::async_trait;

use super::{
    now_ms, AttemptRecord, Claim, ClaimRequest, ConsumerStats, DeadLetter, DeadLetterRecord,
    InboxRecord, KeyReport, Store, StoreAdmin,
};
use crate::effect::EffectJournal;
use crate::error::StoreError;

/// A held lease on a key: what a handler gets from the memory store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    consumer: String,
    key: String,
    token: u64,
    fencing: u64,
}

/// A lease holds no writes: a retry in place has nothing to undo.
impl crate::engine::layers::Rewind for Lease {}

impl Lease {
    /// A number that rises with every acquisition of any key in this store:
    /// a downstream system can refuse writes carrying a lower number than
    /// one it has already seen for the key.
    pub fn fencing_token(&self) -> u64 {
        self.fencing
    }
}

#[derive(Debug)]
enum Entry {
    InFlight {
        token: u64,
        expires: Instant,
        first_seen_ms: i64,
    },
    Done(InboxRecord),
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<(String, String), Entry>,
    attempts: HashMap<(String, String), AttemptRecord>,
    dead_letters: BTreeMap<i64, DeadLetterRecord>,
    /// Letter id ([`DeadLetter::letter_id`]) → dead letter id: one letter
    /// per dead-lettered message.
    letters: HashMap<String, i64>,
    next_dead_letter_id: i64,
    next_token: u64,
    /// The effect journal: (consumer, key, step) → (result, written at ms).
    effects: HashMap<(String, String, String), (serde_json::Value, i64)>,
}

/// An in-process lease store. Cloning shares the same state.
///
/// ```
/// # tokio_test_block(async {
/// use idemq::store::{memory::MemoryStore, Claim, ClaimRequest, Store};
/// use std::time::Duration;
/// let store = MemoryStore::new();
/// let req = ClaimRequest { consumer: "c", key: "k", fingerprint: "f", lease: Duration::from_secs(30) };
/// let Claim::New(lease) = store.claim(&req).await.unwrap() else { panic!() };
/// assert!(matches!(store.claim(&req).await.unwrap(), Claim::InFlight));
/// store.commit(lease, &req, None).await.unwrap();
/// assert!(matches!(store.claim(&req).await.unwrap(), Claim::Done(_)));
/// # });
/// # fn tokio_test_block<F: std::future::Future>(f: F) -> F::Output {
/// #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State half-updated in a
        // way that matters more than losing the whole store, so keep going.
        crate::sync::lock(&self.state)
    }
}

fn scoped(consumer: &str, key: &str) -> (String, String) {
    (consumer.to_owned(), key.to_owned())
}

#[async_trait]
impl Store for MemoryStore {
    type Tx = Lease;

    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<Lease>, StoreError> {
        let mut state = self.state();
        let id = scoped(req.consumer, req.key);
        let now = Instant::now();
        let first_seen_ms = match state.keys.get(&id) {
            Some(Entry::Done(record)) => return Ok(Claim::Done(record.clone())),
            Some(Entry::InFlight { expires, .. }) if *expires > now => return Ok(Claim::InFlight),
            // An expired lease is taken over; the first-seen time stays.
            Some(Entry::InFlight { first_seen_ms, .. }) => *first_seen_ms,
            None => now_ms(),
        };
        state.next_token += 1;
        let token = state.next_token;
        state.keys.insert(
            id,
            Entry::InFlight {
                token,
                expires: now + req.lease,
                first_seen_ms,
            },
        );
        Ok(Claim::New(Lease {
            consumer: req.consumer.to_owned(),
            key: req.key.to_owned(),
            token,
            fencing: token,
        }))
    }

    async fn commit(
        &self,
        lease: Lease,
        req: &ClaimRequest<'_>,
        result: Option<&serde_json::Value>,
    ) -> Result<(), StoreError> {
        let mut state = self.state();
        let id = scoped(&lease.consumer, &lease.key);
        let first_seen_ms = match state.keys.get(&id) {
            Some(Entry::InFlight {
                token,
                first_seen_ms,
                ..
            }) if *token == lease.token => *first_seen_ms,
            _ => return Err(StoreError::lease_lost(&lease.key)),
        };
        state.keys.insert(
            id.clone(),
            Entry::Done(InboxRecord {
                consumer: lease.consumer,
                key: lease.key,
                fingerprint: req.fingerprint.to_owned(),
                result: result.cloned(),
                first_seen_ms,
            }),
        );
        state.attempts.remove(&id);
        Ok(())
    }

    async fn rollback(&self, lease: Lease) -> Result<(), StoreError> {
        let mut state = self.state();
        let id = scoped(&lease.consumer, &lease.key);
        if matches!(state.keys.get(&id), Some(Entry::InFlight { token, .. }) if *token == lease.token)
        {
            state.keys.remove(&id);
        }
        Ok(())
    }

    async fn record_failure(
        &self,
        consumer: &str,
        key: &str,
        error: &str,
    ) -> Result<u32, StoreError> {
        let mut state = self.state();
        let now = now_ms();
        let record = state
            .attempts
            .entry(scoped(consumer, key))
            .or_insert_with(|| AttemptRecord {
                attempts: 0,
                last_error: String::new(),
                first_failed_ms: now,
                last_failed_ms: now,
            });
        record.attempts += 1;
        record.last_error = error.to_owned();
        record.last_failed_ms = now;
        Ok(record.attempts)
    }

    async fn dead_letter(&self, letter: &DeadLetter<'_>) -> Result<(), StoreError> {
        let letter_id = letter.letter_id();
        let mut state = self.state();
        if state.letters.contains_key(&letter_id) {
            return Ok(());
        }
        state.next_dead_letter_id += 1;
        let id = state.next_dead_letter_id;
        state.letters.insert(letter_id, id);
        state.dead_letters.insert(
            id,
            DeadLetterRecord {
                id,
                consumer: letter.consumer.to_owned(),
                key: letter.key.map(str::to_owned),
                reason: letter.reason.code().to_owned(),
                error: letter.error.to_owned(),
                message: letter.message.clone(),
                meta: letter.meta.clone(),
                attempts: letter.attempts,
                created_ms: now_ms(),
            },
        );
        if let Some(key) = letter.key {
            state.attempts.remove(&scoped(letter.consumer, key));
        }
        Ok(())
    }

    fn journal(&self) -> Option<&dyn EffectJournal> {
        Some(self)
    }
}

/// The journal lives with the keys: as long as the process (or until pruned).
#[async_trait]
impl EffectJournal for MemoryStore {
    async fn get(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
    ) -> Result<Option<serde_json::Value>, StoreError> {
        let id = (consumer.to_owned(), key.to_owned(), step.to_owned());
        Ok(self.state().effects.get(&id).map(|(v, _)| v.clone()))
    }

    async fn put(
        &self,
        consumer: &str,
        key: &str,
        step: &str,
        result: &serde_json::Value,
    ) -> Result<serde_json::Value, StoreError> {
        let id = (consumer.to_owned(), key.to_owned(), step.to_owned());
        let mut state = self.state();
        let (stored, _) = state
            .effects
            .entry(id)
            .or_insert_with(|| (result.clone(), now_ms()));
        Ok(stored.clone())
    }

    async fn steps(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let mut steps: Vec<(String, serde_json::Value)> = self
            .state()
            .effects
            .iter()
            .filter(|((c, k, _), _)| c == consumer && k == key)
            .map(|((_, _, step), (value, _))| (step.clone(), value.clone()))
            .collect();
        steps.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(steps)
    }
}

#[async_trait]
impl StoreAdmin for MemoryStore {
    /// Always answers: it is in this process.
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn prune_batch(&self, cutoff_ms: i64, batch: u32) -> Result<u64, StoreError> {
        let mut state = self.state();
        let old: Vec<(String, String)> = state
            .keys
            .iter()
            .filter(|(_, e)| matches!(e, Entry::Done(r) if r.first_seen_ms < cutoff_ms))
            .map(|(k, _)| k.clone())
            .take(batch as usize)
            .collect();
        for k in &old {
            state.keys.remove(k);
        }
        state.attempts.retain(|_, a| a.last_failed_ms >= cutoff_ms);
        let old_effects: Vec<_> = state
            .effects
            .iter()
            .filter(|(_, (_, written))| *written < cutoff_ms)
            .map(|(k, _)| k.clone())
            .take(batch as usize)
            .collect();
        for k in &old_effects {
            state.effects.remove(k);
        }
        Ok(old.len().max(old_effects.len()) as u64)
    }

    async fn inspect(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let state = self.state();
        let id = scoped(consumer, key);
        let (inbox, in_flight) = match state.keys.get(&id) {
            Some(Entry::Done(r)) => (Some(r.clone()), false),
            Some(Entry::InFlight { expires, .. }) => (None, *expires > Instant::now()),
            None => (None, false),
        };
        Ok(KeyReport {
            inbox,
            in_flight,
            attempts: state.attempts.get(&id).cloned(),
            dead_letters: state
                .dead_letters
                .values()
                .filter(|d| d.consumer == consumer && d.key.as_deref() == Some(key))
                .cloned()
                .collect(),
        })
    }

    async fn stats(&self) -> Result<Vec<ConsumerStats>, StoreError> {
        let state = self.state();
        let mut by_consumer: BTreeMap<String, ConsumerStats> = BTreeMap::new();
        let entry = |map: &mut BTreeMap<String, ConsumerStats>, c: &str| {
            map.entry(c.to_owned())
                .or_insert_with(|| ConsumerStats {
                    consumer: c.to_owned(),
                    ..ConsumerStats::default()
                })
                .clone()
        };
        for ((consumer, _), e) in &state.keys {
            if let Entry::Done(r) = e {
                let mut s = entry(&mut by_consumer, consumer);
                s.processed += 1;
                s.oldest_ms = Some(
                    s.oldest_ms
                        .map_or(r.first_seen_ms, |o| o.min(r.first_seen_ms)),
                );
                s.newest_ms = Some(
                    s.newest_ms
                        .map_or(r.first_seen_ms, |o| o.max(r.first_seen_ms)),
                );
                by_consumer.insert(consumer.clone(), s);
            }
        }
        for d in state.dead_letters.values() {
            let mut s = entry(&mut by_consumer, &d.consumer);
            s.dead_letters += 1;
            by_consumer.insert(d.consumer.clone(), s);
        }
        for (consumer, _) in state.attempts.keys() {
            let mut s = entry(&mut by_consumer, consumer);
            s.failing += 1;
            by_consumer.insert(consumer.clone(), s);
        }
        Ok(by_consumer.into_values().collect())
    }

    async fn dead_letters(
        &self,
        consumer: Option<&str>,
        after_id: i64,
        limit: u32,
    ) -> Result<Vec<DeadLetterRecord>, StoreError> {
        let state = self.state();
        Ok(state
            .dead_letters
            .range(after_id + 1..)
            .map(|(_, d)| d)
            .filter(|d| consumer.is_none_or(|c| d.consumer == c))
            .take(limit as usize)
            .cloned()
            .collect())
    }

    async fn delete_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let mut state = self.state();
        state.letters.retain(|_, letter| *letter != id);
        Ok(state.dead_letters.remove(&id).is_some())
    }

    async fn release(&self, consumer: &str, key: &str) -> Result<bool, StoreError> {
        let mut state = self.state();
        let id = scoped(consumer, key);
        if matches!(state.keys.get(&id), Some(Entry::InFlight { .. })) {
            state.keys.remove(&id);
            return Ok(true);
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreErrorKind;
    use std::time::Duration;

    #[tokio::test]
    async fn release_frees_a_held_lease_and_the_stale_holder_cannot_complete() {
        let store = MemoryStore::new();
        let r = req(60_000);
        let Claim::New(stale) = store.claim(&r).await.unwrap() else {
            panic!("expected a new claim")
        };
        assert!(store.release("c", "k").await.unwrap());
        assert!(!store.release("c", "k").await.unwrap());
        let Claim::New(fresh) = store.claim(&r).await.unwrap() else {
            panic!("the released key must be claimable at once")
        };
        assert_eq!(
            store.commit(stale, &r, None).await.map_err(|e| e.kind()),
            Err(StoreErrorKind::LeaseLost)
        );
        store.commit(fresh, &r, None).await.unwrap();
        assert!(
            !store.release("c", "k").await.unwrap(),
            "done keys are not leases"
        );
    }

    fn req(lease_ms: u64) -> ClaimRequest<'static> {
        ClaimRequest {
            consumer: "c",
            key: "k",
            fingerprint: "f",
            lease: Duration::from_millis(lease_ms),
        }
    }

    #[tokio::test]
    async fn expired_lease_is_taken_over_and_stale_holder_is_fenced() {
        let store = MemoryStore::new();
        let Claim::New(first) = store.claim(&req(10)).await.unwrap() else {
            panic!("first claim must be new")
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let Claim::New(second) = store.claim(&req(10_000)).await.unwrap() else {
            panic!("expired lease must be taken over")
        };
        assert!(second.fencing_token() > first.fencing_token());
        assert_eq!(
            store
                .commit(first, &req(0), None)
                .await
                .map_err(|e| e.kind()),
            Err(StoreErrorKind::LeaseLost)
        );
        store.commit(second, &req(0), None).await.unwrap();
        assert!(matches!(
            store.claim(&req(10)).await.unwrap(),
            Claim::Done(_)
        ));
    }

    #[tokio::test]
    async fn rollback_frees_the_key_only_for_the_holder() {
        let store = MemoryStore::new();
        let Claim::New(lease) = store.claim(&req(10_000)).await.unwrap() else {
            panic!()
        };
        store.rollback(lease).await.unwrap();
        assert!(matches!(
            store.claim(&req(10_000)).await.unwrap(),
            Claim::New(_)
        ));
    }
}
