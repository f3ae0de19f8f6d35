//! Kafka: a consumer-group source and a publisher, over `rdkafka` (a
//! statically built librdkafka).
//!
//! # Kafka's redelivery model
//!
//! A Kafka partition is an ordered log. A consumer group remembers, per
//! partition, one *committed offset*: the next record to read. Everything at
//! or after it is delivered again to whichever group member owns the
//! partition after a restart or a rebalance. There is no per-message ack: a
//! record is "acked" by committing an offset past it, which also acks every
//! earlier record of the partition.
//!
//! # How this source maps it
//!
//! - Auto-commit and the automatic offset store are off. The offset of a
//!   record (`offset + 1`) is committed synchronously when its delivery is
//!   acked, that is after the inbox transaction committed; duplicates and
//!   dead-lettered records are committed the same way.
//! - At most **one unsettled delivery per partition** is handed out; the rest
//!   of the partition waits in a buffer (the partition is paused when the
//!   buffer grows past [`KafkaConfig::max_buffered`]). So order within a
//!   partition is kept, and a commit never skips an unsettled record, while
//!   different partitions are processed concurrently.
//! - A nack (retry later) delivers the *same* record again after the delay,
//!   with `delivery_count + 1`; the partition does not move past it. A
//!   delivery dropped unsettled (its task was cancelled) is redelivered at once.
//! - A dead-lettered record is published to the optional dead-letter topic
//!   ([`KafkaConfig::dead_letter_topic`]) with the header
//!   `idemq_dead_letter_reason`, then committed like an ack.
//! - On a rebalance, before revoked partitions go, the source waits up to
//!   [`KafkaConfig::revoke_grace`] for their in-flight deliveries to settle,
//!   commits what is settled, and discards their buffered records. A later ack
//!   of a delivery from a revoked partition commits nothing: the new owner
//!   redelivers the record and the inbox answers "duplicate".
//! - Dropping the source stops polling and closes the consumer in the
//!   background: it commits what is settled and leaves the group. Anything
//!   unsettled is redelivered later. Offsets are committed at every ack, so a
//!   process that exits before the close finishes loses nothing either; the
//!   group then waits for the session timeout before it rebalances.
//!
//! - In offset-watermark mode ([`Consumer::run_watermarked`](crate::Consumer::run_watermarked))
//!   the engine hands the source the store's watermarks
//!   ([`Source::resume_from`]). Every partition assigned from then on starts
//!   at its watermark (the offsets are set in the assignment itself, looked
//!   up in the rebalance callback), and partitions already assigned are
//!   sought to it at once, their buffered records below it dropped; so
//!   records already applied are not even fetched, whatever offset the group
//!   committed. Partitions without a watermark start at the committed offset.
//!   If the lookup fails or takes more than 10 s, the committed offset is
//!   used and the engine's per-record check answers what was applied.
//!   [`KafkaSource::counters`] counts records fetched and partitions positioned.
//!
//! Message mapping: the payload is the record value; [`Message::key`] is the
//! record key (a key that is not UTF-8 turns the delivery into a defect that
//! the engine dead-letters); the headers are the record headers;
//! [`Message::id`] is the header `message_id` (set by [`KafkaPublisher`]),
//! else `"{topic}-{partition}@{offset}"`. [`DeliveryMeta`] carries the topic,
//! partition, offset and the in-process delivery count (1 on first delivery).
//!
//! The default business key for Kafka is [`default_key_spec`]: the header
//! `event_id`, else the record key.
//!
//! ```no_run
//! use idemq::source::kafka::{default_key_spec, KafkaConfig, KafkaSource};
//! use idemq::store::{sql::postgres::PostgresStore, StoreAdmin};
//! use idemq::Consumer;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/test").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("billing", store)
//!     .key(default_key_spec())
//!     .handler_fn(|ctx, tx| Box::pin(async move {
//!         sqlx::query("INSERT INTO charges (payment_id) VALUES ($1)")
//!             .bind(ctx.key)
//!             .execute(&mut **tx)
//!             .await?;
//!         Ok(None)
//!     }))
//!     .build()?;
//! let config = KafkaConfig::from_url("kafka://127.0.0.1:9092/payments?group=billing")?;
//! consumer.run(KafkaSource::connect(config).await?).await?;
//! # Ok(()) }
//! ```

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, RebalanceProtocol,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::util::Timeout;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::Notify;

