//! axum extractors (feature `axum`): [`InboxTx`] and [`IdempotencyInfo`].

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::{IntoResponse, Response};
use http::request::Parts;

use crate::core::IdempotencyInfo;
use crate::error::TxError;
use crate::problem::Problem;
use crate::tx::InboxTx;

/// The claim's transaction (SQL stores) or lease of a request that went
/// through the layer with a key. `Option<InboxTx<_>>` for routes where the
/// key is optional.
impl<S, Tx> FromRequestParts<S> for InboxTx<Tx>
where
    S: Send + Sync,
    Tx: Send + 'static,
{
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<InboxTx<Tx>>()
            .cloned()
            .ok_or(TxError::Missing)
    }
}

impl<S, Tx> OptionalFromRequestParts<S> for InboxTx<Tx>
where
    S: Send + Sync,
    Tx: Send + 'static,
{
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<InboxTx<Tx>>().cloned())
    }
}

/// The key and scope of a request that went through the layer with a key.
impl<S: Send + Sync> FromRequestParts<S> for IdempotencyInfo {
    type Rejection = TxError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyInfo>()
            .cloned()
            .ok_or(TxError::Missing)
    }
}

/// A 500 problem: the route is not behind the layer, or the handler kept the
/// transaction. A handler can use `?` on [`InboxTx::lock`].
impl IntoResponse for TxError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self, "the idempotency transaction is not available");
        Problem::internal(self.to_string())
            .response()
            .into_response()
    }
}
