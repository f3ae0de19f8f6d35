//! One way to open a Redis URL, shared by the Redis store and the Redis
//! Streams source: `redis://` in the clear, `rediss://` over TLS verified
//! against the system's and Mozilla's roots, or against the CA in the PEM
//! file of the URL's `cacert` parameter; a client certificate from the PEM
//! files of `cert` and `key` (the parameters are named after `redis-cli
//! --cacert`, `--cert` and `--key`).

use redis::{Client, ClientTlsConfig, IntoConnectionInfo, TlsCertificates};

use crate::redact::redact_url;

/// The query parameter naming a PEM file of CA certificates.
pub const CACERT_PARAM: &str = "cacert";
/// The query parameter naming the PEM file of the client's certificate.
pub const CERT_PARAM: &str = "cert";
/// The query parameter naming the PEM file of the client certificate's key.
pub const KEY_PARAM: &str = "key";

/// A client for `url`; the error never shows a secret of the URL.
pub fn client(url: &str) -> Result<Client, String> {
    crate::tls::ensure_crypto_provider();
    let bad = |e: &dyn std::fmt::Display| format!("bad Redis URL {:?}: {e}", redact_url(url));
    let (url, cacert) = take_param(url, CACERT_PARAM);
    let (url, cert) = take_param(&url, CERT_PARAM);
    let (url, key) = take_param(&url, KEY_PARAM);
    if cacert.is_none() && cert.is_none() && key.is_none() {
        return Client::open(url.as_str()).map_err(|e| bad(&e));
    }
    let read = |name: &str, value: String| {
        let path = crate::source::url::decode(&value).map_err(|e| bad(&e))?;
        std::fs::read(&path).map_err(|e| bad(&format!("reading {name} {path:?}: {e}")))
    };
    let root_cert = cacert.map(|v| read(CACERT_PARAM, v)).transpose()?;
    let client_tls = match (cert, key) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read(CERT_PARAM, cert)?,
            client_key: read(KEY_PARAM, key)?,
        }),
        (None, None) => None,
        _ => return Err(bad(&"a client certificate needs both cert= and key=")),
    };
    let info = url.as_str().into_connection_info().map_err(|e| bad(&e))?;
    Client::build_with_tls(
        info,
        TlsCertificates {
            client_tls,
            root_cert,
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
pub(crate) fn take_param(url: &str, name: &str) -> (String, Option<String>) {
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
    fn a_client_certificate_needs_its_key() {
        let err = client("rediss://:hunter2@h:6380/?cert=/c.pem").unwrap_err();
        assert!(err.contains("key="), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn a_missing_ca_file_is_an_error_without_the_password() {
        let err = client("rediss://:hunter2@h:6380/?cacert=/nonexistent/ca.pem").unwrap_err();
        assert!(err.contains("cacert"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