use super::url::BrokerUrl;
use super::{Acknowledger, Delivery, OffsetLookup, Publisher, Source};
use crate::error::{InputError, SourceError};
use crate::key::KeySpec;
use crate::message::{DeliveryMeta, Headers, Message};
use crate::store::DeadLetterReason;

/// The header that carries [`Message::id`] on Kafka.
pub const MESSAGE_ID_HEADER: &str = "message_id";

/// The header that carries the dead-letter reason on the dead-letter topic.
pub const DEAD_LETTER_REASON_HEADER: &str = "idemq_dead_letter_reason";

/// The default business key for Kafka records: the header `event_id`, else
/// the record key.
pub fn default_key_spec() -> KeySpec {
    KeySpec::header("event_id").or(KeySpec::transport_key())
}

/// How to reach the broker, what to consume, and the consumer-group tuning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port…]`.
    pub brokers: String,
    /// The topic to consume.
    pub topic: String,
    /// The consumer group id.
    pub group: String,
    /// Where a group without a committed offset starts: `earliest` (default) or `latest`.
    pub auto_offset_reset: String,
    /// The group session timeout (default 10 s).
    pub session_timeout: Duration,
    /// Where dead-lettered records are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
    /// How long a revocation waits for in-flight deliveries of the revoked
    /// partitions to settle before it commits and lets them go (default 5 s).
    pub revoke_grace: Duration,
    /// Records buffered per partition before the partition is paused (default 1000).
    pub max_buffered: usize,
    /// Create the topic with this many partitions if it does not exist, for
    /// brokers that do not auto-create topics (`create_partitions=N` in the URL;
    /// see [`create_topic`]). `None` (default): the topic must exist.
    pub create_partitions: Option<i32>,
    /// Extra librdkafka settings, applied last (they override the above).
    pub settings: Vec<(String, String)>,
}

impl KafkaConfig {
    /// A configuration with the defaults.
    pub fn new(
        brokers: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            auto_offset_reset: "earliest".into(),
            session_timeout: Duration::from_secs(10),
            dead_letter_topic: None,
            revoke_grace: Duration::from_secs(5),
            max_buffered: 1000,
            create_partitions: None,
            settings: Vec::new(),
        }
    }

    /// Parses `kafka://host:port[,host:port]/topic?group=NAME[&…]`.
    ///
    /// Query parameters: `group` (required), `offset_reset` (`earliest` or
    /// `latest`), `session_timeout_ms`, `revoke_grace_ms` (whole
    /// milliseconds, as the names say), `max_buffered`, `create_partitions`,
    /// `dead_letter_topic`; any parameter whose name contains a dot is passed
    /// to librdkafka as is (e.g. `heartbeat.interval.ms=500`). Values may be
    /// percent-encoded; the common URL rules are in `source::url`.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("Kafka", "kafka", url)?;
        let topic = u.require_path("topic")?;
        let brokers = u.host_list()?;
        validate_topic(topic).map_err(|why| u.error(why))?;
        let mut group = None;
        let mut config = KafkaConfig::new(brokers, topic, "");
        for p in u.params() {
            match p.name.as_str() {
                "group" => group = p.non_empty(),
                "offset_reset" | "auto.offset.reset" => {
                    config.auto_offset_reset = p.choice(&["earliest", "latest"])?.to_owned();
                }
                "session_timeout_ms" => config.session_timeout = Duration::from_millis(p.count()?),
                "revoke_grace_ms" => config.revoke_grace = Duration::from_millis(p.count()?),
                "create_partitions" => {
                    let n =
                        p.count::<i32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                            p.error("create_partitions must be between 1 and 2^31-1")
                        })?;
                    config.create_partitions = Some(n);
                }
                "max_buffered" => config.max_buffered = p.count()?,
                "dead_letter_topic" => {
                    validate_topic(&p.value).map_err(|why| p.error(why))?;
                    config.dead_letter_topic = Some(p.value);
                }
                name if name.contains('.') => {
                    if p.value.is_empty() {
                        return Err(p.error(format!("parameter {name:?} has no value")));
                    }
                    config.settings.push((p.name, p.value))
                }
                _ => return Err(p.unknown()),
            }
        }
        config.group = group.ok_or_else(|| u.missing("group"))?;
        Ok(config)
    }

    /// Adds an extra librdkafka setting (applied last).
    pub fn set(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets the group session timeout.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Sets how long a revocation waits for in-flight deliveries.
    pub fn revoke_grace(mut self, grace: Duration) -> Self {
        self.revoke_grace = grace;
        self
    }

    fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", &self.auto_offset_reset)
            .set(
                "session.timeout.ms",
                self.session_timeout.as_millis().to_string(),
            )
            .set("enable.partition.eof", "false");
        for (name, value) in &self.settings {
            cc.set(name, value);
        }
        cc
    }
}

