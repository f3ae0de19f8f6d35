//! Layers around a handler, tower-style: each wraps a [`Handler`] in
//! another [`Handler`] that adds one concern, and they compose with
//! [`ConsumerBuilder::layer`](crate::ConsumerBuilder::layer) or by hand
//! (`Layer::layer`).
//!
//! The consumer always wraps the handler in, from the outside in:
//! [`TraceLayer`] (a span per call), [`MetricsLayer`] (latency and errors),
//! [`CatchPanicLayer`] (a panic becomes a retryable error) and, when
//! [`handler_timeout`](crate::ConsumerBuilder::handler_timeout) is set,
//! [`TimeoutLayer`]. The layers a user adds sit inside those, around the
//! handler, in the order added (the first added is the outermost), so a
//! timeout bounds them too and a panic in one of them is caught.
//!
//! A layer of your own is a [`Layer`] whose handler implements
//! [`Handler`]; see [`ConsumerBuilder::layer`](crate::ConsumerBuilder::layer)
//! for a complete example.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use tracing::Instrument;

pub use tower_layer::{layer_fn, Identity, Layer, Stack};

use super::{BatchResult, Context, Handler, HandlerResult};
use crate::error::{HandlerError, StoreError};

/// A handler behind a box: what [`ConsumerBuilder::layer`](crate::ConsumerBuilder::layer)
/// hands to a layer.
pub type BoxHandler<Tx> = Box<dyn Handler<Tx>>;

/// Fails a handler call that runs longer than a limit with a retryable
/// error (`handler timed out after …`). The call's future is dropped, so a
/// transaction's work is rolled back with it.
#[derive(Debug, Clone, Copy)]
pub struct TimeoutLayer {
    limit: Duration,
}

impl TimeoutLayer {
    /// Calls longer than `limit` fail.
    pub fn new(limit: Duration) -> Self {
        Self { limit }
    }
}

impl<H> Layer<H> for TimeoutLayer {
    type Service = Timeout<H>;

    fn layer(&self, inner: H) -> Timeout<H> {
        Timeout {
            inner,
            limit: self.limit,
        }
    }
}

/// The handler of a [`TimeoutLayer`].
#[derive(Debug)]
pub struct Timeout<H> {
    inner: H,
    limit: Duration,
}

impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Timeout<H> {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            match tokio::time::timeout(self.limit, self.inner.handle(ctx, tx)).await {
                Ok(result) => result,
                Err(_) => Err(HandlerError::retryable(format!(
                    "handler timed out after {:?}",
                    self.limit
                ))),
            }
        })
    }

    fn handles_batches(&self) -> bool {
        self.inner.handles_batches()
    }

    /// The limit bounds the batch call as a whole; a batch that runs past
    /// it is handled again one message at a time, each with the limit.
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult> {
        Box::pin(async move {
            match tokio::time::timeout(self.limit, self.inner.handle_batch(batch, tx)).await {
                Ok(result) => result,
                Err(_) => Err(HandlerError::retryable(format!(
                    "batch handler timed out after {:?}",
                    self.limit
                ))),
            }
        })
    }
}

/// Turns a panic in the handler into a retryable error (`handler panicked:
/// …`), so that one bad message never takes the consumer down.
#[derive(Debug, Clone, Copy, Default)]
pub struct CatchPanicLayer;

impl<H> Layer<H> for CatchPanicLayer {
    type Service = CatchPanic<H>;

    fn layer(&self, inner: H) -> CatchPanic<H> {
        CatchPanic { inner }
    }
}

/// The handler of a [`CatchPanicLayer`].
#[derive(Debug)]
pub struct CatchPanic<H> {
    inner: H,
}

impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for CatchPanic<H> {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            AssertUnwindSafe(self.inner.handle(ctx, tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| Err(panicked(panic)))
        })
    }

    fn handles_batches(&self) -> bool {
        self.inner.handles_batches()
    }

    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult> {
        Box::pin(async move {
            AssertUnwindSafe(self.inner.handle_batch(batch, tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| Err(panicked(panic)))
        })
    }
}

/// The retryable error a caught panic becomes.
fn panicked(panic: Box<dyn std::any::Any + Send>) -> HandlerError {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_owned());
    HandlerError::retryable(format!("handler panicked: {what}"))
}

/// Records every call's latency in the histogram `idemq_handler_seconds`
/// and every failure in the counter `idemq_handler_errors_total` (labels
/// `consumer` and `kind`), through the `metrics` facade.
#[derive(Debug, Clone, Copy, Default)]
pub struct MetricsLayer;

