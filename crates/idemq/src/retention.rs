//! Retention: prune inbox rows older than the broker's redelivery window (R7).
//!
//! Rows go in bounded batches with a pause between them, so pruning never
//! holds long locks. Keep rows for longer than the longest time a duplicate
//! can arrive (broker retention, retry schedules, replays), or a late
//! duplicate is applied again.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::StoreError;
use crate::policy::RetentionPolicy;
use crate::source::health::{human, Horizon};
use crate::store::{system_time_ms, StoreAdmin};

/// Deletes every inbox row first seen more than `policy.keep_for` ago, batch
/// by batch; returns how many went.
pub async fn prune(
    store: &(impl StoreAdmin + ?Sized),
    policy: &RetentionPolicy,
) -> Result<u64, StoreError> {
    let cutoff = SystemTime::now()
        .checked_sub(policy.keep_for)
        .map(system_time_ms)
        .unwrap_or(0);
    prune_before(store, cutoff, policy.batch_size, policy.pause).await
}

/// Deletes every inbox row first seen before `cutoff_ms` (ms since the epoch).
pub async fn prune_before(
    store: &(impl StoreAdmin + ?Sized),
    cutoff_ms: i64,
    batch_size: u32,
    pause: Duration,
) -> Result<u64, StoreError> {
    let batch_size = batch_size.max(1);
    let mut total = 0;
    loop {
        let deleted = store.prune_batch(cutoff_ms, batch_size).await?;
        total += deleted;
        if deleted < u64::from(batch_size) {
            break;
        }
        tokio::time::sleep(pause).await;
    }
    if total > 0 {
        tracing::info!(rows = total, "pruned inbox rows");
    }
    metrics::counter!("idemq_pruned_rows_total").increment(total);
    Ok(total)
}

/// Why pruning rows older than `keep_for` would let a late duplicate
/// through, or `None` when it would not: `keep_for` under the longest
/// bounded redelivery horizon among `horizons` (each named by its source),
/// or under `floor`, the operator's own floor for brokers whose horizon
/// cannot be read. Unbounded and unknown horizons are not refused here
/// (nothing says how long is enough); `idemq doctor` reports them.
///
/// ```
/// use std::time::Duration;
/// use idemq::retention::floor_violation;
/// use idemq::source::health::Horizon;
///
/// let day = Duration::from_secs(86_400);
/// let kafka = Horizon::Bounded { limit: day * 7, setting: "topic t retention.ms=604800000".into() };
/// let why = floor_violation(day, &[("kafka://k/t", &kafka)], None).unwrap();
/// assert!(why.contains("7d"), "{why}");
/// assert!(floor_violation(day * 7, &[("kafka://k/t", &kafka)], None).is_none());
/// assert!(floor_violation(day, &[], Some(day * 2)).is_some());
/// ```
pub fn floor_violation(
    keep_for: Duration,
    horizons: &[(&str, &Horizon)],
    floor: Option<Duration>,
) -> Option<String> {
    let longest = horizons
        .iter()
        .filter_map(|(source, horizon)| match horizon {
            Horizon::Bounded { limit, setting } => Some((*limit, *source, setting.as_str())),
            _ => None,
        })
        .max_by_key(|(limit, ..)| *limit);
    if let Some((limit, source, setting)) = longest.filter(|(limit, ..)| keep_for < *limit) {
        return Some(format!(
            "rows older than {} are younger than what {source} can still deliver, {} ({setting}): a duplicate it delivers later would be applied again",
            human(keep_for),
            human(limit)
        ));
    }
    match floor {
        Some(floor) if keep_for < floor => Some(format!(
            "rows older than {} are under the floor of {}",
            human(keep_for),
            human(floor)
        )),
        _ => None,
    }
}

/// Prunes every `interval` in the background until the handle is aborted.
/// Failures are logged and retried at the next tick.
///
/// This does not check `policy.keep_for` against any broker: [`Pruner`]
/// does, and refuses to start under a source's redelivery horizon.
pub fn spawn_pruner<A>(
    store: Arc<A>,
    policy: RetentionPolicy,
    interval: Duration,
) -> tokio::task::JoinHandle<()>
where
    A: StoreAdmin + 'static,
{
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if let Err(e) = prune(&*store, &policy).await {
                tracing::warn!(error = %e, "pruning failed; retrying at the next interval");
            }
        }
    })
}

/// A retention that would let a late duplicate through: `keep_for` under
/// a source's redelivery horizon or under the configured floor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("refusing to prune: {why}")]
pub struct FloorViolation {
    /// Which horizon or floor, and by how much (see [`floor_violation`]).
    pub why: String,
}

