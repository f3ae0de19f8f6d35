//! [`Idempotency`]: the request path, independent of tower, so that a proxy
//! (or any server) can drive it with its own "next" step.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Either, Full, LengthLimitError, Limited};
use idemq::store::{Claim, ClaimRequest, Store, StoreAdmin};
use idemq::{InFlightPolicy, RetentionPolicy, StoreError, StoreErrorKind};

use crate::config::{Disposition, DispositionFn, Fingerprint, HeaderSelection, ScopeFn, Settings};
use crate::error::ConfigError;
use crate::header::{parse_key, IDEMPOTENCY_KEY};
use crate::problem::Problem;
use crate::registry::{Entry, Phase, Registry, Slot};
use crate::stored::StoredResponse;
use crate::tx::InboxTx;

/// A boxed error, as bodies report them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a response that went through the layer: the layer's own
/// (a stored, replayed or problem response) or the inner service's,
/// passed through untouched.
pub type ResponseBody<B> = Either<Full<Bytes>, B>;

/// The most bytes a store keeps as a key (the SQL stores' `msg_key` column).
pub const MAX_SCOPED_KEY: usize = 512;

/// Put in the extensions of a request whose key was claimed: the key and
/// its scope as the layer stored them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    /// The caller's scope.
    pub scope: String,
    /// The `Idempotency-Key`, unquoted.
    pub key: String,
    /// The key as stored: the escaped scope, `/`, the key.
    pub stored_key: String,
}

/// The server-side Idempotency-Key logic over an idemq [`Store`]: build it
/// with [`Idempotency::builder`], then wrap services with
/// [`layer`](Self::layer) or drive it yourself with [`serve`](Self::serve).
/// Cloning is cheap and shares everything (the store, the settings, the
/// register of keys in flight).
pub struct Idempotency<S: Store> {
    shared: Arc<Shared<S>>,
}

impl<S: Store> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: Store> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("settings", &self.shared.settings)
            .finish_non_exhaustive()
    }
}

struct Shared<S: Store> {
    store: S,
    settings: Settings,
    registry: Registry,
}

/// Builds an [`Idempotency`].
pub struct IdempotencyBuilder<S: Store> {
    store: S,
    settings: Settings,
}

impl<S: Store> std::fmt::Debug for IdempotencyBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyBuilder")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<S: Store> IdempotencyBuilder<S> {
    /// The name the keys are stored under (the idemq consumer name; default
    /// `http`). Layers with different names never share keys.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.settings.name = name.into();
        self
    }

    /// How a request's scope is found: the tenant, the hashed API key, the
    /// route. `None` from it answers 400. The default puts every request in
    /// one scope; see [`hashed_header_scope`](crate::config::hashed_header_scope).
    pub fn scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.settings.scope = Arc::new(scope);
        self
    }

    /// [`scope`](Self::scope) from a shared function.
    pub fn scope_fn(mut self, scope: ScopeFn) -> Self {
        self.settings.scope = scope;
        self
    }

    /// The methods the layer covers (default `POST` and `PATCH`, the
    /// non-idempotent ones); other requests pass through untouched.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings.methods = methods.into_iter().collect();
        self
    }

    /// Whether a covered request without `Idempotency-Key` is refused with
    /// 400 (default `true`) or passed through untouched.
    pub fn require_key(mut self, require: bool) -> Self {
        self.settings.require_key = require;
        self
    }

    /// What the request fingerprint covers.
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.settings.fingerprint = fingerprint;
        self
    }

    /// Which response headers are stored and replayed.
    pub fn stored_headers(mut self, selection: HeaderSelection) -> Self {
        self.settings.stored_headers = selection;
        self
    }

    /// Which statuses are stored and which release the key (default
    /// [`default_disposition`](crate::config::default_disposition)).
    pub fn disposition(
        mut self,
        f: impl Fn(StatusCode) -> Disposition + Send + Sync + 'static,
    ) -> Self {
        let f: DispositionFn = Arc::new(f);
        self.settings.disposition = f;
        self
    }

    /// A request whose key is in flight: 409 at once (`Reject`, default) or
    /// wait for the first one's answer (`Wait`).
    pub fn in_flight(mut self, policy: InFlightPolicy) -> Self {
        self.settings.in_flight = policy;
        self
    }

    /// How long a lease store's claim holds without a heartbeat (default
    /// 30 s). The Redis store renews it every third of that while the
    /// handler runs; the memory store does not, so there it must exceed the
    /// longest request.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        self
    }

    /// The header that marks a replayed response (default
    /// `Idempotent-Replayed: true`).
    pub fn replay_header(mut self, name: HeaderName) -> Self {
        self.settings.replay_header = name;
        self
    }

    /// The largest request body read to fingerprint it (default 1 MiB; more is 413).
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.settings.max_request_body = bytes;
        self
    }

    /// The largest response body stored (default 1 MiB). A larger response
    /// to store releases the key and answers 500. On MariaDB the stored
    /// response must also fit the inbox's `TEXT` column (64 KiB).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.settings.max_response_body = bytes;
        self
    }

    /// `Retry-After` seconds on a 409 or 503 (default 1).
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.settings.retry_after = seconds;
        self
    }

    /// Checks the settings.
    pub fn build(self) -> Result<Idempotency<S>, ConfigError> {
        idemq::engine::validate_consumer_name(&self.settings.name)?;
        if let InFlightPolicy::Wait { poll, .. } = self.settings.in_flight {
            if poll.is_zero() {
                return Err(ConfigError::Option(
                    "the wait poll interval must be above zero".into(),
                ));
            }
        }
        if self.settings.lease.is_zero() {
            return Err(ConfigError::Option("the lease must be above zero".into()));
        }
        Ok(Idempotency {
            shared: Arc::new(Shared {
                store: self.store,
                settings: self.settings,
                registry: Registry::default(),
            }),
        })
    }
}