impl<H> Layer<H> for MetricsLayer {
    type Service = Metrics<H>;

    fn layer(&self, inner: H) -> Metrics<H> {
        Metrics { inner }
    }
}

/// The handler of a [`MetricsLayer`].
#[derive(Debug)]
pub struct Metrics<H> {
    inner: H,
}

impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Metrics<H> {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            let started = Instant::now();
            let result = self.inner.handle(ctx, tx).await;
            metrics::histogram!("idemq_handler_seconds", "consumer" => ctx.consumer.to_owned())
                .record(started.elapsed().as_secs_f64());
            if let Err(e) = &result {
                count_error(ctx.consumer, e);
            }
            result
        })
    }

    fn handles_batches(&self) -> bool {
        self.inner.handles_batches()
    }

    /// A failed batch call is counted in `idemq_handler_errors_total`; its
    /// latency is not sampled (the histogram is per message).
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult> {
        Box::pin(async move {
            let result = self.inner.handle_batch(batch, tx).await;
            let consumer = batch.first().map_or("", |ctx| ctx.consumer);
            if let Err(e) = &result {
                count_error(consumer, e);
            }
            result
        })
    }
}

fn count_error(consumer: &str, error: &HandlerError) {
    metrics::counter!(
        "idemq_handler_errors_total",
        "consumer" => consumer.to_owned(),
        "kind" => kind_label(error)
    )
    .increment(1);
}

fn kind_label(error: &HandlerError) -> &'static str {
    use crate::error::HandlerErrorKind::*;
    match error.kind() {
        Retryable => "retryable",
        Permanent => "permanent",
        Conflict => "conflict",
        InvalidInput => "invalid_input",
    }
}

/// Runs every call inside a `tracing` span `handler` with the consumer,
/// key and attempt, so that the handler's own events carry them; a failed
/// call is logged at debug level inside the span.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceLayer;

impl<H> Layer<H> for TraceLayer {
    type Service = Trace<H>;

    fn layer(&self, inner: H) -> Trace<H> {
        Trace { inner }
    }
}

/// The handler of a [`TraceLayer`].
#[derive(Debug)]
pub struct Trace<H> {
    inner: H,
}

impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Trace<H> {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        let span = tracing::info_span!(
            "handler",
            consumer = ctx.consumer,
            key = ctx.key,
            attempt = ctx.attempt
        );
        Box::pin(
            async move {
                let result = self.inner.handle(ctx, tx).await;
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "handler failed");
                }
                result
            }
            .instrument(span),
        )
    }

    fn handles_batches(&self) -> bool {
        self.inner.handles_batches()
    }

    /// A span `handler_batch` with the consumer and the batch's size.
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult> {
        let span = tracing::info_span!(
            "handler_batch",
            consumer = batch.first().map_or("", |ctx| ctx.consumer),
            size = batch.len()
        );
        Box::pin(
            async move {
                let result = self.inner.handle_batch(batch, tx).await;
                if let Err(e) = &result {
                    tracing::debug!(error = %e, "batch handler failed; the batch runs again per message");
                }
                result
            }
            .instrument(span),
        )
    }
}

/// A transaction (or lease) that can go back to a mark: what [`RetryLayer`]
/// needs to run a handler again in the same transaction without keeping the
/// failed attempt's writes.
///
/// SQL transactions implement it with `SAVEPOINT idemq_retry` /
/// `ROLLBACK TO SAVEPOINT` / `RELEASE SAVEPOINT`. The default methods do
/// nothing, which is right for a lease (memory, Redis): it holds no writes.
#[async_trait::async_trait]
pub trait Rewind: Send {
    /// Sets the mark.
    async fn mark(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Undoes everything written since the mark; the mark stays set.
    async fn rewind(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
    /// Keeps everything written since the mark and forgets the mark.
    async fn release(&mut self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Runs a handler again in place when it fails with a retryable error, up
/// to `attempts` calls in all, sleeping `backoff`, then twice that, and so
/// on between them, after rewinding the transaction to where the first call
/// began ([`Rewind`]). For short blips (a deadlock, a dropped connection
/// to another service); what is still failing after that goes back to the
/// consumer's [`RetryPolicy`](crate::RetryPolicy), which counts the attempt
/// in the store and redelivers later.
///
/// The time spent here counts against the handler timeout and, on lease
/// stores, against the lease (which the engine heartbeats).
#[derive(Debug, Clone, Copy)]
pub struct RetryLayer {
    attempts: u32,
    backoff: Duration,
}

impl RetryLayer {
    /// Up to `attempts` calls in all (at least 1), `backoff` before the
    /// second, doubling after each.
    pub fn new(attempts: u32, backoff: Duration) -> Self {
        Self {
            attempts: attempts.max(1),
            backoff,
        }
    }
}

impl<H> Layer<H> for RetryLayer {
    type Service = Retry<H>;

    fn layer(&self, inner: H) -> Retry<H> {
        Retry {
            inner,
            attempts: self.attempts,
            backoff: self.backoff,
        }
    }
}

/// The handler of a [`RetryLayer`].
#[derive(Debug)]
pub struct Retry<H> {
    inner: H,
    attempts: u32,
    backoff: Duration,
}

impl<Tx: Rewind + 'static, H: Handler<Tx>> Handler<Tx> for Retry<H> {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(self.in_place(
            One {
                handler: &self.inner,
                ctx,
            },
            tx,
        ))
    }

