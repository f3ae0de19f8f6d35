//! The consumer-group member: the state shared with the polling thread and
//! the ackers, rebalance handling (the client context), and [`KafkaSource`],
//! which hands out the deliveries.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, RebalanceProtocol,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::Notify;

use super::acker::{Held, KafkaAcker};
use super::config::validate_topic;
use super::connection::{fetch_metadata, RefusalContext};
use super::limits;
use super::partition::{Partition, Record, State};
use super::poller::Poller;
use super::publisher::{producer, Producer};
use super::{broker, KafkaConfig};
use crate::error::SourceError;
use crate::message::DeliveryMeta;
use crate::source::kit::Unsettled;
use crate::source::{Delivery, OffsetLookup, Source};

/// How long a rebalance waits for the stored watermarks.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// What offset-watermark mode gave the source: the store's watermarks and
/// the runtime to look them up on (the rebalance callback runs on the
/// polling thread).
struct Resume {
    lookup: Arc<dyn OffsetLookup>,
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for Resume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resume")
    }
}

/// Counters of a [`KafkaSource`] ([`KafkaSource::counters`]).
#[derive(Debug, Default)]
pub struct KafkaCounters {
    pub(super) fetched: AtomicU64,
    positioned_at_assignment: AtomicU64,
    pub(super) sought: AtomicU64,
    pub(super) dropped_below_watermark: AtomicU64,
}

impl KafkaCounters {
    /// Records received from the broker for assigned partitions.
    pub fn fetched(&self) -> u64 {
        self.fetched.load(Ordering::SeqCst)
    }

    /// Partitions that an assignment started at their stored watermark
    /// (offset-watermark mode) instead of the committed offset.
    pub fn positioned_at_assignment(&self) -> u64 {
        self.positioned_at_assignment.load(Ordering::SeqCst)
    }

    /// Partitions already assigned when the watermarks arrived, sought to them.
    pub fn sought(&self) -> u64 {
        self.sought.load(Ordering::SeqCst)
    }

    /// Fetched records dropped because they were below the partition's
    /// watermark (fetched before the partition was sought to it).
    pub fn dropped_below_watermark(&self) -> u64 {
        self.dropped_below_watermark.load(Ordering::SeqCst)
    }
}

#[derive(Debug)]
pub(super) struct Shared {
    pub(super) topic: String,
    state: Mutex<State>,
    /// Signalled when a delivery settles (a revocation waits on it).
    pub(super) settled: Condvar,
    /// Signalled when there may be something to deliver.
    pub(super) ready: Notify,
    /// Serializes offset commits with revocations.
    commit_lock: Mutex<()>,
    revoke_grace: Duration,
    pub(super) max_buffered: usize,
    /// Unsettled records handed out per partition at once: 1 unless the
    /// engine keeps per-key order itself ([`Source::settle_out_of_order`]).
    partition_limit: AtomicUsize,
    /// Set by offset-watermark mode ([`Source::resume_from`]).
    resume: Mutex<Option<Resume>>,
    pub(super) counters: Arc<KafkaCounters>,
}

