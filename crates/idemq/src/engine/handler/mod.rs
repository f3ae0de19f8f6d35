//! Handlers: the user's code that applies a message's effects, the forms
//! it can take (`functions`) and the layers around it (`layers`).

use std::future::Future;

use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::effect::EffectJournal;
use crate::error::{HandlerError, InputError};
use crate::message::{DeliveryMeta, Message};

mod functions;
pub mod layers;

pub use functions::{
    handler_fn, AsyncFnHandler, AsyncHandlerFn, FnHandler, StateFnHandler, StateHandlerFn,
};

/// What a handler returns: an optional result to store with the key (given
/// back on every duplicate), or an error that says whether a retry can help.
pub type HandlerResult = Result<Option<serde_json::Value>, HandlerError>;

/// Everything a handler knows about the message it handles.
#[derive(Clone, Copy)]
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
    /// The store's effect journal ([`Store::journal`](crate::store::Store::journal)),
    /// used by [`effect`](Self::effect); `None` if the store keeps none.
    pub journal: Option<&'a dyn EffectJournal>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("consumer", &self.consumer)
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .field("message", &self.message)
            .field("meta", &self.meta)
            .field("attempt", &self.attempt)
            .field("journal", &self.journal.is_some())
            .finish()
    }
}

impl Context<'_> {
    /// The payload decoded from JSON to `T`. A payload that does not decode
    /// is the message's fault: the error is
    /// [`invalid input`](crate::HandlerErrorKind::InvalidInput), and `?`
    /// dead-letters the message at once with the reason `undecodable_payload`.
    ///
    /// ```
    /// # use idemq::{Context, HandlerResult};
    /// #[derive(serde::Deserialize)]
    /// struct Payment { amount: i64 }
    ///
    /// async fn charge(ctx: &Context<'_>, _lease: &mut idemq::store::memory::Lease) -> HandlerResult {
    ///     let payment: Payment = ctx.decode()?;
    ///     Ok(Some(serde_json::json!({ "charged": payment.amount })))
    /// }
    /// ```
    pub fn decode<T: serde::de::DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_slice(&self.message.payload).map_err(|e| {
            HandlerError::invalid_input(InputError::Undecodable {
                type_name: std::any::type_name::<T>(),
                error: e.to_string(),
            })
        })
    }

    /// The idempotency key of `step` for this message: the same on every
    /// redelivery and in every process, for the same consumer, key and step;
    /// different for different steps. Send it to the other system so that
    /// it can deduplicate a repeated call.
    ///
    /// `UUIDv5(`[`NAMESPACE`](crate::effect::NAMESPACE)`, consumer 0x00 key
    /// 0x00 step)` over the UTF-8 bytes; see [`effect`](crate::effect) for
    /// the exact derivation and a test vector.
    pub fn idempotency_key(&self, step: &str) -> Uuid {
        crate::effect::idempotency_key(self.consumer, self.key, step)
    }

    /// Runs an external call at most once per (consumer, key, `step`) as far
    /// as idemq can see.
    ///
    /// If the store's journal holds a result for the step, it is returned
    /// without calling. Otherwise `call` gets the step's
    /// [`idempotency_key`](Self::idempotency_key) (send it to the provider)
    /// and, if it succeeds, its result is serialized and written to the
    /// journal, committed on its own (not in the handler's transaction, which
    /// may still roll back), and the stored result is returned (another
    /// worker's, if it stored one first). A failing call returns its error
    /// and is not journaled. A crash between the call and the journal write
    /// is covered only by the provider honouring the key.
    ///
    /// Errors: journal failures are retryable; an invalid step name (empty,
    /// over 128 bytes, control characters), a store without a journal or an
    /// unserializable result are permanent.
    ///
    /// ```no_run
    /// # use idemq::{Context, HandlerError};
    /// # async fn demo(ctx: &Context<'_>) -> Result<(), HandlerError> {
    /// let receipt = ctx
    ///     .effect("charge", |key| async move {
    ///         // e.g. an HTTP call with the header `Idempotency-Key: {key}`
    ///         Ok::<_, HandlerError>(serde_json::json!({ "charge_id": key.to_string() }))
    ///     })
    ///     .await?;
    /// # let _ = receipt; Ok(()) }
    /// ```
    pub async fn effect<T, F, Fut>(
        &self,
        step: &str,
        call: F,
    ) -> Result<serde_json::Value, HandlerError>
    where
        T: serde::Serialize,
        F: FnOnce(Uuid) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
    {
        crate::effect::run(self.journal, self.consumer, self.key, step, call).await
    }
}

/// What [`Handler::handle_batch`] returns: one stored result per message,
/// in the order given, or an error that sends the batch back to be handled
/// one message at a time.
pub type BatchResult = Result<Vec<Option<serde_json::Value>>, HandlerError>;

