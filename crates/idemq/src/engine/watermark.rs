//! Offset-watermark mode, for partitioned logs (Kafka).
//!
//! Instead of one inbox row per message, the store keeps the **next offset
//! to apply** per (consumer, topic, partition), and moves it in the same
//! transaction as the handler's effects ([`OffsetStore`]). A delivery whose
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
//! and arrive in offset order within a partition, one at a time: the
//! watermark moves to the highest offset applied, so a later record must
//! never commit before an earlier one. The Kafka source hands out one
//! unsettled record per partition here (this mode never asks it for more,
//! see [`Source::settle_out_of_order`]). A delivery without them is
//! dead-lettered as invalid input. A dead-lettered record also moves the
//! watermark, so a re-read does not dead-letter it again.
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

use super::consumer::{Consumer, Identity};
use super::lanes::LaneRelease;
use crate::error::{InputError, SourceError, StoreError};
use crate::message::{DeliveryMeta, Message};
use crate::outcome::DeadLetterReason;
use crate::outcome::{Outcome, Summary};
use crate::source::{Delivery, OffsetLookup, Source};
use crate::store::{ClaimRequest, InboxRecord, OffsetClaim, OffsetStore};

/// How [`Consumer::run_watermarked`] deduplicates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WatermarkOptions {
    /// Also claim the business key in the same transaction, to catch
    /// producer retries (new offset, same key). Off by default.
    pub dedup_keys: bool,
}

/// Where a delivery sits in its partitioned log.
struct Position<'a> {
    topic: &'a str,
    partition: i32,
    offset: i64,
}

fn position(meta: &DeliveryMeta) -> Option<Position<'_>> {
    Some(Position {
        topic: meta.topic.as_deref()?,
        partition: meta.partition?,
        offset: meta.offset?,
    })
}

/// The watermarks of one consumer, as the source looks them up when
/// partitions are assigned.
struct Watermarks<S> {
    store: Arc<S>,
    consumer: String,
}

#[async_trait]
impl<S: OffsetStore> OffsetLookup for Watermarks<S> {
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

impl<S: OffsetStore> Consumer<S> {
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
        let consumer = self.clone();
        self.run_with(source, shutdown, move |delivery, identity, lane| {
            let consumer = consumer.clone();
            async move {
                consumer
                    .process_watermarked_in_lane(delivery, identity, options, lane)
                    .await
            }
        })
        .await
    }

    /// Processes one delivery in offset-watermark mode and settles it.
    pub async fn process_watermarked(
        &self,
        delivery: Delivery,
        options: WatermarkOptions,
    ) -> Outcome {
        let identity = self.identify(&delivery.message, delivery.defect.as_ref());
        self.process_watermarked_in_lane(delivery, identity, options, LaneRelease::none())
            .await
    }

    /// [`process_watermarked`](Self::process_watermarked) of a delivery
    /// identified already, releasing `lane` once the outcome is decided and
    /// before the delivery is settled.
    async fn process_watermarked_in_lane(
        &self,
        delivery: Delivery,
        identity: Identity,
        options: WatermarkOptions,
        lane: LaneRelease,
    ) -> Outcome {
        let (message, meta, defect, acker) = delivery.into_parts();
        let outcome = self
            .decide_watermarked(&message, &meta, defect, identity, options)
            .await;
        lane.release(&outcome);
        self.settle(&outcome, acker).await;
        self.report(&outcome, &meta);
        outcome
    }

