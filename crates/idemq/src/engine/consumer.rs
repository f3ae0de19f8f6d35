//! The consumer: its name, store, key spec, policies and handler, and the
//! builder that checks them.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::handler::layers::{self, BoxHandler, Layer};
use super::handler::{
    AsyncFnHandler, AsyncHandlerFn, Context, FnHandler, Handler, HandlerResult, StateFnHandler,
    StateHandlerFn,
};
use crate::error::ConfigError;
use crate::fingerprint::FingerprintSpec;
use crate::key::KeySpec;
use crate::outcome::DeadLetterReason;
use crate::outcome::Outcome;
use crate::policy::{ConflictPolicy, InFlightPolicy, RetryPolicy};
use crate::store::Store;

/// Callback observing every outcome (progress bars, custom metrics).
pub(crate) type OutcomeHook = Arc<dyn Fn(&Outcome) + Send + Sync>;

/// A user's layer, kept until the handler is known.
type LayerFn<Tx> = Box<dyn FnOnce(BoxHandler<Tx>) -> BoxHandler<Tx> + Send>;

/// The identify step's answer for one delivery, derived once and carried
/// through its key lane to the claim: the business key and the payload
/// fingerprint, or why the delivery must be dead-lettered (with the key when
/// one was derived).
pub(crate) type Identity = Result<(String, String), (Option<String>, DeadLetterReason)>;

/// The key lane of an identified delivery: its business key when one was
/// derived (bad input without a key runs outside any lane).
pub(crate) fn lane_key(identity: &Identity) -> Option<&str> {
    match identity {
        Ok((key, _)) => Some(key),
        Err((key, _)) => key.as_deref(),
    }
}

pub(crate) struct Inner<S: Store> {
    pub(crate) name: String,
    pub(crate) store: Arc<S>,
    pub(crate) key: KeySpec,
    pub(crate) fingerprint: FingerprintSpec,
    /// The handler inside its layers.
    pub(crate) handler: BoxHandler<S::Tx>,
    pub(crate) retry: RetryPolicy,
    pub(crate) conflict: ConflictPolicy,
    pub(crate) in_flight: InFlightPolicy,
    pub(crate) concurrency: usize,
    pub(crate) lease: Duration,
    /// Messages larger than this ([`Message::size_bytes`](crate::Message::size_bytes)) are dead-lettered as too large.
    pub(crate) max_message_bytes: usize,
    /// How long a stopping run waits for the deliveries in flight.
    pub(crate) shutdown_grace: Duration,
    pub(crate) on_outcome: Option<OutcomeHook>,
}

/// The default of [`ConsumerBuilder::max_message_bytes`]: 4 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

/// The default of [`ConsumerBuilder::shutdown_grace`]: 20 s, inside the 30 s
/// Kubernetes and `docker stop` give a process between SIGTERM and SIGKILL.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// An idempotent consumer: a name, a store, a key spec, policies and a handler.
///
/// Cloning is cheap and shares everything.
///
/// ```
/// use idemq::{Consumer, Context, KeySpec, Message, OutcomeKind};
/// use idemq::source::queue::MemoryQueue;
/// use idemq::store::memory::{Lease, MemoryStore};
///
/// #[derive(serde::Deserialize)]
/// struct Payment { amount: i64 }
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let consumer = Consumer::builder("billing", MemoryStore::new())
///     .key(KeySpec::json("/payment_id"))
///     .handle(async |ctx: &Context<'_>, _lease: &mut Lease| {
///         let payment: Payment = ctx.decode()?;
///         Ok(Some(serde_json::json!({ "charged": payment.amount })))
///     })
///     .build()
///     .unwrap();
///
/// let queue = MemoryQueue::new("payments");
/// queue.push(Message::new(r#"{"payment_id":"p-1","amount":5}"#));
/// queue.push(Message::new(r#"{"payment_id":"p-1","amount":5}"#)); // redelivered
/// queue.close();
/// let summary = consumer.run(queue.source()).await.unwrap();
/// assert_eq!(summary.count(OutcomeKind::Processed), 1);
/// assert_eq!(summary.count(OutcomeKind::Duplicate), 1);
/// # });
/// ```
pub struct Consumer<S: Store> {
    pub(crate) inner: Arc<Inner<S>>,
}