/// Where a request stands before its body is read.
enum Route {
    /// Not covered: pass it on untouched.
    Pass,
    /// Refused with this problem.
    Refuse(Problem),
    /// Covered, with this key.
    Keyed(IdempotencyInfo),
}

/// Escapes `%` and `/` so that the first `/` of a stored key ends the scope.
fn escape_scope(scope: &str) -> String {
    scope.replace('%', "%25").replace('/', "%2F")
}

/// Makes sure a claim that did not finish is given back: a request whose
/// future was dropped (the client went away) or that failed releases its key.
struct ClaimGuard<S: Store> {
    shared: Arc<Shared<S>>,
    tx: Option<InboxTx<S::Tx>>,
}

impl<S: Store> ClaimGuard<S> {
    /// Takes the claim back from the handle, disarming the guard.
    fn take(&mut self) -> Option<S::Tx> {
        self.tx.take().and_then(|handle| handle.take())
    }
}

impl<S: Store> Drop for ClaimGuard<S> {
    fn drop(&mut self) {
        let Some(tx) = self.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // the transaction's or lease's own drop handles it
        };
        let shared = Arc::clone(&self.shared);
        runtime.spawn(async move {
            if let Err(e) = shared.store.rollback(tx).await {
                tracing::warn!(error = %e, "releasing an abandoned idempotency claim failed");
            }
        });
    }
}

impl<S: Store> Idempotency<S> {
    /// Starts a builder over `store` (migrated already, for SQL stores).
    pub fn builder(store: S) -> IdempotencyBuilder<S> {
        IdempotencyBuilder {
            store,
            settings: Settings::default(),
        }
    }

    /// The tower layer.
    pub fn layer(&self) -> crate::layer::IdempotencyLayer<S> {
        crate::layer::IdempotencyLayer::new(self.clone())
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.shared.store
    }

    /// Whether the layer covers a request of this method (the rest pass
    /// through without their body being read).
    pub fn covers(&self, request: &Request<impl Sized>) -> bool {
        let s = &self.shared.settings;
        s.methods.contains(request.method())
            && (s.require_key || request.headers().contains_key(IDEMPOTENCY_KEY))
    }

    fn route(&self, parts: &Parts) -> Route {
        let s = &self.shared.settings;
        if !s.methods.contains(&parts.method) {
            return Route::Pass;
        }
        let key = match parse_key(parts.headers.get_all(IDEMPOTENCY_KEY)) {
            Ok(Some(key)) => key,
            Ok(None) if s.require_key => return Route::Refuse(Problem::missing_key()),
            Ok(None) => return Route::Pass,
            Err(e) => return Route::Refuse(Problem::invalid_key(e.to_string())),
        };
        let Some(scope) = (s.scope)(parts) else {
            return Route::Refuse(Problem::missing_scope());
        };
        let stored_key = format!("{}/{key}", escape_scope(&scope));
        if stored_key.len() > MAX_SCOPED_KEY {
            let e = crate::error::KeyError::TooLong {
                len: stored_key.len(),
                max: MAX_SCOPED_KEY,
            };
            return Route::Refuse(Problem::invalid_key(e.to_string()));
        }
        Route::Keyed(IdempotencyInfo {
            scope,
            key,
            stored_key,
        })
    }