/// Applies one message's effects. `Tx` is the store's transaction (SQL
/// stores) or lease (lease stores): write through it so that the effects
/// commit together with the claim.
///
/// Closures implement it through [`ConsumerBuilder::handler_fn`](crate::ConsumerBuilder::handler_fn).
///
/// # Set-based batches
///
/// In batch mode ([`Consumer::run_batched`](crate::Consumer::run_batched))
/// on a SQL store every new message of a batch is handled in the batch's
/// one transaction. A handler that can write many messages' effects in one
/// statement (a multi-row `INSERT`, `UNNEST` arrays, `COPY`) says so with
/// [`handles_batches`](Self::handles_batches) and gets the batch's new
/// messages in one [`handle_batch`](Self::handle_batch) call, so that the
/// effects of a batch cost one round trip instead of one per message.
///
/// If `handle_batch` fails, the engine rolls the whole batch back (claims
/// included) and runs it again one message at a time through
/// [`handle`](Self::handle), each in its own savepoint: the failing message
/// is retried or dead-lettered alone, exactly as in per-message mode, and
/// every other message is applied once. So `handle_batch` may fail for any
/// reason it cannot split per message (one bad row fails a multi-row
/// statement); it must write the same effects `handle` would. Lease stores
/// (memory, Redis, MongoDB), whose members each hold their own lease, and
/// batches with a single new message always go through `handle`.
///
/// ```
/// # #[cfg(feature = "sqlite")]
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use futures_util::future::BoxFuture;
/// use idemq::engine::{BatchOptions, BatchResult};
/// use idemq::source::queue::MemoryQueue;
/// use idemq::sqlx::{QueryBuilder, Sqlite, Transaction};
/// use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
/// use idemq::{Consumer, Context, Handler, HandlerResult, KeySpec, Message};
///
/// /// Appends each payment to the ledger: one row per message, one
/// /// statement per batch.
/// struct Ledger;
///
/// impl Handler<Transaction<'static, Sqlite>> for Ledger {
///     fn handle<'a>(
///         &'a self,
///         ctx: &'a Context<'a>,
///         tx: &'a mut Transaction<'static, Sqlite>,
///     ) -> BoxFuture<'a, HandlerResult> {
///         Box::pin(async move {
///             self.handle_batch(std::slice::from_ref(ctx), tx).await?;
///             Ok(None)
///         })
///     }
///
///     fn handles_batches(&self) -> bool {
///         true
///     }
///
///     fn handle_batch<'a>(
///         &'a self,
///         batch: &'a [Context<'a>],
///         tx: &'a mut Transaction<'static, Sqlite>,
///     ) -> BoxFuture<'a, BatchResult> {
///         Box::pin(async move {
///             let mut insert = QueryBuilder::new("INSERT INTO ledger (id, amount) ");
///             insert.push_values(batch, |mut row, ctx| {
///                 let amount = ctx.message.json().ok().and_then(|p| p["amount"].as_i64());
///                 row.push_bind(ctx.key.to_owned()).push_bind(amount);
///             });
///             insert.build().execute(&mut **tx).await?;
///             Ok(vec![None; batch.len()])
///         })
///     }
/// }
///
/// let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
/// store.migrate().await.unwrap();
/// idemq::sqlx::query("CREATE TABLE ledger (id TEXT NOT NULL, amount INTEGER NOT NULL)")
///     .execute(store.pool())
///     .await
///     .unwrap();
/// let consumer = Consumer::builder("payments", store.clone())
///     .key(KeySpec::json("/id"))
///     .handler(Ledger)
///     .build()
///     .unwrap();
/// let queue = MemoryQueue::new("q");
/// for (id, amount) in [(1, 10), (2, 20), (1, 10), (3, 30)] {
///     queue.push(Message::new(format!(r#"{{"id":{id},"amount":{amount}}}"#)));
/// }
/// queue.close();
/// consumer.run_batched(queue.source(), BatchOptions::default()).await.unwrap();
/// let (rows, total): (i64, i64) = idemq::sqlx::query_as("SELECT count(*), sum(amount) FROM ledger")
///     .fetch_one(store.pool())
///     .await
///     .unwrap();
/// assert_eq!((rows, total), (3, 60));
/// # });
/// ```
pub trait Handler<Tx>: Send + Sync + 'static {
    /// Handles one message.
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult>;

    /// Whether [`handle_batch`](Self::handle_batch) handles a batch in
    /// fewer round trips than one [`handle`](Self::handle) per message, so
    /// that the engine should call it. By default, no.
    fn handles_batches(&self) -> bool {
        false
    }

    /// Handles the new messages of a batch at once, in the batch's
    /// transaction; returns one result per message, in order (see
    /// [set-based batches](Self#set-based-batches)). By default, one
    /// [`handle`](Self::handle) after the other, failing at the first error.
    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult>
    where
        Tx: Send,
    {
        Box::pin(async move {
            let mut results = Vec::with_capacity(batch.len());
            for ctx in batch {
                results.push(self.handle(ctx, tx).await?);
            }
            Ok(results)
        })
    }
}

impl<Tx, H> Handler<Tx> for Box<H>
where
    H: Handler<Tx> + ?Sized,
{
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        (**self).handle(ctx, tx)
    }

    fn handles_batches(&self) -> bool {
        (**self).handles_batches()
    }

    fn handle_batch<'a>(
        &'a self,
        batch: &'a [Context<'a>],
        tx: &'a mut Tx,
    ) -> BoxFuture<'a, BatchResult>
    where
        Tx: Send,
    {
        (**self).handle_batch(batch, tx)
    }
}
