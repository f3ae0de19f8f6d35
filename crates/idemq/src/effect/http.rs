//! Effects over HTTP: the `Idempotency-Key` header and a status mapping
//! (cargo feature `http`, over [`reqwest`]).
//!
//! A call to an HTTP API from a handler is outside the inbox transaction.
//! This module sends it the way the IETF draft
//! [`draft-ietf-httpapi-idempotency-key-header`](https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/)
//! describes, with the step's derived key
//! ([`idempotency_key`](crate::effect::idempotency_key)), and runs it through
//! the effect journal ([`Context::effect`](crate::Context::effect)), so that a
//! redelivery neither repeats the call (journal) nor, if the process died
//! before the journal write, repeats its effect (the provider deduplicates by
//! the key).
//!
//! # The header
//!
//! `Idempotency-Key` is an Item Structured Header field (RFC 8941) whose
//! value is a String: the key in double quotes,
//!
//! ```text
//! Idempotency-Key: "972e9c90-e2be-5b65-bd74-98d4d423507e"
//! ```
//!
//! ([`header_value`], [`IdempotencyKeyExt::idempotency_key`]). A request
//! carries it once: setting it replaces any earlier value.
//!
//! # Status mapping
//!
//! What a response (or a failure to get one) means for the message, as
//! returned by [`classify`], [`send`], [`effect`] and [`post_json`]:
//!
//! | response | meaning | result |
//! |---|---|---|
//! | 2xx | done | `Ok(`[`StoredResponse`]`)`: the status and the body (JSON if it parses, else a string, `null` if empty), journaled |
//! | 409 Conflict | a request with this key is still being processed (the draft's "in flight") | [`HandlerErrorKind::Retryable`](crate::HandlerErrorKind::Retryable), after `Retry-After` if given |
//! | 422 Unprocessable Content | the key was used before with another payload | [`HandlerErrorKind::Conflict`](crate::HandlerErrorKind::Conflict) (dead-lettered with the reason `conflict`, counted as a conflict) |
//! | 408, 429, 5xx | transient | [`HandlerErrorKind::Retryable`](crate::HandlerErrorKind::Retryable), after `Retry-After` if given, else the policy's backoff |
//! | timeout, connection refused or reset, body cut off | transient | [`HandlerErrorKind::Retryable`](crate::HandlerErrorKind::Retryable) |
//! | any other status (other 4xx, 1xx, an unfollowed 3xx) | the request is wrong | [`HandlerErrorKind::Permanent`](crate::HandlerErrorKind::Permanent) with the status and the body (first [`MAX_REASON_BODY`] bytes) |
//! | invalid request (bad URL or header), redirect loop | the request is wrong | [`HandlerErrorKind::Permanent`](crate::HandlerErrorKind::Permanent) |
//!
//! `Retry-After` is read as delay-seconds or an HTTP date, capped at
//! [`MAX_RETRY_AFTER`]. Retryable errors are retried by the engine with the
//! same key until the retry policy's attempts run out; then the message is
//! dead-lettered (`retries_exhausted`).
//!
//! # Example
//!
//! ```no_run
//! use idemq::effect::http::{self, reqwest};
//! use idemq::{Consumer, HandlerError, KeySpec};
//! use idemq::store::memory::MemoryStore;
//!
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let client = reqwest::Client::builder()
//!     .timeout(std::time::Duration::from_secs(10))
//!     .build()?;
//! let consumer = Consumer::builder("billing", MemoryStore::new())
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(move |ctx, _lease| {
//!         let client = client.clone();
//!         Box::pin(async move {
//!             let payment: serde_json::Value =
//!                 ctx.message.json().map_err(HandlerError::permanent)?;
//!             // At most one call per (consumer, payment_id, "charge"), with
//!             // `Idempotency-Key: "<derived key>"`; a redelivery gets the
//!             // journaled response without calling.
//!             let charged = http::post_json(
//!                 ctx,
//!                 "charge",
//!                 &client,
//!                 "https://payments.example/v1/charges",
//!                 &payment,
//!             )
//!             .await?;
//!             Ok(Some(serde_json::json!({ "charge": charged.body })))
//!         })
//!     })
//!     .build()?;
//! # let _ = consumer; Ok(()) }
//! ```

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{RequestBuilder, StatusCode};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::engine::Context;
use crate::error::HandlerError;

/// The reqwest version this module works with, for building clients and requests.
pub use reqwest;

/// The header's name, as the draft spells it.
pub const HEADER: &str = "Idempotency-Key";

/// The header's name for [`reqwest::header`] maps (lower case).
pub const HEADER_NAME: HeaderName = HeaderName::from_static("idempotency-key");

/// How much of a failed response's body goes into the error message, in bytes.
pub const MAX_REASON_BODY: usize = 512;

/// The longest 2xx body kept as a stored result: 1 MiB. A longer one is
/// stored as `{"truncated_to_bytes": N, "text": "<its first N bytes>"}`
/// (the call did happen; it is not repeated), and the rest is not read.
pub const MAX_RESULT_BODY: usize = 1024 * 1024;

/// The longest `Retry-After` honoured; longer ones are cut to this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// The header's value for `key`: an RFC 8941 String, i.e. the hyphenated
/// UUID in double quotes (`"972e9c90-e2be-5b65-bd74-98d4d423507e"`).
pub fn header_value(key: Uuid) -> String {
    format!("\"{}\"", key.hyphenated())
}

/// Reads an `Idempotency-Key` value as a server does: an RFC 8941 String
/// (double quotes, `\"` and `\\` escapes, printable ASCII), surrounding
/// spaces allowed. `None` if it is not one.
///
/// ```
/// use idemq::effect::http::{header_value, parse_header_value};
/// let key = idemq::idempotency_key("billing", "pay-1", "charge");
/// assert_eq!(parse_header_value(&header_value(key)), Some(key.to_string()));
/// assert_eq!(parse_header_value("not-quoted"), None);
/// ```
pub fn parse_header_value(value: &str) -> Option<String> {
    let inner = value
        .trim_matches(' ')
        .strip_prefix('"')?
        .strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return None,
            },
            '"' => return None,
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    Some(out)
}

/// Adds the `Idempotency-Key` header to a request.
pub trait IdempotencyKeyExt {
    /// Sets `Idempotency-Key: "<key>"`, replacing an earlier value (the
    /// draft allows one per request).
    fn idempotency_key(self, key: Uuid) -> Self;
}

impl IdempotencyKeyExt for RequestBuilder {
    fn idempotency_key(self, key: Uuid) -> Self {
        let value = header_value(key);
        match HeaderValue::from_str(&value) {
            Ok(value) => {
                let mut one = HeaderMap::new();
                one.insert(HEADER_NAME, value);
                // `headers` replaces the values of the names it carries.
                self.headers(one)
            }
            // Quotes, hex digits and hyphens are always valid; should it ever
            // fail, reqwest reports it when the request is sent.
            Err(_) => self.header(HEADER_NAME, value),
        }
    }
}

/// A successful (2xx) response as the journal keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The HTTP status code.
    pub status: u16,
    /// The body: JSON if it parses as JSON, else the text (invalid UTF-8
    /// replaced), `null` if it is empty.
    pub body: serde_json::Value,
}

