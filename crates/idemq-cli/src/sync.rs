//! Poison-tolerant locking of the binary's small shared states.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, also when a thread panicked while holding it: the states
/// locked this way (a last outcome, samples, scrape results) are replaced
/// or appended whole, so a panic elsewhere cannot leave them half-changed.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