    async fn decide_watermarked(
        &self,
        message: &Message,
        meta: &DeliveryMeta,
        defect: Option<InputError>,
        identity: Identity,
        options: WatermarkOptions,
    ) -> Outcome {
        let inner = &*self.inner;
        let consumer = inner.name.as_str();
        let Some(at) = position(meta) else {
            let reason = DeadLetterReason::InvalidInput(InputError::Malformed(
                "offset-watermark mode needs a topic, a partition and an offset".into(),
            ));
            return self.dead_letter(None, reason, message, meta, 0).await;
        };
        let record_id = format!("{}-{}@{}", at.topic, at.partition, at.offset);
        let ids = if options.dedup_keys {
            Some(identity)
        } else {
            defect.map(|defect| Err((None, DeadLetterReason::InvalidInput(defect))))
        };
        let (key, fingerprint) = match ids {
            Some(Ok((key, fingerprint))) => (key, fingerprint),
            Some(Err((key, reason))) => {
                let outcome = self
                    .dead_letter(key.as_deref(), reason, message, meta, 0)
                    .await;
                return self.advance_after(outcome, &at).await;
            }
            None => (record_id.clone(), String::new()),
        };
        let mut tx = match inner
            .store
            .claim_offset(consumer, at.topic, at.partition, at.offset)
            .await
        {
            Ok(OffsetClaim::New(tx)) => {
                crate::failpoint::failpoint!("after_claim");
                tx
            }
            Ok(OffsetClaim::Applied { .. }) => {
                return Outcome::Duplicate {
                    record: InboxRecord {
                        consumer: consumer.to_owned(),
                        key,
                        fingerprint,
                        result: None,
                        first_seen_ms: 0,
                    },
                }
            }
            Err(e) => return self.busy(Some(key), format!("offset claim failed: {e}")),
        };
        let req = ClaimRequest {
            consumer,
            key: &key,
            fingerprint: &fingerprint,
            lease: inner.lease,
        };
        if options.dedup_keys {
            match inner.store.claim_key_in(&mut tx, &req).await {
                Ok(None) => {}
                Ok(Some(record)) => {
                    // A producer retry (or a conflict): nothing to apply, but
                    // the watermark moves past this record.
                    let moved = inner
                        .store
                        .commit_offset(tx, consumer, at.topic, at.partition, at.offset, None)
                        .await;
                    if let Err(e) = moved {
                        return self.busy(Some(key), format!("commit failed: {e}"));
                    }
                    return if record.fingerprint == fingerprint {
                        Outcome::Duplicate { record }
                    } else {
                        self.conflict(record, fingerprint, message, meta).await
                    };
                }
                Err(e) => {
                    if let Err(e) = inner.store.rollback(tx).await {
                        tracing::warn!(consumer, error = %e, "rollback failed");
                    }
                    return self.busy(Some(key), format!("key claim failed: {e}"));
                }
            }
        }
        if let Some(error) = self.over_delivery_limit(meta) {
            if let Err(e) = inner.store.rollback(tx).await {
                tracing::warn!(consumer, error = %e, "rollback failed");
            }
            let outcome = self
                .dead_letter_with(
                    Some(&key),
                    DeadLetterReason::DeliveryLimit,
                    &error,
                    message,
                    meta,
                    0,
                )
                .await;
            return self.advance_after(outcome, &at).await;
        }
        let result = self.call_handler(&mut tx, &req, message, meta).await;
        crate::failpoint::failpoint!("after_handler");
        match result {
            Ok(value) => {
                let keyed = options.dedup_keys.then_some((&req, value.as_ref()));
                crate::failpoint::failpoint!("before_commit");
                match inner
                    .store
                    .commit_offset(tx, consumer, at.topic, at.partition, at.offset, keyed)
                    .await
                {
                    Ok(()) => {
                        crate::failpoint::failpoint!("after_commit_before_ack");
                        Outcome::Processed { key, result: value }
                    }
                    Err(e) => self.busy(Some(key), format!("commit failed: {e}")),
                }
            }
            Err(error) => {
                if let Err(e) = inner.store.rollback(tx).await {
                    tracing::warn!(consumer, error = %e, "rollback failed");
                }
                let outcome = self.failed(&key, error, message, meta).await;
                self.advance_after(outcome, &at).await
            }
        }
    }

    /// After a dead letter, moves the watermark past the record; if that
    /// fails the record is retried (and dead-lettered again), never lost.
    async fn advance_after(&self, outcome: Outcome, at: &Position<'_>) -> Outcome {
        if !matches!(outcome, Outcome::DeadLettered { .. }) {
            return outcome;
        }
        let inner = &*self.inner;
        match inner
            .store
            .advance_offset(&inner.name, at.topic, at.partition, at.offset)
            .await
        {
            Ok(()) => outcome,
            Err(e) => self.busy(None, format!("moving the watermark failed: {e}")),
        }
    }
}