/// The body as a JSON value: parsed if it is JSON, else text, `null` if empty.
pub fn body_value(body: &[u8]) -> serde_json::Value {
    if body.iter().all(u8::is_ascii_whitespace) {
        return serde_json::Value::Null;
    }
    serde_json::from_slice(body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// The first [`MAX_REASON_BODY`] bytes of a body as text, for error messages.
fn reason_body(body: &[u8]) -> String {
    let cut = body.len().min(MAX_REASON_BODY);
    let text = String::from_utf8_lossy(&body[..cut]);
    let text = text.trim();
    if body.len() > cut {
        format!("{text}…")
    } else {
        text.to_owned()
    }
}

/// The `Retry-After` header as a delay: delay-seconds or an HTTP date (a date
/// in the past is zero), at most [`MAX_RETRY_AFTER`]. `None` if absent or
/// unreadable.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let delay = if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(text.parse().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(text).ok()?;
        at.duration_since(SystemTime::now()).unwrap_or_default()
    };
    Some(delay.min(MAX_RETRY_AFTER))
}

/// Maps a response to its outcome (see the [module docs](self) for the table).
pub fn classify(
    status: StatusCode,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<StoredResponse, HandlerError> {
    let code = status.as_u16();
    if status.is_success() {
        return Ok(StoredResponse {
            status: code,
            body: body_value(body),
        });
    }
    let detail = match reason_body(body) {
        text if text.is_empty() => String::new(),
        text => format!(": {text}"),
    };
    let retryable = |message: String| {
        let error = HandlerError::retryable(message);
        match retry_after(headers) {
            Some(delay) => error.with_retry_after(delay),
            None => error,
        }
    };
    Err(match code {
        409 => retryable(format!(
            "HTTP 409: a request with this Idempotency-Key is still in flight at the provider{detail}"
        )),
        422 => HandlerError::conflict(format!(
            "HTTP 422: the provider says this Idempotency-Key was used before with \
             another payload{detail}"
        )),
        408 | 429 | 500..=599 => retryable(format!("HTTP {status}{detail}")),
        _ => HandlerError::permanent(format!("HTTP {status}{detail}")),
    })
}

/// `err` and its sources, joined by `: ` (reqwest's own message is terse).
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// Maps a failure to get a response: an invalid request (bad URL, invalid
/// header) or a redirect loop is permanent; timeouts, connection errors and
/// cut-off bodies are retryable.
pub fn classify_error(err: &reqwest::Error) -> HandlerError {
    let mut text = chain(err);
    // reqwest names the URL; its secret parameters (an `api_key=`) must not
    // reach the logs or the dead-letter table.
    if let Some(url) = err.url() {
        text = text.replace(url.as_str(), &crate::redact::redact_url(url.as_str()));
    }
    if err.is_builder() || err.is_redirect() {
        HandlerError::permanent(format!("invalid HTTP request: {text}"))
    } else if err.is_timeout() {
        HandlerError::retryable(format!("HTTP request timed out: {text}"))
    } else {
        HandlerError::retryable(format!("HTTP request failed: {text}"))
    }
}

/// Reads a response's body (up to [`MAX_RESULT_BODY`] bytes for a 2xx, the
/// first [`MAX_REASON_BODY`] bytes otherwise) and [`classify`]s it.
pub async fn read_response(
    mut response: reqwest::Response,
) -> Result<StoredResponse, HandlerError> {
    let status = response.status();
    let headers = std::mem::take(response.headers_mut());
    let mut body = Vec::new();
    let limit = if status.is_success() {
        MAX_RESULT_BODY + 1
    } else {
        MAX_REASON_BODY + 1
    };
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) => break,
            // A 2xx whose body was cut off: the effect may have happened, so
            // the retry must send the same key again; for an error status
            // the part read is enough for the message.
            Err(e) if status.is_success() => return Err(classify_error(&e)),
            Err(_) => break,
        }
    }
    if status.is_success() && body.len() > MAX_RESULT_BODY {
        body.truncate(MAX_RESULT_BODY);
        tracing::warn!(
            status = status.as_u16(),
            max_bytes = MAX_RESULT_BODY,
            "the answer is longer than a stored result may be; its first bytes are stored"
        );
        return Ok(StoredResponse {
            status: status.as_u16(),
            body: serde_json::json!({
                "truncated_to_bytes": MAX_RESULT_BODY,
                "text": String::from_utf8_lossy(&body),
            }),
        });
    }
    classify(status, &headers, &body)
}

