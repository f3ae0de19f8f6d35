//! What the layer covers and how: scope, fingerprint, stored headers, which
//! responses are stored, in-flight policy, limits.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};
use idemq::{FingerprintSpec, InFlightPolicy, InputError, Message};
use sha2::{Digest, Sha256};

/// Where a request's key is scoped: the caller's tenant, API key or route.
/// Two scopes never share keys.
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// What happens to a claim once the handler answered with a status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Store the response with the key (commit the claim, and on SQL stores
    /// the handler's writes with it); retries replay it.
    Store,
    /// Release the key (roll the claim back, and on SQL stores the
    /// handler's writes with it); a retry runs the handler again.
    Release,
}

/// Decides a [`Disposition`] from the status.
pub type DispositionFn = Arc<dyn Fn(StatusCode) -> Disposition + Send + Sync>;

/// The default: 5xx, and the 4xx that ask for a retry (408 Request
/// Timeout, 409 Conflict, 425 Too Early, 429 Too Many Requests), release
/// the key; every other answer (2xx, 3xx, other 4xx) is stored.
pub fn default_disposition(status: StatusCode) -> Disposition {
    match status.as_u16() {
        408 | 409 | 425 | 429 | 500..=599 | 100..=199 => Disposition::Release,
        _ => Disposition::Store,
    }
}

/// Which response headers are stored and replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderSelection {
    /// Every header except these (and the hop-by-hop ones, which are never
    /// stored).
    AllExcept(Vec<HeaderName>),
    /// Only these.
    Only(Vec<HeaderName>),
}

impl Default for HeaderSelection {
    /// Every header but `date`, `set-cookie` (a session secret has no place
    /// in the store) and `content-length` (set again from the stored body).
    fn default() -> Self {
        HeaderSelection::AllExcept(vec![
            http::header::DATE,
            http::header::SET_COOKIE,
            http::header::CONTENT_LENGTH,
        ])
    }
}

/// Connection-specific headers (RFC 9110 §7.6.1), never stored (and
/// never forwarded by a proxy).
pub const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl HeaderSelection {
    /// Whether a response header of this name is stored.
    pub fn keeps(&self, name: &HeaderName) -> bool {
        if HOP_BY_HOP.contains(&name.as_str()) {
            return false;
        }
        match self {
            HeaderSelection::AllExcept(except) => !except.contains(name),
            HeaderSelection::Only(only) => only.contains(name),
        }
    }
}

/// What the request fingerprint covers. Two requests with one key and
/// different fingerprints are a reuse of the key: 422.
///
/// The default covers the method, the path with its query, the
/// `Content-Type` header and the whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// Whether the method counts.
    pub method: bool,
    /// Whether the path counts.
    pub path: bool,
    /// Whether the query string counts.
    pub query: bool,
    /// Request headers that count (absent and present differ).
    pub headers: Vec<HeaderName>,
    /// How the body counts (the idemq payload fingerprint: the whole bytes,
    /// or chosen JSON pointers); `None` leaves it out.
    pub body: Option<FingerprintSpec>,
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self {
            method: true,
            path: true,
            query: true,
            headers: vec![http::header::CONTENT_TYPE],
            body: Some(FingerprintSpec::Payload),
        }
    }
}

impl Fingerprint {
    /// The hex SHA-256 (64 characters) over the chosen parts, each length
    /// prefixed so that no two different requests share an encoding.
    pub fn compute(&self, parts: &Parts, body: &[u8]) -> Result<String, InputError> {
        let mut hash = Sha256::new();
        let mut field = |bytes: Option<&[u8]>| match bytes {
            Some(b) => {
                hash.update((b.len() as u64).to_be_bytes());
                hash.update(b);
            }
            None => hash.update(u64::MAX.to_be_bytes()),
        };
        field(Some(b"idemq-http-fingerprint/1"));
        field(self.method.then(|| parts.method.as_str().as_bytes()));
        field(self.path.then(|| parts.uri.path().as_bytes()));
        field(if self.query {
            parts.uri.query().map(str::as_bytes)
        } else {
            None
        });
        for name in &self.headers {
            field(Some(name.as_str().as_bytes()));
            let values: Vec<&[u8]> = parts
                .headers
                .get_all(name)
                .iter()
                .map(|v| v.as_bytes())
                .collect();
            field(Some(&(values.len() as u64).to_be_bytes()));
            for v in values {
                field(Some(v));
            }
        }
        let body_print = match &self.body {
            Some(spec) => Some(spec.compute(&Message::new(body))?),
            None => None,
        };
        field(body_print.as_deref().map(str::as_bytes));
        Ok(hex::encode(hash.finalize()))
    }
}