fn validate_topic(topic: &str) -> Result<(), String> {
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "topic {topic:?} must be 1 to 249 characters of [a-zA-Z0-9._-]"
        ))
    }
}

fn broker(e: impl std::fmt::Display) -> SourceError {
    SourceError::Broker(e.to_string())
}

/// A record received from the broker, ready to be delivered (again).
#[derive(Debug, Clone)]
struct Record {
    offset: i64,
    message: Message,
    defect: Option<InputError>,
    /// The delivery count of its next delivery.
    count: u32,
}

#[derive(Debug, Default)]
struct Partition {
    /// Changes whenever the partition is (re)assigned; stale acks are ignored.
    generation: u64,
    buffer: VecDeque<Record>,
    /// The offset of the one delivery handed out and not yet settled.
    in_flight: Option<i64>,
    /// A nacked record and when to deliver it again.
    retry: Option<(Instant, Record)>,
    /// The offset to commit (`offset + 1` of the last settled record), if not yet committed.
    uncommitted: Option<i64>,
    paused: bool,
    /// Being revoked: nothing more is handed out.
    revoking: bool,
    /// Records below this offset are already applied (the stored watermark
    /// the partition was positioned at): dropped if fetched anyway.
    floor: Option<i64>,
    /// A seek to the watermark the polling thread is still to make; nothing
    /// of the partition is handed out until it is made.
    seek_to: Option<i64>,
}

