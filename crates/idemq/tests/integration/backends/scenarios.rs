//! The scenarios, generic over [`Backend`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::source::queue::{MemoryQueue, QueueSource};
use idemq::source::{Acknowledger, Delivery, Source};
use idemq::store::{now_ms, StoreAdmin};
use idemq::{
    Consumer, ConsumerBuilder, KeySpec, Message, Outcome, OutcomeKind, RetryPolicy, SourceError,
    Summary,
};

use crate::backends::backend::{Backend, Plan};

macro_rules! suite {
    ($backend:ty) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn exactly_once_under_concurrency() {
            crate::backends::scenarios::exactly_once_under_concurrency::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn retryable_failure_rolls_back_and_retries_once() {
            crate::backends::scenarios::retryable_failure_rolls_back_and_retries_once::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn poison_messages_are_dead_lettered() {
            crate::backends::scenarios::poison_messages_are_dead_lettered::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_message_dead_lettered_again_keeps_one_letter() {
            crate::backends::scenarios::a_message_dead_lettered_again_keeps_one_letter::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_before_commit_is_redelivered_and_applied_once() {
            crate::backends::scenarios::crash_before_commit_is_redelivered_and_applied_once::<$backend>()
                .await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_message_that_keeps_crashing_hits_the_delivery_limit() {
            crate::backends::scenarios::a_message_that_keeps_crashing_hits_the_delivery_limit::<$backend>()
                .await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_after_commit_before_ack_is_a_duplicate() {
            crate::backends::scenarios::crash_after_commit_before_ack_is_a_duplicate::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn conflicts_are_reported_and_results_replayed() {
            crate::backends::scenarios::conflicts_are_reported_and_results_replayed::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn bad_input_is_dead_lettered_with_its_reason() {
            crate::backends::scenarios::bad_input_is_dead_lettered_with_its_reason::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn pruning_removes_only_rows_past_the_window() {
            crate::backends::scenarios::pruning_removes_only_rows_past_the_window::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn migrations_are_idempotent_under_concurrency() {
            crate::backends::scenarios::migrations_are_idempotent_under_concurrency::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn the_first_copy_in_order_wins_at_concurrency_8() {
            crate::backends::scenarios::the_first_copy_in_order_wins::<$backend>(8).await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn the_first_copy_in_order_wins_at_concurrency_64() {
            crate::backends::scenarios::the_first_copy_in_order_wins::<$backend>(64).await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_retry_in_place_keeps_only_the_last_calls_writes() {
            crate::backends::scenarios::a_retry_in_place_keeps_only_the_last_calls_writes::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_handler_past_its_timeout_is_rolled_back_and_retried() {
            crate::backends::scenarios::a_handler_past_its_timeout_is_rolled_back_and_retried::<$backend>()
                .await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn layers_wrap_the_handler_in_the_order_added() {
            crate::backends::scenarios::layers_wrap_the_handler_in_the_order_added::<$backend>().await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_later_copy_never_overtakes_one_waiting_for_its_retry() {
            crate::backends::scenarios::a_later_copy_never_overtakes_one_waiting_for_its_retry::<$backend>()
                .await
        }
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn the_store_answers_a_ping() {
            let backend = <$backend as crate::backends::backend::Backend>::fresh().await;
            idemq::store::StoreAdmin::ping(&crate::backends::backend::Backend::store(&backend))
                .await
                .expect("ping");
            crate::backends::backend::Backend::cleanup(backend).await;
        }
    };
}
pub(crate) use suite;

pub(crate) fn fast_retries(max_attempts: u32) -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(max_attempts)
        .with_initial_backoff(Duration::from_millis(5))
        .with_max_backoff(Duration::from_millis(20))
        .with_jitter(0.0)
        .with_busy_delay(Duration::from_millis(5))
}

pub(crate) fn consumer<B: Backend>(
    backend: &B,
    name: &str,
    plan: &Arc<Plan>,
) -> ConsumerBuilder<B::S> {
    Consumer::builder(name, backend.store())
        .key(KeySpec::json("/k"))
        .handler(backend.handler(Arc::clone(plan)))
        .retry(fast_retries(3))
}

pub(crate) fn msg(key: &str, amount: i64) -> Message {
    Message::new(serde_json::json!({ "k": key, "amount": amount }).to_string())
}

pub(crate) fn failing(key: &str, fail: &str) -> Message {
    Message::new(serde_json::json!({ "k": key, "amount": 1, "fail": fail }).to_string())
}

pub(crate) fn queue_of(messages: impl IntoIterator<Item = Message>) -> MemoryQueue {
    let queue = MemoryQueue::new("test");
    for m in messages {
        queue.push(m);
    }
    queue.close();
    queue
}

fn recorder() -> (
    Arc<Mutex<Vec<Outcome>>>,
    impl Fn(&Outcome) + Send + Sync + 'static,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    (seen, move |o: &Outcome| {
        sink.lock().unwrap().push(o.clone())
    })
}

/// How many of the retries in `seen` counted an attempt (the handler
/// failed). A retry that counts none (`attempts` 0) is one the engine may
/// report on a loaded machine without the handler failing — a transient
/// store error, or a redelivery that came back before its earlier attempt
/// released the key's lane and was deferred behind it — so tests count the
/// handler's failures with this, not all retries.
fn counted_retries(seen: &Mutex<Vec<Outcome>>) -> u64 {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|o| matches!(o, Outcome::RetryLater { attempts, .. } if *attempts > 0))
        .count() as u64
}

async fn run<B: Backend>(builder: ConsumerBuilder<B::S>, queue: &MemoryQueue) -> Summary {
    let consumer = builder.build().expect("consumer");
    tokio::time::timeout(Duration::from_secs(300), consumer.run(queue.source()))
        .await
        .expect("run finished in time")
        .expect("run")
}

pub async fn exactly_once_under_concurrency<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let mut messages = Vec::new();
    let mut expected_sum = 0;
    for i in 0..1000i64 {
        let copies = 1 + fastrand::usize(..3);
        for _ in 0..copies {
            messages.push(msg(&format!("key-{i}"), i));
        }
        expected_sum += i;
    }
    // Half the duplicates arrive back to back (racing claims), the rest anywhere.
    let mut tail = messages.split_off(messages.len() / 2);
    fastrand::shuffle(&mut tail);
    messages.extend(tail);
    let total = messages.len() as u64;
    let queue = queue_of(messages);

    let workers: Vec<_> = (0..8)
        .map(|w| {
            let consumer = consumer(&backend, "ledger", &plan)
                .concurrency(4)
                .build()
                .unwrap();
            let source = queue.source();
            tokio::spawn(async move {
                let _ = w;
                consumer.run(source).await
            })
        })
        .collect();
    let mut processed = 0;
    let mut duplicates = 0;
    for w in workers {
        let summary = tokio::time::timeout(Duration::from_secs(300), w)
            .await
            .expect("workers finish")
            .unwrap()
            .unwrap();
        processed += summary.count(OutcomeKind::Processed);
        duplicates += summary.count(OutcomeKind::Duplicate);
        assert_eq!(summary.count(OutcomeKind::DeadLettered), 0);
        assert_eq!(summary.count(OutcomeKind::Conflict), 0);
    }
    assert_eq!(processed, 1000);
    assert_eq!(processed + duplicates, total);
    assert_eq!(queue.acked(), total, "every delivery acked once settled");

    let ledger = backend.ledger().await;
    assert_eq!(ledger.len(), 1000, "one effect per distinct key");
    let mut keys: Vec<_> = ledger.iter().map(|(k, _)| k.clone()).collect();
    keys.dedup();
    assert_eq!(keys.len(), 1000);
    assert_eq!(ledger.iter().map(|(_, a)| a).sum::<i64>(), expected_sum);
    backend.cleanup().await;
}

pub async fn retryable_failure_rolls_back_and_retries_once<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let (seen, hook) = recorder();
    let flaky = Message::new(r#"{"k":"flaky","amount":5,"fail":"retry","fail_times":2}"#);
    let queue = queue_of([flaky, msg("steady", 1)]);
    let summary = run::<B>(consumer(&backend, "ledger", &plan).on_outcome(hook), &queue).await;

    assert_eq!(summary.count(OutcomeKind::Processed), 2);
    // The handler's own retryable failures, told by their text: exactly
    // two, of "flaky", in order, never counted up to max_attempts. Any
    // other retry is one the engine may report on a loaded machine without
    // counting an attempt (attempts 0): a claim or commit that failed
    // transiently, or a redelivery that came back before its earlier
    // attempt released the key's lane and was deferred behind it.
    let retries: Vec<(Option<String>, u32, String)> = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|o| match o {
            Outcome::RetryLater {
                key,
                attempts,
                error,
                ..
            } => Some((key.clone(), *attempts, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(summary.count(OutcomeKind::RetryLater), retries.len() as u64);
    let (handler, transient): (Vec<_>, Vec<_>) = retries
        .iter()
        .partition(|(_, _, error)| error.starts_with("flaky call"));
    assert_eq!(handler.len(), 2, "{retries:?}");
    for (n, (key, attempts, error)) in handler.iter().enumerate() {
        assert_eq!(key.as_deref(), Some("flaky"), "{retries:?}");
        assert!(
            error.starts_with(&format!("flaky call {}", n + 1)),
            "{retries:?}"
        );
        assert!(*attempts <= 2, "{retries:?}");
    }
    assert!(
        transient.iter().all(|(_, attempts, _)| *attempts == 0),
        "a retry that counted an attempt without the handler failing: {retries:?}"
    );
    // The handler ran for two failures and two successes, and once more
    // only for a success whose commit failed.
    let commits_failed = transient
        .iter()
        .filter(|(_, _, error)| error.starts_with("commit failed"))
        .count() as u32;
    assert_eq!(
        plan.calls.load(std::sync::atomic::Ordering::SeqCst),
        4 + commits_failed,
        "{retries:?}"
    );
    assert_eq!(
        backend.ledger().await,
        vec![("flaky".to_owned(), 5), ("steady".to_owned(), 1)],
        "the failed attempts' writes were rolled back"
    );
    let report = backend.store().inspect("ledger", "flaky").await.unwrap();
    assert!(report.inbox.is_some());
    assert!(report.attempts.is_none(), "attempts are cleared on success");
    backend.cleanup().await;
}

/// A poison message that comes back after its letter was written (the
/// consumer died before the ack) is dead-lettered again: the store keeps
/// one letter for it; another delivery of the same payload at another
/// offset is another message and gets its own; a deleted letter can be
/// written again.
pub async fn a_message_dead_lettered_again_keeps_one_letter<B: Backend>() {
    use idemq::store::{DeadLetter, Store};
    use idemq::DeadLetterReason;
    use idemq::DeliveryMeta;

    let backend = B::fresh().await;
    let store = backend.store();
    let message = failing("twice", "permanent").with_id("m-1");
    let at = |offset: i64, delivery_count: u32| DeliveryMeta {
        topic: Some("orders".into()),
        partition: Some(0),
        offset: Some(offset),
        delivery_count,
        ..DeliveryMeta::new("test")
    };
    let reason = DeadLetterReason::PermanentFailure;
    let write = |meta: DeliveryMeta| {
        let store = store.clone();
        let message = message.clone();
        let reason = reason.clone();
        async move {
            store
                .dead_letter(&DeadLetter {
                    consumer: "ledger",
                    key: Some("twice"),
                    reason: &reason,
                    error: "business rule",
                    message: &message,
                    meta: &meta,
                    attempts: 1,
                })
                .await
                .unwrap()
        }
    };
    let letters = || async { store.inspect("ledger", "twice").await.unwrap().dead_letters };

    write(at(7, 1)).await;
    write(at(7, 2)).await;
    write(at(7, 3)).await;
    assert_eq!(letters().await.len(), 1, "one letter for one message");
    write(at(8, 1)).await;
    let both = letters().await;
    assert_eq!(both.len(), 2, "another offset is another message");
    assert!(store.delete_dead_letter(both[0].id).await.unwrap());
    write(at(7, 4)).await;
    assert_eq!(
        letters().await.len(),
        2,
        "a deleted letter can be written again"
    );
    backend.cleanup().await;
}

pub async fn poison_messages_are_dead_lettered<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let (seen, hook) = recorder();
    let queue = queue_of([
        failing("poison", "retry"),
        failing("rejected", "permanent"),
        failing("buggy", "panic"),
        msg("fine", 2),
    ]);
    let summary = run::<B>(consumer(&backend, "ledger", &plan).on_outcome(hook), &queue).await;

    assert_eq!(summary.count(OutcomeKind::Processed), 1);
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 3);
    assert_eq!(
        counted_retries(&seen),
        4,
        "2 retries each for poison and buggy"
    );
    assert_eq!(
        queue.acked(),
        4,
        "dead letters are acked, nothing left behind"
    );
    assert_eq!(backend.ledger().await, vec![("fine".to_owned(), 2)]);

    let store = backend.store();
    let poison = store.inspect("ledger", "poison").await.unwrap();
    assert!(poison.inbox.is_none());
    assert!(
        poison.attempts.is_none(),
        "attempts cleared once dead-lettered"
    );
    assert_eq!(poison.dead_letters.len(), 1);
    assert_eq!(poison.dead_letters[0].reason, "retries_exhausted");
    assert_eq!(
        poison.dead_letters[0].attempts, 3,
        "attempts survived the rollbacks"
    );
    assert_eq!(poison.dead_letters[0].message, failing("poison", "retry"));

    let rejected = store.inspect("ledger", "rejected").await.unwrap();
    assert_eq!(rejected.dead_letters[0].reason, "permanent_failure");
    assert!(rejected.dead_letters[0].error.contains("business rule"));
    let buggy = store.inspect("ledger", "buggy").await.unwrap();
    assert_eq!(buggy.dead_letters[0].reason, "retries_exhausted");
    assert!(
        buggy.dead_letters[0].error.contains("panicked"),
        "{}",
        buggy.dead_letters[0].error
    );
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!(
        (stats[0].processed, stats[0].dead_letters, stats[0].failing),
        (1, 3, 0)
    );
    backend.cleanup().await;
}

pub async fn crash_before_commit_is_redelivered_and_applied_once<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let hang = Message::new(r#"{"k":"h","amount":7,"fail":"hang"}"#);
    let queue = queue_of([hang]);
    // The first worker claims, writes its effect, and dies before committing.
    let first = consumer(&backend, "ledger", &plan)
        .lease(Duration::from_millis(300))
        .build()
        .unwrap();
    let source = queue.source();
    let crashed = tokio::spawn(async move { first.run(source).await });
    let started = std::time::Instant::now();
    while !plan.has_hung("h") {
        assert!(started.elapsed() < Duration::from_secs(10), "h never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    crashed.abort();
    let _ = crashed.await;

    let second = consumer(&backend, "ledger", &plan).lease(Duration::from_millis(300));
    let summary = run::<B>(second, &queue).await;
    assert_eq!(summary.count(OutcomeKind::Processed), 1);
    assert_eq!(
        backend.ledger().await,
        vec![("h".to_owned(), 7)],
        "applied exactly once"
    );
    assert_eq!(queue.acked(), 1);
    backend.cleanup().await;
}

pub async fn a_message_that_keeps_crashing_hits_the_delivery_limit<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let queue = queue_of([Message::new(r#"{"k":"killer","amount":7,"fail":"hang"}"#)]);
    let limited = || {
        consumer(&backend, "ledger", &plan)
            .lease(Duration::from_millis(300))
            .retry(fast_retries(3).with_max_deliveries(Some(1)))
    };
    // The first delivery takes the consumer down mid-handler: no failure is counted.
    let first = limited().build().unwrap();
    let source = queue.source();
    let crashed = tokio::spawn(async move { first.run(source).await });
    let started = std::time::Instant::now();
    while !plan.has_hung("killer") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "killer never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    crashed.abort();
    let _ = crashed.await;
    // The dead consumer's lease (lease stores) is gone — released by the
    // drop or run out — before the next delivery; otherwise that delivery is
    // answered "in flight" and nacked, which counts one more delivery. (A SQL
    // claim waits for the dead transaction's rollback instead.)
    let released = std::time::Instant::now();
    while backend
        .store()
        .inspect("ledger", "killer")
        .await
        .unwrap()
        .in_flight
    {
        assert!(
            released.elapsed() < Duration::from_secs(10),
            "the dead consumer's lease stayed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let summary = run::<B>(limited(), &queue).await;
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1);
    assert!(
        backend.ledger().await.is_empty(),
        "the handler did not run again"
    );
    let report = backend.store().inspect("ledger", "killer").await.unwrap();
    assert!(report.inbox.is_none());
    assert_eq!(report.dead_letters[0].reason, "delivery_limit");
    assert_eq!(report.dead_letters[0].meta.delivery_count, 2);
    assert_eq!(report.dead_letters.len(), 1);
    backend.cleanup().await;
}

/// Loses the ack of the first `lose` deliveries, as when a consumer dies
/// between the commit and the ack: the queue redelivers them.
pub(crate) struct LosingAcks {
    pub(crate) inner: QueueSource,
    pub(crate) lose: usize,
}

struct LostAck(#[allow(dead_code)] Box<dyn Acknowledger>);

#[async_trait::async_trait]
impl Acknowledger for LostAck {
    async fn ack(self: Box<Self>) -> Result<(), SourceError> {
        Ok(()) // dropping the inner acknowledger unsettled makes the queue redeliver
    }
    async fn nack(self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        self.0.nack(delay).await
    }
}

#[async_trait::async_trait]
impl Source for LosingAcks {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        let Some(delivery) = self.inner.next().await? else {
            return Ok(None);
        };
        if self.lose == 0 {
            return Ok(Some(delivery));
        }
        self.lose -= 1;
        let (message, meta, _, acker) = delivery.into_parts();
        Ok(Some(Delivery::new(message, meta, Box::new(LostAck(acker)))))
    }
}

pub async fn crash_after_commit_before_ack_is_a_duplicate<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let queue = queue_of([msg("paid", 9)]);
    let consumer = consumer(&backend, "ledger", &plan).build().unwrap();
    let summary = consumer
        .run(LosingAcks {
            inner: queue.source(),
            lose: 1,
        })
        .await
        .unwrap();
    assert_eq!(summary.count(OutcomeKind::Processed), 1);
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        1,
        "the redelivery after the lost ack"
    );
    assert_eq!(backend.ledger().await, vec![("paid".to_owned(), 9)]);
    assert_eq!(queue.acked(), 1);
    backend.cleanup().await;
}

pub async fn conflicts_are_reported_and_results_replayed<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let queue = queue_of([msg("c", 5), msg("c", 5), msg("c", 6)]);
    let (seen, hook) = recorder();
    run::<B>(
        consumer(&backend, "ledger", &plan)
            .concurrency(1)
            .on_outcome(hook),
        &queue,
    )
    .await;

    let seen = seen.lock().unwrap().clone();
    let kinds: Vec<_> = seen.iter().map(Outcome::kind).collect();
    assert_eq!(
        kinds,
        [
            OutcomeKind::Processed,
            OutcomeKind::Duplicate,
            OutcomeKind::Conflict
        ]
    );
    let Outcome::Duplicate { record } = &seen[1] else {
        unreachable!()
    };
    assert_eq!(
        record.result,
        Some(serde_json::json!({ "amount": 5 })),
        "stored result replayed"
    );
    let report = backend.store().inspect("ledger", "c").await.unwrap();
    assert_eq!(report.dead_letters.len(), 1);
    assert_eq!(report.dead_letters[0].reason, "conflict");
    assert_eq!(report.dead_letters[0].message, msg("c", 6));
    assert_eq!(backend.ledger().await, vec![("c".to_owned(), 5)]);
    backend.cleanup().await;
}

pub async fn bad_input_is_dead_lettered_with_its_reason<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let sneaky = "k'); DROP TABLE ledger; --\"\\";
    let long_key = "x".repeat(idemq::key::MAX_KEY_BYTES + 1);
    let inputs = vec![
        (Message::new(r#"{"amount":1}"#), Some("missing_key")),
        (Message::new("not json at all"), Some("malformed_json")),
        (msg(&long_key, 1), Some("key_too_long")),
        (Message::new(r#"{"k":"","amount":1}"#), Some("empty_key")),
        (
            Message::new(r#"{"k":{"nested":1},"amount":1}"#),
            Some("invalid_key_value"),
        ),
        (
            msg("ignored", 1).with_header("event_id", vec![0xff, 0xfe]),
            Some("header_not_utf8"),
        ),
        (failing("typed", "decode"), Some("undecodable_payload")),
        (msg(sneaky, 3), None),
        (msg("Order-1", 1), None),
        (msg("order-1", 1), None),
        (msg("ключ-🔑", 4), None),
    ];
    let queue = queue_of(inputs.iter().map(|(m, _)| m.clone()));
    let builder =
        consumer(&backend, "ledger", &plan).key("header:event_id|json:/k".parse().unwrap());
    let summary = run::<B>(builder, &queue).await;
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 7);
    assert_eq!(summary.count(OutcomeKind::Processed), 4);
    assert_eq!(queue.acked(), inputs.len() as u64, "nothing lost");

    let letters = backend
        .store()
        .dead_letters(Some("ledger"), 0, 100)
        .await
        .unwrap();
    let mut got: Vec<(String, Message)> = letters
        .iter()
        .map(|d| (d.reason.clone(), d.message.clone()))
        .collect();
    let mut want: Vec<(String, Message)> = inputs
        .iter()
        .filter_map(|(m, r)| r.map(|r| (r.to_owned(), m.clone())))
        .collect();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        got, want,
        "each bad message dead-lettered whole, with its reason"
    );

    let mut expected = vec![
        ("Order-1".to_owned(), 1),
        ("order-1".to_owned(), 1),
        (sneaky.to_owned(), 3),
        ("ключ-🔑".to_owned(), 4),
    ];
    expected.sort();
    assert_eq!(
        backend.ledger().await,
        expected,
        "keys stored verbatim, case-sensitive"
    );
    backend.cleanup().await;
}

pub async fn pruning_removes_only_rows_past_the_window<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let old = queue_of((0..5).map(|i| msg(&format!("old-{i}"), 1)));
    run::<B>(consumer(&backend, "ledger", &plan), &old).await;
    let cutoff = match backend.retention_step() {
        None => {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let cutoff = now_ms();
            tokio::time::sleep(Duration::from_millis(20)).await;
            cutoff
        }
        // Retention by whole partitions: the cutoff is the start of the
        // partition the new rows go to.
        Some(step) => {
            let step = i64::try_from(step.as_millis()).unwrap();
            let next = (now_ms() / step + 1) * step;
            tokio::time::sleep(Duration::from_millis(
                u64::try_from(next - now_ms()).unwrap_or(0) + 20,
            ))
            .await;
            next
        }
    };
    let new = queue_of((0..3).map(|i| msg(&format!("new-{i}"), 1)));
    run::<B>(consumer(&backend, "ledger", &plan), &new).await;

    let store = backend.store();
    let pruned = idemq::retention::prune_before(&store, cutoff, 2, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(pruned, 5, "in batches of 2");
    assert!(store
        .inspect("ledger", "old-0")
        .await
        .unwrap()
        .inbox
        .is_none());
    assert!(store
        .inspect("ledger", "new-0")
        .await
        .unwrap()
        .inbox
        .is_some());
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].processed, 3);
    assert!(stats[0].oldest_ms.unwrap() >= cutoff);
    backend.cleanup().await;
}

pub async fn migrations_are_idempotent_under_concurrency<B: Backend>() {
    let backend = B::fresh().await;
    let (a, b) = (backend.store(), backend.store());
    let (ra, rb) = tokio::join!(a.migrate(), b.migrate());
    ra.unwrap();
    rb.unwrap();
    backend.store().migrate().await.unwrap();
    backend.cleanup().await;
}

/// Keys reused with another amount on the very next message, at high
/// concurrency in one consumer: the first copy in the source's order is the
/// one applied, every later copy is a conflict (or a duplicate when it
/// repeats the first payload), and nothing is applied twice.
pub async fn the_first_copy_in_order_wins<B: Backend>(concurrency: usize) {
    first_copies_win::<B>(concurrency, |consumer, queue| {
        Box::pin(async move { consumer.run(queue.source()).await })
    })
    .await
}

/// How [`first_copies_win`] runs a consumer over a queue.
pub(crate) type RunWith<S> =
    fn(
        Consumer<S>,
        MemoryQueue,
    ) -> futures_util::future::BoxFuture<'static, Result<Summary, SourceError>>;

/// [`the_first_copy_in_order_wins`], with the consumer run by `run_with`
/// (per-message or batch mode).
pub(crate) async fn first_copies_win<B: Backend>(concurrency: usize, run_with: RunWith<B::S>) {
    const KEYS: i64 = 300;
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let mut messages = Vec::new();
    for i in 0..KEYS {
        let key = format!("key-{i}");
        messages.push(msg(&key, i));
        messages.push(msg(&key, i + 100_000));
        if i % 3 == 0 {
            messages.push(msg(&key, i)); // a redelivery of the first copy
        }
    }
    let total = messages.len() as u64;
    let queue = queue_of(messages);
    let consumer = consumer(&backend, "ledger", &plan)
        .concurrency(concurrency)
        .build()
        .expect("consumer");
    let summary = tokio::time::timeout(Duration::from_secs(300), run_with(consumer, queue.clone()))
        .await
        .expect("run finished in time")
        .expect("run");

    let ledger = backend.ledger().await;
    let later_wins: Vec<_> = ledger.iter().filter(|(_, a)| *a >= 100_000).collect();
    assert!(
        later_wins.is_empty(),
        "a later copy won for {} of {KEYS} keys: {later_wins:?}",
        later_wins.len()
    );
    assert_eq!(ledger.len() as i64, KEYS, "one effect per key");
    assert_eq!(
        ledger.iter().map(|(_, a)| a).sum::<i64>(),
        KEYS * (KEYS - 1) / 2
    );
    assert_eq!(summary.count(OutcomeKind::Processed), KEYS as u64);
    assert_eq!(summary.count(OutcomeKind::Conflict), KEYS as u64);
    assert_eq!(
        summary.count(OutcomeKind::Duplicate),
        (KEYS as u64).div_ceil(3)
    );
    assert_eq!(queue.acked(), total, "every delivery settled");
    backend.cleanup().await;
}

/// The first copy of a key fails retryably once; the next copy (another
/// amount) arrives right behind it. The later copy is nacked without
/// claiming while the first waits for its retry, so the first copy is the
/// one applied and the later one is the conflict.
pub async fn a_later_copy_never_overtakes_one_waiting_for_its_retry<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let first = Message::new(r#"{"k":"r","amount":1,"fail":"retry","fail_times":1}"#);
    let queue = queue_of([first, msg("r", 2), msg("other", 3)]);
    let (seen, hook) = recorder();
    let summary = run::<B>(
        consumer(&backend, "ledger", &plan)
            .concurrency(8)
            .on_outcome(hook),
        &queue,
    )
    .await;

    assert_eq!(
        backend.ledger().await,
        vec![("other".to_owned(), 3), ("r".to_owned(), 1)],
        "the first copy of r was applied, after its retry"
    );
    assert_eq!(summary.count(OutcomeKind::Processed), 2);
    assert_eq!(summary.count(OutcomeKind::Conflict), 1);
    let deferred = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|o| {
            matches!(o, Outcome::RetryLater { attempts: 0, error, .. }
                if error.contains("earlier delivery of this key"))
        })
        .count();
    assert_eq!(deferred, 1, "the later copy was nacked without claiming");
    backend.cleanup().await;
}

/// A retryable failure retried in place ([`RetryLayer`]) keeps only the
/// successful call's writes (the failed calls' ledger rows were rewound to
/// the savepoint on SQL stores; lease stores write only on success) and
/// counts no attempt in the store; what still fails after the layer's calls
/// goes back to the retry policy and is redelivered.
pub async fn a_retry_in_place_keeps_only_the_last_calls_writes<B: Backend>()
where
    <B::S as idemq::store::Store>::Tx: idemq::layers::Rewind,
{
    use idemq::layers::RetryLayer;
    use std::sync::atomic::Ordering;
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let flaky = Message::new(r#"{"k":"flaky","amount":5,"fail":"retry","fail_times":2}"#);
    let stubborn = Message::new(r#"{"k":"stubborn","amount":7,"fail":"retry","fail_times":4}"#);
    let queue = queue_of([flaky, stubborn, msg("steady", 1)]);
    let (seen, hook) = recorder();
    let builder = consumer(&backend, "ledger", &plan)
        .layer(RetryLayer::new(3, Duration::from_millis(1)))
        .on_outcome(hook);
    let summary = run::<B>(builder, &queue).await;

    assert_eq!(summary.count(OutcomeKind::Processed), 3);
    assert_eq!(
        counted_retries(&seen),
        1,
        "stubborn failed all 3 calls of its first delivery, then passed on the 2nd call of its second"
    );
    assert_eq!(plan.calls.load(Ordering::SeqCst), 3 + 5 + 1);
    assert_eq!(
        backend.ledger().await,
        vec![
            ("flaky".to_owned(), 5),
            ("steady".to_owned(), 1),
            ("stubborn".to_owned(), 7)
        ],
        "one row per message: the failed calls' writes were rewound"
    );
    let report = backend.store().inspect("ledger", "flaky").await.unwrap();
    assert!(report.inbox.is_some());
    assert!(report.attempts.is_none());
    backend.cleanup().await;
}

/// A user's layers wrap the handler in the order added (the first added is
/// the outermost); a layer that refuses a call (a circuit breaker) keeps it
/// from the handler, and its error is handled like the handler's own.
pub async fn layers_wrap_the_handler_in_the_order_added<B: Backend>() {
    use futures_util::future::BoxFuture;
    use idemq::layers::Layer;
    use idemq::{Context, Handler, HandlerError, HandlerResult};

    /// Records its name on every call; refuses (permanently) keys named `refuse-<name>`.
    struct Gate<H> {
        name: &'static str,
        log: Arc<Mutex<Vec<&'static str>>>,
        inner: H,
    }
    impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Gate<H> {
        fn handle<'a>(
            &'a self,
            ctx: &'a Context<'a>,
            tx: &'a mut Tx,
        ) -> BoxFuture<'a, HandlerResult> {
            self.log.lock().unwrap().push(self.name);
            if ctx.key == format!("refuse-{}", self.name) {
                return Box::pin(async move {
                    Err(HandlerError::permanent(format!("{} is open", self.name)))
                });
            }
            self.inner.handle(ctx, tx)
        }
    }
    struct GateLayer(&'static str, Arc<Mutex<Vec<&'static str>>>);
    impl<H> Layer<H> for GateLayer {
        type Service = Gate<H>;
        fn layer(&self, inner: H) -> Gate<H> {
            Gate {
                name: self.0,
                log: Arc::clone(&self.1),
                inner,
            }
        }
    }

    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let log = Arc::new(Mutex::new(Vec::new()));
    let builder = consumer(&backend, "ledger", &plan)
        .layer(GateLayer("outer", Arc::clone(&log)))
        .layer(GateLayer("inner", Arc::clone(&log)))
        .concurrency(1);
    let queue = queue_of([msg("a", 1), msg("refuse-inner", 2), msg("b", 3)]);
    let summary = run::<B>(builder, &queue).await;

    assert_eq!(
        *log.lock().unwrap(),
        ["outer", "inner", "outer", "inner", "outer", "inner"]
    );
    assert_eq!(summary.count(OutcomeKind::Processed), 2);
    assert_eq!(summary.count(OutcomeKind::DeadLettered), 1);
    assert_eq!(
        plan.calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the refused call never reached the handler"
    );
    let refused = backend
        .store()
        .inspect("ledger", "refuse-inner")
        .await
        .unwrap();
    assert_eq!(refused.dead_letters[0].reason, "permanent_failure");
    assert!(refused.dead_letters[0].error.contains("inner is open"));
    assert_eq!(
        backend.ledger().await,
        vec![("a".to_owned(), 1), ("b".to_owned(), 3)]
    );
    backend.cleanup().await;
}

/// A call past the handler timeout fails retryably: its writes are rolled
/// back with its dropped future, and the redelivery applies the message once.
pub async fn a_handler_past_its_timeout_is_rolled_back_and_retried<B: Backend>() {
    let backend = B::fresh().await;
    let plan = Arc::new(Plan::default());
    let (seen, hook) = recorder();
    let hung = Message::new(r#"{"k":"slow","amount":4,"fail":"hang"}"#);
    let builder = consumer(&backend, "ledger", &plan)
        // Far above what the quick call needs, also on a loaded machine.
        .handler_timeout(Duration::from_secs(2))
        .on_outcome(hook);
    let queue = queue_of([hung, msg("quick", 1)]);
    let summary = run::<B>(builder, &queue).await;

    assert_eq!(summary.count(OutcomeKind::Processed), 2);
    assert_eq!(counted_retries(&seen), 1);
    let timed_out = seen
        .lock()
        .unwrap()
        .iter()
        .find_map(|o| match o {
            Outcome::RetryLater { error, .. } => Some(error.clone()),
            _ => None,
        })
        .expect("a retry");
    assert!(timed_out.contains("timed out after 2s"), "{timed_out}");
    assert_eq!(
        backend.ledger().await,
        vec![("quick".to_owned(), 1), ("slow".to_owned(), 4)],
        "the timed-out call's write was rolled back"
    );
    backend.cleanup().await;
}

/// A SQL commit deletes a key's failed attempts only when this store counted
/// one (most keys never fail: no round trip for them). Failures counted by
/// another process stay as history after the key is processed here: they
/// are not "failing" in `stats`, and a failure counted by the committing
/// store is cleared with its commit.
pub async fn attempts_counted_elsewhere<S: crate::backends::backend::SqlTestStore>()
where
    S::Tx: Send,
{
    use idemq::store::{Claim, ClaimRequest};

    let backend = crate::backends::backend::SqlBackend::<S>::fresh().await;
    let here = backend.store();
    let elsewhere = here.another();
    let req = |key| ClaimRequest {
        consumer: "failing",
        key,
        fingerprint: "f",
        lease: Duration::from_secs(30),
    };
    let failing_count = |stats: Vec<idemq::store::ConsumerStats>| {
        stats
            .iter()
            .find(|s| s.consumer == "failing")
            .map_or(0, |s| s.failing)
    };

    // Counted by the other process, then processed here.
    assert_eq!(
        elsewhere
            .record_failure("failing", "a", "boom")
            .await
            .unwrap(),
        1
    );
    assert_eq!(failing_count(here.stats().await.unwrap()), 1);
    let Claim::New(tx) = here.claim(&req("a")).await.unwrap() else {
        panic!("a is new")
    };
    here.commit(tx, &req("a"), None).await.unwrap();
    assert_eq!(
        failing_count(here.stats().await.unwrap()),
        0,
        "a processed key is not failing"
    );
    let a = here.inspect("failing", "a").await.unwrap();
    assert!(a.inbox.is_some());
    assert_eq!(a.attempts.map(|r| r.attempts), Some(1), "kept as history");

    // Counted here, then processed here: cleared with the commit.
    assert_eq!(
        here.record_failure("failing", "b", "boom").await.unwrap(),
        1
    );
    assert_eq!(
        here.record_failure("failing", "b", "boom").await.unwrap(),
        2
    );
    let Claim::New(tx) = here.claim(&req("b")).await.unwrap() else {
        panic!("b is new")
    };
    here.commit(tx, &req("b"), None).await.unwrap();
    assert!(here
        .inspect("failing", "b")
        .await
        .unwrap()
        .attempts
        .is_none());

    // Still failing (not processed anywhere): counted.
    elsewhere
        .record_failure("failing", "c", "boom")
        .await
        .unwrap();
    assert_eq!(failing_count(here.stats().await.unwrap()), 1);
    backend.cleanup().await;
}
