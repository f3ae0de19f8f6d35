//! RFC 9457 problem details for the layer's own answers (400, 409, 413,
//! 422, 500, 503), as the Idempotency-Key draft recommends.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

/// The media type of a problem details body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// One of the layer's own error answers. Its `type` is a URN of the form
/// `urn:idemq:problem:<kind>`, stable for clients to match on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The HTTP status.
    pub status: StatusCode,
    /// The kind, the last part of the `type` URN (e.g. `idempotency-key-missing`).
    pub kind: &'static str,
    /// A short, fixed summary.
    pub title: &'static str,
    /// What happened to this request.
    pub detail: String,
    /// Seconds after which a retry may succeed (`Retry-After`), if any.
    pub retry_after: Option<u32>,
}

impl Problem {
    /// 400: the route requires an `Idempotency-Key` and the request has none.
    pub fn missing_key() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "idempotency-key-missing",
            "Idempotency-Key is missing",
            "this operation requires an Idempotency-Key header".into(),
        )
    }

    /// 400: the `Idempotency-Key` header is malformed.
    pub fn invalid_key(detail: String) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
            "Idempotency-Key is invalid",
            detail,
        )
    }

    /// 400: the request's idempotency scope could not be determined.
    pub fn missing_scope() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "idempotency-scope-missing",
            "Idempotency scope is missing",
            "the request carries nothing that identifies its client".into(),
        )
    }

    /// 400: the request could not be fingerprinted (its body could not be
    /// read, or is not the JSON the fingerprint reads from).
    pub fn bad_request(detail: String) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "request-unreadable",
            "The request could not be read",
            detail,
        )
    }

    /// 409: a request with this key is still being processed.
    pub fn in_flight(retry_after: u32) -> Self {
        let mut p = Self::new(
            StatusCode::CONFLICT,
            "idempotency-key-in-flight",
            "A request with this Idempotency-Key is in progress",
            "the first request with this key has not finished; retry later".into(),
        );
        p.retry_after = Some(retry_after);
        p
    }

    /// 413: the body is larger than the layer buffers to fingerprint it.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request-too-large",
            "The request body is too large",
            format!("an idempotent request body may have at most {limit} bytes"),
        )
    }

    /// 422: the key was used before with another request.
    pub fn reused_key() -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency-key-reused",
            "Idempotency-Key reused with another request",
            "this key was used with a request of another method, path, headers or body".into(),
        )
    }

    /// 503: the store could not be reached; a retry may succeed.
    pub fn unavailable(retry_after: u32) -> Self {
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency-store-unavailable",
            "The idempotency store is unavailable",
            "the request was not processed; retry later with the same key".into(),
        );
        p.retry_after = Some(retry_after);
        p
    }

    /// 500: something the layer cannot answer for (a stored response it
    /// cannot read, a response too large to store, a store failure).
    pub fn internal(detail: String) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency-internal-error",
            "The idempotent request could not be completed",
            detail,
        )
    }

    fn new(status: StatusCode, kind: &'static str, title: &'static str, detail: String) -> Self {
        Self {
            status,
            kind,
            title,
            detail,
            retry_after: None,
        }
    }

    /// The `type` member: `urn:idemq:problem:<kind>`.
    pub fn type_uri(&self) -> String {
        format!("urn:idemq:problem:{}", self.kind)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "type": self.type_uri(),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        })
    }

    /// The response: status, `Content-Type: application/problem+json`,
    /// `Retry-After` when set, and the JSON body.
    pub fn response(&self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(Bytes::from(self.body().to_string())));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_body_has_the_rfc_9457_members() {
        let p = Problem::in_flight(1);
        let body = p.body();
        assert_eq!(body["status"], 409);
        assert_eq!(body["type"], "urn:idemq:problem:idempotency-key-in-flight");
        let r = p.response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    }
}
