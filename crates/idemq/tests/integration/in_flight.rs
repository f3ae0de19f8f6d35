//! The in-flight policies over the memory lease store: a duplicate that
//! arrives while the first copy is being handled waits for its result
//! (`Wait`), is retried later (`Reject`), or takes over an expired lease.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemq::source::queue::MemoryQueue;
use idemq::source::Source;
use idemq::store::memory::MemoryStore;
use idemq::store::Store;
use idemq::{Consumer, HandlerError, InFlightPolicy, KeySpec, Message, Outcome};

/// A consumer over the memory store whose handler sleeps `sleep` and
/// returns the payload's amount.
fn consumer(
    policy: InFlightPolicy,
    sleep: Duration,
    lease: Duration,
) -> (Consumer<MemoryStore>, Arc<AtomicU32>) {
    consumer_over(MemoryStore::new(), policy, sleep, lease)
}

/// The same consumer over any store.
fn consumer_over<S: Store>(
    store: S,
    policy: InFlightPolicy,
    sleep: Duration,
    lease: Duration,
) -> (Consumer<S>, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&calls);
    let consumer = Consumer::builder("in-flight", store)
        .key(KeySpec::json("/id"))
        .in_flight(policy)
        .lease(lease)
        .handler_fn(move |ctx, _lease| {
            let counted = Arc::clone(&counted);
            Box::pin(async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(sleep).await;
                let v: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
                Ok(Some(serde_json::json!({ "amount": v["amount"] })))
            })
        })
        .build()
        .unwrap();
    (consumer, calls)
}

/// Processes two copies of one message, the second once the first one's
/// handler has started (so the first holds the key: the handlers below
/// sleep for seconds, a wide window also on a loaded machine).
async fn two_copies<S: Store>(consumer: &Consumer<S>, calls: &AtomicU32) -> (Outcome, Outcome) {
    let queue = MemoryQueue::new("q");
    let msg = Message::new(r#"{"id":"k-1","amount":7}"#);
    queue.push(msg.clone());
    queue.push(msg);
    let mut source = queue.source();
    let first = source.next().await.unwrap().unwrap();
    let second = source.next().await.unwrap().unwrap();
    let a = consumer.clone();
    let first = tokio::spawn(async move { a.process(first).await });
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while calls.load(Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the first copy's handler never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = consumer.process(second).await;
    (first.await.unwrap(), second)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_returns_the_first_copys_stored_result() {
    let policy = InFlightPolicy::wait(Duration::from_secs(5));
    let (consumer, calls) = consumer(policy, Duration::from_secs(2), Duration::from_secs(30));
    let (first, second) = two_copies(&consumer, &calls).await;
    assert!(matches!(first, Outcome::Processed { .. }), "{first:?}");
    match second {
        Outcome::Duplicate { record } => {
            assert_eq!(record.result, Some(serde_json::json!({ "amount": 7 })))
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_retries_the_duplicate_later() {
    let (consumer, calls) = consumer(
        InFlightPolicy::Reject,
        Duration::from_secs(2),
        Duration::from_secs(30),
    );
    let (first, second) = two_copies(&consumer, &calls).await;
    assert!(matches!(first, Outcome::Processed { .. }), "{first:?}");
    match second {
        Outcome::RetryLater { attempts, .. } => assert_eq!(attempts, 0),
        other => panic!("expected retry later, got {other:?}"),
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_takes_over_when_the_holders_lease_expires() {
    // The first copy outlives its 200 ms lease: the waiting copy takes the
    // key over, and the stale first holder's completion is refused. The
    // handler's 3 s leave the second copy time to take over first.
    let policy = InFlightPolicy::wait(Duration::from_secs(5));
    let (consumer, calls) = consumer(policy, Duration::from_secs(3), Duration::from_millis(200));
    let (first, second) = two_copies(&consumer, &calls).await;
    assert!(matches!(second, Outcome::Processed { .. }), "{second:?}");
    assert!(
        matches!(first, Outcome::RetryLater { .. }),
        "the stale holder must not complete: {first:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_zero_poll_interval_is_refused() {
    let result = Consumer::builder("c", MemoryStore::new())
        .in_flight(InFlightPolicy::Wait {
            poll: Duration::ZERO,
            max_wait: Duration::from_secs(1),
        })
        .handler_fn(|_, _| Box::pin(async { Ok(None) }))
        .build();
    assert!(result.is_err());
}

/// The same policies over the Redis lease store (feature `redis`).
#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use idemq::store::redis::{RedisOptions, RedisStore};

    async fn store() -> RedisStore {
        let prefix = format!("inflight{}x{}", std::process::id(), fastrand::u32(..));
        RedisStore::connect_with(
            "redis://127.0.0.1:6379",
            RedisOptions::default().prefix(prefix),
        )
        .await
        .expect("Redis on 127.0.0.1:6379")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wait_returns_the_first_copys_stored_result() {
        let policy = InFlightPolicy::wait(Duration::from_secs(5));
        let (consumer, calls) = consumer_over(
            store().await,
            policy,
            Duration::from_secs(2),
            Duration::from_secs(30),
        );
        let (first, second) = two_copies(&consumer, &calls).await;
        assert!(matches!(first, Outcome::Processed { .. }), "{first:?}");
        match second {
            Outcome::Duplicate { record } => {
                assert_eq!(record.result, Some(serde_json::json!({ "amount": 7 })))
            }
            other => panic!("expected a duplicate, got {other:?}"),
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reject_retries_the_duplicate_later() {
        let (consumer, calls) = consumer_over(
            store().await,
            InFlightPolicy::Reject,
            Duration::from_secs(2),
            Duration::from_secs(30),
        );
        let (first, second) = two_copies(&consumer, &calls).await;
        assert!(matches!(first, Outcome::Processed { .. }), "{first:?}");
        assert!(
            matches!(second, Outcome::RetryLater { attempts: 0, .. }),
            "{second:?}"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