    /// Runs one request through the layer. `next` is the rest of the
    /// server (the inner service, or an upstream for a proxy); it gets the
    /// request with its body read into memory and, when a key was claimed,
    /// an [`InboxTx`] and an [`IdempotencyInfo`] in its extensions.
    ///
    /// Errors of `next` release the key and are returned as they are;
    /// everything else is a response (the layer's own answers are RFC 9457
    /// problem details).
    pub async fn serve<B, N, Fut, RB, E>(
        &self,
        request: Request<B>,
        next: N,
    ) -> Result<Response<ResponseBody<RB>>, E>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BoxError>,
        N: FnOnce(Request<Bytes>) -> Fut,
        Fut: Future<Output = Result<Response<RB>, E>>,
        RB: Body<Data = Bytes>,
        RB::Error: Into<BoxError>,
    {
        let (parts, body) = request.into_parts();
        let info = match self.route(&parts) {
            Route::Pass => {
                let body = match read_body(body, usize::MAX).await {
                    Ok(body) => body,
                    Err(p) => return Ok(problem(&p)),
                };
                let response = next(Request::from_parts(parts, body)).await?;
                return Ok(response.map(Either::Right));
            }
            Route::Refuse(p) => return Ok(problem(&p)),
            Route::Keyed(info) => info,
        };
        let settings = &self.shared.settings;
        let body = match read_body(body, settings.max_request_body).await {
            Ok(body) => body,
            Err(p) => return Ok(problem(&p)),
        };
        let fingerprint = match settings.fingerprint.compute(&parts, &body) {
            Ok(f) => f,
            Err(e) => {
                return Ok(problem(&Problem::bad_request(format!(
                    "cannot fingerprint the request: {e}"
                ))))
            }
        };
        let req = ClaimRequest {
            consumer: &settings.name,
            key: &info.stored_key,
            fingerprint: &fingerprint,
            lease: settings.lease,
        };
        let (slot, tx) = match self.claim(&req).await {
            Claimed::New(slot, tx) => (slot, tx),
            Claimed::Answer(response) => return Ok(response.map(Either::Left)),
        };
        slot.running();
        tracing::debug!(key = %info.key, scope = %info.scope, "idempotency key claimed");
        let handle = InboxTx::new(tx);
        let mut guard = ClaimGuard {
            shared: Arc::clone(&self.shared),
            tx: Some(handle.clone()),
        };
        let mut request = Request::from_parts(parts, body);
        request.extensions_mut().insert(handle);
        request.extensions_mut().insert(info.clone());
        // An error of `next` drops the guard, which releases the key.
        let response = next(request).await?;
        let response = self.finish(&mut guard, &req, response).await;
        drop(slot);
        Ok(response)
    }

    /// Claims the key, waiting or answering as the in-flight policy says.
    async fn claim(&self, req: &ClaimRequest<'_>) -> Claimed<S::Tx> {
        let settings = &self.shared.settings;
        let started = Instant::now();
        let max_wait = match settings.in_flight {
            InFlightPolicy::Wait { max_wait, .. } => max_wait,
            _ => Duration::ZERO,
        };
        // A claim in progress elsewhere in this process is waited for in
        // any case (it ends in a replay or a release), for at most a lease.
        let claim_wait = max_wait.max(settings.lease);
        let in_flight = || Claimed::Answer(Problem::in_flight(settings.retry_after).response());
        loop {
            let slot = match self.shared.registry.enter(req.key) {
                Entry::Held(slot) => slot,
                Entry::Taken(mut rx) => {
                    let phase = *rx.borrow_and_update();
                    let limit = match phase {
                        Phase::Running if max_wait.is_zero() => return in_flight(),
                        Phase::Running => max_wait,
                        Phase::Claiming => claim_wait,
                    };
                    let Some(left) = limit.checked_sub(started.elapsed()) else {
                        return in_flight();
                    };
                    match tokio::time::timeout(left, rx.changed()).await {
                        Err(_) => return in_flight(),
                        Ok(_) => continue, // its phase changed or it let go
                    }
                }
            };
            let claim = match self.shared.store.claim(req).await {
                Ok(claim) => claim,
                Err(e) => return Claimed::Answer(store_failure(&e, settings.retry_after)),
            };
            match claim {
                Claim::New(tx) => return Claimed::New(slot, tx),
                Claim::Done(record) => {
                    drop(slot);
                    return Claimed::Answer(self.replay(req, &record));
                }
                Claim::InFlight => {
                    // Held by another process (lease stores).
                    drop(slot);
                    let InFlightPolicy::Wait { poll, max_wait } = settings.in_flight else {
                        return in_flight();
                    };
                    let Some(left) = max_wait.checked_sub(started.elapsed()) else {
                        return in_flight();
                    };
                    if left.is_zero() {
                        return in_flight();
                    }
                    tokio::time::sleep(poll.min(left)).await;
                }
            }
        }
    }

