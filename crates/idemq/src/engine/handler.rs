//! Handlers: the user's code that applies a message's effects.

use futures_util::future::BoxFuture;

use crate::error::HandlerError;
use crate::message::{DeliveryMeta, Message};

/// What a handler returns: an optional result to store with the key (given
/// back on every duplicate), or an error that says whether a retry can help.
pub type HandlerResult = Result<Option<serde_json::Value>, HandlerError>;

/// Everything a handler knows about the message it handles.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// The consumer name.
    pub consumer: &'a str,
    /// The business key (scoped by `consumer` in the store).
    pub key: &'a str,
    /// The payload fingerprint.
    pub fingerprint: &'a str,
    /// The message.
    pub message: &'a Message,
    /// Where and how often it was delivered.
    pub meta: &'a DeliveryMeta,
    /// This attempt's number: failed attempts counted so far + 1, as far as
    /// this process has seen (the store keeps the authoritative count).
    pub attempt: u32,
}

/// Applies one message's effects. `Tx` is the store's transaction (SQL
/// stores) or lease (lease stores): write through it so that the effects
/// commit together with the claim.
///
/// Closures implement it through [`ConsumerBuilder::handler_fn`](crate::ConsumerBuilder::handler_fn).
pub trait Handler<Tx>: Send + Sync + 'static {
    /// Handles one message.
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult>;
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
/// its higher-ranked signature.
pub fn handler_fn<Tx, F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a Context<'a>, &'a mut Tx) -> BoxFuture<'a, HandlerResult>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}

impl<Tx, H> Handler<Tx> for Box<H>
where
    H: Handler<Tx> + ?Sized,
{
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        (**self).handle(ctx, tx)
    }
}
