//! Offset-watermark mode ([`Consumer::run_watermarked`]) with the Kafka
//! source against Apache Kafka, on each SQL store (PostgreSQL, MariaDB, SQLite),
//! with a ledger table the handler writes through the claim's transaction:
//! after a crash between the database commit and the offset commit, the
//! restarted consumer starts each partition at its watermark and does not
//! even fetch the applied records; an offset reset of a running member seeks
//! past the watermark; a source that cannot seek is still answered by the
//! per-record check; a consumer killed inside its handler loses nothing and
//! applies nothing twice; key dedup on top catches producer retries; a
//! rebalance with messages in flight positions the moved partitions at their
//! watermarks and loses nothing and applies nothing twice.
//!
//! Each scenario is written once, generic over [`Backend`]; `on_store!`
//! instantiates all of them per store (a module per store, each gated by
//! the store's feature).
#![cfg(all(
    feature = "kafka",
    any(feature = "postgres", feature = "mysql", feature = "sqlite")
))]

use crate::support;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{payments, Plan, SwallowAcks, Tally};
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use idemq::engine::WatermarkOptions;
use idemq::source::kafka::{create_topic, KafkaConfig, KafkaCounters, KafkaPublisher, KafkaSource};
use idemq::source::{Delivery, Source};
use idemq::store::sql::{SqlOptions, Tables};
use idemq::store::unit::{
    Completion, MemberAnswer, MemberClaim, RecordClaim, RecordPosition, UnitOptions, WorkUnit,
};
use idemq::store::{ClaimRequest, Store, StoreAdmin, UnitStore, WatermarkStore};
use idemq::{
    Consumer, ConsumerBuilder, HandlerError, KeySpec, Message, OutcomeKind, SourceError, Summary,
};

const BROKERS: &str = "127.0.0.1:9092";
const PARTITIONS: i32 = 3;

async fn new_topic() -> String {
    let topic = support::unique("wm");
    assert!(create_topic(BROKERS, &topic, PARTITIONS).await.unwrap());
    topic
}

async fn source(topic: &str, group: &str) -> KafkaSource {
    let config = KafkaConfig::new(BROKERS, topic, group)
        .session_timeout(Duration::from_secs(6))
        .revoke_grace(Duration::from_secs(2))
        .set("heartbeat.interval.ms", "500");
    KafkaSource::connect(config).await.unwrap()
}

async fn publish(topic: &str, messages: &[Message]) {
    let publisher = KafkaPublisher::connect(BROKERS, topic).await.unwrap();
    support::publish_all(&publisher, messages).await;
}

// ---- the stores ----

/// Writes one ledger row through the claim's transaction: (transaction,
/// the dialect's INSERT of (msg_key, amount), key, amount).
type Write<Tx> =
    for<'a> fn(&'a mut Tx, &'a str, &'a str, i64) -> BoxFuture<'a, Result<(), HandlerError>>;

/// What must outlive the stores of a test (SQLite's temporary directory).
type Keep = Box<dyn std::any::Any + Send + Sync>;

/// A SQL store under test: how to open it, and the few statements the
/// scenarios run on its database besides the store's own.
trait Backend: 'static {
    /// The store.
    type S: WatermarkStore + StoreAdmin + Clone;
    /// A database for one test: its URL, and what must outlive the stores.
    fn location() -> (String, Keep);
    /// A store on `url` whose tables start with `prefix` (not migrated).
    async fn connect(url: &str, prefix: &str) -> Self::S;
    /// The store's table names.
    fn tables(store: &Self::S) -> &Tables;
    /// Runs `sql` (no parameters, no rows).
    async fn execute(store: &Self::S, sql: &str);
    /// Runs `sql`, which answers one number.
    async fn count(store: &Self::S, sql: &str) -> i64;
    /// Runs `sql`, which answers (msg_key, amount) rows.
    async fn rows(store: &Self::S, sql: &str) -> Vec<(String, i64)>;
    /// Inserts `(msg_key, amount)` into `table`, in this dialect.
    fn insert(table: &str) -> String;
    /// Writes a ledger row through the claim's transaction.
    fn write() -> Write<<Self::S as Store>::Tx>;
    /// Closes the store's connections, as the death of its process would.
    async fn close(store: &Self::S);
}

