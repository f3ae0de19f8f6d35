//! The consumer: one message through claim → handler → commit → ack.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;

use super::handler::{Context, FnHandler, Handler, HandlerResult};
use super::lanes::LaneRelease;
use crate::error::{ConfigError, HandlerError, HandlerErrorKind, InputError, StoreError};
use crate::fingerprint::FingerprintSpec;
use crate::key::KeySpec;
use crate::message::{DeliveryMeta, Message};
use crate::outcome::DeadLetterReason;
use crate::outcome::Outcome;
use crate::policy::{ConflictPolicy, InFlightPolicy, RetryPolicy};
use crate::source::{Acknowledger, Delivery};
use crate::store::{Claim, ClaimRequest, DeadLetter, Store};

/// Callback observing every outcome (progress bars, custom metrics).
pub(crate) type OutcomeHook = Arc<dyn Fn(&Outcome) + Send + Sync>;

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
    pub(crate) handler: Box<dyn Handler<S::Tx>>,
    pub(crate) retry: RetryPolicy,
    pub(crate) conflict: ConflictPolicy,
    pub(crate) in_flight: InFlightPolicy,
    pub(crate) concurrency: usize,
    pub(crate) lease: Duration,
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) on_outcome: Option<OutcomeHook>,
}

/// An idempotent consumer: a name, a store, a key spec, policies and a handler.
///
/// Cloning is cheap and shares everything.
///
/// ```
/// use idemq::{Consumer, HandlerError, KeySpec, Message, OutcomeKind};
/// use idemq::source::queue::MemoryQueue;
/// use idemq::store::memory::MemoryStore;
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let consumer = Consumer::builder("billing", MemoryStore::new())
///     .key(KeySpec::json("/payment_id"))
///     .handler_fn(|ctx, _lease| Box::pin(async move {
///         let payment: serde_json::Value = ctx.message.json().map_err(HandlerError::permanent)?;
///         Ok(Some(serde_json::json!({ "charged": payment["amount"] })))
///     }))
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
    handler: Option<Box<dyn Handler<S::Tx>>>,
    retry: RetryPolicy,
    conflict: ConflictPolicy,
    in_flight: InFlightPolicy,
    concurrency: usize,
    lease: Duration,
    handler_timeout: Option<Duration>,
    on_outcome: Option<OutcomeHook>,
}