impl<S: Store> Clone for Consumer<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S: Store> std::fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.inner.name)
            .field("key", &self.inner.key)
            .field("fingerprint", &self.inner.fingerprint)
            .field("concurrency", &self.inner.concurrency)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Consumer`].
pub struct ConsumerBuilder<S: Store> {
    name: String,
    store: Arc<S>,
    key: KeySpec,
    fingerprint: FingerprintSpec,
    handler: Option<BoxHandler<S::Tx>>,
    layers: Vec<LayerFn<S::Tx>>,
    retry: RetryPolicy,
    conflict: ConflictPolicy,
    in_flight: InFlightPolicy,
    concurrency: usize,
    lease: Duration,
    handler_timeout: Option<Duration>,
    max_message_bytes: usize,
    shutdown_grace: Duration,
    on_outcome: Option<OutcomeHook>,
}

impl<S: Store> Consumer<S> {
    /// Starts building a consumer called `name` over `store`.
    ///
    /// Defaults: key `key|id` (the transport key, else the message id: set a
    /// business key with [`key`](ConsumerBuilder::key)), fingerprint of the
    /// whole payload, [`RetryPolicy::default`], conflicts dead-lettered,
    /// 8 messages in flight, 30 s leases, no handler timeout, messages up
    /// to [`DEFAULT_MAX_MESSAGE_BYTES`].
    pub fn builder(name: impl Into<String>, store: impl Into<Arc<S>>) -> ConsumerBuilder<S> {
        ConsumerBuilder {
            name: name.into(),
            store: store.into(),
            key: KeySpec::transport_key().or(KeySpec::id()),
            fingerprint: FingerprintSpec::Payload,
            handler: None,
            layers: Vec::new(),
            retry: RetryPolicy::default(),
            conflict: ConflictPolicy::default(),
            in_flight: InFlightPolicy::default(),
            concurrency: 8,
            lease: Duration::from_secs(30),
            handler_timeout: None,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            on_outcome: None,
        }
    }

    /// The consumer name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.inner.store
    }
}

impl<S: Store> ConsumerBuilder<S> {
    /// How the business key is read (see [`KeySpec`]).
    pub fn key(mut self, key: KeySpec) -> Self {
        self.key = key;
        self
    }

    /// What the payload fingerprint covers.
    pub fn fingerprint(mut self, fingerprint: FingerprintSpec) -> Self {
        self.fingerprint = fingerprint;
        self
    }

    /// The handler.
    pub fn handler(mut self, handler: impl Handler<S::Tx>) -> Self {
        self.handler = Some(Box::new(handler));
        self
    }

    /// The handler as an `async fn(&Context<'_>, &mut Tx) -> HandlerResult`
    /// (or an async closure that captures nothing); no `Box::pin` needed.
    /// A handler that needs shared state takes it through
    /// [`handle_with`](Self::handle_with).
    ///
    /// ```
    /// use idemq::{Consumer, Context, HandlerResult};
    /// use idemq::store::memory::{Lease, MemoryStore};
    ///
    /// async fn charge(ctx: &Context<'_>, _lease: &mut Lease) -> HandlerResult {
    ///     let payment: serde_json::Value = ctx.decode()?;
    ///     Ok(Some(payment["amount"].clone()))
    /// }
    ///
    /// let consumer = Consumer::builder("billing", MemoryStore::new()).handle(charge).build();
    /// assert!(consumer.is_ok());
    /// ```
    pub fn handle<F>(self, f: F) -> Self
    where
        F: for<'a> AsyncHandlerFn<'a, S::Tx>,
    {
        self.handler(AsyncFnHandler(f))
    }

    /// The handler as an `async fn(&State, &Context<'_>, &mut Tx) ->
    /// HandlerResult`, called with `&state` on every message (a pool, an
    /// HTTP client, a config), like an axum handler's `State`.
    ///
    /// ```
    /// use idemq::{Consumer, Context, HandlerResult};
    /// use idemq::store::memory::{Lease, MemoryStore};
    ///
    /// struct Rates { fee: i64 }
    ///
    /// async fn charge(rates: &Rates, ctx: &Context<'_>, _lease: &mut Lease) -> HandlerResult {
    ///     let payment: serde_json::Value = ctx.decode()?;
    ///     let total = payment["amount"].as_i64().unwrap_or(0) + rates.fee;
    ///     Ok(Some(total.into()))
    /// }
    ///
    /// let consumer = Consumer::builder("billing", MemoryStore::new())
    ///     .handle_with(Rates { fee: 1 }, charge)
    ///     .build();
    /// assert!(consumer.is_ok());
    /// ```
    pub fn handle_with<State, F>(self, state: State, f: F) -> Self
    where
        State: Send + Sync + 'static,
        F: for<'a> StateHandlerFn<'a, State, S::Tx>,
    {
        self.handler(StateFnHandler::new(state, f))
    }

    /// Wraps the handler in `layer` (tower-style, see [`layers`]): for
    /// cross-cutting concerns such as a retry in place, a circuit breaker
    /// or a rate limit. Layers added first are outermost; all of them sit
    /// inside the consumer's own trace, metrics, panic and timeout layers.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// use futures_util::future::BoxFuture;
    /// use idemq::layers::{Layer, RetryLayer};
    /// use idemq::{Consumer, Context, Handler, HandlerResult};
    /// use idemq::store::memory::{Lease, MemoryStore};
    ///
    /// /// Counts the calls that reach the handler.
    /// struct Counted<H> { inner: H, calls: Arc<AtomicUsize> }
    ///
    /// impl<Tx: Send + 'static, H: Handler<Tx>> Handler<Tx> for Counted<H> {
    ///     fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
    ///         self.calls.fetch_add(1, Ordering::Relaxed);
    ///         self.inner.handle(ctx, tx)
    ///     }
    /// }
    ///
    /// struct CountLayer(Arc<AtomicUsize>);
    ///
    /// impl<H> Layer<H> for CountLayer {
    ///     type Service = Counted<H>;
    ///     fn layer(&self, inner: H) -> Counted<H> {
    ///         Counted { inner, calls: Arc::clone(&self.0) }
    ///     }
    /// }
    ///
    /// async fn charge(_ctx: &Context<'_>, _lease: &mut Lease) -> HandlerResult { Ok(None) }
    ///
    /// let calls = Arc::new(AtomicUsize::new(0));
    /// let consumer = Consumer::builder("billing", MemoryStore::new())
    ///     .handle(charge)
    ///     .layer(CountLayer(Arc::clone(&calls)))
    ///     .layer(RetryLayer::new(3, std::time::Duration::from_millis(10)))
    ///     .build();
    /// assert!(consumer.is_ok());
    /// ```
    pub fn layer<L>(mut self, layer: L) -> Self
    where
        L: Layer<BoxHandler<S::Tx>> + Send + 'static,
        L::Service: Handler<S::Tx>,
    {
        self.layers.push(Box::new(move |inner: BoxHandler<S::Tx>| {
            Box::new(layer.layer(inner)) as BoxHandler<S::Tx>
        }));
        self
    }

    /// The handler as a closure returning a boxed future:
    /// `|ctx, tx| Box::pin(async move { … })`. Prefer [`handle`](Self::handle)
    /// with an `async fn`, which needs no `Box::pin`.
    pub fn handler_fn<F>(self, f: F) -> Self
    where
        F: for<'a> Fn(&'a Context<'a>, &'a mut S::Tx) -> BoxFuture<'a, HandlerResult>
            + Send
            + Sync
            + 'static,
    {
        self.handler(FnHandler(f))
    }

    /// Retry and backoff.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// What to do with conflicts.
    pub fn on_conflict(mut self, policy: ConflictPolicy) -> Self {
        self.conflict = policy;
        self
    }

    /// What to do with a duplicate whose first copy is still in flight in
    /// another worker (lease stores; see [`InFlightPolicy`]).
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.in_flight = policy;
        self
    }

    /// Messages in flight at once in [`Consumer::run`].
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Dead-letters a message larger than `bytes` (id, transport key,
    /// headers and payload: [`Message::size_bytes`](crate::Message::size_bytes))
    /// with the reason `too_large`, before its key is read and without
    /// running the handler; its dead letter keeps only its first `bytes`
    /// bytes ([`Message::head`](crate::Message::head)).
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// How long a run asked to stop ([`Consumer::run_until`]) waits for the
    /// deliveries in flight to finish and settle (default
    /// [`DEFAULT_SHUTDOWN_GRACE`]). Those still running then are abandoned:
    /// an uncommitted transaction rolls back, a lease expires, and the
    /// source redelivers them — also one whose commit landed but whose ack
    /// did not, which the inbox then answers as a duplicate. The summary
    /// counts them ([`Summary::abandoned`](crate::Summary::abandoned)).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// For lease stores: how long a claim lives without completion.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Fails (retryably) a handler call that runs longer than this, its
    /// layers included ([`TimeoutLayer`](super::layers::TimeoutLayer)).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// Calls `hook` with every outcome, after the delivery was settled.
    pub fn on_outcome(mut self, hook: impl Fn(&Outcome) + Send + Sync + 'static) -> Self {
        self.on_outcome = Some(Arc::new(hook));
        self
    }

    /// Checks the configuration and builds the consumer.
    pub fn build(self) -> Result<Consumer<S>, ConfigError> {
        validate_consumer_name(&self.name)?;
        if self.concurrency == 0 {
            return Err(ConfigError::Policy("concurrency must be at least 1".into()));
        }
        if let InFlightPolicy::Wait { poll, .. } = self.in_flight {
            if poll.is_zero() {
                return Err(ConfigError::Policy(
                    "the in-flight wait poll interval must be above zero".into(),
                ));
            }
        }
        if self.retry.max_attempts == 0 {
            return Err(ConfigError::Policy(
                "max_attempts must be at least 1".into(),
            ));
        }
        let mut handler = self
            .handler
            .ok_or_else(|| ConfigError::Policy("a handler is required".into()))?;
        for wrap in self.layers.into_iter().rev() {
            handler = wrap(handler);
        }
        let handler = layers::standard(handler, self.handler_timeout);
        Ok(Consumer {
            inner: Arc::new(Inner {
                name: self.name,
                store: self.store,
                key: self.key,
                fingerprint: self.fingerprint,
                handler,
                retry: self.retry,
                conflict: self.conflict,
                in_flight: self.in_flight,
                concurrency: self.concurrency,
                lease: self.lease,
                max_message_bytes: self.max_message_bytes,
                shutdown_grace: self.shutdown_grace,
                on_outcome: self.on_outcome,
            }),
        })
    }
}

/// A consumer name is 1 to 128 bytes of UTF-8 without control characters.
pub fn validate_consumer_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
        return Err(ConfigError::ConsumerName(name.to_owned()));
    }
    Ok(())
}