#[derive(Debug, Default)]
struct State {
    partitions: HashMap<i32, Partition>,
    next_generation: u64,
    cursor: usize,
    /// Positions set in an assignment, for the partitions it creates.
    floors: HashMap<i32, i64>,
}

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
    fetched: AtomicU64,
    positioned_at_assignment: AtomicU64,
    sought: AtomicU64,
    dropped_below_watermark: AtomicU64,
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
struct Shared {
    topic: String,
    state: Mutex<State>,
    /// Signalled when a delivery settles (a revocation waits on it).
    settled: Condvar,
    /// Signalled when there may be something to deliver.
    ready: Notify,
    /// Serializes offset commits with revocations.
    commit_lock: Mutex<()>,
    revoke_grace: Duration,
    max_buffered: usize,
    /// Set by offset-watermark mode ([`Source::resume_from`]).
    resume: Mutex<Option<Resume>>,
    counters: Arc<KafkaCounters>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn commit_guard(&self) -> MutexGuard<'_, ()> {
        self.commit_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn tpl(&self, offsets: &[(i32, i64)]) -> Result<TopicPartitionList, SourceError> {
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
            let resume = self.resume.lock().unwrap_or_else(|p| p.into_inner());
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
                    .is_some_and(|p| p.in_flight.is_some())
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

/// The consumer context: commits settled offsets of revoked partitions before they go.
struct KafkaContext {
    shared: Arc<Shared>,
}

impl ClientContext for KafkaContext {}

impl ConsumerContext for KafkaContext {
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

type KafkaConsumer = BaseConsumer<KafkaContext>;

/// A Kafka consumer-group member as a [`Source`] (see the [module docs](self)).
///
/// A background thread polls the broker and serves rebalances; dropping the
/// source stops it and closes the consumer.
pub struct KafkaSource {
    shared: Arc<Shared>,
    consumer: Weak<KafkaConsumer>,
    dead_letters: Option<(FutureProducer, String)>,
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
    pub async fn connect(config: KafkaConfig) -> Result<Self, SourceError> {
        validate_topic(&config.topic).map_err(SourceError::Config)?;
        if config.group.is_empty() {
            return Err(SourceError::Config("a consumer group is required".into()));
        }
        if let Some(partitions) = config.create_partitions {
            create_topic(&config.brokers, &config.topic, partitions).await?;
        }
        let shared = Arc::new(Shared {
            topic: config.topic.clone(),
            state: Mutex::default(),
            settled: Condvar::new(),
            ready: Notify::new(),
            commit_lock: Mutex::new(()),
            revoke_grace: config.revoke_grace,
            max_buffered: config.max_buffered.max(1),
            resume: Mutex::new(None),
            counters: Arc::default(),
        });
        let context = KafkaContext {
            shared: Arc::clone(&shared),
        };
        let consumer: KafkaConsumer = config
            .client_config()
            .create_with_context(context)
            .map_err(|e| SourceError::Config(format!("kafka consumer: {e}")))?;
        let consumer = Arc::new(consumer);
        let topic = config.topic.clone();
        let check = Arc::clone(&consumer);
        let consumer = tokio::task::spawn_blocking(move || {
            let metadata = check
                .fetch_metadata(Some(&topic), Duration::from_secs(10))
                .map_err(broker)?;
            let found = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .filter(|t| t.error().is_none() && !t.partitions().is_empty());
            if found.is_none() {
                return Err(SourceError::Broker(format!(
                    "topic {topic:?} does not exist"
                )));
            }
            check.subscribe(&[&topic]).map_err(broker)?;
            Ok(check)
        })
        .await
        .map_err(|e| SourceError::Other(e.to_string()))??;
        let dead_letters = match &config.dead_letter_topic {
            Some(topic) => {
                validate_topic(topic).map_err(SourceError::Config)?;
                Some((producer(&config.brokers)?, topic.clone()))
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
            .map_err(SourceError::Io)?;
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
        let Some(lookup) = self
            .shared
            .resume
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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
            if p.in_flight.is_some() || p.revoking {
                continue;
            }
            let before = p.buffer.len();
            p.buffer.retain(|r| r.offset >= next);
            if p.retry.as_ref().is_some_and(|(_, r)| r.offset < next) {
                p.retry = None;
            }
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
            if p.in_flight.is_some() || p.revoking || p.seek_to.is_some() {
                continue;
            }
            let record = match &p.retry {
                Some((at, _)) if *at > now => {
                    wait = wait.min(at.saturating_duration_since(now));
                    None
                }
                Some(_) => p.retry.take().map(|(_, r)| r),
                None => p.buffer.pop_front(),
            };
            let Some(record) = record else {
                continue;
            };
            p.in_flight = Some(record.offset);
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
            shared: Arc::clone(&self.shared),
            consumer: self.consumer.clone(),
            dead_letters: self.dead_letters.clone(),
            partition,
            generation,
            record: Some(record),
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
    /// Positions every partition at its stored watermark from now on (see
    /// the [module docs](self)).
    async fn resume_from(&mut self, lookup: Arc<dyn OffsetLookup>) {
        let runtime = tokio::runtime::Handle::current();
        *self.shared.resume.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Resume { lookup, runtime });
        self.seek_assigned().await;
    }

    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let ready = self.shared.ready.notified();
            match self.take_ready() {
                Ok(delivery) => return Ok(Some(delivery)),
                Err(wait) => {
                    if self.consumer.strong_count() == 0 {
                        return Err(SourceError::Broker("the kafka consumer stopped".into()));
                    }
                    let _ = tokio::time::timeout(wait, ready).await;
                }
            }
        }
    }
}

/// The background thread: polls records into the partition buffers, serves
/// rebalances (through [`KafkaContext`]), pauses and resumes partitions.
struct Poller {
    consumer: Arc<KafkaConsumer>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
}

impl Poller {
    fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            match self.consumer.poll(Duration::from_millis(100)) {
                None => {}
                Some(Ok(msg)) => {
                    let partition = msg.partition();
                    let record = record_of(&self.shared.topic, &msg);
                    drop(msg);
                    let mut state = self.shared.state();
                    match state.partitions.get_mut(&partition) {
                        Some(p) if p.floor.is_some_and(|floor| record.offset < floor) => {
                            self.shared.counters.fetched.fetch_add(1, Ordering::SeqCst);
                            self.shared
                                .counters
                                .dropped_below_watermark
                                .fetch_add(1, Ordering::SeqCst);
                        }
                        Some(p) => {
                            self.shared.counters.fetched.fetch_add(1, Ordering::SeqCst);
                            p.buffer.push_back(record);
                        }
                        None => {
                            tracing::debug!(partition, "record of an unassigned partition dropped")
                        }
                    }
                    drop(state);
                    self.shared.ready.notify_waiters();
                }
                Some(Err(e)) => {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "kafka consumer error")
                }
            }
            self.flow_control();
            self.apply_seeks();
        }
        tracing::debug!(topic = %self.shared.topic, "kafka source stopped; closing the consumer");
        // Dropping the last strong reference closes the consumer: the
        // revocation commits what is settled. Ackers only hold weak references.
    }

