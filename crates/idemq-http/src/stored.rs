//! The stored response: what the layer keeps with a completed key, as the
//! JSON result of the idemq claim, and how it is replayed.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use serde::{Deserialize, Serialize};

/// Marks a result as a stored HTTP response, and its format version.
const FORMAT: &str = "idemq-http/1";

/// A response as kept in the store: status, the chosen headers and the body,
/// byte for byte.
///
/// In JSON a body (or header value) that is valid UTF-8 is kept as text so
/// that `idemq inspect` shows it; anything else as base64.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The stored headers, in their order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
}

#[derive(Serialize, Deserialize)]
struct Record {
    format: String,
    status: u16,
    /// `[name, value]`, or `[name, base64, "b64"]` for a value that is not UTF-8.
    headers: Vec<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    body_b64: Option<String>,
}

/// A stored result that is not a response this layer wrote.
#[derive(Debug, thiserror::Error)]
#[error("the stored result is not a response stored by idemq-http: {0}")]
pub struct DecodeError(String);

impl StoredResponse {
    /// The JSON kept in the store.
    pub fn to_json(&self) -> serde_json::Value {
        let headers = self
            .headers
            .iter()
            .map(|(name, value)| match value.to_str() {
                Ok(text) => vec![name.as_str().to_owned(), text.to_owned()],
                Err(_) => vec![
                    name.as_str().to_owned(),
                    B64.encode(value.as_bytes()),
                    "b64".to_owned(),
                ],
            })
            .collect();
        let (body, body_b64) = match std::str::from_utf8(&self.body) {
            Ok(text) => (Some(text.to_owned()), None),
            Err(_) => (None, Some(B64.encode(&self.body))),
        };
        let record = Record {
            format: FORMAT.to_owned(),
            status: self.status.as_u16(),
            headers,
            body,
            body_b64,
        };
        serde_json::to_value(record).unwrap_or(serde_json::Value::Null)
    }

    /// Reads back what [`to_json`](Self::to_json) wrote.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, DecodeError> {
        let record = Record::deserialize(value).map_err(|e| DecodeError(e.to_string()))?;
        if record.format != FORMAT {
            return Err(DecodeError(format!("unknown format {:?}", record.format)));
        }
        let status = StatusCode::from_u16(record.status).map_err(|e| DecodeError(e.to_string()))?;
        let mut headers = Vec::with_capacity(record.headers.len());
        for h in record.headers {
            let (name, value) = match h.as_slice() {
                [name, value] => (name, HeaderValue::from_str(value)),
                [name, value, kind] if kind == "b64" => {
                    let bytes = B64.decode(value).map_err(|e| DecodeError(e.to_string()))?;
                    (name, HeaderValue::from_bytes(&bytes))
                }
                _ => return Err(DecodeError("bad header entry".into())),
            };
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|e| DecodeError(e.to_string()))?;
            headers.push((name, value.map_err(|e| DecodeError(e.to_string()))?));
        }
        let body = match (record.body, record.body_b64) {
            (Some(text), None) => Bytes::from(text),
            (None, Some(b64)) => {
                Bytes::from(B64.decode(b64).map_err(|e| DecodeError(e.to_string()))?)
            }
            (None, None) => Bytes::new(),
            (Some(_), Some(_)) => return Err(DecodeError("two bodies".into())),
        };
        Ok(Self {
            status,
            headers,
            body,
        })
    }

    /// The response to send: the stored status, headers and body; the
    /// length is set from the body.
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.body.clone()));
        *response.status_mut() = self.status;
        let map: &mut HeaderMap = response.headers_mut();
        for (name, value) in &self.headers {
            map.append(name.clone(), value.clone());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_text_and_binary() {
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    http::header::LOCATION,
                    HeaderValue::from_static("/orders/1"),
                ),
                (
                    HeaderName::from_static("x-raw"),
                    HeaderValue::from_bytes(b"\xff\xfe").unwrap(),
                ),
                (
                    HeaderName::from_static("x-two"),
                    HeaderValue::from_static("a"),
                ),
                (
                    HeaderName::from_static("x-two"),
                    HeaderValue::from_static("b"),
                ),
            ],
            body: Bytes::from_static(b"\x00\x01binary\xff"),
        };
        let json = stored.to_json();
        assert!(json["body_b64"].is_string());
        assert_eq!(StoredResponse::from_json(&json).unwrap(), stored);

        let text = StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static("{\"ok\":true} é".as_bytes()),
        };
        let json = text.to_json();
        assert_eq!(json["body"], "{\"ok\":true} é");
        assert_eq!(StoredResponse::from_json(&json).unwrap(), text);
    }

    #[test]
    fn foreign_results_are_refused() {
        assert!(StoredResponse::from_json(&serde_json::json!({"status": 200})).is_err());
        assert!(StoredResponse::from_json(&serde_json::json!("text")).is_err());
    }
}