/// Sends `request` with `Idempotency-Key: "<key>"` and maps the response
/// (see the [module docs](self)). Use it inside
/// [`Context::effect`](crate::Context::effect), or use [`effect`].
pub async fn send(request: RequestBuilder, key: Uuid) -> Result<StoredResponse, HandlerError> {
    let response = request
        .idempotency_key(key)
        .send()
        .await
        .map_err(|e| classify_error(&e))?;
    read_response(response).await
}

/// Sends `request` at most once per (consumer, key, `step`) as far as idemq
/// can see: through [`Context::effect`](crate::Context::effect) with the
/// step's derived key in `Idempotency-Key`. A 2xx response is journaled and
/// returned; a redelivery gets the journaled response without sending.
/// Failures are mapped as the [module docs](self) say and not journaled.
pub async fn effect(
    ctx: &Context<'_>,
    step: &str,
    request: RequestBuilder,
) -> Result<StoredResponse, HandlerError> {
    let stored = ctx.effect(step, |key| send(request, key)).await?;
    serde_json::from_value(stored).map_err(|e| {
        HandlerError::permanent(format!(
            "effect {step:?}: the journaled result is not an HTTP response ({e}); \
             was the step name used for another effect?"
        ))
    })
}

/// POSTs `body` as JSON to `url` through [`effect`]: at most once per
/// (consumer, key, `step`), with the step's `Idempotency-Key`.
pub async fn post_json<T: Serialize + ?Sized>(
    ctx: &Context<'_>,
    step: &str,
    client: &reqwest::Client,
    url: &str,
    body: &T,
) -> Result<StoredResponse, HandlerError> {
    effect(ctx, step, client.post(url).json(body)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::HandlerErrorKind;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn header_value_is_an_sf_string() {
        let key = crate::effect::idempotency_key("billing", "pay-1", "charge");
        assert_eq!(
            header_value(key),
            "\"972e9c90-e2be-5b65-bd74-98d4d423507e\""
        );
        assert_eq!(
            parse_header_value(" \"a\\\"b\\\\c\" ").as_deref(),
            Some("a\"b\\c")
        );
        for bad in ["", "\"", "abc", "\"a\"b\"", "\"a\\x\"", "\"é\""] {
            assert_eq!(parse_header_value(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_header_is_set_once() {
        let key = Uuid::from_u128(7);
        let request = reqwest::Client::new()
            .post("http://127.0.0.1:9/")
            .header(HEADER, "\"old\"")
            .idempotency_key(key)
            .idempotency_key(key)
            .build()
            .unwrap();
        let values: Vec<_> = request.headers().get_all(HEADER).iter().collect();
        assert_eq!(values, vec![header_value(key).as_str()]);
    }

    #[test]
    fn statuses_map_as_documented() {
        let none = HeaderMap::new();
        let ok = classify(StatusCode::CREATED, &none, br#"{"id":"ch_1"}"#).unwrap();
        assert_eq!(ok.status, 201);
        assert_eq!(ok.body, serde_json::json!({ "id": "ch_1" }));
        assert_eq!(
            classify(StatusCode::OK, &none, b"plain").unwrap().body,
            "plain"
        );
        assert_eq!(
            classify(StatusCode::NO_CONTENT, &none, b"").unwrap().body,
            serde_json::Value::Null
        );

        let busy =
            classify(StatusCode::CONFLICT, &headers(&[("retry-after", "7")]), b"").unwrap_err();
        assert_eq!(busy.kind(), HandlerErrorKind::Retryable, "{busy:?}");
        assert_eq!(busy.retry_after(), Some(Duration::from_secs(7)));
        assert!(busy.message().contains("in flight"), "{busy}");
        let reused = classify(StatusCode::UNPROCESSABLE_ENTITY, &none, b"key reused").unwrap_err();
        assert!(
            reused.kind() == HandlerErrorKind::Conflict && reused.message().starts_with("HTTP 422"),
            "{reused:?}"
        );
        assert!(!reused.is_retryable());
        assert!(reused.to_string().contains("key reused"), "{reused}");
        for status in [500, 502, 503, 504, 408, 429] {
            let err = classify(StatusCode::from_u16(status).unwrap(), &none, b"").unwrap_err();
            assert!(err.is_retryable(), "{status}: {err}");
        }
        for status in [400, 401, 403, 404, 410, 302, 101] {
            let err = classify(StatusCode::from_u16(status).unwrap(), &none, b"nope").unwrap_err();
            assert!(!err.is_retryable(), "{status}: {err}");
            assert!(err.to_string().contains(&status.to_string()), "{err}");
            assert!(err.to_string().contains("nope"), "{err}");
        }
        let long = vec![b'x'; MAX_REASON_BODY * 3];
        let err = classify(StatusCode::BAD_REQUEST, &none, &long).unwrap_err();
        assert!(err.to_string().len() < MAX_REASON_BODY + 100, "{err}");
        assert!(err.to_string().ends_with('…'), "{err}");
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            retry_after(&headers(&[("retry-after", "120")])),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            retry_after(&headers(&[("retry-after", "999999999")])),
            Some(MAX_RETRY_AFTER)
        );
        let soon = SystemTime::now() + Duration::from_secs(30);
        let date = httpdate::fmt_http_date(soon);
        let got = retry_after(&headers(&[("retry-after", &date)])).unwrap();
        assert!(
            got <= Duration::from_secs(30) && got >= Duration::from_secs(28),
            "{got:?}"
        );
        assert_eq!(
            retry_after(&headers(&[(
                "retry-after",
                "Wed, 21 Oct 2015 07:28:00 GMT"
            )])),
            Some(Duration::ZERO)
        );
        assert_eq!(retry_after(&headers(&[("retry-after", "soon")])), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }
}