    /// Makes the seeks [`KafkaSource::seek_assigned`] asked for. On this
    /// thread, between two polls, so every record polled afterwards comes
    /// from the new position: the buffer, fetched from the old one, is
    /// dropped (it is fetched again in order). If a seek fails, the buffer
    /// (all at or past the watermark) is kept and delivery goes on in order.
    fn apply_seeks(&self) {
        let wanted: Vec<(i32, i64, u64)> = self
            .shared
            .state()
            .partitions
            .iter()
            .filter_map(|(id, p)| p.seek_to.map(|next| (*id, next, p.generation)))
            .collect();
        if wanted.is_empty() {
            return;
        }
        let mut sought = Vec::new();
        for (partition, next, generation) in wanted {
            let result = self.consumer.seek(
                &self.shared.topic,
                partition,
                Offset::Offset(next),
                Duration::from_secs(10),
            );
            let mut state = self.shared.state();
            let Some(p) = state.partitions.get_mut(&partition) else {
                continue;
            };
            if p.generation != generation {
                continue;
            }
            p.seek_to = None;
            match result {
                Ok(()) => {
                    p.buffer.clear();
                    sought.push((partition, next));
                }
                Err(e) => {
                    tracing::warn!(topic = %self.shared.topic, partition, error = %e, "seeking a partition to its watermark failed; records below it are dropped as they arrive")
                }
            }
        }
        self.shared
            .counters
            .sought
            .fetch_add(sought.len() as u64, Ordering::SeqCst);
        self.shared.ready.notify_waiters();
        if !sought.is_empty() {
            sought.sort_unstable();
            tracing::info!(topic = %self.shared.topic, ?sought, "assigned kafka partitions sought to their stored watermarks");
        }
    }