impl<S: Store> Consumer<S> {
    /// Starts building a consumer called `name` over `store`.
    ///
    /// Defaults: key `key|id` (the transport key, else the message id: set a
    /// business key with [`key`](ConsumerBuilder::key)), fingerprint of the
    /// whole payload, [`RetryPolicy::default`], conflicts dead-lettered,
    /// 8 messages in flight, 30 s leases, no handler timeout.
    pub fn builder(name: impl Into<String>, store: impl Into<Arc<S>>) -> ConsumerBuilder<S> {
        ConsumerBuilder {
            name: name.into(),
            store: store.into(),
            key: KeySpec::transport_key().or(KeySpec::id()),
            fingerprint: FingerprintSpec::Payload,
            handler: None,
            retry: RetryPolicy::default(),
            conflict: ConflictPolicy::default(),
            in_flight: InFlightPolicy::default(),
            concurrency: 8,
            lease: Duration::from_secs(30),
            handler_timeout: None,
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

    /// The handler as a closure returning a boxed future:
    /// `|ctx, tx| Box::pin(async move { … })`.
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

    /// For lease stores: how long a claim lives without completion.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Fails (retryably) a handler that runs longer than this.
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
        let handler = self
            .handler
            .ok_or_else(|| ConfigError::Policy("a handler is required".into()))?;
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
                handler_timeout: self.handler_timeout,
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

impl<S: Store> Consumer<S> {
    /// Processes one delivery to its outcome and settles it with its source:
    /// ack after commit (processed, duplicate), nack with a delay (retry
    /// later), or dead-letter and ack.
    pub async fn process(&self, delivery: Delivery) -> Outcome {
        let identity = self.identify(&delivery.message, delivery.defect.as_ref());
        self.process_in_lane(delivery, identity, LaneRelease::none())
            .await
    }

    /// [`process`](Self::process) of a delivery identified already,
    /// releasing `lane` once the outcome is decided and before the delivery
    /// is settled.
    pub(crate) async fn process_in_lane(
        &self,
        delivery: Delivery,
        identity: Identity,
        lane: LaneRelease,
    ) -> Outcome {
        let (message, meta, _defect, acker) = delivery.into_parts();
        let outcome = self.decide(identity, &message, &meta).await;
        lane.release(&outcome);
        self.settle(&outcome, acker).await;
        self.report(&outcome, &meta);
        outcome
    }

    pub(crate) async fn settle(&self, outcome: &Outcome, acker: Box<dyn Acknowledger>) {
        let result = match outcome {
            Outcome::Processed { .. } | Outcome::Duplicate { .. } => acker.ack().await,
            Outcome::Conflict { .. } => match self.inner.conflict {
                ConflictPolicy::DeadLetter => {
                    acker.forward_dead_letter(&DeadLetterReason::Conflict).await
                }
                ConflictPolicy::Ignore => acker.ack().await,
            },
            Outcome::RetryLater { delay, .. } => acker.nack(*delay).await,
            Outcome::DeadLettered { reason, .. } => acker.forward_dead_letter(reason).await,
        };
        if let Err(e) = result {
            // Nothing is lost: the source redelivers and the inbox answers.
            tracing::warn!(consumer = %self.inner.name, error = %e, "settling the delivery failed");
        }
    }

    pub(crate) fn report(&self, outcome: &Outcome, meta: &DeliveryMeta) {
        let consumer = self.inner.name.as_str();
        match outcome {
            Outcome::Processed { key, .. } => {
                tracing::info!(consumer, key = %key, offset = ?meta.offset, "processed")
            }
            Outcome::Duplicate { record } => tracing::warn!(
                consumer, key = %record.key, first_seen_ms = record.first_seen_ms,
                "duplicate skipped"
            ),
            Outcome::Conflict {
                record,
                fingerprint,
            } => tracing::error!(
                consumer, key = %record.key, stored = %record.fingerprint, got = %fingerprint,
                "conflict: key reused with another payload"
            ),
            Outcome::RetryLater {
                key,
                attempts,
                delay,
                error,
            } => tracing::warn!(
                consumer, key = ?key, attempts, delay_ms = delay.as_millis() as u64, error = %error,
                "will retry"
            ),
            Outcome::DeadLettered { key, reason, error } => tracing::error!(
                consumer, key = ?key, reason = %reason, error = %error, offset = ?meta.offset,
                "dead-lettered"
            ),
        }
        metrics::counter!(
            "idemq_messages_total",
            "consumer" => self.inner.name.clone(),
            "outcome" => outcome.kind().as_str()
        )
        .increment(1);
        if let Some(hook) = &self.inner.on_outcome {
            hook(outcome);
        }
    }

    /// The identify step: the business key and fingerprint of a message, or
    /// why it must be dead-lettered (with the key when one was derived). A
    /// source's `defect` (an undecodable record) wins.
    pub(crate) fn identify(&self, message: &Message, defect: Option<&InputError>) -> Identity {
        let inner = &*self.inner;
        if let Some(defect) = defect {
            return Err((None, DeadLetterReason::InvalidInput(defect.clone())));
        }
        let key = inner
            .key
            .extract(message)
            .map_err(|e| (None, DeadLetterReason::InvalidInput(e)))?;
        match inner.fingerprint.compute(message) {
            Ok(fingerprint) => Ok((key, fingerprint)),
            Err(e) => Err((Some(key), DeadLetterReason::InvalidInput(e))),
        }
    }

    async fn decide(&self, identity: Identity, message: &Message, meta: &DeliveryMeta) -> Outcome {
        let inner = &*self.inner;
        let (key, fingerprint) = match identity {
            Ok(ids) => ids,
            Err((key, reason)) => {
                return self
                    .dead_letter(key.as_deref(), reason, message, meta, 0)
                    .await
            }
        };
        let req = ClaimRequest {
            consumer: &inner.name,
            key: &key,
            fingerprint: &fingerprint,
            lease: inner.lease,
        };
        let tx = match self.claim(&req).await {
            Ok(Claim::New(tx)) => {
                crate::failpoint::failpoint!("after_claim");
                tx
            }
            Ok(Claim::Done(record)) if record.fingerprint == fingerprint => {
                return Outcome::Duplicate { record }
            }
            Ok(Claim::Done(record)) => {
                return self.conflict(record, fingerprint, message, meta).await
            }
            Ok(Claim::InFlight) => {
                return self.busy(Some(key), "in flight in another worker".into())
            }
            Err(e) => return self.busy(Some(key), format!("claim failed: {e}")),
        };
        self.run_handler(tx, &req, message, meta).await
    }

    /// Why a delivery is past [`RetryPolicy::max_deliveries`], if it is.
    pub(crate) fn over_delivery_limit(&self, meta: &DeliveryMeta) -> Option<String> {
        let max = self.inner.retry.max_deliveries?;
        (meta.delivery_count > max).then(|| {
            format!(
                "delivered {} times, more than max_deliveries {max}",
                meta.delivery_count
            )
        })
    }

    /// Runs the handler once with `tx`: a panic or a timeout becomes a
    /// retryable error.
    pub(crate) async fn call_handler(
        &self,
        tx: &mut S::Tx,
        req: &ClaimRequest<'_>,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> HandlerResult {
        let inner = &*self.inner;
        let ctx = Context {
            consumer: req.consumer,
            key: req.key,
            fingerprint: req.fingerprint,
            message,
            meta,
            attempt: meta.delivery_count.max(1),
            journal: inner.store.journal(),
        };
        let started = Instant::now();
        let result = {
            let run = AssertUnwindSafe(inner.handler.handle(&ctx, tx)).catch_unwind();
            match inner.handler_timeout {
                Some(limit) => match tokio::time::timeout(limit, run).await {
                    Ok(r) => r,
                    Err(_) => Ok(Err(HandlerError::retryable(format!(
                        "handler timed out after {limit:?}"
                    )))),
                },
                None => run.await,
            }
        };
        metrics::histogram!("idemq_handler_seconds", "consumer" => inner.name.clone())
            .record(started.elapsed().as_secs_f64());
        result.unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(HandlerError::retryable(format!("handler panicked: {what}")))
        })
    }

    /// Claims the key; with [`InFlightPolicy::Wait`], polls while another
    /// worker holds it, until it completes, its lease expires, or the wait ends.
    async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim<S::Tx>, StoreError> {
        let store = &self.inner.store;
        let claim = store.claim(req).await?;
        let InFlightPolicy::Wait { poll, max_wait } = self.inner.in_flight else {
            return Ok(claim);
        };
        if !matches!(claim, Claim::InFlight) {
            return Ok(claim);
        }
        let deadline = Instant::now() + max_wait;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Ok(Claim::InFlight);
            }
            tokio::time::sleep(poll.min(deadline - now)).await;
            match store.claim(req).await? {
                Claim::InFlight => continue,
                other => return Ok(other),
            }
        }
    }

    async fn run_handler(
        &self,
        mut tx: S::Tx,
        req: &ClaimRequest<'_>,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> Outcome {
        let inner = &*self.inner;
        if let Some(error) = self.over_delivery_limit(meta) {
            if let Err(e) = inner.store.rollback(tx).await {
                tracing::warn!(consumer = %inner.name, key = req.key, error = %e, "rollback failed");
            }
            return self
                .dead_letter_with(
                    Some(req.key),
                    DeadLetterReason::DeliveryLimit,
                    &error,
                    message,
                    meta,
                    0,
                )
                .await;
        }
        let result = self.call_handler(&mut tx, req, message, meta).await;
        crate::failpoint::failpoint!("after_handler");
        match result {
            Ok(value) => {
                crate::failpoint::failpoint!("before_commit");
                match inner.store.commit(tx, req, value.as_ref()).await {
                    Ok(()) => {
                        crate::failpoint::failpoint!("after_commit_before_ack");
                        Outcome::Processed {
                            key: req.key.to_owned(),
                            result: value,
                        }
                    }
                    // The commit may or may not have happened; the redelivery finds out.
                    Err(e) => self.busy(Some(req.key.to_owned()), format!("commit failed: {e}")),
                }
            }
            Err(error) => {
                if let Err(e) = inner.store.rollback(tx).await {
                    tracing::warn!(consumer = %inner.name, key = req.key, error = %e, "rollback failed");
                }
                self.failed(req.key, error, message, meta).await
            }
        }
    }

    pub(crate) async fn failed(
        &self,
        key: &str,
        error: HandlerError,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> Outcome {
        let inner = &*self.inner;
        let text = error.message();
        match error.kind() {
            HandlerErrorKind::Conflict => {
                self.dead_letter_with(
                    Some(key),
                    DeadLetterReason::Conflict,
                    text,
                    message,
                    meta,
                    1,
                )
                .await
            }
            HandlerErrorKind::Permanent => {
                self.dead_letter_with(
                    Some(key),
                    DeadLetterReason::PermanentFailure,
                    text,
                    message,
                    meta,
                    1,
                )
                .await
            }
            HandlerErrorKind::Retryable => {
                let attempts = match inner.store.record_failure(&inner.name, key, text).await {
                    Ok(n) => n,
                    Err(e) => {
                        // Counting failed (the store is down): retry without counting.
                        return self.busy(
                            Some(key.to_owned()),
                            format!("{text}; counting the attempt failed: {e}"),
                        );
                    }
                };
                if attempts >= inner.retry.max_attempts {
                    return self
                        .dead_letter_with(
                            Some(key),
                            DeadLetterReason::RetriesExhausted,
                            text,
                            message,
                            meta,
                            attempts,
                        )
                        .await;
                }
                Outcome::RetryLater {
                    key: Some(key.to_owned()),
                    attempts,
                    delay: error
                        .retry_after()
                        .unwrap_or_else(|| inner.retry.backoff(attempts)),
                    error: text.to_owned(),
                }
            }
        }
    }

    pub(crate) async fn conflict(
        &self,
        record: crate::store::InboxRecord,
        fingerprint: String,
        message: &Message,
        meta: &DeliveryMeta,
    ) -> Outcome {
        if self.inner.conflict == ConflictPolicy::DeadLetter {
            let error = format!(
                "key {:?} was processed with fingerprint {}; this message has {}",
                record.key, record.fingerprint, fingerprint
            );
            let outcome = self
                .dead_letter_with(
                    Some(&record.key),
                    DeadLetterReason::Conflict,
                    &error,
                    message,
                    meta,
                    0,
                )
                .await;
            if matches!(outcome, Outcome::RetryLater { .. }) {
                return outcome;
            }
        }
        Outcome::Conflict {
            record,
            fingerprint,
        }
    }

    /// Not this message's fault: retry after the busy delay without counting an attempt.
    pub(crate) fn busy(&self, key: Option<String>, error: String) -> Outcome {
        Outcome::RetryLater {
            key,
            attempts: 0,
            delay: self.inner.retry.busy_delay,
            error,
        }
    }

    pub(crate) async fn dead_letter(
        &self,
        key: Option<&str>,
        reason: DeadLetterReason,
        message: &Message,
        meta: &DeliveryMeta,
        attempts: u32,
    ) -> Outcome {
        let error = match &reason {
            DeadLetterReason::InvalidInput(e) => e.to_string(),
            other => other.code().to_owned(),
        };
        self.dead_letter_with(key, reason, &error, message, meta, attempts)
            .await
    }

    pub(crate) async fn dead_letter_with(
        &self,
        key: Option<&str>,
        reason: DeadLetterReason,
        error: &str,
        message: &Message,
        meta: &DeliveryMeta,
        attempts: u32,
    ) -> Outcome {
        let letter = DeadLetter {
            consumer: &self.inner.name,
            key,
            reason: &reason,
            error,
            message,
            meta,
            attempts,
        };
        match self.inner.store.dead_letter(&letter).await {
            Ok(()) => Outcome::DeadLettered {
                key: key.map(str::to_owned),
                reason,
                error: error.to_owned(),
            },
            // Never ack what could not be dead-lettered: it comes back.
            Err(e) => self.busy(
                key.map(str::to_owned),
                format!("dead-lettering ({}) failed: {e}", reason.code()),
            ),
        }
    }
}
