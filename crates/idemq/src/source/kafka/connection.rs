//! Reaching the cluster: waiting for its metadata, and telling a refusal
//! (credentials, TLS, authorization) from a broker that is merely slow.
//!
//! librdkafka retries a refused connection forever and reports the refusal
//! only as an error event beside it; without this, a wrong password or an
//! untrusted certificate would look like a broker that never answers.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::client::{Client, ClientContext};
use rdkafka::error::KafkaError;
use rdkafka::metadata::Metadata;
use rdkafka::types::RDKafkaErrorCode;

use super::broker;
use crate::error::SourceError;

/// How long connecting waits for the cluster's metadata.
const METADATA_DEADLINE: Duration = Duration::from_secs(10);

/// What to check when the cluster refuses a client with `code`; `None`
/// when `code` is not a refusal.
fn refusal_hint(code: RDKafkaErrorCode) -> Option<&'static str> {
    use RDKafkaErrorCode as C;
    Some(match code {
        C::Authentication | C::SaslAuthenticationFailed | C::UnsupportedSASLMechanism => {
            "the broker refused the credentials (check security.protocol, sasl.mechanism, sasl.username and sasl.password)"
        }
        C::SSL => {
            "the TLS handshake failed (check security.protocol, ssl.ca.location, and for mutual TLS ssl.certificate.location and ssl.key.location)"
        }
        C::TopicAuthorizationFailed
        | C::GroupAuthorizationFailed
        | C::ClusterAuthorizationFailed => "the broker denied this principal access (check its ACLs)",
        _ => return None,
    })
}

/// The refusal `error` (with librdkafka's `reason`) says, if it is one. A
/// TLS alert from the broker (a client certificate missing or refused)
/// reaches librdkafka as a transport failure whose reason names the alert.
pub(super) fn refusal_of(error: &KafkaError, reason: &str) -> Option<String> {
    let code = error.rdkafka_error_code()?;
    let hint = refusal_hint(code).or_else(|| {
        (code == RDKafkaErrorCode::BrokerTransportFailure && reason.contains("SSL alert"))
            .then_some("the broker refused the TLS handshake (a client certificate it does not accept? check ssl.certificate.location and ssl.key.location)")
    })?;
    Some(format!("kafka: {hint}: {code}: {reason}"))
}

/// A client context that remembers the first refusal librdkafka reports.
/// Clones share what they remember.
#[derive(Default, Clone)]
pub(super) struct RefusalContext {
    refused: Arc<Mutex<Option<String>>>,
}

impl RefusalContext {
    /// The first refusal reported so far.
    pub(super) fn refusal(&self) -> Option<String> {
        crate::sync::lock(&self.refused).clone()
    }

    /// Logs a librdkafka error, remembering it if it is a refusal.
    pub(super) fn note(&self, error: &KafkaError, reason: &str) {
        match refusal_of(error, reason) {
            Some(refusal) => {
                tracing::warn!(error = %error, reason, "the kafka cluster refused the connection");
                crate::sync::lock(&self.refused).get_or_insert(refusal);
            }
            None => tracing::warn!(error = %error, reason, "librdkafka error"),
        }
    }
}

impl ClientContext for RefusalContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.note(&error, reason);
    }
}

/// Waits up to ten seconds for the cluster's metadata (of `topic`, or of
/// every topic), asking `refused` between tries whether the cluster
/// refused this client: a refusal is a configuration error at once, a
/// cluster that does not answer a broker error at the deadline.
pub(super) fn fetch_metadata<C: ClientContext>(
    client: &Client<C>,
    topic: Option<&str>,
    mut refused: impl FnMut() -> Option<String>,
) -> Result<Metadata, SourceError> {
    let started = Instant::now();
    loop {
        let result = client.fetch_metadata(topic, Duration::from_millis(500));
        if let Some(refusal) = refused() {
            return Err(SourceError::config(refusal));
        }
        match result {
            Ok(metadata) => return Ok(metadata),
            Err(e) if started.elapsed() >= METADATA_DEADLINE => return Err(broker(e)),
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_from_other_errors() {
        let refused = KafkaError::Global(RDKafkaErrorCode::Authentication);
        assert!(refusal_of(&refused, "").unwrap().contains("sasl.password"));
        let tls = KafkaError::Global(RDKafkaErrorCode::SSL);
        assert!(refusal_of(&tls, "").unwrap().contains("ssl.ca.location"));
        let alert = KafkaError::Global(RDKafkaErrorCode::BrokerTransportFailure);
        let reason = "ssl://localhost:9095/bootstrap: Receive failed: SSL alert number 42";
        assert!(refusal_of(&alert, reason)
            .unwrap()
            .contains("ssl.certificate.location"));
        assert_eq!(refusal_of(&alert, "Connection refused"), None);
        let slow = KafkaError::Global(RDKafkaErrorCode::AllBrokersDown);
        assert_eq!(refusal_of(&slow, ""), None);
    }
}