    /// The answer to a retry of a completed key: its stored response, or 422.
    fn replay(
        &self,
        req: &ClaimRequest<'_>,
        record: &idemq::store::InboxRecord,
    ) -> Response<Full<Bytes>> {
        if record.fingerprint != req.fingerprint {
            return Problem::reused_key().response();
        }
        let stored = record
            .result
            .as_ref()
            .ok_or_else(|| "the key was completed without a stored response".to_owned())
            .and_then(|v| StoredResponse::from_json(v).map_err(|e| e.to_string()));
        match stored {
            Ok(stored) => {
                let mut response = stored.to_response();
                response.headers_mut().insert(
                    self.shared.settings.replay_header.clone(),
                    HeaderValue::from_static("true"),
                );
                response
            }
            Err(e) => {
                tracing::error!(key = %req.key, error = %e, "cannot replay a completed idempotency key");
                Problem::internal("the stored response of this key cannot be read".into())
                    .response()
            }
        }
    }

    /// Stores or releases as the status says, and answers.
    async fn finish<RB>(
        &self,
        guard: &mut ClaimGuard<S>,
        req: &ClaimRequest<'_>,
        response: Response<RB>,
    ) -> Response<ResponseBody<RB>>
    where
        RB: Body<Data = Bytes>,
        RB::Error: Into<BoxError>,
    {
        let settings = &self.shared.settings;
        let store = &self.shared.store;
        if (settings.disposition)(response.status()) == Disposition::Release {
            if let Some(tx) = guard.take() {
                if let Err(e) = store.rollback(tx).await {
                    tracing::warn!(key = %req.key, error = %e, "releasing an idempotency key failed");
                }
            }
            return response.map(Either::Right);
        }
        let (parts, body) = response.into_parts();
        let body = match Limited::new(body, settings.max_response_body)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                let detail = if e.downcast_ref::<LengthLimitError>().is_some() {
                    format!(
                        "the response is larger than the {} bytes that can be stored",
                        settings.max_response_body
                    )
                } else {
                    "the response body could not be read".to_owned()
                };
                tracing::error!(key = %req.key, error = %e, "the response to store failed; the key is released");
                self.release(guard, req).await;
                return problem(&Problem::internal(detail));
            }
        };
        let stored = StoredResponse {
            status: parts.status,
            headers: parts
                .headers
                .iter()
                .filter(|(name, _)| settings.stored_headers.keeps(name))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect(),
            body,
        };
        let Some(tx) = guard.take() else {
            tracing::error!(key = %req.key, "the handler kept the idempotency transaction past its response");
            return problem(&Problem::internal(
                "the handler did not give the transaction back".into(),
            ));
        };
        if let Err(e) = store.commit(tx, req, Some(&stored.to_json())).await {
            tracing::error!(key = %req.key, error = %e, "storing the response failed");
            return store_failure(&e, settings.retry_after).map(Either::Left);
        }
        let mut response = Response::from_parts(parts, Full::new(stored.body));
        response.headers_mut().remove(http::header::CONTENT_LENGTH);
        response.map(Either::Left)
    }

    async fn release(&self, guard: &mut ClaimGuard<S>, req: &ClaimRequest<'_>) {
        if let Some(tx) = guard.take() {
            if let Err(e) = self.shared.store.rollback(tx).await {
                tracing::warn!(key = %req.key, error = %e, "releasing an idempotency key failed");
            }
        }
    }
}

impl<S: Store + StoreAdmin> Idempotency<S> {
    /// Expires keys first seen more than `policy.keep_for` ago, with idemq's
    /// retention (`idemq::retention::prune`): a later retry of such a key
    /// runs again. Pruning covers every consumer of the store: give the
    /// HTTP keys their own tables (SQL table prefix, Redis prefix) when
    /// their retention differs. The Redis store also expires them by itself
    /// after its `RedisOptions::retention`.
    pub async fn expire(&self, policy: &RetentionPolicy) -> Result<u64, StoreError> {
        idemq::retention::prune(&self.shared.store, policy).await
    }
}

enum Claimed<Tx> {
    New(Slot, Tx),
    Answer(Response<Full<Bytes>>),
}

fn problem<RB>(p: &Problem) -> Response<ResponseBody<RB>> {
    p.response().map(Either::Left)
}

fn store_failure(e: &StoreError, retry_after: u32) -> Response<Full<Bytes>> {
    if matches!(
        e.kind(),
        StoreErrorKind::Transient | StoreErrorKind::LeaseLost
    ) {
        // Lease lost: another request took the key over after this one's
        // lease ran out; a retry gets its answer.
        tracing::warn!(error = %e, "the idempotency store is unavailable");
        Problem::unavailable(retry_after).response()
    } else {
        tracing::error!(error = %e, "the idempotency store failed");
        Problem::internal("the idempotency store failed".into()).response()
    }
}

/// Reads a request body into memory, up to `limit` bytes.
async fn read_body<B>(body: B, limit: usize) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(Problem::too_large(limit)),
        Err(e) => Err(Problem::bad_request(format!(
            "the request body could not be read: {e}"
        ))),
    }
}
