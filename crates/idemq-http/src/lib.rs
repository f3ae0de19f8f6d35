//! # idemq-http — a server-side `Idempotency-Key` layer
//!
//! A [tower](https://docs.rs/tower) layer (and, with the `axum` feature, extractors) that makes
//! `POST`/`PATCH` handlers idempotent per
//! [draft-ietf-httpapi-idempotency-key-header](https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/),
//! over the idemq stores: PostgreSQL, MariaDB/MySQL, SQLite, Redis and memory.
//!
//! - the key is the `Idempotency-Key` header, a Structured Field string
//!   (`Idempotency-Key: "8e03978e-…"`), scoped by a caller-supplied scope
//!   (tenant, hashed API key, route) so two clients' keys never collide;
//! - the first request claims the key ([`Store::claim`](idemq::store::Store::claim)),
//!   runs the inner service and stores status, chosen headers and body with
//!   the key as the claim's result; on SQL stores the handler can write its
//!   business rows in the claim's own transaction ([`InboxTx`]), so the
//!   effect and the stored response commit together;
//! - a retry after completion gets the stored response byte for byte, with
//!   `Idempotent-Replayed: true`;
//! - the same key while the first request runs: 409 (or, with
//!   [`InFlightPolicy::Wait`], the first one's answer); the same key with
//!   another request fingerprint: 422; a missing key: 400 — as RFC 9457
//!   problem details ([`Problem`]);
//! - 5xx (and 408, 409, 425, 429) release the key, as does a request whose
//!   future is dropped (the connection went away); everything else is
//!   stored ([`Disposition`]). Keys expire with idemq's retention
//!   ([`Idempotency::expire`]).
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use idemq::store::memory::MemoryStore;
//! use idemq_http::Idempotency;
//! use tower::{service_fn, Layer, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idemq_http::BoxError> {
//! let idempotency = Idempotency::builder(MemoryStore::new())
//!     .scope(|parts| parts.headers.get("x-tenant")?.to_str().ok().map(str::to_owned))
//!     .build()?;
//! let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
//! let counter = calls.clone();
//! let service = idempotency.layer().layer(service_fn(move |_req: Request<Full<Bytes>>| {
//!     let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
//!     async move {
//!         let mut response = Response::new(Full::new(Bytes::from(format!("order {n}"))));
//!         *response.status_mut() = StatusCode::CREATED;
//!         Ok::<_, Infallible>(response)
//!     }
//! }));
//! let request = || {
//!     Request::post("/orders")
//!         .header("x-tenant", "acme")
//!         .header("idempotency-key", "\"7f1c0e0a\"")
//!         .body(Full::new(Bytes::from_static(b"{\"item\":\"book\"}")))
//! };
//! let first = service.clone().oneshot(request()?).await?;
//! let retry = service.clone().oneshot(request()?).await?;
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(first.into_body().collect().await?.to_bytes(), "order 1");
//! assert_eq!(retry.into_body().collect().await?.to_bytes(), "order 1");
//! assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```
//!
//! What happens on each store when the server dies mid-request, and how a
//! proxy can reuse [`Idempotency::serve`], is in the crate's README.

#![warn(missing_docs)]

#[cfg(feature = "axum")]
mod axum;
pub mod config;
mod core;
pub mod error;
pub mod header;
mod layer;
pub mod problem;
mod registry;
pub mod stored;
mod tx;

pub use crate::config::{
    default_disposition, hashed_header_scope, Disposition, Fingerprint, HeaderSelection,
};
pub use crate::core::{
    BoxError, Idempotency, IdempotencyBuilder, IdempotencyInfo, ResponseBody, MAX_SCOPED_KEY,
};
pub use crate::error::{ConfigError, KeyError, TxError};
pub use crate::layer::{IdempotencyLayer, IdempotencyService, ResponseFuture};
pub use crate::problem::Problem;
pub use crate::stored::StoredResponse;
pub use crate::tx::{InboxTx, TxGuard};
pub use idemq::InFlightPolicy;