impl Shared {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    pub(super) fn commit_guard(&self) -> MutexGuard<'_, ()> {
        crate::sync::lock(&self.commit_lock)
    }

    /// A commit of `offsets` failed (the broker refused it, the
    /// coordinator moved): each position is made the next to commit again,
    /// unless the partition was revoked or a later position is on its way.
    pub(super) fn commit_failed(&self, offsets: &TopicPartitionList) {
        let mut state = self.state();
        for element in offsets.elements_for_topic(&self.topic) {
            let Offset::Offset(offset) = element.offset() else {
                continue;
            };
            let Some(p) = state.partitions.get_mut(&element.partition()) else {
                continue;
            };
            if p.committed.is_some_and(|c| c > offset) {
                // A later position was committed since: nothing to redo.
                continue;
            }
            p.committed = None;
            if p.uncommitted.is_none_or(|u| u < offset) {
                p.uncommitted = Some(offset);
            }
        }
    }

    pub(super) fn tpl(&self, offsets: &[(i32, i64)]) -> Result<TopicPartitionList, SourceError> {
        let mut tpl = TopicPartitionList::new();
        for &(partition, offset) in offsets {
            tpl.add_partition_offset(&self.topic, partition, Offset::Offset(offset))
                .map_err(broker)?;
        }
        Ok(tpl)
    }

    /// Offset-watermark mode: sets the offset of every partition in the
    /// assignment `tpl` that has a stored watermark to that watermark
    /// (runs in the rebalance callback, before the assignment is applied).
    fn position(&self, tpl: &mut TopicPartitionList) {
        let (lookup, runtime) = {
            let resume = crate::sync::lock(&self.resume);
            match &*resume {
                Some(r) => (Arc::clone(&r.lookup), r.runtime.clone()),
                None => return,
            }
        };
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&self.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        if partitions.is_empty() {
            return;
        }
        let found = runtime.block_on(async {
            tokio::time::timeout(
                LOOKUP_TIMEOUT,
                lookup.next_offsets(&self.topic, &partitions),
            )
            .await
        });
        let found = match found {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => {
                tracing::warn!(topic = %self.topic, error = %e, "looking up the stored watermarks failed; the assigned partitions start at the committed offsets");
                return;
            }
            Err(_) => {
                tracing::warn!(topic = %self.topic, "looking up the stored watermarks timed out; the assigned partitions start at the committed offsets");
                return;
            }
        };
        let mut positioned = Vec::new();
        for (partition, next) in found {
            match tpl.set_partition_offset(&self.topic, partition, Offset::Offset(next)) {
                Ok(()) => positioned.push((partition, next)),
                Err(e) => {
                    tracing::warn!(topic = %self.topic, partition, error = %e, "positioning a partition at its watermark failed")
                }
            }
        }
        positioned.sort_unstable();
        let mut state = self.state();
        for &(partition, next) in &positioned {
            state.floors.insert(partition, next);
        }
        drop(state);
        self.counters
            .positioned_at_assignment
            .fetch_add(positioned.len() as u64, Ordering::SeqCst);
        tracing::info!(topic = %self.topic, ?positioned, "kafka partitions start at their stored watermarks");
    }

    fn on_assign(&self, tpl: &TopicPartitionList) {
        let mut state = self.state();
        for elem in tpl.elements() {
            if elem.topic() != self.topic {
                continue;
            }
            state.next_generation += 1;
            let generation = state.next_generation;
            let floor = state.floors.remove(&elem.partition());
            state
                .partitions
                .entry(elem.partition())
                .or_insert_with(|| Partition {
                    generation,
                    floor,
                    ..Partition::default()
                });
        }
        state.floors.clear();
        let mut assigned: Vec<_> = state.partitions.keys().copied().collect();
        assigned.sort_unstable();
        drop(state);
        tracing::info!(topic = %self.topic, partitions = ?assigned, "kafka partitions assigned");
    }

    fn on_revoke<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, tpl: &TopicPartitionList) {
        let revoked: Vec<i32> = tpl
            .elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition())
            .collect();
        // Let in-flight deliveries of the revoked partitions finish, for a while.
        let deadline = Instant::now() + self.revoke_grace;
        let mut state = self.state();
        for p in &revoked {
            if let Some(partition) = state.partitions.get_mut(p) {
                partition.revoking = true;
            }
        }
        loop {
            let busy = revoked.iter().any(|p| {
                state
                    .partitions
                    .get(p)
                    .is_some_and(|p| !p.in_flight.is_empty())
            });
            let left = deadline.saturating_duration_since(Instant::now());
            if !busy || left.is_zero() {
                if busy {
                    tracing::warn!(topic = %self.topic, "revoking partitions with deliveries still in flight; they will be redelivered to the new owner");
                }
                break;
            }
            state = match self.settled.wait_timeout(state, left) {
                Ok((s, _)) => s,
                Err(p) => p.into_inner().0,
            };
        }
        drop(state);
        // Commit what is settled, and forget the partitions: late acks commit nothing.
        let _guard = self.commit_guard();
        let mut offsets = Vec::new();
        {
            let mut state = self.state();
            for p in &revoked {
                if let Some(partition) = state.partitions.remove(p) {
                    if let Some(offset) = partition.uncommitted {
                        offsets.push((*p, offset));
                    }
                }
            }
        }
        self.settled.notify_all();
        if !offsets.is_empty() {
            let result = self
                .tpl(&offsets)
                .and_then(|tpl| consumer.commit(&tpl, CommitMode::Sync).map_err(broker));
            match result {
                Ok(()) => {
                    tracing::debug!(topic = %self.topic, ?offsets, "committed offsets of revoked partitions")
                }
                Err(e) => {
                    tracing::warn!(topic = %self.topic, ?offsets, error = %e, "committing offsets of revoked partitions failed; they will be redelivered")
                }
            }
        }
        tracing::info!(topic = %self.topic, partitions = ?revoked, "kafka partitions revoked");
    }
}

