//! Poison-tolerant locking of the crate's small shared states.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, also when a thread panicked while holding it. Every state
/// locked this way is a set, map or list that a panic elsewhere cannot leave
/// half-changed in a way that matters, and a consumer keeps running rather
/// than propagate another thread's panic.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