    fn handles_batches(&self) -> bool {
        self.inner.handles_batches()
    }

    /// Retries the batch call in place as a whole.
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult> {
        Box::pin(self.in_place(
            Many {
                handler: &self.inner,
                batch,
            },
            tx,
        ))
    }
}

impl<H> Retry<H> {
    /// Makes `call` up to `attempts` times, rewinding `tx` between calls.
    async fn in_place<Tx: Rewind, C: InPlace<Tx>>(
        &self,
        call: C,
        tx: &mut Tx,
    ) -> Result<C::Output, HandlerError> {
        let rewind_failed = |e: StoreError| HandlerError::retryable(format!("retry in place: {e}"));
        tx.mark().await.map_err(rewind_failed)?;
        let mut delay = self.backoff;
        let mut attempt = 1;
        loop {
            let result = call.call(tx).await;
            match result {
                Err(e) if e.is_retryable() && attempt < self.attempts => {
                    tracing::debug!(error = %e, call = attempt, "retrying the handler in place");
                    tx.rewind().await.map_err(rewind_failed)?;
                    tokio::time::sleep(e.retry_after().unwrap_or(delay)).await;
                    delay = delay.saturating_mul(2);
                    attempt += 1;
                }
                result => {
                    tx.release().await.map_err(rewind_failed)?;
                    return result;
                }
            }
        }
    }
}

/// One call [`Retry`] can repeat: a message's or a batch's.
trait InPlace<Tx>: Send + Sync {
    /// What a successful call returns.
    type Output: Send;
    /// Makes the call once.
    fn call<'t>(&'t self, tx: &'t mut Tx) -> BoxFuture<'t, Result<Self::Output, HandlerError>>;
}

/// A call of [`Handler::handle`].
struct One<'a, H> {
    handler: &'a H,
    ctx: &'a Context<'a>,
}

impl<Tx: 'static, H: Handler<Tx>> InPlace<Tx> for One<'_, H> {
    type Output = Option<serde_json::Value>;

    fn call<'t>(&'t self, tx: &'t mut Tx) -> BoxFuture<'t, HandlerResult> {
        self.handler.handle(self.ctx, tx)
    }
}

/// A call of [`Handler::handle_batch`].
struct Many<'a, H> {
    handler: &'a H,
    batch: &'a [Context<'a>],
}

impl<Tx: Send + 'static, H: Handler<Tx>> InPlace<Tx> for Many<'_, H> {
    type Output = Vec<Option<serde_json::Value>>;

    fn call<'t>(&'t self, tx: &'t mut Tx) -> BoxFuture<'t, BatchResult> {
        self.handler.handle_batch(self.batch, tx)
    }
}

