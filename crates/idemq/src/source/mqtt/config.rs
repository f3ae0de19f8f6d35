//! [`MqttConfig`]: the settings, parsed from a URL, and the `rumqttc` client options.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rumqttc::v5::MqttOptions;
use rumqttc::{TlsConfiguration, Transport};

use super::link::CONNECT_TIMEOUT;
#[cfg(doc)]
use super::MqttPublisher;
use crate::error::SourceError;
use crate::source::loss::{LossPolicy, LossRisk, DEFAULT_MIN_RETENTION};
use crate::source::url::{Bare, BrokerUrl};

/// How to reach the broker and what to subscribe to. Build it with
/// [`MqttConfig::new`] and the public fields, or parse a URL with
/// [`MqttConfig::from_url`].
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MqttConfig {
    /// Broker host.
    pub host: String,
    /// Broker port (default 1883).
    pub port: u16,
    /// The topic filter to subscribe to (wildcards and `$share/group/…`
    /// allowed); for [`MqttPublisher`], the topic to publish to.
    pub topic: String,
    /// The client id, which names the persistent session: keep it stable
    /// across restarts, and unique among the consumers running at once.
    pub client_id: String,
    /// Keep-alive interval (default 30 s, at least 5 s).
    pub keep_alive: Duration,
    /// How long the broker keeps the session after a disconnect (default 1 day).
    pub session_expiry: Duration,
    /// Where dead-lettered messages are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
    /// Username and password, if the broker requires them.
    pub credentials: Option<(String, String)>,
    /// Connect over TLS (an `mqtts://` URL; default port 8883).
    pub tls: bool,
    /// A PEM file of the certificate authority that signed the broker's
    /// certificate (`cacert=PATH`, as `mosquitto_sub --cafile`); Mozilla's
    /// roots otherwise.
    pub ca_file: Option<PathBuf>,
    /// A client certificate and its key, PEM files (`cert=PATH&key=PATH`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// What the source does when its settings can lose messages
    /// (`broker_loss=refuse|warn`, default refuse): a `session_expiry`
    /// under `min_retention`.
    pub broker_loss: LossPolicy,
    /// The shortest `session_expiry` that is no risk (`min_retention=`,
    /// default 1 day).
    pub min_retention: Duration,
}

impl std::fmt::Debug for MqttConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MqttConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("topic", &self.topic)
            .field("client_id", &self.client_id)
            .field("keep_alive", &self.keep_alive)
            .field("session_expiry", &self.session_expiry)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("credentials", &self.credentials.as_ref().map(|(u, _)| u))
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("broker_loss", &self.broker_loss)
            .field("min_retention", &self.min_retention)
            .finish()
    }
}

impl MqttConfig {
    /// Defaults for `topic` on `host:port` as `client_id`.
    pub fn new(
        host: impl Into<String>,
        port: u16,
        topic: impl Into<String>,
        client_id: impl Into<String>,
    ) -> Self {
        Self {
            host: host.into(),
            port,
            topic: topic.into(),
            client_id: client_id.into(),
            keep_alive: Duration::from_secs(30),
            session_expiry: Duration::from_secs(86_400),
            dead_letter_topic: None,
            credentials: None,
            tls: false,
            ca_file: None,
            client_cert: None,
            broker_loss: LossPolicy::Refuse,
            min_retention: DEFAULT_MIN_RETENTION,
        }
    }

