//! The forms a handler can take besides a type that implements
//! [`Handler`]: an `async fn` (or an async closure that captures nothing),
//! the same with shared state, and a closure returning a boxed future.
//!
//! An `async fn` handler needs no `Box::pin`: [`AsyncHandlerFn`] names the
//! future it returns for each pair of borrowed arguments, which lets the
//! engine require that future to be `Send` on stable Rust (async closures
//! that capture state cannot promise that yet, hence the state form).

use std::future::Future;

use futures_util::future::BoxFuture;

use super::{Context, Handler, HandlerResult};

/// A function usable as a handler: `async fn(&Context<'_>, &mut Tx) -> HandlerResult`.
///
/// Implemented for every `async fn` of that shape and every async closure
/// that captures nothing; pass it to
/// [`ConsumerBuilder::handle`](crate::ConsumerBuilder::handle). Functions
/// that need shared state (a pool, a client) take it as a first argument
/// instead: see [`StateHandlerFn`].
pub trait AsyncHandlerFn<'a, Tx: 'a>: Send + Sync + 'static {
    /// The future the function returns for these borrows.
    type Future: Future<Output = HandlerResult> + Send + 'a;

    /// Calls the function.
    fn call(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> Self::Future;
}

impl<'a, Tx: 'a, F, Fut> AsyncHandlerFn<'a, Tx> for F
where
    F: Fn(&'a Context<'a>, &'a mut Tx) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> Fut {
        self(ctx, tx)
    }
}

/// A function usable as a handler with shared state:
/// `async fn(&State, &Context<'_>, &mut Tx) -> HandlerResult`; pass it to
/// [`ConsumerBuilder::handle_with`](crate::ConsumerBuilder::handle_with).
pub trait StateHandlerFn<'a, State: 'a, Tx: 'a>: Send + Sync + 'static {
    /// The future the function returns for these borrows.
    type Future: Future<Output = HandlerResult> + Send + 'a;

    /// Calls the function.
    fn call(&'a self, state: &'a State, ctx: &'a Context<'a>, tx: &'a mut Tx) -> Self::Future;
}

impl<'a, State: 'a, Tx: 'a, F, Fut> StateHandlerFn<'a, State, Tx> for F
where
    F: Fn(&'a State, &'a Context<'a>, &'a mut Tx) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult> + Send + 'a,
{
    type Future = Fut;

    fn call(&'a self, state: &'a State, ctx: &'a Context<'a>, tx: &'a mut Tx) -> Fut {
        self(state, ctx, tx)
    }
}

/// A [`Handler`] made from an `async fn` ([`AsyncHandlerFn`]).
pub struct AsyncFnHandler<F>(pub F);

impl<Tx: 'static, F> Handler<Tx> for AsyncFnHandler<F>
where
    F: for<'a> AsyncHandlerFn<'a, Tx>,
{
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(self.0.call(ctx, tx))
    }
}

/// A [`Handler`] made from an `async fn` that takes shared state first
/// ([`StateHandlerFn`]).
pub struct StateFnHandler<State, F> {
    state: State,
    f: F,
}

impl<State, F> StateFnHandler<State, F> {
    /// `f` called with `&state` on every message.
    pub fn new(state: State, f: F) -> Self {
        Self { state, f }
    }
}

impl<Tx: 'static, State, F> Handler<Tx> for StateFnHandler<State, F>
where
    State: Send + Sync + 'static,
    F: for<'a> StateHandlerFn<'a, State, Tx>,
{
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(self.f.call(&self.state, ctx, tx))
    }
}

/// A [`Handler`] made from a closure returning a boxed future.
pub struct FnHandler<F>(pub F);

impl<Tx, F> Handler<Tx> for FnHandler<F>
where
    F: for<'a> Fn(&'a Context<'a>, &'a mut Tx) -> BoxFuture<'a, HandlerResult>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        (self.0)(ctx, tx)
    }
}

/// Makes a [`Handler`] from a closure `|ctx, tx| Box::pin(async move { … })`.
///
/// Writing the closure as the argument of this function lets Rust infer
/// its higher-ranked signature. Prefer an `async fn` with
/// [`ConsumerBuilder::handle`](crate::ConsumerBuilder::handle), which needs
/// no `Box::pin`.
pub fn handler_fn<Tx, F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a Context<'a>, &'a mut Tx) -> BoxFuture<'a, HandlerResult>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}