/// Wraps `handler` in the layers every consumer has (see the module docs).
pub(crate) fn standard<Tx: Send + 'static>(
    handler: BoxHandler<Tx>,
    timeout: Option<Duration>,
) -> BoxHandler<Tx> {
    let handler: BoxHandler<Tx> = match timeout {
        Some(limit) => Box::new(TimeoutLayer::new(limit).layer(handler)),
        None => handler,
    };
    Box::new(TraceLayer.layer(MetricsLayer.layer(CatchPanicLayer.layer(handler))))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::message::{DeliveryMeta, Message};

    /// A transaction that logs what the retry layer asks of it.
    #[derive(Default)]
    struct Journal(Vec<&'static str>);

    #[async_trait::async_trait]
    impl Rewind for Journal {
        async fn mark(&mut self) -> Result<(), StoreError> {
            self.0.push("mark");
            Ok(())
        }
        async fn rewind(&mut self) -> Result<(), StoreError> {
            self.0.push("rewind");
            Ok(())
        }
        async fn release(&mut self) -> Result<(), StoreError> {
            self.0.push("release");
            Ok(())
        }
    }

    /// Fails retryably `failures` times, then succeeds; or panics, or hangs.
    struct Flaky {
        failures: u32,
        calls: Arc<AtomicU32>,
        panics: bool,
        hangs: bool,
    }

    impl<Tx: Send + 'static> Handler<Tx> for Flaky {
        fn handle<'a>(
            &'a self,
            _ctx: &'a Context<'a>,
            _tx: &'a mut Tx,
        ) -> BoxFuture<'a, HandlerResult> {
            Box::pin(async move {
                let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
                if self.panics {
                    panic!("bug in call {n}");
                }
                if self.hangs {
                    std::future::pending::<()>().await;
                }
                if n <= self.failures {
                    return Err(HandlerError::retryable(format!("call {n}")));
                }
                Ok(Some(n.into()))
            })
        }
    }

    fn flaky(failures: u32) -> (Flaky, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let handler = Flaky {
            failures,
            calls: Arc::clone(&calls),
            panics: false,
            hangs: false,
        };
        (handler, calls)
    }

    async fn call<H: Handler<Journal>>(handler: &H, tx: &mut Journal) -> HandlerResult {
        let message = Message::new("{}");
        let meta = DeliveryMeta::default();
        let ctx = Context {
            consumer: "c",
            key: "k",
            fingerprint: "f",
            message: &message,
            meta: &meta,
            attempt: 1,
            journal: None,
        };
        handler.handle(&ctx, tx).await
    }

    #[tokio::test]
    async fn retry_rewinds_before_each_new_call_and_releases_at_the_end() {
        let (handler, calls) = flaky(2);
        let retry = RetryLayer::new(3, Duration::from_millis(1)).layer(handler);
        let mut tx = Journal::default();
        assert_eq!(call(&retry, &mut tx).await.unwrap(), Some(3.into()));
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(tx.0, ["mark", "rewind", "rewind", "release"]);
    }

    #[tokio::test]
    async fn retry_gives_up_after_its_calls_with_the_last_error() {
        let (handler, calls) = flaky(5);
        let retry = RetryLayer::new(2, Duration::from_millis(1)).layer(handler);
        let mut tx = Journal::default();
        let err = call(&retry, &mut tx).await.unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.message(), "call 2");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(tx.0, ["mark", "rewind", "release"]);
    }

    #[tokio::test]
    async fn retry_does_not_repeat_a_permanent_failure() {
        struct Refuses;
        impl Handler<Journal> for Refuses {
            fn handle<'a>(
                &'a self,
                _ctx: &'a Context<'a>,
                _tx: &'a mut Journal,
            ) -> BoxFuture<'a, HandlerResult> {
                Box::pin(async { Err(HandlerError::permanent("no")) })
            }
        }
        let retry = RetryLayer::new(5, Duration::from_millis(1)).layer(Refuses);
        let mut tx = Journal::default();
        assert!(!call(&retry, &mut tx).await.unwrap_err().is_retryable());
        assert_eq!(tx.0, ["mark", "release"]);
    }

    #[tokio::test]
    async fn a_panic_becomes_a_retryable_error_with_its_message() {
        let (mut handler, _) = flaky(0);
        handler.panics = true;
        let caught = CatchPanicLayer.layer(handler);
        let err = call(&caught, &mut Journal::default()).await.unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.message(), "handler panicked: bug in call 1");
    }

    #[tokio::test]
    async fn a_call_past_the_limit_times_out_retryably() {
        let (mut handler, _) = flaky(0);
        handler.hangs = true;
        let limited = TimeoutLayer::new(Duration::from_millis(20)).layer(handler);
        let err = call(&limited, &mut Journal::default()).await.unwrap_err();
        assert!(err.is_retryable());
        assert_eq!(err.message(), "handler timed out after 20ms");
    }

    #[tokio::test]
    async fn the_standard_stack_catches_a_panic_inside_a_timeout() {
        let (mut handler, _) = flaky(0);
        handler.panics = true;
        let stack = standard::<Journal>(Box::new(handler), Some(Duration::from_secs(5)));
        let err = call(&stack, &mut Journal::default()).await.unwrap_err();
        assert!(err.message().starts_with("handler panicked"), "{err}");
    }
}
