//! An idempotent write to MongoDB: the message's document inserted once,
//! keyed by its business key (cargo feature `mongodb`).
//!
//! The second recipe of the idempotent-consumer pattern: make the write
//! itself idempotent. [`upsert_once`] runs
//! `updateOne({_id: key}, {$setOnInsert: document}, {upsert: true})`: the
//! first delivery inserts the document, and every later one (a redelivery
//! after a crash, a duplicate published twice, a second worker that took an
//! expired lease over) matches the existing `_id` and rewrites nothing. Of
//! two racing first deliveries, the unique `_id` index lets one insert; the
//! other's duplicate-key error (11000) means the same thing as a match.
//!
//! That holds on any MongoDB-wire server whose `_id` index is unique,
//! including FerretDB, whose updates are not atomic (read, then write back):
//! the decision is the insert, never a conditional update.
//!
//! What it does not do: change a document that exists. A redelivery with
//! *another* payload for the same key leaves the first one in place (the
//! inbox in front of it reports such a message as a conflict by its
//! fingerprint before the handler runs).
//!
//! ```no_run
//! use idemq::effect::mongo::{document_of, upsert_once, Upserted};
//! use idemq::store::mongo::MongoStore;
//! use idemq::{Consumer, KeySpec};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MongoStore::connect("mongodb://127.0.0.1:27017/shop").await?;
//! let payments = store.database().collection("payments");
//! let consumer = Consumer::builder("billing", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(move |ctx, _lease| {
//!         let payments = payments.clone();
//!         Box::pin(async move {
//!             let document = document_of(ctx.message)?;
//!             let done = upsert_once(&payments, ctx.key, document).await?;
//!             Ok(Some(serde_json::json!({ "inserted": done == Upserted::Inserted })))
//!         })
//!     })
//!     .build()?;
//! # let _ = consumer;
//! # Ok(())
//! # }
//! ```

use mongodb::bson::{doc, Bson, Document};
use mongodb::Collection;

/// The `mongodb` driver crate this module is built on (for [`Collection`]
/// and [`Client`](mongodb::Client) without a direct dependency).
pub use mongodb;

use crate::error::HandlerError;
use crate::message::Message;
use crate::store::mongo::error::{is_duplicate, is_transient};
use crate::{Context, Handler, HandlerResult};
use futures_util::future::BoxFuture;

/// What [`upsert_once`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upserted {
    /// No document had the key: this call inserted it.
    Inserted,
    /// A document with the key existed (an earlier delivery wrote it):
    /// nothing was written.
    AlreadyPresent,
}

/// Inserts `document` with `_id` = `key` into `collection` unless a document
/// with that `_id` exists; never modifies an existing one.
///
/// `document` must not carry an `_id` other than `key`
/// ([`HandlerErrorKind::Permanent`](crate::HandlerErrorKind::Permanent)).
/// Network errors, timeouts and a server stepping down are
/// [`Retryable`](crate::HandlerErrorKind::Retryable); other server errors
/// (a document too large, a validation rule) are permanent.
pub async fn upsert_once(
    collection: &Collection<Document>,
    key: &str,
    mut document: Document,
) -> Result<Upserted, HandlerError> {
    match document.remove("_id") {
        None => {}
        Some(Bson::String(id)) if id == key => {}
        Some(other) => {
            return Err(HandlerError::permanent(format!(
                "the document's _id {other} is not the message key {key:?}"
            )))
        }
    }
    let update = doc! { "$setOnInsert": document };
    match collection
        .update_one(doc! { "_id": key }, update)
        .upsert(true)
        .await
    {
        Ok(result) if result.upserted_id.is_some() => Ok(Upserted::Inserted),
        Ok(_) => Ok(Upserted::AlreadyPresent),
        Err(e) if is_duplicate(&e) => Ok(Upserted::AlreadyPresent),
        Err(e) if is_transient(&e) => Err(HandlerError::retryable(format!(
            "mongodb upsert into {}: {}",
            collection.name(),
            e.kind
        ))),
        Err(e) => Err(HandlerError::permanent(format!(
            "mongodb upsert into {}: {}",
            collection.name(),
            e.kind
        ))),
    }
}

/// The message's JSON payload as a BSON document: a JSON object, else
/// [`InputError`](crate::InputError) (`MalformedJson`), which the engine
/// dead-letters as bad input.
pub fn document_of(message: &Message) -> Result<Document, HandlerError> {
    let value = message.json().map_err(|e| {
        HandlerError::invalid_input(crate::InputError::MalformedJson(e.to_string()))
    })?;
    if !value.is_object() {
        return Err(HandlerError::invalid_input(
            crate::InputError::MalformedJson(
                "the payload is not a JSON object, so it is not a document".into(),
            ),
        ));
    }
    mongodb::bson::to_document(&value).map_err(|e| {
        HandlerError::invalid_input(crate::InputError::MalformedJson(format!(
            "the payload is not a BSON document: {e}"
        )))
    })
}

/// A handler that writes each message's payload (a JSON object) into one
/// collection with [`upsert_once`], keyed by the message key; its stored
/// result is `{"collection": name, "inserted": bool}`. Usable with any store
/// (it ignores the store's transaction or lease).
#[derive(Debug, Clone)]
pub struct UpsertHandler {
    collection: Collection<Document>,
}

impl UpsertHandler {
    /// Writes into `collection`.
    pub fn new(collection: Collection<Document>) -> Self {
        Self { collection }
    }
}

impl<Tx: Send + 'static> Handler<Tx> for UpsertHandler {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, _tx: &'a mut Tx) -> BoxFuture<'a, HandlerResult> {
        Box::pin(async move {
            let document = document_of(ctx.message)?;
            let done = upsert_once(&self.collection, ctx.key, document).await?;
            Ok(Some(serde_json::json!({
                "collection": self.collection.name(),
                "inserted": done == Upserted::Inserted,
            })))
        })
    }
}
