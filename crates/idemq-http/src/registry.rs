//! The process-local register of keys being claimed or run by this layer.
//!
//! It is not the claim (the store's claim is): it lets a second request of
//! a key that this process is already running answer 409 at once, or wait
//! for the first without holding a database connection. Without it, a SQL
//! store's second claim would block on the first one's row lock (SQL
//! stores never answer "in flight"), parking a pooled connection per waiting
//! request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

/// What the holder of a key is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Asking the store: the key may turn out done (a replay) or new.
    Claiming,
    /// The key is claimed and its handler runs.
    Running,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct Registry {
    map: Arc<Mutex<HashMap<String, watch::Receiver<Phase>>>>,
}

/// The key is held by this request until the slot is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    map: Arc<Mutex<HashMap<String, watch::Receiver<Phase>>>>,
    key: String,
    phase: watch::Sender<Phase>,
}

pub(crate) enum Entry {
    /// This request holds the key now.
    Held(Slot),
    /// Another request of this process holds it: watch its phase; the
    /// channel closes when it lets go.
    Taken(watch::Receiver<Phase>),
}

fn lock(
    map: &Mutex<HashMap<String, watch::Receiver<Phase>>>,
) -> MutexGuard<'_, HashMap<String, watch::Receiver<Phase>>> {
    // Only inserts and removes happen under the lock; a panic cannot
    // leave the map inconsistent.
    map.lock().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// Takes `key` if no request of this process holds it.
    pub(crate) fn enter(&self, key: &str) -> Entry {
        let mut map = lock(&self.map);
        if let Some(rx) = map.get(key) {
            return Entry::Taken(rx.clone());
        }
        let (tx, rx) = watch::channel(Phase::Claiming);
        map.insert(key.to_owned(), rx);
        Entry::Held(Slot {
            map: Arc::clone(&self.map),
            key: key.to_owned(),
            phase: tx,
        })
    }

    /// How many keys are held (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

impl Slot {
    /// Tells waiters that the key is claimed and its handler runs.
    pub(crate) fn running(&self) {
        self.phase.send_replace(Phase::Running);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.map).remove(&self.key);
        // The sender drops after this: every receiver's `changed()` then
        // returns an error, which waiters read as "let go".
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_held_key_is_taken_until_its_slot_drops() {
        let registry = Registry::default();
        let Entry::Held(slot) = registry.enter("k") else {
            panic!("first entry holds")
        };
        let Entry::Taken(mut rx) = registry.enter("k") else {
            panic!("second entry waits")
        };
        assert_eq!(*rx.borrow(), Phase::Claiming);
        slot.running();
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), Phase::Running);
        drop(slot);
        assert!(rx.changed().await.is_err());
        assert_eq!(registry.len(), 0);
        assert!(matches!(registry.enter("k"), Entry::Held(_)));
    }
}