    fn flow_control(&self) {
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        {
            let mut state = self.shared.state();
            let max = self.shared.max_buffered;
            for (id, p) in state.partitions.iter_mut() {
                if !p.paused && p.buffer.len() >= max {
                    p.paused = true;
                    pause.push(*id);
                } else if p.paused && p.buffer.len() <= max / 2 {
                    p.paused = false;
                    resume.push(*id);
                }
            }
        }
        let apply = |list: &[i32], pause: bool| {
            if list.is_empty() {
                return;
            }
            let mut tpl = TopicPartitionList::new();
            for p in list {
                tpl.add_partition(&self.shared.topic, *p);
            }
            let result = if pause {
                self.consumer.pause(&tpl)
            } else {
                self.consumer.resume(&tpl)
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, pause, "pausing/resuming kafka partitions failed");
            }
        };
        apply(&pause, true);
        apply(&resume, false);
    }
}

fn record_of(topic: &str, msg: &BorrowedMessage<'_>) -> Record {
    let partition = msg.partition();
    let offset = msg.offset();
    let mut defect = None;
    let mut headers = Headers::new();
    if let Some(h) = msg.headers() {
        for header in h.iter() {
            headers.insert(header.key, header.value.unwrap_or_default());
        }
    }
    let id = match headers.get(MESSAGE_ID_HEADER).map(std::str::from_utf8) {
        Some(Ok(id)) => id.to_owned(),
        Some(Err(_)) => {
            defect = Some(InputError::HeaderNotUtf8(MESSAGE_ID_HEADER.into()));
            format!("{topic}-{partition}@{offset}")
        }
        None => format!("{topic}-{partition}@{offset}"),
    };
    let key = match msg.key().map(std::str::from_utf8) {
        None => None,
        Some(Ok(k)) => Some(k.to_owned()),
        Some(Err(e)) => {
            defect = Some(InputError::Malformed(format!(
                "the record key is not valid UTF-8: {e}"
            )));
            None
        }
    };
    Record {
        offset,
        message: Message {
            id: Some(id),
            key,
            headers,
            payload: msg.payload().unwrap_or_default().to_vec(),
        },
        defect,
        count: 1,
    }
}

/// Settles one Kafka delivery: see the [module docs](self).
struct KafkaAcker {
    shared: Arc<Shared>,
    consumer: Weak<KafkaConsumer>,
    dead_letters: Option<(FutureProducer, String)>,
    partition: i32,
    generation: u64,
    /// `None` once settled.
    record: Option<Record>,
}

impl KafkaAcker {
    /// Puts the record back for a redelivery after `delay`, if the partition is still ours.
    fn redeliver(&mut self, delay: Duration) {
        let Some(mut record) = self.record.take() else {
            return;
        };
        let mut state = self.shared.state();
        if let Some(p) = state.partitions.get_mut(&self.partition) {
            if p.generation == self.generation && p.in_flight == Some(record.offset) {
                p.in_flight = None;
                record.count = record.count.saturating_add(1);
                p.retry = Some((Instant::now() + delay, record));
            }
        }
        drop(state);
        self.shared.settled.notify_all();
        self.shared.ready.notify_waiters();
    }

    /// Marks the record settled and commits its offset, if the partition is still ours.
    fn commit(
        shared: &Shared,
        consumer: &Weak<KafkaConsumer>,
        partition: i32,
        generation: u64,
        offset: i64,
    ) -> Result<(), SourceError> {
        let next = offset + 1;
        let Some(consumer) = consumer.upgrade() else {
            // The source is gone: the record is redelivered later and the inbox answers.
            release(shared, partition, generation, offset, None);
            return Ok(());
        };
        let result = {
            let _guard = shared.commit_guard();
            if !release(shared, partition, generation, offset, Some(next)) {
                tracing::debug!(
                    partition,
                    offset,
                    "ack after the partition was revoked: not committed"
                );
                return Ok(());
            }
            let result = shared
                .tpl(&[(partition, next)])
                .and_then(|tpl| consumer.commit(&tpl, CommitMode::Sync).map_err(broker));
            if result.is_ok() {
                let mut state = shared.state();
                if let Some(p) = state.partitions.get_mut(&partition) {
                    if p.generation == generation && p.uncommitted == Some(next) {
                        p.uncommitted = None;
                    }
                }
            }
            result
        };
        // The last strong reference may be this one: close the consumer outside the lock.
        drop(consumer);
        result
    }

