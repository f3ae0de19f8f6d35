//! `--apply-http URL`: POST each newly claimed message to an HTTP endpoint.
//!
//! The request carries the payload as its body (`Content-Type:
//! application/json` when the payload parses as JSON, else
//! `application/octet-stream`) and these headers:
//!
//! - `Idempotency-Key: "<uuid>"`: the derived key of step `http`
//!   (`idemq::effect::idempotency_key(consumer, key, "http")`), as the IETF
//!   draft spells it;
//! - `X-Idemq-Key`, `X-Idemq-Consumer` and (if the message has one)
//!   `X-Idemq-Message-Id`, percent-encoded where a byte is not printable
//!   ASCII or is `%`;
//! - every `--http-header`.
//!
//! The call runs through the effect journal (`idemq::effect::http::effect`):
//! a 2xx answer is journaled and stored as the message's result
//! (`{"status", "body"}`), and a redelivery does not call again. The status
//! mapping (409 → retry, 422 → conflict dead letter, 5xx/timeouts → retry,
//! other 4xx → dead letter) is the library's.

use std::time::Duration;

use anyhow::{Context as _, Result};
use idemq::effect::http::{self, reqwest};
use idemq::{Context, Handler, HandlerError};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};

use super::HandlerFuture;
use crate::exit;

/// The effect step of `--apply-http` (the derived key's step name).
pub const STEP: &str = "http";

/// Posts each message to one URL through the effect journal.
pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
}

impl HttpSink {
    /// A sink posting to `url` with a per-request `timeout` (connect, send
    /// and the whole response) and the extra `headers` (`Name: value`).
    pub fn new(url: &str, timeout: Duration, headers: &[String]) -> Result<Self> {
        let shown = crate::backend::redact(url);
        let url = reqwest::Url::parse(url)
            .map_err(|e| exit::usage(format!("--apply-http {shown:?} is not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(exit::usage(format!(
                "--apply-http {shown}: the scheme must be http or https"
            )));
        }
        let mut defaults = HeaderMap::new();
        for header in headers {
            let (name, value) = parse_header(header)?;
            defaults.append(name, value);
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .default_headers(defaults)
            .user_agent(concat!("idemq/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("building the HTTP client")?;
        Ok(Self { client, url })
    }
}

/// Parses `Name: value` (`--http-header`).
fn parse_header(text: &str) -> Result<(HeaderName, HeaderValue)> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| exit::usage(format!("--http-header {text:?}: expected `Name: value`")))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|e| exit::usage(format!("--http-header {text:?}: bad name: {e}")))?;
    if name == http::HEADER_NAME {
        return Err(exit::usage(
            "--http-header: the Idempotency-Key is derived per message and cannot be set",
        ));
    }
    let value = HeaderValue::from_str(value.trim())
        .map_err(|e| exit::usage(format!("--http-header {text:?}: bad value: {e}")))?;
    Ok((name, value))
}

/// Percent-encodes the bytes of `text` that are not printable ASCII, and `%`.
pub fn header_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl<Tx: Send + 'static> Handler<Tx> for HttpSink {
    fn handle<'a>(&'a self, ctx: &'a Context<'a>, _tx: &'a mut Tx) -> HandlerFuture<'a> {
        Box::pin(async move {
            let content_type = if ctx.message.json().is_ok() {
                "application/json"
            } else {
                "application/octet-stream"
            };
            let mut request = self
                .client
                .post(self.url.clone())
                .header(CONTENT_TYPE, content_type)
                .header("x-idemq-key", header_text(ctx.key))
                .header("x-idemq-consumer", header_text(ctx.consumer))
                .body(ctx.message.payload.clone());
            if let Some(id) = &ctx.message.id {
                request = request.header("x-idemq-message-id", header_text(id));
            }
            let response = http::effect(ctx, STEP, request).await?;
            let stored = serde_json::to_value(response).map_err(HandlerError::permanent)?;
            Ok(Some(stored))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_text_encodes_what_a_header_cannot_carry() {
        assert_eq!(header_text("pay-1"), "pay-1");
        assert_eq!(header_text("a b%c"), "a%20b%25c");
        assert_eq!(header_text("ü\n"), "%C3%BC%0A");
    }

    #[test]
    fn headers_and_urls_are_checked() {
        let (name, value) = parse_header("Authorization: Bearer x").unwrap();
        assert_eq!(name, "authorization");
        assert_eq!(value, "Bearer x");
        for bad in ["no colon", "bad name: x", "Idempotency-Key: \"x\""] {
            assert!(parse_header(bad).is_err(), "{bad}");
        }
        let t = Duration::from_secs(1);
        assert!(HttpSink::new("http://127.0.0.1:1/x", t, &[]).is_ok());
        assert!(HttpSink::new("ftp://127.0.0.1/x", t, &[]).is_err());
        assert!(HttpSink::new("nope", t, &[]).is_err());
    }
}
