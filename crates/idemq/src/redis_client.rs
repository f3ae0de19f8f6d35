//! One way to open a Redis URL, shared by the Redis store and the Redis
//! Streams source: `redis://` in the clear, `rediss://` over TLS verified
//! against the system's and Mozilla's roots, or against the CA in the PEM
//! file of the URL's `cacert` parameter (named after `redis-cli --cacert`).

use redis::{Client, IntoConnectionInfo, TlsCertificates};

use crate::redact::redact_url;

/// The query parameter naming a PEM file of CA certificates.
pub const CACERT_PARAM: &str = "cacert";

/// A client for `url`; the error never shows a secret of the URL.
pub fn client(url: &str) -> Result<Client, String> {
    crate::tls::ensure_crypto_provider();
    let bad = |e: &dyn std::fmt::Display| format!("bad Redis URL {:?}: {e}", redact_url(url));
    let (url, cacert) = take_param(url, CACERT_PARAM);
    let Some(path) = cacert else {
        return Client::open(url.as_str()).map_err(|e| bad(&e));
    };
    let path = crate::source::url::decode(&path).map_err(|e| bad(&e))?;
    let pem =
        std::fs::read(&path).map_err(|e| bad(&format!("reading {CACERT_PARAM} {path:?}: {e}")))?;
    let info = url.as_str().into_connection_info().map_err(|e| bad(&e))?;
    Client::build_with_tls(
        info,
        TlsCertificates {
            client_tls: None,
            root_cert: Some(pem),
        },
    )
    .map_err(|e| bad(&e))
}

/// `value` percent-encoded where it would end or break a query parameter.
#[cfg(feature = "redis-streams")]
pub(crate) fn encode_param(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '%' | '&' | '#' | '+' | '=' | ' ' | '?' => out.push_str(&format!("%{:02X}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// `url` without its query parameter `name`, and that parameter's value
/// as written.
fn take_param(url: &str, name: &str) -> (String, Option<String>) {
    let (head, fragment) = match url.split_once('#') {
        Some((h, f)) => (h, Some(f)),
        None => (url, None),
    };
    let Some((base, query)) = head.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k == name {
                value = Some(v.to_owned());
                false
            } else {
                true
            }
        })
        .collect();
    let mut out = base.to_owned();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    (out, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_parameter_is_taken_out_of_the_url() {
        assert_eq!(
            take_param(
                "rediss://h:6380/0?cacert=%2Ftmp%2Fca.pem&protocol=resp3",
                "cacert"
            ),
            (
                "rediss://h:6380/0?protocol=resp3".to_owned(),
                Some("%2Ftmp%2Fca.pem".to_owned())
            )
        );
        assert_eq!(
            take_param("rediss://h/?cacert=/a.pem#insecure", "cacert"),
            ("rediss://h/#insecure".to_owned(), Some("/a.pem".to_owned()))
        );
        assert_eq!(
            take_param("redis://h:6379", "cacert"),
            ("redis://h:6379".to_owned(), None)
        );
    }

    #[test]
    fn a_missing_ca_file_is_an_error_without_the_password() {
        let err = client("rediss://:hunter2@h:6380/?cacert=/nonexistent/ca.pem").unwrap_err();
        assert!(err.contains("cacert"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