/// The consumer context: commits settled offsets of revoked partitions
/// before they go, and reports the group's lag.
pub(super) struct KafkaContext {
    shared: Arc<Shared>,
    refusals: RefusalContext,
    group: String,
}

impl ClientContext for KafkaContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.refusals.note(&error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the
    /// consumer lag of each assigned partition, as the gauge
    /// `idemq_source_lag_messages{source,group,topic,partition}`.
    fn stats(&self, statistics: rdkafka::Statistics) {
        for (topic, stats) in &statistics.topics {
            for (partition, stats) in &stats.partitions {
                // -1: the internal unassigned partition, or a lag not known yet.
                if *partition < 0 || stats.consumer_lag < 0 {
                    continue;
                }
                metrics::gauge!(
                    "idemq_source_lag_messages",
                    "source" => "kafka",
                    "group" => self.group.clone(),
                    "topic" => topic.clone(),
                    "partition" => partition.to_string()
                )
                .set(stats.consumer_lag as f64);
            }
        }
    }
}

impl ConsumerContext for KafkaContext {
    /// A refused commit is sent again by the next ack or the revocation.
    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            tracing::warn!(topic = %self.shared.topic, error = %e, "a kafka offset commit failed; it will be sent again");
            self.shared.commit_failed(offsets);
        }
    }

    /// rdkafka's default rebalance, with the assigned partitions first
    /// positioned at their stored watermarks (offset-watermark mode).
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let assigning = err == RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
        if assigning {
            self.shared.position(tpl);
        }
        let tpl: &TopicPartitionList = tpl;
        let rebalance = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => Rebalance::Assign(tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => Rebalance::Revoke(tpl),
            _ => Rebalance::Error(KafkaError::Rebalance(err.into())),
        };
        self.pre_rebalance(consumer, &rebalance);
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let applied = match (assigning, cooperative) {
            (true, true) => consumer.incremental_assign(tpl),
            (true, false) => consumer.assign(tpl),
            (false, true) => consumer.incremental_unassign(tpl),
            (false, false) => consumer.unassign(),
        };
        if let Err(e) = applied {
            tracing::warn!(topic = %self.shared.topic, error = %e, assigning, "applying a kafka rebalance failed");
        }
        self.post_rebalance(consumer, &rebalance);
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => self.shared.on_revoke(consumer, tpl),
            Rebalance::Assign(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "kafka rebalance error"),
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            self.shared.on_assign(tpl);
            self.shared.ready.notify_waiters();
        }
    }
}

pub(super) type KafkaConsumer = BaseConsumer<KafkaContext>;

