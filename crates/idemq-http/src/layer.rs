//! The tower [`Layer`] and [`Service`] over [`Idempotency`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Either;
use idemq::store::Store;
use tower_layer::Layer;
use tower_service::Service;

use crate::core::{BoxError, Idempotency, ResponseBody};

/// Wraps a service with the Idempotency-Key handling of an [`Idempotency`].
pub struct IdempotencyLayer<S: Store> {
    core: Idempotency<S>,
}

impl<S: Store> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        Self {
            core: self.core.clone(),
        }
    }
}

impl<S: Store> std::fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("core", &self.core)
            .finish()
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// The layer of `core`.
    pub fn new(core: Idempotency<S>) -> Self {
        Self { core }
    }
}

impl<S: Store, I> Layer<I> for IdempotencyLayer<S> {
    type Service = IdempotencyService<S, I>;

    fn layer(&self, inner: I) -> Self::Service {
        IdempotencyService {
            core: self.core.clone(),
            inner,
        }
    }
}

/// The service [`IdempotencyLayer`] makes. A covered request's body is read
/// into memory (to fingerprint it) and handed on as `B::from(bytes)`.
pub struct IdempotencyService<S: Store, I> {
    core: Idempotency<S>,
    inner: I,
}

impl<S: Store, I: Clone> Clone for IdempotencyService<S, I> {
    fn clone(&self) -> Self {
        Self {
            core: self.core.clone(),
            inner: self.inner.clone(),
        }
    }
}

impl<S: Store, I> std::fmt::Debug for IdempotencyService<S, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("core", &self.core)
            .finish_non_exhaustive()
    }
}

/// The future of an [`IdempotencyService`].
pub type ResponseFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, I, B, RB> Service<Request<B>> for IdempotencyService<S, I>
where
    S: Store,
    I: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    I::Future: Send,
    I::Error: Send,
    B: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = I::Error;
    type Future = ResponseFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone is not ready: call the one that was polled ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.core.covers(&request) {
            let future = inner.call(request);
            return Box::pin(async move { Ok(future.await?.map(Either::Right)) });
        }
        let core = self.core.clone();
        Box::pin(async move {
            core.serve(request, move |request: Request<Bytes>| {
                inner.call(request.map(B::from))
            })
            .await
        })
    }
}
