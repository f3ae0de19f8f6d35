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
}