/// A Kafka consumer-group member as a [`Source`] (see the [module docs](super)).
///
/// A background thread polls the broker and serves rebalances; dropping the
/// source stops it and closes the consumer.
pub struct KafkaSource {
    shared: Arc<Shared>,
    consumer: Weak<KafkaConsumer>,
    dead_letters: Option<(Producer, String)>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource")
            .field("topic", &self.shared.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Joins the consumer group and subscribes to the topic. Fails if the
    /// broker cannot be reached or the topic does not exist.
    ///
    /// Before subscribing, reads the topic's configuration and refuses, by
    /// default, a topic that can delete records the group never processed
    /// (compaction, `retention.bytes`, `retention.ms` under
    /// [`KafkaConfig::min_retention`]) and `auto.offset.reset=latest`: a
    /// [configuration error](crate::SourceErrorKind::Config) naming each
    /// setting and what to set instead; with
    /// [`LossPolicy::Warn`](crate::source::loss::LossPolicy::Warn)
    /// (`broker_loss=warn`) each is logged at `warn` and the source runs.
    /// A configuration the cluster does not let this client read (ACLs) is
    /// logged at `warn` as not checked.
    pub async fn connect(config: KafkaConfig) -> Result<Self, SourceError> {
        validate_topic(&config.topic).map_err(SourceError::config)?;
        if config.group.is_empty() {
            return Err(SourceError::config("a consumer group is required"));
        }
        if let Some(partitions) = config.create_partitions {
            config.create_topic(partitions).await?;
        }
        let shared = Arc::new(Shared {
            topic: config.topic.clone(),
            state: Mutex::default(),
            settled: Condvar::new(),
            ready: Notify::new(),
            commit_lock: Mutex::new(()),
            revoke_grace: config.revoke_grace,
            max_buffered: config.max_buffered.max(1),
            partition_limit: AtomicUsize::new(1),
            resume: Mutex::new(None),
            counters: Arc::default(),
        });
        let refusals = RefusalContext::default();
        let context = KafkaContext {
            shared: Arc::clone(&shared),
            refusals: refusals.clone(),
            group: config.group.clone(),
        };
        let consumer: KafkaConsumer = config
            .client_config()
            .create_with_context(context)
            .map_err(|e| SourceError::config(format!("kafka consumer: {e}")))?;
        let consumer = Arc::new(consumer);
        let topic = config.topic.clone();
        let check = Arc::clone(&consumer);
        let consumer = tokio::task::spawn_blocking(move || {
            // Not subscribed yet: a poll only brings the client's errors,
            // which reach the context.
            let refused = || {
                while check.poll(Duration::ZERO).is_some() {}
                refusals.refusal()
            };
            let metadata = fetch_metadata(check.client(), Some(&topic), refused)?;
            let found = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .filter(|t| t.error().is_none() && !t.partitions().is_empty());
            if found.is_none() {
                return Err(SourceError::broker(format!(
                    "topic {topic:?} does not exist"
                )));
            }
            Ok(check)
        })
        .await
        .map_err(|e| SourceError::other(e.to_string()))??;
        // Before joining the group: a topic that can lose records is refused
        // without this member ever taking partitions from the others.
        let described = limits::describe_topic(&config).await;
        config
            .broker_loss
            .apply("Kafka", &limits::risks(&config, described.as_ref()))?;
        let topic = config.topic.clone();
        let consumer = tokio::task::spawn_blocking(move || {
            consumer.subscribe(&[&topic]).map_err(broker)?;
            Ok::<_, SourceError>(consumer)
        })
        .await
        .map_err(|e| SourceError::other(e.to_string()))??;
        let dead_letters = match &config.dead_letter_topic {
            Some(topic) => {
                validate_topic(topic).map_err(SourceError::config)?;
                Some((producer(&config, Default::default())?, topic.clone()))
            }
            None => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let weak = Arc::downgrade(&consumer);
        let poller = Poller {
            consumer,
            shared: Arc::clone(&shared),
            stop: Arc::clone(&stop),
        };
        std::thread::Builder::new()
            .name("idemq-kafka".into())
            .spawn(move || poller.run())
            .map_err(SourceError::from)?;
        Ok(Self {
            shared,
            consumer: weak,
            dead_letters,
            stop,
        })
    }

    /// Counts of records fetched and partitions positioned (shared: read
    /// them while the source runs, or after it was moved into a run).
    pub fn counters(&self) -> Arc<KafkaCounters> {
        Arc::clone(&self.shared.counters)
    }

    /// Partitions assigned before the watermarks arrived: drops their
    /// buffered records below the watermark and asks the polling thread to
    /// seek them to it (see [`Poller::apply_seeks`]); nothing of such a
    /// partition is handed out until then. Partitions with a delivery in
    /// flight are left to the per-record check.
    async fn seek_assigned(&self) {
        let Some(lookup) = crate::sync::lock(&self.shared.resume)
            .as_ref()
            .map(|r| Arc::clone(&r.lookup))
        else {
            return;
        };
        let assigned = self.assigned_partitions();
        if assigned.is_empty() {
            return;
        }
        let topic = &self.shared.topic;
        let found = match tokio::time::timeout(
            LOOKUP_TIMEOUT,
            lookup.next_offsets(topic, &assigned),
        )
        .await
        {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => {
                tracing::warn!(topic = %topic, error = %e, "looking up the stored watermarks failed; the assigned partitions go on from the committed offsets");
                return;
            }
            Err(_) => {
                tracing::warn!(topic = %topic, "looking up the stored watermarks timed out; the assigned partitions go on from the committed offsets");
                return;
            }
        };
        let mut state = self.shared.state();
        for (partition, next) in found {
            let Some(p) = state.partitions.get_mut(&partition) else {
                continue;
            };
            if !p.in_flight.is_empty() || p.revoking {
                continue;
            }
            let before = p.buffer.len();
            p.buffer.retain(|r| r.offset >= next);
            p.retries.retain(|(_, offset), _| *offset >= next);
            self.shared
                .counters
                .dropped_below_watermark
                .fetch_add((before - p.buffer.len()) as u64, Ordering::SeqCst);
            p.floor = Some(next);
            p.seek_to = Some(next);
        }
    }

    /// The partitions this member owns right now.
    pub fn assigned_partitions(&self) -> Vec<i32> {
        let mut partitions: Vec<_> = self.shared.state().partitions.keys().copied().collect();
        partitions.sort_unstable();
        partitions
    }

    fn take_ready(&self) -> Result<Delivery, Duration> {
        let limit = self.shared.partition_limit.load(Ordering::SeqCst).max(1);
        let mut state = self.shared.state();
        let now = Instant::now();
        let mut ids: Vec<i32> = state.partitions.keys().copied().collect();
        ids.sort_unstable();
        let mut wait = Duration::from_secs(1);
        let n = ids.len();
        let start = state.cursor;
        for i in 0..n {
            let id = ids[(start + i) % n];
            let Some(p) = state.partitions.get_mut(&id) else {
                continue;
            };
            if !p.open(limit) {
                continue;
            }
            let record = match p.next_record(now, limit) {
                Ok(record) => record,
                Err(retry_at) => {
                    if let Some(at) = retry_at {
                        wait = wait.min(at.saturating_duration_since(now));
                    }
                    continue;
                }
            };
            p.in_flight
                .insert(record.offset, record.message.key.clone());
            let generation = p.generation;
            state.cursor = (start + i + 1) % n;
            drop(state);
            return Ok(self.delivery(id, generation, record));
        }
        Err(wait)
    }

    fn delivery(&self, partition: i32, generation: u64, record: Record) -> Delivery {
        let meta = DeliveryMeta {
            source: "kafka".into(),
            topic: Some(self.shared.topic.clone()),
            partition: Some(partition),
            offset: Some(record.offset),
            delivery_count: record.count,
        };
        let message = record.message.clone();
        let defect = record.defect.clone();
        let acker = KafkaAcker {
            consumer: self.consumer.clone(),
            dead_letters: self.dead_letters.clone(),
            held: Unsettled::new(Held {
                shared: Arc::clone(&self.shared),
                partition,
                generation,
                record,
            }),
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

impl Drop for KafkaSource {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[async_trait]
impl Source for KafkaSource {
    /// Hands out up to `per_partition` unsettled records of a partition at
    /// once (see the [module docs](super)); offsets are still committed only
    /// up to the lowest unsettled one.
    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.shared
            .partition_limit
            .store(per_partition.max(1), Ordering::SeqCst);
        self.shared.ready.notify_waiters();
    }

    /// Positions every partition at its stored watermark from now on (see
    /// the [module docs](super)).
    async fn resume_from(&mut self, lookup: Arc<dyn OffsetLookup>) {
        let runtime = tokio::runtime::Handle::current();
        *crate::sync::lock(&self.shared.resume) = Some(Resume { lookup, runtime });
        self.seek_assigned().await;
    }

    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let ready = self.shared.ready.notified();
            match self.take_ready() {
                Ok(delivery) => return Ok(Some(delivery)),
                Err(wait) => {
                    if self.consumer.strong_count() == 0 {
                        return Err(SourceError::broker("the kafka consumer stopped"));
                    }
                    let _ = tokio::time::timeout(wait, ready).await;
                }
            }
        }
    }
}