/// Everything the layer was configured with.
#[derive(Clone)]
pub(crate) struct Settings {
    pub name: String,
    pub scope: ScopeFn,
    pub methods: Vec<Method>,
    pub require_key: bool,
    pub fingerprint: Fingerprint,
    pub stored_headers: HeaderSelection,
    pub disposition: DispositionFn,
    pub in_flight: InFlightPolicy,
    pub lease: Duration,
    pub replay_header: HeaderName,
    pub max_request_body: usize,
    pub max_response_body: usize,
    pub retry_after: u32,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("name", &self.name)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("fingerprint", &self.fingerprint)
            .field("stored_headers", &self.stored_headers)
            .field("in_flight", &self.in_flight)
            .field("lease", &self.lease)
            .field("replay_header", &self.replay_header)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .finish_non_exhaustive()
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            name: "http".to_owned(),
            scope: Arc::new(|_| Some(String::new())),
            methods: vec![Method::POST, Method::PATCH],
            require_key: true,
            fingerprint: Fingerprint::default(),
            stored_headers: HeaderSelection::default(),
            disposition: Arc::new(default_disposition),
            in_flight: InFlightPolicy::Reject,
            lease: Duration::from_secs(30),
            replay_header: HeaderName::from_static("idempotent-replayed"),
            max_request_body: 1024 * 1024,
            max_response_body: 1024 * 1024,
            retry_after: 1,
        }
    }
}

/// A scope from a request header's value, hashed (SHA-256, the first 16
/// bytes in hex) so that a secret such as an API key is never stored or
/// logged. `None` (a 400) when the header is absent.
pub fn hashed_header_scope(name: HeaderName) -> ScopeFn {
    Arc::new(move |parts: &Parts| {
        let value = parts.headers.get(&name)?;
        let digest = Sha256::digest(value.as_bytes());
        Some(hex::encode(&digest[..16]))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str, ct: Option<&str>) -> Parts {
        let mut b = http::Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn fingerprint_tells_requests_apart() {
        let f = Fingerprint::default();
        let a = f
            .compute(&parts("POST", "/a?x=1", Some("application/json")), b"{}")
            .unwrap();
        assert_eq!(a.len(), 64);
        for (p, body) in [
            (
                parts("PATCH", "/a?x=1", Some("application/json")),
                &b"{}"[..],
            ),
            (parts("POST", "/b?x=1", Some("application/json")), b"{}"),
            (parts("POST", "/a?x=2", Some("application/json")), b"{}"),
            (parts("POST", "/a?x=1", None), b"{}"),
            (parts("POST", "/a?x=1", Some("application/json")), b"{ }"),
        ] {
            assert_ne!(f.compute(&p, body).unwrap(), a);
        }
        let loose = Fingerprint {
            query: false,
            body: Some("json:/amount".parse().unwrap()),
            ..Fingerprint::default()
        };
        let p = parts("POST", "/a?x=1", Some("application/json"));
        let q = parts("POST", "/a?y=2", Some("application/json"));
        assert_eq!(
            loose.compute(&p, br#"{"amount":5,"note":"a"}"#).unwrap(),
            loose.compute(&q, br#"{"amount":5,"note":"b"}"#).unwrap()
        );
        assert!(loose.compute(&p, b"not json").is_err());
    }

    #[test]
    fn defaults_store_success_and_client_errors_and_release_the_rest() {
        assert_eq!(default_disposition(StatusCode::CREATED), Disposition::Store);
        assert_eq!(
            default_disposition(StatusCode::NOT_FOUND),
            Disposition::Store
        );
        assert_eq!(
            default_disposition(StatusCode::TOO_MANY_REQUESTS),
            Disposition::Release
        );
        assert_eq!(
            default_disposition(StatusCode::BAD_GATEWAY),
            Disposition::Release
        );
        let sel = HeaderSelection::default();
        assert!(sel.keeps(&http::header::LOCATION));
        assert!(!sel.keeps(&http::header::SET_COOKIE));
        assert!(!sel.keeps(&http::header::TRANSFER_ENCODING));
    }
}