    async fn settle(mut self) -> Result<(), SourceError> {
        let Some(record) = self.record.take() else {
            return Ok(());
        };
        let shared = Arc::clone(&self.shared);
        let consumer = self.consumer.clone();
        let (partition, generation, offset) = (self.partition, self.generation, record.offset);
        tokio::task::spawn_blocking(move || {
            Self::commit(&shared, &consumer, partition, generation, offset)
        })
        .await
        .map_err(|e| SourceError::Other(e.to_string()))?
    }
}

/// Clears the in-flight mark of `offset`; records `uncommitted` when given.
/// Returns whether the partition is still owned in that generation.
fn release(
    shared: &Shared,
    partition: i32,
    generation: u64,
    offset: i64,
    uncommitted: Option<i64>,
) -> bool {
    let mut state = shared.state();
    let owned = match state.partitions.get_mut(&partition) {
        Some(p) if p.generation == generation && p.in_flight == Some(offset) => {
            p.in_flight = None;
            if uncommitted.is_some() {
                p.uncommitted = uncommitted;
            }
            true
        }
        _ => false,
    };
    drop(state);
    shared.settled.notify_all();
    shared.ready.notify_waiters();
    owned
}

#[async_trait]
impl Acknowledger for KafkaAcker {
    async fn ack(self: Box<Self>) -> Result<(), SourceError> {
        (*self).settle().await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        self.redeliver(delay);
        Ok(())
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let forward = match (&self.dead_letters, &self.record) {
            (Some((producer, topic)), Some(record)) => {
                Some((producer.clone(), topic.clone(), record.message.clone()))
            }
            _ => None,
        };
        if let Some((producer, topic, message)) = forward {
            let mut headers = OwnedHeaders::new();
            for (name, value) in message.headers.iter() {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            headers = headers.insert(Header {
                key: DEAD_LETTER_REASON_HEADER,
                value: Some(reason.code()),
            });
            let mut out = FutureRecord::to(&topic)
                .payload(message.payload.as_slice())
                .headers(headers);
            if let Some(key) = &message.key {
                out = out.key(key.as_str());
            }
            if let Err((e, _)) = producer
                .send(out, Timeout::After(Duration::from_secs(30)))
                .await
            {
                // Not forwarded: keep the record and try again a little later.
                self.redeliver(Duration::from_secs(1));
                return Err(SourceError::Broker(format!(
                    "publishing to the dead-letter topic {topic:?} failed: {e}"
                )));
            }
        }
        (*self).settle().await
    }
}

impl Drop for KafkaAcker {
    /// An unsettled delivery is delivered again at once.
    fn drop(&mut self) {
        self.redeliver(Duration::ZERO);
    }
}

/// Creates `topic` with `partitions` partitions (replication factor 1) on
/// `brokers` unless it exists; whether it was created. For brokers without
/// topic auto-creation (locked-down clusters), tests and demos.
pub async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
) -> Result<bool, SourceError> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;

    validate_topic(topic).map_err(SourceError::Config)?;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| SourceError::Config(format!("kafka admin client: {e}")))?;
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .map_err(broker)?;
    match results.into_iter().next() {
        Some(Ok(_)) => Ok(true),
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => Ok(false),
        Some(Err((name, code))) => Err(SourceError::Broker(format!(
            "creating topic {name:?}: {code}"
        ))),
    }
}