/// Per store: its [`Backend`] and a module of tests running every scenario
/// on it, all gated by the store's feature. `$p1`/`$p2` are the dialect's
/// first two placeholders; `$location` gives the database of one test.
macro_rules! on_store {
    ($feature:literal, $module:ident, $backend:ident, $store:ty, $db:ty,
     [$p1:literal, $p2:literal], $location:expr) => {
        #[cfg(feature = $feature)]
        struct $backend;

        #[cfg(feature = $feature)]
        impl Backend for $backend {
            type S = $store;
            fn location() -> (String, Keep) {
                $location
            }
            async fn connect(url: &str, prefix: &str) -> $store {
                <$store>::connect_with(url, SqlOptions::default().table_prefix(prefix))
                    .await
                    .expect("connect to the store")
            }
            fn tables(store: &$store) -> &Tables {
                store.tables()
            }
            async fn execute(store: &$store, sql: &str) {
                sqlx::query(sql).execute(store.pool()).await.expect(sql);
            }
            async fn count(store: &$store, sql: &str) -> i64 {
                sqlx::query_scalar(sql)
                    .fetch_one(store.pool())
                    .await
                    .expect(sql)
            }
            async fn rows(store: &$store, sql: &str) -> Vec<(String, i64)> {
                sqlx::query_as(sql)
                    .fetch_all(store.pool())
                    .await
                    .expect(sql)
            }
            fn insert(table: &str) -> String {
                format!(
                    "INSERT INTO {table} (msg_key, amount) VALUES ({}, {})",
                    $p1, $p2
                )
            }
            fn write() -> Write<sqlx::Transaction<'static, $db>> {
                |tx, insert, key, amount| {
                    Box::pin(async move {
                        sqlx::query(insert)
                            .bind(key)
                            .bind(amount)
                            .execute(&mut **tx)
                            .await?;
                        Ok(())
                    })
                }
            }
            async fn close(store: &$store) {
                store.pool().close().await;
            }
        }

        #[cfg(feature = $feature)]
        mod $module {
            use super::$backend;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_restart_seeks_past_the_watermark_and_fetches_nothing_applied() {
                super::a_restart_seeks_past_the_watermark_and_fetches_nothing_applied::<$backend>()
                    .await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_consumer_killed_inside_its_handler_loses_nothing() {
                super::a_consumer_killed_inside_its_handler_loses_nothing::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn key_dedup_on_top_catches_producer_retries() {
                super::key_dedup_on_top_catches_producer_retries::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn first_claims_of_many_partitions_at_once() {
                super::first_claims_of_many_partitions_at_once::<$backend>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_rebalance_with_messages_in_flight() {
                super::a_rebalance_with_messages_in_flight::<$backend>(
                    idemq::engine::WatermarkOptions::default(),
                )
                .await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_rebalance_with_concurrent_records_in_flight() {
                super::a_rebalance_with_messages_in_flight::<$backend>(super::concurrent()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_records_never_move_the_watermark_past_one_in_flight() {
                super::concurrent_records_never_move_the_watermark_past_one_in_flight::<$backend>()
                    .await
            }
        }
    };
}

on_store!(
    "postgres",
    postgres,
    Postgres,
    idemq::store::sql::postgres::PostgresStore,
    sqlx::Postgres,
    ["$1", "$2"],
    (support::postgres_url(), Box::new(()))
);
on_store!(
    "mysql",
    mariadb,
    MariaDb,
    idemq::store::sql::mysql::MySqlStore,
    sqlx::MySql,
    ["?", "?"],
    (support::mysql_url(), Box::new(()))
);
on_store!(
    "sqlite",
    sqlite,
    Sqlite,
    idemq::store::sql::sqlite::SqliteStore,
    sqlx::Sqlite,
    ["?", "?"],
    {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("wm.db").display());
        (url, Box::new(dir))
    }
);

/// A migrated store with unique tables and a ledger table
/// `{prefix}ledger (msg_key, amount)` without a unique constraint, so a
/// double effect shows as two rows.
struct Ledger<B: Backend> {
    store: B::S,
    url: String,
    table: String,
    _keep: Keep,
}

impl<B: Backend> Ledger<B> {
    /// Fresh tables for one test.
    async fn new() -> Self {
        let (url, keep) = B::location();
        let prefix = format!("{}_", support::unique("t"));
        let store = B::connect(&url, &prefix).await;
        store.migrate().await.expect("migrate");
        let table = format!("{prefix}ledger");
        B::execute(
            &store,
            &format!(
                "CREATE TABLE {table} (msg_key VARCHAR(200) NOT NULL, amount BIGINT NOT NULL)"
            ),
        )
        .await;
        Self {
            store,
            url,
            table,
            _keep: keep,
        }
    }

    /// Another store on the same tables, as another process would open it.
    async fn another_store(&self) -> B::S {
        B::connect(&self.url, &B::tables(&self.store).prefix).await
    }

    /// A consumer builder over this ledger's store; see [`Self::consumer_on`].
    fn consumer(&self, name: &str, plan: &Arc<Plan>) -> ConsumerBuilder<B::S> {
        self.consumer_on(self.store.clone(), name, plan)
    }

    /// A consumer builder over `store` with key `/payment_id`, a fast retry
    /// policy and the ledger handler: it counts its calls in `plan`, sleeps
    /// `sleep_ms` if the payload asks, writes the ledger row through the
    /// claim's transaction, then fails permanently if the payload says
    /// `"fail": "permanent"` (so a missing rollback shows).
    fn consumer_on(&self, store: B::S, name: &str, plan: &Arc<Plan>) -> ConsumerBuilder<B::S> {
        let insert: Arc<str> = B::insert(&self.table).into();
        let write = B::write();
        let plan = Arc::clone(plan);
        Consumer::builder(name, store)
            .key(KeySpec::json("/payment_id"))
            .retry(support::fast_retry())
            .handler_fn(move |ctx, tx| {
                let (insert, plan) = (Arc::clone(&insert), Arc::clone(&plan));
                Box::pin(async move {
                    plan.calls.fetch_add(1, Ordering::SeqCst);
                    let payload: serde_json::Value =
                        ctx.message.json().map_err(HandlerError::permanent)?;
                    if let Some(ms) = payload["sleep_ms"].as_u64() {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    let amount = payload["amount"].as_i64().unwrap_or(0);
                    write(tx, &insert, ctx.key, amount).await?;
                    if payload["fail"] == "permanent" {
                        return Err(HandlerError::permanent("rejected by business rule"));
                    }
                    Ok(Some(serde_json::json!({ "amount": amount })))
                })
            })
    }

    /// Ledger rows as (key, amount), sorted.
    async fn rows(&self) -> Vec<(String, i64)> {
        let sql = format!("SELECT msg_key, amount FROM {}", self.table);
        let mut rows = B::rows(&self.store, &sql).await;
        rows.sort();
        rows
    }

    /// Waits until `check` holds for the ledger rows, up to `limit`.
    async fn wait_for(
        &self,
        limit: Duration,
        check: impl Fn(&[(String, i64)]) -> bool,
    ) -> Vec<(String, i64)> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let rows = self.rows().await;
            if check(&rows) || tokio::time::Instant::now() > deadline {
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The ledger holds `n` rows, one per distinct record, summing to `sum`.
    async fn assert_applied_once(&self, n: usize, sum: i64) {
        let rows = self.rows().await;
        let distinct: HashSet<_> = rows.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(rows.len(), n, "rows: {rows:?}");
        assert_eq!(distinct.len(), n, "a record applied twice: {rows:?}");
        assert_eq!(rows.iter().map(|(_, a)| a).sum::<i64>(), sum);
    }

    /// The ledger holds exactly one row per expected key, with its amount.
    async fn assert_exactly_once(&self, expected: &BTreeMap<String, i64>) {
        let want: Vec<_> = expected.iter().map(|(k, a)| (k.clone(), *a)).collect();
        assert_eq!(
            self.rows().await,
            want,
            "double, lost or unexpected effects"
        );
    }

    /// Rows in the store's inbox.
    async fn inbox_rows(&self) -> i64 {
        let inbox = &B::tables(&self.store).inbox;
        B::count(&self.store, &format!("SELECT COUNT(*) FROM {inbox}")).await
    }

    /// Drops the test's tables (SQLite's file goes with its directory).
    async fn cleanup(self) {
        let t = B::tables(&self.store).clone();
        for table in [
            &self.table,
            &t.inbox,
            &t.attempts,
            &t.dead_letters,
            &t.migrations,
            &t.offsets,
            &t.effects,
        ] {
            B::execute(&self.store, &format!("DROP TABLE IF EXISTS {table}")).await;
        }
    }
}

// ---- the scenarios ----

/// A source that cannot seek: it forwards deliveries but not the
/// watermarks ([`Source::resume_from`]), as a source over a log without
/// positions would; the engine's per-record check must answer alone.
struct NoSeek(KafkaSource);

#[async_trait]
impl Source for NoSeek {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        self.0.next().await
    }

    async fn close(&mut self) {
        self.0.close().await
    }
}

/// Hands out at most `quota` deliveries of each partition until `open`
/// holds; every further one it keeps, unsettled (still in flight for the
/// source), and hands out first once `open` holds, or [`GATE`] after it
/// began keeping. The first member of a rebalance test then cannot finish
/// its records before the second member has partitions, and it crosses the
/// rebalance with deliveries in flight.
struct Gated<S> {
    inner: S,
    quota: usize,
    open: Box<dyn Fn() -> bool + Send + Sync>,
    given: HashMap<i32, usize>,
    kept: VecDeque<Delivery>,
    until: Option<tokio::time::Instant>,
}

/// How long [`Gated`] keeps deliveries at most (the assertions then decide).
const GATE: Duration = Duration::from_secs(60);

impl<S> Gated<S> {
    fn new(inner: S, quota: usize, open: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self {
            inner,
            quota,
            open: Box::new(open),
            given: HashMap::new(),
            kept: VecDeque::new(),
            until: None,
        }
    }
}

#[async_trait]
impl<S: Source> Source for Gated<S> {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let expired = self
                .until
                .is_some_and(|until| tokio::time::Instant::now() >= until);
            if (self.open)() || expired {
                if let Some(kept) = self.kept.pop_front() {
                    return Ok(Some(kept));
                }
                return self.inner.next().await;
            }
            // The Kafka source's `next` is cancel-safe: look at the gate
            // again every 50 ms.
            let Ok(next) = tokio::time::timeout(Duration::from_millis(50), self.inner.next()).await
            else {
                continue;
            };
            let Some(delivery) = next? else {
                return Ok(None);
            };
            let given = self
                .given
                .entry(delivery.meta.partition.unwrap_or(-1))
                .or_default();
            if *given < self.quota {
                *given += 1;
                return Ok(Some(delivery));
            }
            if self.until.is_none() {
                self.until = Some(tokio::time::Instant::now() + GATE);
            }
            self.kept.push_back(delivery);
        }
    }

    // A wrapper forwards what the engine tells the source (see `Source`).
    async fn close(&mut self) {
        self.inner.close().await
    }

    async fn resume_from(&mut self, lookup: Arc<dyn idemq::source::OffsetLookup>) {
        self.inner.resume_from(lookup).await
    }

    fn settle_out_of_order(&mut self, per_partition: usize) {
        self.inner.settle_out_of_order(per_partition)
    }
}

/// Runs until `outcomes` deliveries were settled (or 60 s), then stops.
async fn run_for<S: WatermarkStore>(
    consumer: &Consumer<S>,
    source: impl Source,
    options: WatermarkOptions,
    seen: &Tally,
    outcomes: usize,
) -> Summary {
    let stop = support::wait_until(Duration::from_secs(60), || seen.total() >= outcomes);
    consumer
        .run_watermarked_until(source, options, async {
            stop.await;
        })
        .await
        .unwrap()
}

fn counting<B: Backend>(
    ledger: &Ledger<B>,
    name: &str,
    plan: &Arc<Plan>,
) -> (Consumer<B::S>, Tally) {
    let seen = Tally::default();
    (seen.build(ledger.consumer(name, plan)), seen)
}

async fn a_restart_seeks_past_the_watermark_and_fetches_nothing_applied<B: Backend>() {
    let ledger = Ledger::<B>::new().await;
    let topic = new_topic().await;
    let (messages, _) = payments(24, serde_json::json!({}));
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let options = WatermarkOptions::default();
    let group = support::unique("g");
    let parts = PARTITIONS as u64;

    // A applies the first record of each partition and dies before any
    // offset commit reaches Kafka: the group's offsets stay behind the
    // watermarks.
    let (a, seen) = counting(&ledger, "wm", &plan);
    let swallowing = SwallowAcks::new(source(&topic, &group).await, |_| true);
    let first = run_for(&a, swallowing, options, &seen, PARTITIONS as usize).await;
    assert_eq!(first.count(OutcomeKind::Processed), parts, "{first}");

    // B, same group, restarted: every partition is assigned at its
    // watermark, so the applied records are neither fetched nor handled.
    let (b, seen) = counting(&ledger, "wm", &plan);
    let b_source = source(&topic, &group).await;
    let b_counters = b_source.counters();
    let second = run_for(&b, b_source, options, &seen, 24 - PARTITIONS as usize).await;
    assert_eq!(second.count(OutcomeKind::Processed), 24 - parts, "{second}");
    assert_eq!(second.count(OutcomeKind::Duplicate), 0, "{second}");
    assert_eq!(b_counters.positioned_at_assignment(), parts);
    assert_eq!(
        b_counters.fetched(),
        24 - parts,
        "records below the watermark were fetched"
    );
    assert_eq!(b_counters.dropped_below_watermark(), 0);
    assert_eq!(
        plan.calls.load(Ordering::SeqCst),
        24,
        "the handler ran once per record"
    );

    // C, a new group (an offset reset to the earliest record) that joined
    // and fetched everything before its run began: the run seeks its
    // partitions past the watermarks and drops what was buffered.
    let (c, seen) = counting(&ledger, "wm", &plan);
    let c_source = source(&topic, &support::unique("g")).await;
    let c_counters = c_source.counters();
    assert!(
        support::wait_until(Duration::from_secs(60), || c_counters.fetched() >= 24).await,
        "C fetched {} records",
        c_counters.fetched()
    );
    let stop = async {
        assert!(
            support::wait_until(Duration::from_secs(30), || c_counters.sought() >= parts).await
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let reset = c
        .run_watermarked_until(c_source, options, stop)
        .await
        .unwrap();
    assert_eq!(seen.total(), 0, "{reset}");
    assert_eq!(c_counters.sought(), parts);
    assert_eq!(c_counters.dropped_below_watermark(), 24);
    assert_eq!(
        c_counters.fetched(),
        24,
        "nothing fetched again after the seek"
    );

    // D, another new group over a source that cannot seek: everything is
    // delivered again and the watermark answers every record.
    let (d, seen) = counting(&ledger, "wm", &plan);
    let d_source = NoSeek(source(&topic, &support::unique("g")).await);
    let replay = run_for(&d, d_source, options, &seen, 24).await;
    assert_eq!(replay.count(OutcomeKind::Duplicate), 24, "{replay}");
    assert_eq!(replay.count(OutcomeKind::Processed), 0, "{replay}");
    assert_eq!(
        plan.calls.load(Ordering::SeqCst),
        24,
        "the handler never ran again"
    );

    ledger.assert_applied_once(24, (1..=24).sum()).await;
    // O(partitions) state: no inbox rows, one watermark per partition.
    assert_eq!(ledger.inbox_rows().await, 0);
    let mut next = 0;
    for p in 0..PARTITIONS {
        next += ledger
            .store
            .watermark("wm", &topic, p)
            .await
            .unwrap()
            .unwrap_or(0);
    }
    assert_eq!(next, 24, "the watermarks sum to the records applied");
    ledger.cleanup().await;
}

/// A consumer killed inside its handler, with a delivery in flight on each
/// partition (its task is aborted and its store's connections closed, as
/// when its process dies): the restarted member of the same group starts
/// every partition at its watermark, handles again only what was in flight,
/// and loses nothing.
async fn a_consumer_killed_inside_its_handler_loses_nothing<B: Backend>() {
    const N: usize = 30;
    let ledger = Ledger::<B>::new().await;
    let topic = new_topic().await;
    let (messages, _) = payments(N, serde_json::json!({ "sleep_ms": 50 }));
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let options = WatermarkOptions::default();
    let group = support::unique("g");

    let dying = ledger.another_store().await;
    let a = ledger
        .consumer_on(dying.clone(), "wm-kill", &plan)
        .build()
        .unwrap();
    let a_source = source(&topic, &group).await;
    let run = tokio::spawn(async move { a.run_watermarked(a_source, options).await });
    assert!(
        support::wait_until(Duration::from_secs(60), || plan
            .calls
            .load(Ordering::SeqCst)
            >= 8)
        .await,
        "the first member handled too little"
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    B::close(&dying).await;
    let applied = ledger.rows().await.len();
    let calls = plan.calls.load(Ordering::SeqCst) as usize;
    assert!(
        (1..N).contains(&applied),
        "{applied} applied before the kill"
    );
    assert!(
        calls - applied <= PARTITIONS as usize,
        "{calls} calls, {applied} applied: more in flight than partitions"
    );

    let (b, seen) = counting(&ledger, "wm-kill", &plan);
    let b_source = source(&topic, &group).await;
    let b_counters = b_source.counters();
    let rest = run_for(&b, b_source, options, &seen, N - applied).await;
    assert_eq!(
        rest.count(OutcomeKind::Processed),
        (N - applied) as u64,
        "{rest}"
    );
    assert_eq!(rest.count(OutcomeKind::Duplicate), 0, "{rest}");
    assert_eq!(
        b_counters.fetched(),
        (N - applied) as u64,
        "records below the watermark were fetched"
    );
    assert_eq!(
        plan.calls.load(Ordering::SeqCst) as usize,
        calls + N - applied,
        "the handler ran again for more than what was in flight"
    );
    ledger.assert_applied_once(N, (1..=N as i64).sum()).await;
    ledger.cleanup().await;
}

async fn key_dedup_on_top_catches_producer_retries<B: Backend>() {
    let ledger = Ledger::<B>::new().await;
    let topic = new_topic().await;
    let workload = support::workload(20, 1);
    publish(&topic, &workload.messages).await;
    let plan = Arc::new(Plan::default());
    let (consumer, seen) = counting(&ledger, "wm-keys", &plan);
    let mut options = WatermarkOptions::default();
    options.dedup_keys = true;
    let total = workload.messages.len();
    let summary = run_for(
        &consumer,
        source(&topic, &support::unique("g")).await,
        options,
        &seen,
        total,
    )
    .await;
    assert_eq!(summary.count(OutcomeKind::Processed), 20, "{summary}");
    assert_eq!(
        summary.count(OutcomeKind::Duplicate) as usize,
        workload.duplicates,
        "{summary}"
    );
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "{summary}");
    ledger.assert_exactly_once(&workload.expected).await;
    // The dead-lettered record moved the watermark too: a re-read from the
    // start (over a source that does not seek) finds every record applied
    // or dead-lettered.
    let (again, seen) = counting(&ledger, "wm-keys", &plan);
    let reread = run_for(
        &again,
        NoSeek(source(&topic, &support::unique("g")).await),
        options,
        &seen,
        total,
    )
    .await;
    assert_eq!(
        reread.count(OutcomeKind::Duplicate) as usize,
        total,
        "{reread}"
    );
    let letters = ledger
        .store
        .dead_letters(None, 0, 10_000)
        .await
        .expect("read dead letters");
    assert_eq!(letters.len(), 1, "{letters:?}");
    ledger.cleanup().await;
}

/// The first claims of many partitions at once (each creates its
/// partition's watermark row) all succeed and move their watermarks: none
/// fails for another's sake (on MariaDB, locking reads of missing rows took
/// gap locks under which the row inserts deadlocked).
async fn first_claims_of_many_partitions_at_once<B: Backend>() {
    const MANY: i32 = 8;
    let ledger = Ledger::<B>::new().await;
    let store = &ledger.store;
    let topic = support::unique("wm");
    let shared = std::sync::Arc::new(store.clone());
    let claims = (0..MANY).map(|p| {
        let (topic, shared) = (&topic, &shared);
        async move {
            let key = format!("{topic}-{p}@5");
            let claim = MemberClaim::Record(RecordClaim {
                at: RecordPosition {
                    topic,
                    partition: p,
                    offset: 5,
                },
                identity: ClaimRequest {
                    consumer: "wm-first",
                    key: &key,
                    fingerprint: "",
                    lease: std::time::Duration::from_secs(30),
                },
                claim_key: false,
                position: None,
                skip_to: None,
            });
            let mut unit = shared.begin(UnitOptions::new(
                false,
                std::time::Duration::from_secs(30),
                idemq::InFlightPolicy::Reject,
            ));
            let answers = unit.claim(std::slice::from_ref(&claim)).await?;
            assert_eq!(
                answers,
                [MemberAnswer::New],
                "partition {p}: a first claim found a watermark"
            );
            let done = [Completion {
                member: 0,
                result: None,
                watermark: Some(6),
            }];
            unit.complete(&[claim], &done).await.map(|_| ())
        }
    });
    let results = futures_util::future::join_all(claims).await;
    for (p, result) in (0..MANY).zip(results) {
        result.unwrap_or_else(|e| panic!("partition {p}: the first claim failed: {e}"));
        assert_eq!(
            store.watermark("wm-first", &topic, p).await.unwrap(),
            Some(6)
        );
    }
    ledger.cleanup().await;
}

async fn a_rebalance_with_messages_in_flight<B: Backend>(options: WatermarkOptions) {
    let ledger = Ledger::<B>::new().await;
    let topic = new_topic().await;
    const RECORDS: usize = 120;
    let (messages, _) = payments(RECORDS, serde_json::json!({ "sleep_ms": 150 }));
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let group = support::unique("g");
    let seen = Tally::default();
    let build = || seen.build(ledger.consumer("wm-group", &plan));
    let (a, b) = (build(), build());
    let stop = Arc::new(tokio::sync::Notify::new());
    // The first member applies at most 4 records of each partition until the
    // second one is assigned partitions (a condition, not a race between the
    // group join and the first member's pace): whatever it is given, records
    // are left to it, and the first member's kept deliveries are in flight
    // when its partitions are revoked.
    let b_assigned: Arc<std::sync::OnceLock<Arc<KafkaCounters>>> = Arc::default();
    let first = source(&topic, &group).await;
    let a_counters = first.counters();
    let first = Gated::new(first, 4, {
        let b_assigned = Arc::clone(&b_assigned);
        move || {
            b_assigned
                .get()
                .is_some_and(|b| b.positioned_at_assignment() >= 1)
        }
    });
    let run_a = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            a.run_watermarked_until(first, options, stop.notified_owned())
                .await
        }
    });
    assert!(
        support::wait_until(Duration::from_secs(60), || seen.total() >= 5).await,
        "the first member settled nothing"
    );
    // Every partition has a stored position before the second member joins,
    // so whichever partitions it is given, it can start them there (on a
    // loaded machine the first settled records may all be of one partition).
    let store = &ledger.store;
    let mut positioned = false;
    for _ in 0..600 {
        let mut all = true;
        for p in 0..PARTITIONS {
            all &= store
                .watermark("wm-group", &topic, p)
                .await
                .unwrap()
                .is_some();
        }
        if all {
            positioned = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        positioned,
        "the first member stored no position for some partition"
    );
    let second = source(&topic, &group).await;
    let b_counters = second.counters();
    let _ = b_assigned.set(Arc::clone(&b_counters));
    let run_b = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            b.run_watermarked_until(second, options, stop.notified_owned())
                .await
        }
    });
    let rows = ledger
        .wait_for(Duration::from_secs(90), |rows| rows.len() >= RECORDS)
        .await;
    assert_eq!(rows.len(), RECORDS, "lost records");
    // Redeliveries still on their way are answered (or left to the next
    // member) by the graceful stop; nothing below depends on them.
    stop.notify_waiters();
    let (sa, sb) = (run_a.await.unwrap().unwrap(), run_b.await.unwrap().unwrap());
    assert!(
        sb.count(OutcomeKind::Processed) + sb.count(OutcomeKind::Duplicate) > 0,
        "{sa} / {sb}"
    );
    // The rebalance assigned partitions with watermarks to both members,
    // which started them there.
    assert!(
        b_counters.positioned_at_assignment() >= 1,
        "B started no partition at its watermark"
    );
    assert!(
        a_counters.positioned_at_assignment() >= 1,
        "A started no partition at its watermark after the rebalance"
    );
    ledger
        .assert_applied_once(RECORDS, (1..=RECORDS as i64).sum())
        .await;
    ledger.cleanup().await;
}

/// Watermark options with records of a partition applied concurrently.
fn concurrent() -> WatermarkOptions {
    let mut options = WatermarkOptions::default();
    options.concurrent_records = true;
    options
}

/// With concurrent records, one partition's first record sleeps in its
/// handler while the 29 after it are applied; the watermark stays at the
/// first record (it never passes one in flight); the consumer is then
/// killed. The restarted member starts the partition at the watermark,
/// applies the first record and finds the other 29 applied by their
/// position rows: none skipped, none applied twice. (Not on SQLite, whose
/// one writer at a time runs nothing beside the slow record.)
async fn concurrent_records_never_move_the_watermark_past_one_in_flight<B: Backend>() {
    const N: usize = 30;
    let ledger = Ledger::<B>::new().await;
    if ledger.url.starts_with("sqlite:") {
        // SQLite has one writer at a time: the slow record's transaction
        // holds the write lock through its handler, and the records after
        // it wait for it. Nothing of the partition runs beside it (the
        // rebalance scenario runs concurrent records on SQLite too).
        ledger.cleanup().await;
        return;
    }
    let topic = support::unique("wm");
    assert!(create_topic(BROKERS, &topic, 1).await.unwrap());
    let (mut messages, _) = payments(N - 1, serde_json::json!({}));
    messages.insert(
        0,
        support::payment(
            "m-slow",
            "p-slow",
            N as i64,
            serde_json::json!({ "sleep_ms": 4000 }),
        ),
    );
    publish(&topic, &messages).await;
    let plan = Arc::new(Plan::default());
    let group = support::unique("g");
    let options = concurrent();

    let dying = ledger.another_store().await;
    let a = ledger
        .consumer_on(dying.clone(), "wm-concurrent", &plan)
        .concurrency(8)
        .build()
        .unwrap();
    let a_source = source(&topic, &group).await;
    let run = tokio::spawn(async move { a.run_watermarked(a_source, options).await });
    let rows = ledger
        .wait_for(Duration::from_secs(60), |rows| rows.len() >= N - 1)
        .await;
    assert_eq!(
        rows.len(),
        N - 1,
        "the records after the slow one: {rows:?}"
    );
    // The ledger's keys are the records' positions (no key dedup).
    let slow = format!("{topic}-0@0");
    assert!(
        rows.iter().all(|(key, _)| *key != slow),
        "the slow record must still be in its handler: {rows:?}"
    );
    let watermark = ledger
        .store
        .watermark("wm-concurrent", &topic, 0)
        .await
        .unwrap();
    assert!(
        watermark.is_none_or(|w| w == 0),
        "the watermark {watermark:?} passed the record in flight at offset 0"
    );
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    B::close(&dying).await;

    let (b, seen) = counting(&ledger, "wm-concurrent", &plan);
    let rest = run_for(&b, source(&topic, &group).await, options, &seen, N).await;
    let applied = rows.len() as u64;
    assert_eq!(
        rest.count(OutcomeKind::Processed),
        N as u64 - applied,
        "{rest}"
    );
    assert_eq!(rest.count(OutcomeKind::Duplicate), applied, "{rest}");
    ledger.assert_applied_once(N, (1..=N as i64).sum()).await;
    assert_eq!(
        ledger
            .store
            .watermark("wm-concurrent", &topic, 0)
            .await
            .unwrap(),
        Some(N as i64),
        "every record settled: the watermark is past the last one"
    );
    ledger.cleanup().await;
}
