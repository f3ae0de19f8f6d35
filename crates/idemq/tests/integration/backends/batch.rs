//! Batch mode ([`Consumer::run_batched`]) over the SQL stores: the same
//! exactly-once scenarios as per-message mode, with duplicates inside and
//! across batches, a failing message in the middle of a batch, and crashes
//! before and after the batch's commit.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use idemq::engine::BatchOptions;
use idemq::store::{Claim, ClaimRequest, Store, StoreAdmin, UnitStore};
use idemq::{Message, OutcomeKind, StoreErrorKind};

use crate::backends::backend::{unmigrated, Backend, Plan, SqlTestStore};
use crate::backends::scenarios::{consumer, failing, msg, queue_of, LosingAcks};

macro_rules! batch_scenarios {
    ($backend:ty) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn exactly_once_with_duplicates_inside_and_across_batches() {
            crate::backends::batch::exactly_once_with_duplicates_inside_and_across_batches::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_failing_message_rolls_back_alone() {
            crate::backends::batch::a_failing_message_rolls_back_alone::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_first_copy_in_order_wins_across_batches_at_concurrency_8() {
            crate::backends::batch::the_first_copy_in_order_wins_across_batches::<$backend>(8).await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn the_first_copy_in_order_wins_across_batches_at_concurrency_64() {
            crate::backends::batch::the_first_copy_in_order_wins_across_batches::<$backend>(64).await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retry_in_place_inside_a_batch_keeps_only_the_last_calls_writes() {
            crate::backends::batch::a_retry_in_place_inside_a_batch::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_crash_before_the_commit_applies_the_batch_once() {
            crate::backends::batch::a_crash_before_the_commit_applies_the_batch_once::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn lost_acks_after_the_commit_are_duplicates() {
            crate::backends::batch::lost_acks_after_the_commit_are_duplicates::<$backend>().await
        }
    };
}
pub(crate) use batch_scenarios;

macro_rules! batch_suite {
    ($backend:ty) => {
        mod batch {
            crate::backends::batch::batch_scenarios!($backend);
        }
        mod schema {
            #[tokio::test]
            async fn missing_tables_are_a_kind_of_error_with_its_cause() {
                crate::backends::batch::missing_tables_are_a_kind_of_error_with_its_cause::<$backend>().await
            }
        }
    };
    (set_based: $backend:ty) => {
        /// The batch scenarios with a handler that writes a batch's rows
        /// in one statement ([`idemq::Handler::handle_batch`]).
        mod set_based {
            crate::backends::batch::batch_scenarios!($backend);
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_the_database_refuses_fails_the_batch_and_runs_alone() {
                crate::backends::batch::a_row_the_database_refuses_runs_alone::<$backend>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_of_new_keys_is_one_handler_call() {
                crate::backends::batch::a_batch_of_new_keys_is_one_handler_call::<$backend>().await
            }
        }
    };
}
pub(crate) use batch_suite;

/// A store whose tables were never created answers every call with a
/// [`StoreErrorKind::MissingSchema`] error whose source is the database's
/// own error; after the migration the same store works.
pub async fn missing_tables_are_a_kind_of_error_with_its_cause<B: Backend>()
where
    B::S: SqlTestStore,
{
    let (store, _prefix, _dir) = unmigrated::<B::S>().await;
    let req = ClaimRequest {
        consumer: "c",
        key: "k",
        fingerprint: "f",
        lease: Duration::from_secs(5),
    };
    let claim = store
        .claim(&req)
        .await
        .err()
        .expect("no tables: the claim fails");
    assert_eq!(claim.kind(), StoreErrorKind::MissingSchema, "{claim}");
    let cause = std::error::Error::source(&claim).expect("the database error is the source");
    assert!(cause.downcast_ref::<sqlx::Error>().is_some(), "{cause:?}");
    let stats = store.stats().await.expect_err("no tables: stats fail");
    assert_eq!(stats.kind(), StoreErrorKind::MissingSchema, "{stats}");
    store.migrate().await.expect("migrate");
    let Claim::New(tx) = store.claim(&req).await.expect("claim after migrate") else {
        panic!("a new key after the migration")
    };
    store.rollback(tx).await.expect("rollback");
}

/// Keys reused with another amount on the very next message, in batch
/// mode with many batches in flight: a later copy waits for the earlier
/// copy's batch, so the first copy in the source's order is the one
/// applied, across batches as inside one.
pub async fn the_first_copy_in_order_wins_across_batches<B: Backend>(concurrency: usize)
where
    B::S: UnitStore,
{
    crate::backends::scenarios::first_copies_win::<B>(concurrency, |consumer, queue| {
        Box::pin(async move { consumer.run_batched(queue.source(), options(20)).await })
    })
    .await
}

fn options(max_size: usize) -> BatchOptions {
    BatchOptions::new(max_size, Duration::from_millis(5))
}

/// Counts the deliveries `inner` hands out.
struct Counting<S> {
    inner: S,
    handed: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl<S: idemq::source::Source> idemq::source::Source for Counting<S> {
    async fn next(&mut self) -> Result<Option<idemq::source::Delivery>, idemq::SourceError> {
        let delivery = self.inner.next().await?;
        if delivery.is_some() {
            self.handed.fetch_add(1, Ordering::SeqCst);
        }
        Ok(delivery)
    }
}

/// Batches of `n`, for a test that queues `n` new keys and needs them in
/// one batch: the batch closes when its `n`-th member arrives (or the source
/// ends), never on the wait. (With [`options`], 5 ms after the first member,
/// a loaded machine can split them: the engine promises no more.)
fn one_batch(n: usize) -> BatchOptions {
    BatchOptions::new(n, Duration::from_secs(60))
}

pub async fn exactly_once_with_duplicates_inside_and_across_batches<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let mut messages = Vec::new();
    let mut expected_sum = 0;
    for i in 0..600i64 {
        // Back-to-back copies land in one batch; the shuffled half spreads
        // copies over batches and workers.
        for _ in 0..1 + fastrand::usize(..3) {
            messages.push(msg(&format!("key-{i}"), i));
        }
        expected_sum += i;
    }
    let mut tail = messages.split_off(messages.len() / 2);
    fastrand::shuffle(&mut tail);
    messages.extend(tail);
    let total = messages.len() as u64;
    let queue = queue_of(messages);
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
            let source = queue.source();
            tokio::spawn(async move { consumer.run_batched(source, options(50)).await })
        })
        .collect();
    let (mut processed, mut duplicates, mut retried) = (0, 0, 0);
    for w in workers {
        let summary = tokio::time::timeout(Duration::from_secs(300), w)
            .await
            .expect("workers finish")
            .unwrap()
            .unwrap();
        processed += summary.count(OutcomeKind::Processed);
        duplicates += summary.count(OutcomeKind::Duplicate);
        retried += summary.count(OutcomeKind::RetryLater);
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 0);
        assert_eq!(summary.count(OutcomeKind::Conflict), 0);
    }
    assert_eq!(processed, 600);
    assert_eq!(processed + duplicates, total, "{retried} retried");
    assert_eq!(queue.acked(), total);
    let ledger = backend.ledger().await;
    assert_eq!(ledger.len(), 600, "one effect per distinct key");
    assert_eq!(ledger.iter().map(|(_, a)| a).sum::<i64>(), expected_sum);
    backend.cleanup().await;
}

pub async fn a_failing_message_rolls_back_alone<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let flaky = Message::new(r#"{"k":"flaky","amount":5,"fail":"retry","fail_times":1}"#);
    let queue = queue_of([
        msg("a", 1),
        failing("bad", "permanent"),
        flaky,
        msg("a", 1), // a copy of "a" in the same batch
        failing("panics", "panic"),
        msg("c", 3),
    ]);
    let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
    let summary = consumer
        .run_batched(queue.source(), options(10))
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 3, "a, c, flaky");
    assert_eq!(summary.count(OutcomeKind::Duplicate), 1);
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 2, "bad, panics");
    // The handler writes its row before failing: the savepoint took it back.
    let mut ledger = backend.ledger().await;
    ledger.sort();
    assert_eq!(
        ledger,
        vec![("a".into(), 1), ("c".into(), 3), ("flaky".into(), 5)]
    );
    let letters = backend.store().dead_letters(None, 0, 10).await.unwrap();
    let mut reasons: Vec<_> = letters.iter().map(|l| l.reason.as_str()).collect();
    reasons.sort();
    assert_eq!(reasons, ["permanent_failure", "retries_exhausted"]);
    assert_eq!(queue.acked(), 6);
    backend.cleanup().await;
}

/// A retry in place inside a batch nests its savepoint in the member's:
/// the failed calls' rows go, the batch's other members stay, and a member
/// that fails every call in place still rolls back alone.
pub async fn a_retry_in_place_inside_a_batch<B: Backend>()
where
    B::S: UnitStore,
    <B::S as Store>::Tx: idemq::layers::Rewind,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let flaky = Message::new(r#"{"k":"flaky","amount":5,"fail":"retry","fail_times":2}"#);
    let queue = queue_of([msg("a", 1), flaky, failing("poison", "retry"), msg("c", 3)]);
    let consumer = consumer(&backend, "ledger", &plan)
        .layer(idemq::layers::RetryLayer::new(3, Duration::from_millis(1)))
        .build()
        .unwrap();
    let summary = consumer
        .run_batched(queue.source(), options(10))
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 3, "a, c, flaky");
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "poison");
    let mut ledger = backend.ledger().await;
    ledger.sort();
    assert_eq!(
        ledger,
        vec![("a".into(), 1), ("c".into(), 3), ("flaky".into(), 5)]
    );
    let poison = backend.store().inspect("ledger", "poison").await.unwrap();
    assert_eq!(poison.dead_letters[0].reason, "retries_exhausted");
    assert_eq!(
        poison.dead_letters[0].attempts, 3,
        "3 deliveries of 3 calls"
    );
    assert_eq!(queue.acked(), 4);
    backend.cleanup().await;
}