fn producer(brokers: &str) -> Result<FutureProducer, SourceError> {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .map_err(|e| SourceError::Config(format!("kafka producer: {e}")))
}

/// Publishes [`Message`]s to a Kafka topic with an idempotent producer.
///
/// The record key is [`Message::key`], the value the payload, and the
/// headers are the message headers plus `message_id` = [`Message::id`] when
/// set, which [`KafkaSource`] reads back as the id.
#[derive(Clone)]
pub struct KafkaPublisher {
    producer: FutureProducer,
    topic: String,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// An idempotent producer for `topic` on `brokers` (`host:port[,…]`).
    pub async fn connect(brokers: &str, topic: &str) -> Result<Self, SourceError> {
        validate_topic(topic).map_err(SourceError::Config)?;
        Ok(Self {
            producer: producer(brokers)?,
            topic: topic.to_owned(),
        })
    }
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let mut headers = OwnedHeaders::new();
        for (name, value) in message.headers.iter() {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        if let Some(id) = &message.id {
            if message.headers.get(MESSAGE_ID_HEADER).is_none() {
                headers = headers.insert(Header {
                    key: MESSAGE_ID_HEADER,
                    value: Some(id.as_str()),
                });
            }
        }
        let mut record = FutureRecord::to(&self.topic)
            .payload(message.payload.as_slice())
            .headers(headers);
        if let Some(key) = &message.key {
            record = record.key(key.as_str());
        }
        self.producer
            .send(record, Timeout::After(Duration::from_secs(30)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| SourceError::Broker(format!("publishing to {:?}: {e}", self.topic)))
    }

    async fn flush(&self) -> Result<(), SourceError> {
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(30)))
            .await
            .map_err(|e| SourceError::Other(e.to_string()))?
            .map_err(broker)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = KafkaConfig::from_url(
            "kafka://127.0.0.1:9092/payments?group=billing&session_timeout_ms=6000&heartbeat.interval.ms=500&dead_letter_topic=payments.dlq",
        )
        .unwrap();
        assert_eq!(c.brokers, "127.0.0.1:9092");
        assert_eq!(c.topic, "payments");
        assert_eq!(c.group, "billing");
        assert_eq!(c.session_timeout, Duration::from_secs(6));
        assert_eq!(c.dead_letter_topic.as_deref(), Some("payments.dlq"));
        assert_eq!(c.auto_offset_reset, "earliest");
        assert_eq!(
            c.settings,
            vec![("heartbeat.interval.ms".to_owned(), "500".to_owned())]
        );
        let c = KafkaConfig::from_url("kafka://a:1,b:2/t?group=g&offset_reset=latest").unwrap();
        assert_eq!(c.brokers, "a:1,b:2");
        assert_eq!(c.auto_offset_reset, "latest");
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://127.0.0.1:9092/payments",
            "kafka://127.0.0.1:9092/payments?group=",
            "kafka://127.0.0.1:9092?group=g",
            "kafka:///payments?group=g",
            "http://127.0.0.1:9092/payments?group=g",
            "kafka://127.0.0.1:9092/pay ments?group=g",
            "kafka://127.0.0.1:9092/payments?group=g&bogus=1",
            "kafka://127.0.0.1:9092/payments?group=g&session_timeout_ms=soon",
            "kafka://127.0.0.1:9092/payments?group=g&offset_reset=middle",
        ] {
            assert!(
                matches!(KafkaConfig::from_url(url), Err(SourceError::Config(_))),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn default_key_prefers_the_event_id_header() {
        let spec = default_key_spec();
        let m = Message::new("{}")
            .with_key("k")
            .with_header("event_id", "e");
        assert_eq!(spec.extract(&m).unwrap(), "e");
        assert_eq!(
            spec.extract(&Message::new("{}").with_key("k")).unwrap(),
            "k"
        );
    }
}
