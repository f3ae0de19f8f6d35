//! The console's charts: samples of each consumer's counts taken every
//! `--sample-every` from the store (processed keys, dead letters) and from
//! the running consumers' `/metrics` (duplicates, conflicts), kept in memory
//! for the console's lifetime (the newest [`KEEP`]). Long-term history is
//! Prometheus's job (docs/grafana-dashboard.json).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use crate::sync::lock;
use std::time::Duration;

/// Samples kept: six hours at the default 10 s.
pub const KEEP: usize = 2160;

/// One consumer's counts at one instant. The store's numbers are levels
/// (rows present); the scraped ones are counters since each process started.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counts {
    /// Keys in the inbox.
    pub processed: u64,
    /// Dead letters in the store.
    pub dead_letters: u64,
    /// `idemq_messages_total{outcome="duplicate"}` summed over the targets.
    pub duplicates: Option<f64>,
    /// `idemq_messages_total{outcome="conflict"}` summed over the targets.
    pub conflicts: Option<f64>,
}

/// Every consumer's counts at one instant.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// When, ms since the epoch.
    pub at_ms: i64,
    /// Per consumer name.
    pub consumers: BTreeMap<String, Counts>,
}

/// What changed between two samples, per interval: the chart's points.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Step {
    /// The interval's end, ms since the epoch.
    pub at_ms: i64,
    /// New inbox rows (rows pruned meanwhile can hide some).
    pub processed: f64,
    /// Duplicates delivered.
    pub duplicates: f64,
    /// Conflicts.
    pub conflicts: f64,
    /// New dead letters (letters replayed or deleted meanwhile can hide some).
    pub dead_letters: f64,
}

/// The samples, newest last.
#[derive(Debug, Default)]
pub struct History {
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    /// Appends a sample, dropping the oldest beyond [`KEEP`].
    pub fn push(&self, sample: Sample) {
        let mut samples = lock(&self.samples);
        if samples.len() == KEEP {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The consumer's steps between consecutive samples, oldest first.
    pub fn steps(&self, consumer: &str) -> Vec<Step> {
        let samples = lock(&self.samples);
        let counts: Vec<(i64, Counts)> = samples
            .iter()
            .map(|s| {
                (
                    s.at_ms,
                    s.consumers.get(consumer).copied().unwrap_or_default(),
                )
            })
            .collect();
        counts
            .windows(2)
            .map(|pair| {
                let ((_, before), (at_ms, after)) = (pair[0], pair[1]);
                Step {
                    at_ms,
                    processed: after.processed.saturating_sub(before.processed) as f64,
                    dead_letters: after.dead_letters.saturating_sub(before.dead_letters) as f64,
                    duplicates: counter_delta(before.duplicates, after.duplicates),
                    conflicts: counter_delta(before.conflicts, after.conflicts),
                }
            })
            .collect()
    }

    /// How many samples there are.
    pub fn len(&self) -> usize {
        lock(&self.samples).len()
    }
}

/// The increase of a counter between two scrapes; a counter that went down
/// belongs to a restarted process, whose whole value is new.
fn counter_delta(before: Option<f64>, after: Option<f64>) -> f64 {
    match (before, after) {
        (Some(b), Some(a)) if a >= b => a - b,
        (_, Some(a)) => a,
        (_, None) => 0.0,
    }
}

/// Fetches each target's `/metrics` within `timeout`; unreachable targets
/// are skipped (the console says which in its header).
pub async fn scrape(
    client: &reqwest::Client,
    targets: &[String],
    timeout: Duration,
) -> (BTreeMap<(String, String), f64>, Vec<String>) {
    let mut totals = BTreeMap::new();
    let mut failed = Vec::new();
    for target in targets {
        let text = async {
            client
                .get(target)
                .timeout(timeout)
                .send()
                .await?
                .error_for_status()?
                .text()
                .await
        }
        .await;
        match text {
            Ok(text) => {
                for (key, value) in crate::ops::outcome_totals(&text) {
                    *totals.entry(key).or_insert(0.0) += value;
                }
            }
            Err(e) => {
                tracing::debug!(%target, error = %e, "scraping a consumer's /metrics failed");
                failed.push(target.clone());
            }
        }
    }
    (totals, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_differences_and_a_restarted_counter_counts_whole() {
        let history = History::default();
        let counts = |processed, dead_letters, duplicates| Counts {
            processed,
            dead_letters,
            duplicates: Some(duplicates),
            conflicts: None,
        };
        for (at_ms, c) in [
            (0, counts(10, 1, 5.0)),
            (10, counts(25, 3, 8.0)),
            (20, counts(20, 2, 2.0)), // pruned rows, replayed letters, a restart
        ] {
            history.push(Sample {
                at_ms,
                consumers: [("billing".to_owned(), c)].into(),
            });
        }
        let steps = history.steps("billing");
        assert_eq!(steps.len(), 2);
        assert_eq!(
            (
                steps[0].processed,
                steps[0].dead_letters,
                steps[0].duplicates
            ),
            (15.0, 2.0, 3.0)
        );
        assert_eq!(
            (
                steps[1].processed,
                steps[1].dead_letters,
                steps[1].duplicates
            ),
            (0.0, 0.0, 2.0)
        );
        assert!(history.steps("unknown").iter().all(|s| s.processed == 0.0));
    }
}