pub async fn a_crash_before_the_commit_applies_the_batch_once<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let hang = Message::new(r#"{"k":"h","amount":7,"fail":"hang"}"#);
    let queue = queue_of([msg("x", 1), msg("y", 2), hang, msg("z", 3)]);
    let first = consumer(&backend, "ledger", &plan).build().unwrap();
    let source = queue.source();
    // The members before h (in the order the run loop formed the batch, not
    // necessarily x y h z) ran in the batch's transaction; h hangs; the
    // worker dies.
    let crashed = tokio::spawn(async move { first.run_batched(source, one_batch(4)).await });
    let started = std::time::Instant::now();
    while !plan.has_hung("h") {
        assert!(started.elapsed() < Duration::from_secs(10), "h never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = plan.calls.load(Ordering::SeqCst);
    crashed.abort();
    let _ = crashed.await;
    assert!(backend.ledger().await.is_empty(), "nothing committed");

    let second = consumer(&backend, "ledger", &plan).build().unwrap();
    let summary = second
        .run_batched(queue.source(), one_batch(4))
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 4);
    let mut ledger = backend.ledger().await;
    ledger.sort();
    assert_eq!(
        ledger,
        vec![
            ("h".into(), 7),
            ("x".into(), 1),
            ("y".into(), 2),
            ("z".into(), 3)
        ]
    );
    // Every key ran once more; what ran before the crash was rolled back.
    assert_eq!(plan.calls.load(Ordering::SeqCst), before + 4);
    assert_eq!(queue.acked(), 4);
    backend.cleanup().await;
}

pub async fn lost_acks_after_the_commit_are_duplicates<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let queue = queue_of((0..5).map(|i| msg(&format!("k{i}"), i)));
    let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
    let summary = consumer
        .run_batched(
            LosingAcks {
                inner: queue.source(),
                lose: 5,
            },
            options(10),
        )
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 5);
    assert_eq!(summary.count(OutcomeKind::Duplicate), 5, "the redeliveries");
    assert_eq!(backend.ledger().await.len(), 5);
    assert_eq!(queue.acked(), 5);
    backend.cleanup().await;
}