    /// Parses
    /// `mqtt://[user:password@]host[:port]/topic/filter?client_id=ID[&qos=1][&keep_alive=30s][&session_expiry=1h][&dead_letter_topic=T][&broker_loss=refuse|warn][&min_retention=1d]`.
    ///
    /// A source refuses a `session_expiry` under `min_retention` (default
    /// 1 day): the broker would delete the session, with every message
    /// queued for it, while the consumer is down that long
    /// (`broker_loss=warn` logs it and runs).
    ///
    /// Everything between the first `/` and the `?` is the topic filter, `#`
    /// and `+` included (they may also be written `%23` and `%2B`).
    /// `client_id` is required; only `qos=1` is supported. Durations take a
    /// unit (`ms`, `s`, `m`, `h`; a bare number is seconds).
    ///
    /// `mqtts://` connects over TLS (port 8883 by default), verifying the
    /// broker against Mozilla's roots or the CA file in `cacert=PATH`, with
    /// a client certificate from `cert=PATH&key=PATH` if given.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let tls = url.starts_with("mqtts://");
        let scheme = if tls { "mqtts" } else { "mqtt" };
        let u = BrokerUrl::parse("MQTT", scheme, url)?;
        u.require_path("topic")?;
        let (host, port) = u.host_port(if tls { 8883 } else { 1883 })?;
        let mut config = Self::new(host, port, u.decoded_path()?, "");
        config.credentials.clone_from(&u.userinfo);
        config.tls = tls;
        let (mut cert, mut key) = (None, None);
        for p in u.params() {
            match p.name.as_str() {
                "client_id" => config.client_id = p.value,
                "qos" => {
                    p.choice(&["1"])?;
                }
                "keep_alive" => config.keep_alive = p.duration(Bare::Seconds)?,
                "session_expiry" => config.session_expiry = p.duration(Bare::Seconds)?,
                "dead_letter_topic" => config.dead_letter_topic = Some(p.value),
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                "min_retention" => config.min_retention = p.duration(Bare::Seconds)?,
                "cacert" if tls => config.ca_file = p.non_empty().map(PathBuf::from),
                "cert" if tls => cert = p.non_empty().map(PathBuf::from),
                "key" if tls => key = p.non_empty().map(PathBuf::from),
                "cacert" | "cert" | "key" => {
                    return Err(p.error("TLS settings need an mqtts:// URL"))
                }
                _ => return Err(p.unknown()),
            }
        }
        config.client_cert = u.client_cert(cert, key)?;
        if config.client_id.is_empty() {
            return Err(u.missing("client_id"));
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets the session expiry interval.
    pub fn session_expiry(mut self, expiry: Duration) -> Self {
        self.session_expiry = expiry;
        self
    }

    /// What a source does when its settings can lose messages
    /// ([`LossPolicy::Refuse`] by default).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// The settings of this source that can lose messages: a
    /// `session_expiry` under `min_retention` (the broker deletes the
    /// session and the messages queued for it once the consumer has been
    /// disconnected that long).
    pub(super) fn loss_risks(&self) -> Vec<LossRisk> {
        if self.session_expiry >= self.min_retention {
            return Vec::new();
        }
        vec![LossRisk {
            place: format!("session {}", self.client_id),
            setting: format!(
                "session_expiry={:?} (under min_retention {:?})",
                self.session_expiry, self.min_retention
            ),
            effect: "lets the broker delete the session, with every message queued for it, once this consumer has been disconnected that long".into(),
            remedy: "set session_expiry above the longest outage (and the broker's own cap, Mosquitto's persistent_client_expiration, above it too), or lower min_retention in the URL".into(),
        }]
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if self.topic.is_empty() {
            return Err(SourceError::config("the topic is empty"));
        }
        if self.client_id.is_empty() {
            return Err(SourceError::config("the client id is empty"));
        }
        if let Some(dlq) = &self.dead_letter_topic {
            validate_publish_topic(dlq)?;
        }
        if self.keep_alive < Duration::from_secs(5) {
            return Err(SourceError::config("keep_alive must be at least 5 s"));
        }
        if self.session_expiry.as_secs() == 0 || self.session_expiry.as_secs() > u64::from(u32::MAX)
        {
            return Err(SourceError::config(
                "session_expiry must be from 1 s to 2^32-1 s (a persistent session)",
            ));
        }
        Ok(())
    }

    /// The rustls settings of an `mqtts://` connection (ring, the CA file
    /// or Mozilla's roots, the client certificate).
    fn tls_configuration(&self) -> Result<TlsConfiguration, SourceError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};

        let unreadable = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
            SourceError::config(format!("MQTT: reading the {what} {}: {e}", path.display()))
        };
        let certs =
            |path: &PathBuf, what: &str| -> Result<Vec<CertificateDer<'static>>, SourceError> {
                CertificateDer::pem_file_iter(path)
                    .and_then(Iterator::collect)
                    .map_err(|e| unreadable(what, path, &e))
            };
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_file {
            Some(path) => {
                for cert in certs(path, "CA file")? {
                    roots
                        .add(cert)
                        .map_err(|e| unreadable("CA file", path, &e))?;
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| SourceError::config(format!("MQTT: TLS setup: {e}")))?
            .with_root_certificates(roots);
        let config = match &self.client_cert {
            Some((cert, key)) => {
                let chain = certs(cert, "client certificate")?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| unreadable("client key", key, &e))?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    SourceError::config(format!("MQTT: the client certificate: {e}"))
                })?
            }
            None => builder.with_no_client_auth(),
        };
        Ok(TlsConfiguration::Rustls(Arc::new(config)))
    }

    pub(super) fn options(
        &self,
        client_id: &str,
        persistent: bool,
    ) -> Result<MqttOptions, SourceError> {
        let mut options = MqttOptions::new(client_id, self.host.clone(), self.port);
        options.set_keep_alive(self.keep_alive);
        options.set_manual_acks(true);
        options.set_connection_timeout(CONNECT_TIMEOUT.as_secs());
        if persistent {
            options.set_clean_start(false);
            options.set_session_expiry_interval(Some(
                u32::try_from(self.session_expiry.as_secs()).unwrap_or(u32::MAX),
            ));
        } else {
            options.set_clean_start(true);
        }
        if let Some((user, password)) = &self.credentials {
            options.set_credentials(user.clone(), password.clone());
        }
        if self.tls {
            options.set_transport(Transport::tls_with_config(self.tls_configuration()?));
        }
        Ok(options)
    }
}

