//! Policies: retry and backoff, conflicts, concurrency, retention.

use std::time::Duration;

/// Retries of retryable failures: bounded, with exponential backoff.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts before a message is dead-lettered (the first delivery counts as attempt 1).
    pub max_attempts: u32,
    /// Delay before the second attempt.
    pub initial_backoff: Duration,
    /// Growth factor of the delay per attempt.
    pub multiplier: f64,
    /// Upper bound of the delay.
    pub max_backoff: Duration,
    /// Random spread of each delay, as a fraction (0.2 = ±20%), so that many
    /// failing consumers do not retry in lockstep.
    pub jitter: f64,
    /// Delay before a message whose key is in flight elsewhere, or whose store
    /// call failed transiently, is tried again (no attempt is counted).
    pub busy_delay: Duration,
    /// Dead-letter a message whose source reports more deliveries than this,
    /// before its handler runs again. This catches a message that kills the
    /// consumer on every attempt and so never gets a failure counted. `None`
    /// (the default) turns it off; sources whose delivery count also counts
    /// busy redeliveries need it well above `max_attempts`.
    pub max_deliveries: Option<u32>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(200),
            multiplier: 2.0,
            max_backoff: Duration::from_secs(60),
            jitter: 0.2,
            busy_delay: Duration::from_millis(250),
            max_deliveries: None,
        }
    }
}

impl RetryPolicy {
    /// With [`max_attempts`](Self::max_attempts).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemq::RetryPolicy;
    ///
    /// let retry = RetryPolicy::default()
    ///     .with_max_attempts(3)
    ///     .with_initial_backoff(Duration::from_millis(100))
    ///     .with_jitter(0.0);
    /// assert_eq!(retry.backoff(2), Duration::from_millis(200));
    /// ```
    pub fn with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts;
        self
    }

    /// With [`initial_backoff`](Self::initial_backoff).
    pub fn with_initial_backoff(mut self, initial_backoff: Duration) -> Self {
        self.initial_backoff = initial_backoff;
        self
    }

    /// With [`max_backoff`](Self::max_backoff).
    pub fn with_max_backoff(mut self, max_backoff: Duration) -> Self {
        self.max_backoff = max_backoff;
        self
    }

    /// With [`multiplier`](Self::multiplier).
    pub fn with_multiplier(mut self, multiplier: f64) -> Self {
        self.multiplier = multiplier;
        self
    }

    /// With [`jitter`](Self::jitter).
    pub fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// With [`busy_delay`](Self::busy_delay).
    pub fn with_busy_delay(mut self, busy_delay: Duration) -> Self {
        self.busy_delay = busy_delay;
        self
    }

    /// With [`max_deliveries`](Self::max_deliveries).
    pub fn with_max_deliveries(mut self, max_deliveries: Option<u32>) -> Self {
        self.max_deliveries = max_deliveries;
        self
    }

    /// The delay after failed attempt number `attempt` (1-based).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .multiplier
            .powi(attempt.saturating_sub(1).min(64) as i32);
        let base = self.initial_backoff.as_secs_f64() * exp;
        let capped = base.min(self.max_backoff.as_secs_f64());
        let spread = if self.jitter > 0.0 {
            1.0 + self.jitter * (fastrand::f64() * 2.0 - 1.0)
        } else {
            1.0
        };
        Duration::from_secs_f64((capped * spread).max(0.0))
    }
}

/// What to do with a message whose key was processed before with a different payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ConflictPolicy {
    /// Write a dead letter with reason `conflict` and ack (default): nothing is
    /// lost, and an operator can look at both payloads.
    #[default]
    DeadLetter,
    /// Log a warning and ack, like a duplicate.
    Ignore,
}

/// What a consumer does with a duplicate that arrives while the first copy
/// of its key is still being handled by another worker (lease stores answer
/// such a claim with [`Claim::InFlight`](crate::store::Claim::InFlight)).
///
/// SQL stores never answer `InFlight`: the second claim's `INSERT` waits on
/// the first one's row lock inside the database, and returns a duplicate
/// when the first commits, or takes over the key when it rolls back. That is
/// the `Wait` behaviour, bounded by the database's lock timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InFlightPolicy {
    /// Retry the duplicate later, after [`RetryPolicy::busy_delay`], without
    /// counting an attempt (default). For HTTP-style callers this is a 409.
    #[default]
    Reject,
    /// Poll the store every `poll` until the first copy completes (the
    /// duplicate is answered with its stored result) or its lease expires
    /// (this delivery takes over). After `max_wait` it falls back to `Reject`.
    Wait {
        /// Time between two claims.
        poll: std::time::Duration,
        /// Longest wait; set it above the lease so that a dead holder's
        /// lease can expire within it.
        max_wait: std::time::Duration,
    },
}

impl InFlightPolicy {
    /// `Wait` polling every 50 ms for at most `max_wait`.
    pub fn wait(max_wait: std::time::Duration) -> Self {
        Self::Wait {
            poll: std::time::Duration::from_millis(50),
            max_wait,
        }
    }
}

/// How long inbox rows are kept, and how pruning runs.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct RetentionPolicy {
    /// Rows older than this are pruned. Must exceed the longest time the
    /// broker may redeliver a message (R7), or a late duplicate applies again.
    pub keep_for: Duration,
    /// Rows deleted per statement, to keep locks short.
    pub batch_size: u32,
    /// Pause between batches.
    pub pause: Duration,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        Self {
            keep_for: Duration::from_secs(7 * 24 * 3600),
            batch_size: 5_000,
            pause: Duration::from_millis(10),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps() {
        let p = RetryPolicy {
            jitter: 0.0,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
            ..RetryPolicy::default()
        };
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(3), Duration::from_millis(350));
        assert_eq!(p.backoff(1000), Duration::from_millis(350));
    }
}