/// A set-based handler's multi-row statement fails as a whole when the
/// database refuses one row (NULL in a NOT NULL column): the batch is rolled
/// back and runs again one message at a time, so the refused message is
/// dead-lettered alone and the others are applied once.
pub async fn a_row_the_database_refuses_runs_alone<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let refused = Message::new(r#"{"k":"refused","amount":null}"#);
    let queue = queue_of([msg("a", 1), msg("b", 2), refused, msg("c", 3), msg("a", 1)]);
    let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
    // a, b, refused and c in one batch. The copy of a waits in its key lane
    // for a's batch, then for a batch of its own to fill: the stop, once all
    // five were handed out and the first four settled, closes it at once.
    let handed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let source = Counting {
        inner: queue.source(),
        handed: Arc::clone(&handed),
    };
    let settled = {
        let queue = queue.clone();
        async move {
            let started = std::time::Instant::now();
            while handed.load(Ordering::SeqCst) < 5 || queue.acked() < 4 {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "the first batch never settled"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let summary = consumer
        .run_batched_until(source, one_batch(4), settled)
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 3, "a, b, c");
    assert_eq!(summary.count(OutcomeKind::Duplicate), 1, "the copy of a");
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1, "refused");
    assert!(backend.batch_calls() >= 1, "the batch was tried at once");
    let ledger = backend.ledger().await;
    assert_eq!(
        ledger,
        vec![("a".into(), 1), ("b".into(), 2), ("c".into(), 3)]
    );
    let refused = backend.store().inspect("ledger", "refused").await.unwrap();
    assert_eq!(refused.dead_letters[0].reason, "permanent_failure");
    assert_eq!(queue.acked(), 5);
    backend.cleanup().await;
}

/// Without failures, the new keys of a batch reach the handler in one
/// call, and each gets its own stored result.
pub async fn a_batch_of_new_keys_is_one_handler_call<B: Backend>()
where
    B::S: UnitStore,
{
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let queue = queue_of((0..40).map(|i| msg(&format!("k{i}"), i)));
    let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
    // A batch of 40 forms from the 40 queued messages (it closes at its 40th
    // member, not on the wait).
    let summary = consumer
        .run_batched(queue.source(), one_batch(40))
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 40);
    assert_eq!(backend.batch_calls(), 1, "one call for 40 new keys");
    assert_eq!(backend.ledger().await.len(), 40);
    let record = backend.store().inspect("ledger", "k7").await.unwrap();
    assert_eq!(
        record.inbox.and_then(|r| r.result),
        Some(serde_json::json!({ "amount": 7 }))
    );
    backend.cleanup().await;
}