pub(super) fn validate_publish_topic(topic: &str) -> Result<(), SourceError> {
    if topic.is_empty() || topic.contains(['#', '+']) || topic.starts_with('$') {
        return Err(SourceError::config(format!(
            "{topic:?} is not a topic to publish to (empty, a wildcard or a $ topic)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn a_session_expiry_under_min_retention_is_a_risk() {
        let short = MqttConfig::from_url("mqtt://h/t?client_id=c&session_expiry=1h").unwrap();
        assert_eq!(
            short.loss_risks()[0].setting,
            "session_expiry=3600s (under min_retention 86400s)"
        );
        let lenient =
            MqttConfig::from_url("mqtt://h/t?client_id=c&session_expiry=1h&min_retention=1h")
                .unwrap();
        assert!(lenient.loss_risks().is_empty());
        assert!(MqttConfig::from_url("mqtt://h/t?client_id=c")
            .unwrap()
            .loss_risks()
            .is_empty());
        let warn = MqttConfig::from_url("mqtt://h/t?client_id=c&broker_loss=warn").unwrap();
        assert_eq!(warn.broker_loss, LossPolicy::Warn);
    }

    #[test]
    fn parses_mqtts_urls() {
        let c = MqttConfig::from_url(
            "mqtts://u:pw@h/t?client_id=c&cacert=/ca.pem&cert=/c.pem&key=/k.pem",
        )
        .unwrap();
        assert!(c.tls);
        assert_eq!(c.port, 8883);
        assert_eq!(c.ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            c.client_cert,
            Some((PathBuf::from("/c.pem"), PathBuf::from("/k.pem")))
        );
        let plain = MqttConfig::from_url("mqtt://h/t?client_id=c&cacert=/ca.pem").unwrap_err();
        assert_eq!(plain.kind(), SourceErrorKind::Config);
        let half = MqttConfig::from_url("mqtts://h/t?client_id=c&key=/k.pem").unwrap_err();
        assert_eq!(half.kind(), SourceErrorKind::Config);
    }

    #[test]
    fn parses_urls() {
        let c = MqttConfig::from_url(
            "mqtt://u:p%40ss@127.0.0.1:1884/orders/#?client_id=c1&qos=1&keep_alive=10s&session_expiry=1h&dead_letter_topic=orders-dead",
        )
        .unwrap();
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 1884);
        assert_eq!(c.topic, "orders/#");
        assert_eq!(c.client_id, "c1");
        assert_eq!(c.keep_alive, Duration::from_secs(10));
        assert_eq!(c.session_expiry, Duration::from_secs(3600));
        assert_eq!(c.dead_letter_topic.as_deref(), Some("orders-dead"));
        assert_eq!(c.credentials, Some(("u".into(), "p@ss".into())));

        let c = MqttConfig::from_url("mqtt://broker/%24share/g/a%2Bb?client_id=x").unwrap();
        assert_eq!(c.port, 1883);
        assert_eq!(c.topic, "$share/g/a+b");
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "tcp://h:1883/t?client_id=c",
            "mqtt://h:1883/t",
            "mqtt://h:1883?client_id=c",
            "mqtt://h:1883/?client_id=c",
            "mqtt://:1883/t?client_id=c",
            "mqtt://h:x/t?client_id=c",
            "mqtt://h/t?client_id=c&qos=0",
            "mqtt://h/t?client_id=c&keep_alive=1s",
            "mqtt://h/t?client_id=c&session_expiry=0",
            "mqtt://h/t?client_id=c&dead_letter_topic=a/%23",
            "mqtt://h/t?client_id=c&bogus=1",
        ] {
            assert!(
                matches!(MqttConfig::from_url(url), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{url} should be rejected"
            );
        }
    }
}