/// The background pruner, checked: it refuses to start when the policy's
/// `keep_for` is under the redelivery horizon of a source it is told about
/// (read from the broker: [`BrokerHealth::horizon`](crate::source::health::BrokerHealth))
/// or under an operator's floor, unless forced, as `idemq prune` does.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idemq::retention::Pruner;
/// use idemq::source::health::Horizon;
/// use idemq::store::memory::MemoryStore;
/// use idemq::RetentionPolicy;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let store = Arc::new(MemoryStore::new());
/// let week = Duration::from_secs(7 * 86_400);
/// let kafka = Horizon::Bounded { limit: week, setting: "topic payments retention.ms=604800000".into() };
///
/// let mut policy = RetentionPolicy::default();
/// policy.keep_for = Duration::from_secs(86_400);
/// let refused = Pruner::new(Arc::clone(&store), policy.clone())
///     .source("kafka payments", kafka.clone())
///     .spawn();
/// assert!(refused.is_err());
///
/// policy.keep_for = week;
/// let pruner = Pruner::new(store, policy)
///     .every(Duration::from_secs(3600))
///     .source("kafka payments", kafka)
///     .spawn()
///     .unwrap();
/// pruner.abort();
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a Pruner does nothing until spawned"]
pub struct Pruner<A> {
    store: Arc<A>,
    policy: RetentionPolicy,
    interval: Duration,
    horizons: Vec<(String, Horizon)>,
    floor: Option<Duration>,
    force: bool,
}

impl<A: StoreAdmin + 'static> Pruner<A> {
    /// A pruner of `store` with `policy`, every hour, checked against no
    /// source yet.
    pub fn new(store: Arc<A>, policy: RetentionPolicy) -> Self {
        Self {
            store,
            policy,
            interval: Duration::from_secs(3600),
            horizons: Vec::new(),
            floor: None,
            force: false,
        }
    }

    /// Prunes every `interval` (default one hour).
    pub fn every(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// A source whose consumers write to this inbox, named as it should
    /// appear in the refusal, with the horizon read from its broker.
    pub fn source(mut self, name: impl Into<String>, horizon: Horizon) -> Self {
        self.horizons.push((name.into(), horizon));
        self
    }

    /// The operator's floor, for brokers whose horizon cannot be read.
    pub fn floor(mut self, floor: Duration) -> Self {
        self.floor = Some(floor);
        self
    }

    /// Starts even under a horizon or the floor, with a warning.
    pub fn force(mut self) -> Self {
        self.force = true;
        self
    }

    /// Checks the retention, then prunes in the background until the
    /// handle is aborted.
    pub fn spawn(self) -> Result<tokio::task::JoinHandle<()>, FloorViolation> {
        let named: Vec<(&str, &Horizon)> = self
            .horizons
            .iter()
            .map(|(name, horizon)| (name.as_str(), horizon))
            .collect();
        if let Some(why) = floor_violation(self.policy.keep_for, &named, self.floor) {
            if !self.force {
                return Err(FloorViolation { why });
            }
            tracing::warn!("pruning anyway (forced): {why}");
        }
        Ok(spawn_pruner(self.store, self.policy, self.interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, ClaimRequest, Store};

    #[tokio::test]
    async fn background_pruner_removes_expired_rows() {
        let store = Arc::new(MemoryStore::new());
        for key in ["a", "b", "c"] {
            let req = ClaimRequest {
                consumer: "c",
                key,
                fingerprint: "f",
                lease: Duration::from_secs(30),
            };
            let Claim::New(lease) = store.claim(&req).await.unwrap() else {
                panic!("new key")
            };
            store.commit(lease, &req, None).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let policy = RetentionPolicy {
            keep_for: Duration::from_millis(1),
            batch_size: 2,
            pause: Duration::ZERO,
        };
        let pruner = spawn_pruner(Arc::clone(&store), policy, Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(100)).await;
        pruner.abort();
        assert!(store.stats().await.unwrap().is_empty(), "all rows pruned");
    }

    #[tokio::test]
    async fn the_checked_pruner_refuses_under_a_horizon_or_floor_unless_forced() {
        let store = Arc::new(MemoryStore::new());
        let day = Duration::from_secs(86_400);
        let sqs = Horizon::Bounded {
            limit: day * 4,
            setting: "queue q MessageRetentionPeriod=345600".into(),
        };
        let policy = RetentionPolicy {
            keep_for: day,
            ..RetentionPolicy::default()
        };
        let refused = Pruner::new(Arc::clone(&store), policy.clone())
            .source("sqs q", sqs.clone())
            .spawn()
            .unwrap_err();
        assert!(
            refused.why.contains("sqs q") && refused.why.contains("4d"),
            "{refused}"
        );
        let under_floor = Pruner::new(Arc::clone(&store), policy.clone())
            .floor(day * 2)
            .spawn()
            .unwrap_err();
        assert!(under_floor.why.contains("floor"), "{under_floor}");
        let unknown = Horizon::Unknown {
            why: "not read".into(),
        };
        Pruner::new(Arc::clone(&store), policy.clone())
            .source("mqtt", unknown)
            .spawn()
            .unwrap()
            .abort();
        Pruner::new(store, policy)
            .source("sqs q", sqs)
            .force()
            .spawn()
            .unwrap()
            .abort();
    }
}
