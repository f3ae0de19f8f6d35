//! Offset-watermark mode, for partitioned logs (Kafka).
//!
//! Instead of one inbox row per message, the store keeps the **next offset
//! to apply** per (consumer, topic, partition), and moves it in the same
//! transaction as the handler's effects ([`WatermarkStore`]). A delivery whose
//! offset is below the watermark was applied before and is acked as a
//! duplicate without running anything. The state is O(partitions), not
//! O(messages), and nothing needs pruning.
//!
//! The watermark catches redeliveries of the *same record* (a lost offset
//! commit, a rebalance, a restart, an offset reset). It cannot catch a
//! producer retry, which is a new record at a new offset: combine it with
//! key dedup ([`WatermarkOptions::dedup_keys`]) when producers may retry;
//! the business key is then claimed in the same transaction as well, and
//! the inbox keeps one row per key again (prune it as usual).
//!
//! The mode needs deliveries that carry a topic, a partition and an offset
//! (a delivery without them is dead-lettered as invalid input). By default
//! they arrive in offset order within a partition, one at a time: the
//! watermark moves past each record as it commits, and a claim holds the
//! partition's watermark row until its transaction ends. With
//! [`WatermarkOptions::concurrent_records`], a source that tracks its
//! partitions ([`Contiguity::Tracked`], Kafka) hands out several records of
//! a partition at once — records of one record key still in offset order
//! — and each commit moves the watermark only to the partition's
//! contiguous position, never past a record still unsettled; a record that
//! commits above it is remembered by an inbox row of its position
//! (`topic-partition@offset`), which a later claim of the same record
//! finds (or waits for, while another transaction holds it). A
//! dead-lettered record is marked applied the same way, so a re-read does
//! not dead-letter it again.
//!
//! Before the run, the source gets the watermarks ([`Source::resume_from`]):
//! the Kafka source starts each partition it is assigned at the partition's
//! watermark rather than at the group's committed offset, so records below
//! it are not even fetched (e.g. after a crash between the database commit
//! and the offset commit, or a reset of the group's offsets). The stored
//! watermark wins over a committed offset in both directions. The
//! per-record check above still answers whatever a source delivers below
//! the watermark.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;

use super::consumer::Consumer;
use super::run::{Direct, Units};
use super::unit::offsets::Watermark;
use crate::error::{SourceError, StoreError};
use crate::outcome::{Outcome, Summary};
#[cfg(doc)]
use crate::source::Contiguity;
use crate::source::{Delivery, OffsetLookup, Source};
use crate::store::WatermarkStore;

/// How [`Consumer::run_watermarked`] deduplicates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WatermarkOptions {
    /// Also claim the business key in the same transaction, to catch
    /// producer retries (new offset, same key). Off by default.
    pub dedup_keys: bool,
    /// Apply several records of one partition at once (records of one
    /// record key still one after the other, in offset order), where the
    /// source tracks its partitions' unsettled records (Kafka). The
    /// watermark then moves only to the partition's *contiguous* position —
    /// every record below it settled — and each record also claims its
    /// position in the inbox, so one committed above the watermark is not
    /// applied again. The state is then one inbox row per record (prune it
    /// as usual), not one row per partition. Off by default.
    pub concurrent_records: bool,
}

/// The watermarks of one consumer, as the source looks them up when
/// partitions are assigned.
struct Watermarks<S> {
    store: Arc<S>,
    consumer: String,
}

#[async_trait]
impl<S: WatermarkStore> OffsetLookup for Watermarks<S> {
    async fn next_offsets(
        &self,
        topic: &str,
        partitions: &[i32],
    ) -> Result<HashMap<i32, i64>, StoreError> {
        let lookups = partitions
            .iter()
            .map(|&p| async move { (p, self.store.watermark(&self.consumer, topic, p).await) });
        let mut found = HashMap::new();
        for (partition, next) in futures_util::future::join_all(lookups).await {
            if let Some(next) = next? {
                found.insert(partition, next);
            }
        }
        Ok(found)
    }
}

impl<S: WatermarkStore> Consumer<S> {
    /// Runs `source` in offset-watermark mode until it ends (see the module
    /// docs); up to [`concurrency`](super::ConsumerBuilder::concurrency)
    /// deliveries are in flight.
    pub async fn run_watermarked(
        &self,
        source: impl Source,
        options: WatermarkOptions,
    ) -> Result<Summary, SourceError> {
        self.run_watermarked_until(source, options, std::future::pending::<()>())
            .await
    }

    /// Like [`run_watermarked`](Self::run_watermarked), but stops taking new
    /// deliveries when `shutdown` completes.
    pub async fn run_watermarked_until(
        &self,
        mut source: impl Source,
        options: WatermarkOptions,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Summary, SourceError> {
        source
            .resume_from(Arc::new(Watermarks {
                store: Arc::clone(&self.inner.store),
                consumer: self.inner.name.clone(),
            }))
            .await;
        self.run_units(source, shutdown, Direct(Watermark(options)), Units::ONE)
            .await
    }

    /// Processes one delivery in offset-watermark mode and settles it.
    pub async fn process_watermarked(
        &self,
        delivery: Delivery,
        options: WatermarkOptions,
    ) -> Outcome {
        self.process_one(Watermark(options), delivery).await
    }
}
