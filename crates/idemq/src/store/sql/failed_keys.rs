//! Which keys this store has counted a failed attempt for, so that a
//! commit deletes the key's attempts row only when there may be one.
//!
//! Most messages succeed at the first attempt; for them the `DELETE FROM
//! attempts` of every commit was a round trip that found nothing. A failure
//! counted by *another* process (its delivery then redelivered here) is not
//! in this set: its row outlives the key's success. Such a row decides
//! nothing (a processed key is answered as a duplicate before any attempt
//! is counted again); `stats` leaves out the attempts of processed keys,
//! and retention prunes them by `last_failed_at`.

use std::collections::HashSet;
use std::sync::Mutex;

/// Keys remembered at the most; past it every commit deletes (as before).
const CAPACITY: usize = 100_000;

/// The (consumer, key) pairs with a failed attempt counted by this store.
#[derive(Debug, Default)]
pub(super) struct FailedKeys {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    keys: HashSet<(String, String)>,
    /// More keys failed than [`CAPACITY`]: no longer known, always delete.
    overflowed: bool,
}

impl FailedKeys {
    /// Remembers a failed attempt of `key`.
    pub(super) fn record(&self, consumer: &str, key: &str) {
        let mut state = self.lock();
        if state.overflowed {
            return;
        }
        if state.keys.len() >= CAPACITY {
            state.keys.clear();
            state.overflowed = true;
            return;
        }
        state.keys.insert((consumer.to_owned(), key.to_owned()));
    }

    /// Whether `key` may have an attempts row written by this store.
    pub(super) fn may_have(&self, consumer: &str, key: &str) -> bool {
        let state = self.lock();
        // The common case, nothing failed here: no key is copied to look.
        state.overflowed
            || (!state.keys.is_empty()
                && state.keys.contains(&(consumer.to_owned(), key.to_owned())))
    }

    /// Forgets `key` (its attempts row was deleted in a committed transaction).
    pub(super) fn forget(&self, consumer: &str, key: &str) {
        let mut state = self.lock();
        if !state.overflowed {
            state.keys.remove(&(consumer.to_owned(), key.to_owned()));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a set of names: a panic elsewhere cannot leave it
        // half-changed in a way that matters, so a poisoned lock is used.
        crate::sync::lock(&self.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_forgets_and_overflows_to_always() {
        let failed = FailedKeys::default();
        assert!(!failed.may_have("c", "k"));
        failed.record("c", "k");
        assert!(failed.may_have("c", "k"));
        assert!(!failed.may_have("other", "k"));
        failed.forget("c", "k");
        assert!(!failed.may_have("c", "k"));
        for n in 0..=CAPACITY {
            failed.record("c", &n.to_string());
        }
        assert!(
            failed.may_have("c", "never-failed"),
            "past the cap: always delete"
        );
    }
}
