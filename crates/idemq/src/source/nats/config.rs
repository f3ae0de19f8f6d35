//! The configuration: [`NatsConfig`], its URL form, and NATS names and subjects.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::jetstream;

use crate::error::SourceError;
use crate::source::loss::LossPolicy;
use crate::source::url::{redact, Bare, BrokerUrl};

const MAX_BATCH: usize = 10_000;

/// Where and how to consume a JetStream stream. Build it with
/// [`NatsConfig::new`] and the builder methods, or parse a URL with
/// [`NatsConfig::from_url`].
#[derive(Clone)]
#[non_exhaustive]
pub struct NatsConfig {
    /// The server URL, e.g. `nats://127.0.0.1:4222` (credentials may be in it).
    pub server: String,
    /// The stream name.
    pub stream: String,
    /// The durable consumer name.
    pub consumer: String,
    /// The subject: the stream's subject when it is created, the consumer's
    /// filter subject, and the subject [`NatsPublisher`](super::NatsPublisher)
    /// publishes to (which must then be free of wildcards).
    pub subject: Option<String>,
    /// How long the server waits for an ack before redelivering; while a
    /// delivery is unsettled it is extended every third of this (≥ 1 s).
    pub ack_wait: Duration,
    /// The server's delivery limit per message (`None`: unlimited).
    pub max_deliver: Option<i64>,
    /// Messages per pull request (1 ..= 10000).
    pub batch: usize,
    /// How long a pull request waits for messages (≥ 100 ms).
    pub wait: Duration,
    /// The subject that dead-lettered messages are copied to.
    pub dead_letter_subject: Option<String>,
    /// The duplicate window of a stream this creates (at least 100 ms;
    /// `None`: the server's default of 2 minutes).
    pub duplicate_window: Option<Duration>,
    /// Create the stream (and the consumer, and a dead-letter stream) if missing.
    pub create: bool,
    /// Require TLS (`tls=true`; a `tls://` server requires it too).
    pub tls: bool,
    /// A PEM file of the certificate authority that signed the server's
    /// certificate (`cacert=PATH`), for a private CA.
    pub ca_file: Option<PathBuf>,
    /// A client certificate and its key, PEM files (`cert=PATH&key=PATH`),
    /// for servers that verify their clients.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// A file holding an nkey seed (`nkey=PATH`, as `nats --nkey`): the
    /// client signs the server's nonce with it.
    pub nkey_file: Option<PathBuf>,
    /// How often the consumer's lag is read into `idemq_source_lag_messages`
    /// (`lag_interval=`, default 5 s; zero turns it off, else at least 1 s).
    pub lag_interval: Duration,
    /// What to do when the stream's limits can drop messages no consumer
    /// processed (`broker_loss=refuse|warn`, default refuse).
    pub broker_loss: LossPolicy,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("server", &redact(&self.server))
            .field("stream", &self.stream)
            .field("consumer", &self.consumer)
            .field("subject", &self.subject)
            .field("ack_wait", &self.ack_wait)
            .field("max_deliver", &self.max_deliver)
            .field("batch", &self.batch)
            .field("wait", &self.wait)
            .field("dead_letter_subject", &self.dead_letter_subject)
            .field("duplicate_window", &self.duplicate_window)
            .field("create", &self.create)
            .field("tls", &self.tls)
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("nkey_file", &self.nkey_file)
            .field("lag_interval", &self.lag_interval)
            .field("broker_loss", &self.broker_loss)
            .finish()
    }
}

impl NatsConfig {
    /// Defaults for `stream` and `consumer` on `nats://127.0.0.1:4222`: no
    /// subject, 30 s `ack_wait`, unlimited deliveries, 10 messages per pull
    /// waiting up to 5 s, no dead-letter subject, nothing created, the lag
    /// read every 5 s.
    pub fn new(stream: impl Into<String>, consumer: impl Into<String>) -> Self {
        Self {
            server: "nats://127.0.0.1:4222".into(),
            stream: stream.into(),
            consumer: consumer.into(),
            subject: None,
            ack_wait: Duration::from_secs(30),
            max_deliver: None,
            batch: 10,
            wait: Duration::from_secs(5),
            dead_letter_subject: None,
            duplicate_window: None,
            create: false,
            tls: false,
            ca_file: None,
            client_cert: None,
            nkey_file: None,
            lag_interval: super::lag::DEFAULT_LAG_INTERVAL,
            broker_loss: LossPolicy::Refuse,
        }
    }

    /// Parses
    /// `nats://[user:password@]host:port/STREAM/CONSUMER?subject=…&ack_wait=30s&max_deliver=10&batch=10&wait=5s&dlq_subject=…&duplicate_window=2m&create=true&lag_interval=5s&broker_loss=refuse`.
    ///
    /// Authentication as the NATS tools write it: `user:password@` in the
    /// URL, or a token alone as the user (`nats://TOKEN@host`), or
    /// `nkey=PATH` (a seed file). TLS: `tls=true`, with `cacert=PATH` for a
    /// private CA and `cert=PATH&key=PATH` for a client certificate.
    ///
    /// Durations are a number with `ms`, `s`, `m` or `h` (a bare number is
    /// seconds). Values may be percent-encoded (`orders.%3E` for `orders.>`;
    /// a plain `>` works too). Unknown parameters and out-of-range values are
    /// a [`SourceErrorKind::Config`](crate::SourceErrorKind::Config).
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("NATS", "nats", url)?;
        u.host_list()?;
        let path = u.require_path("STREAM/CONSUMER")?;
        let [stream, consumer]: [String; 2] = u
            .segments()?
            .try_into()
            .map_err(|_| u.error(format!("the path {path:?} must be STREAM/CONSUMER")))?;
        let mut config = NatsConfig::new(stream, consumer);
        config.server = format!("nats://{}", u.authority);
        let (mut cert, mut key) = (None, None);
        for p in u.params() {
            match p.name.as_str() {
                "subject" => config.subject = p.non_empty(),
                "ack_wait" => config.ack_wait = p.duration(Bare::Seconds)?,
                "max_deliver" => {
                    config.max_deliver = match p.value.as_str() {
                        "-1" => None,
                        _ => match p.count::<i64>()? {
                            0 => {
                                return Err(
                                    p.error("max_deliver must be at least 1 (or -1 for unlimited)")
                                )
                            }
                            n => Some(n),
                        },
                    }
                }
                "batch" => config.batch = p.count()?,
                "wait" => config.wait = p.duration(Bare::Seconds)?,
                "dlq_subject" => config.dead_letter_subject = p.non_empty(),
                "duplicate_window" => config.duplicate_window = Some(p.duration(Bare::Seconds)?),
                "create" => config.create = p.flag()?,
                "tls" => config.tls = p.flag()?,
                "cacert" => config.ca_file = p.non_empty().map(PathBuf::from),
                "cert" => cert = p.non_empty().map(PathBuf::from),
                "key" => key = p.non_empty().map(PathBuf::from),
                "nkey" => config.nkey_file = p.non_empty().map(PathBuf::from),
                "lag_interval" => config.lag_interval = p.duration(Bare::Seconds)?,
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                _ => return Err(p.unknown()),
            }
        }
        config.client_cert = u.client_cert(cert, key)?;
        config.validate()?;
        Ok(config)
    }

    /// What to do when the stream can drop unprocessed messages
    /// ([`LossPolicy::Refuse`] by default).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// Sets the server URL.
    pub fn server(mut self, server: impl Into<String>) -> Self {
        self.server = server.into();
        self
    }

    /// Sets the subject.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets `ack_wait`.
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Sets the server's delivery limit per message.
    pub fn max_deliver(mut self, max_deliver: i64) -> Self {
        self.max_deliver = Some(max_deliver);
        self
    }

    /// Sets the messages per pull request.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// Sets how long a pull request waits for messages.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the dead-letter subject.
    pub fn dead_letter_subject(mut self, subject: impl Into<String>) -> Self {
        self.dead_letter_subject = Some(subject.into());
        self
    }

    /// Sets the duplicate window of a stream this creates.
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = Some(window);
        self
    }

    /// Whether to create a missing stream, consumer and dead-letter stream.
    pub fn create(mut self, create: bool) -> Self {
        self.create = create;
        self
    }

    /// Requires TLS, verifying the server against the CA in `ca_file` (a
    /// PEM file) when given.
    pub fn tls(mut self, ca_file: Option<PathBuf>) -> Self {
        self.tls = true;
        self.ca_file = ca_file;
        self
    }

    /// Presents a client certificate (PEM files of the certificate and its key).
    pub fn client_cert(mut self, cert: PathBuf, key: PathBuf) -> Self {
        self.client_cert = Some((cert, key));
        self
    }

    /// Authenticates with the nkey seed in `path`.
    pub fn nkey_file(mut self, path: PathBuf) -> Self {
        self.nkey_file = Some(path);
        self
    }

    /// Sets how often the consumer's lag is read (zero: never).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if !self.server.starts_with("nats://") && !self.server.starts_with("tls://") {
            return Err(SourceError::config(format!(
                "server {:?} must start with nats:// or tls://",
                redact(&self.server)
            )));
        }
        validate_name("stream", &self.stream)?;
        validate_name("consumer", &self.consumer)?;
        if let Some(subject) = &self.subject {
            validate_subject(subject, true)?;
        } else if self.create {
            return Err(SourceError::config(
                "creating the stream needs a subject (?subject=…)",
            ));
        }
        if let Some(subject) = &self.dead_letter_subject {
            validate_subject(subject, false)?;
            if self
                .subject
                .as_deref()
                .is_some_and(|s| subject_matches(s, subject))
            {
                return Err(SourceError::config(format!(
                    "the dead-letter subject {subject:?} is inside the consumed subject"
                )));
            }
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(SourceError::config(format!(
                "ack_wait must be at least 1 s, not {:?}",
                self.ack_wait
            )));
        }
        if let Some(n) = self.max_deliver {
            if n == 0 || n < -1 {
                return Err(SourceError::config(
                    "max_deliver must be at least 1 (or -1 for unlimited)",
                ));
            }
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(SourceError::config(format!(
                "batch must be from 1 to {MAX_BATCH}, not {}",
                self.batch
            )));
        }
        if self.wait < Duration::from_millis(100) {
            return Err(SourceError::config(format!(
                "wait must be at least 100 ms, not {:?}",
                self.wait
            )));
        }
        if !self.lag_interval.is_zero() && self.lag_interval < Duration::from_secs(1) {
            return Err(SourceError::config(format!(
                "lag_interval must be 0 (off) or at least 1 s, not {:?}",
                self.lag_interval
            )));
        }
        if self
            .duplicate_window
            .is_some_and(|w| w < Duration::from_millis(100))
        {
            return Err(SourceError::config(
                "duplicate_window must be at least 100 ms (the server's minimum)",
            ));
        }
        Ok(())
    }

    /// The client options: the credentials and TLS settings, and the
    /// server URL without its user info (which the client would ignore).
    async fn connect_options(&self) -> Result<(async_nats::ConnectOptions, String), SourceError> {
        let mut options =
            async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(10));
        let (scheme, rest) = self
            .server
            .split_once("://")
            .ok_or_else(|| SourceError::config("the NATS server URL has no scheme"))?;
        let mut server = self.server.clone();
        if let Some((userinfo, hosts)) = rest.rsplit_once('@') {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let decoded = |part: &str| {
                crate::source::url::decode(part).map_err(|why| {
                    SourceError::config(format!("the NATS server URL's user info: {why}"))
                })
            };
            let (user, password) = (decoded(user)?, decoded(password)?);
            options = if password.is_empty() {
                options.token(user)
            } else {
                options.user_and_password(user, password)
            };
            server = format!("{scheme}://{hosts}");
        }
        if let Some(path) = &self.nkey_file {
            let seed = tokio::fs::read_to_string(path).await.map_err(|e| {
                SourceError::config(format!(
                    "reading the nkey seed file {}: {e}",
                    path.display()
                ))
            })?;
            options = options.nkey(seed.trim().to_owned());
        }
        if self.tls {
            options = options.require_tls(true);
        }
        if let Some(ca) = &self.ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let Some((cert, key)) = &self.client_cert {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        Ok((options, server))
    }

    /// Connects to the server and returns a JetStream context.
    pub async fn jetstream(&self) -> Result<jetstream::Context, SourceError> {
        self.validate()?;
        crate::tls::ensure_crypto_provider();
        let (options, server) = self.connect_options().await?;
        let client = options
            .connect(server.as_str())
            .await
            .map_err(|e| connect_error(&self.server, e))?;
        Ok(jetstream::new(client))
    }

    /// Gets the stream, creating it (subjects: the subject) with `create`.
    pub(super) async fn stream(
        &self,
        js: &jetstream::Context,
    ) -> Result<jetstream::stream::Stream, SourceError> {
        if self.create {
            let Some(subject) = &self.subject else {
                return Err(SourceError::config("creating the stream needs a subject"));
            };
            let config = jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![subject.clone()],
                duplicate_window: self.duplicate_window.unwrap_or_default(),
                ..Default::default()
            };
            js.get_or_create_stream(config)
                .await
                .map_err(|e| broker_error(&format!("creating the stream {}", self.stream), e))
        } else {
            js.get_stream(&self.stream)
                .await
                .map_err(|e| broker_error(&format!("getting the stream {}", self.stream), e))
        }
    }

    /// With `create` and a dead-letter subject that no stream captures,
    /// creates the stream `<STREAM>_dlq` for it.
    pub(super) async fn dead_letter_stream(
        &self,
        js: &jetstream::Context,
    ) -> Result<(), SourceError> {
        let (true, Some(subject)) = (self.create, &self.dead_letter_subject) else {
            return Ok(());
        };
        if js.stream_by_subject(subject.clone()).await.is_ok() {
            return Ok(());
        }
        let name = format!("{}_dlq", self.stream);
        tracing::info!(stream = %name, subject = %subject, "creating the NATS dead-letter stream");
        js.get_or_create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| broker_error(&format!("creating the dead-letter stream {name}"), e))
    }
}

pub(super) fn broker_error(what: &str, err: impl Into<crate::error::BoxError>) -> SourceError {
    crate::source::kit::broker_error("NATS", what, err)
}

/// A failed connection: refused credentials and a TLS handshake that fails
/// (an unknown CA, a server without TLS) are configuration errors, which no
/// retry fixes; the rest are the broker's. The server URL is shown redacted.
fn connect_error(server: &str, err: async_nats::ConnectError) -> SourceError {
    use async_nats::ConnectErrorKind as Kind;
    let what = format!("connecting to {}", redact(server));
    // A certificate the handshake refused reaches us as an I/O error with
    // invalid data (rustls's verdict) underneath.
    let bad_certificate = || {
        let mut cause = std::error::Error::source(&err);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                return io.kind() == std::io::ErrorKind::InvalidData;
            }
            cause = e.source();
        }
        false
    };
    match err.kind() {
        Kind::Authentication | Kind::AuthorizationViolation | Kind::Tls => {
            SourceError::config(format!("NATS: {what}: {err}")).with_source(err)
        }
        Kind::Io if bad_certificate() => {
            SourceError::config(format!("NATS: {what}: {err}")).with_source(err)
        }
        _ => broker_error(&what, err),
    }
}

/// Stream and consumer names: 1 to 255 printable characters without
/// whitespace, `.`, `*`, `>`, `/` or `\`.
fn validate_name(what: &str, name: &str) -> Result<(), SourceError> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && !".*>/\\".contains(c));
    if ok {
        Ok(())
    } else {
        Err(SourceError::config(format!(
            "invalid NATS {what} name {name:?}: no whitespace, '.', '*', '>', '/' or '\\'"
        )))
    }
}

/// A subject: dot-separated non-empty tokens without whitespace; with
/// `wildcards`, `*` as a whole token and `>` as the whole last token.
pub(super) fn validate_subject(subject: &str, wildcards: bool) -> Result<(), SourceError> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let last = tokens.len() - 1;
    let ok = tokens.iter().enumerate().all(|(i, t)| {
        let plain = !t.is_empty()
            && t.chars()
                .all(|c| !c.is_whitespace() && !c.is_control() && c != '*' && c != '>');
        plain || (wildcards && (*t == "*" || (*t == ">" && i == last)))
    });
    if ok {
        Ok(())
    } else if wildcards {
        Err(SourceError::config(format!(
            "invalid NATS subject {subject:?}: dot-separated tokens, '*' a whole token, '>' the last one"
        )))
    } else {
        Err(SourceError::config(format!(
            "invalid NATS subject {subject:?}: dot-separated tokens without wildcards"
        )))
    }
}

pub(super) fn has_wildcards(subject: &str) -> bool {
    subject.split('.').any(|t| t == "*" || t == ">")
}

/// Whether the concrete `subject` matches `filter` (which may have wildcards).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut filter = filter.split('.');
    let mut subject = subject.split('.');
    loop {
        match (filter.next(), subject.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(f), Some(s)) if f == s => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;
    use crate::source::url::parse_duration;

    #[test]
    fn parses_tls_and_credentials() {
        let c = NatsConfig::from_url(
            "nats://tok@h:4222/S/C?tls=true&cacert=/ca.pem&cert=/c.pem&key=/k.pem&nkey=/u.nk",
        )
        .unwrap();
        assert!(c.tls);
        assert_eq!(c.ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(
            c.client_cert,
            Some((PathBuf::from("/c.pem"), PathBuf::from("/k.pem")))
        );
        assert_eq!(c.nkey_file, Some(PathBuf::from("/u.nk")));
        assert!(!format!("{c:?}").contains("tok@"), "{c:?}");
        let half = NatsConfig::from_url("nats://h/S/C?cert=/c.pem").unwrap_err();
        assert_eq!(half.kind(), SourceErrorKind::Config);
    }

    #[test]
    fn parses_urls() {
        let c = NatsConfig::from_url(
            "nats://127.0.0.1:4222/ORDERS/billing?subject=orders.>&ack_wait=2s&max_deliver=5&batch=4&wait=500ms&dlq_subject=dead.orders&duplicate_window=1m&create=true",
        )
        .unwrap();
        assert_eq!(c.server, "nats://127.0.0.1:4222");
        assert_eq!(c.stream, "ORDERS");
        assert_eq!(c.consumer, "billing");
        assert_eq!(c.subject.as_deref(), Some("orders.>"));
        assert_eq!(c.ack_wait, Duration::from_secs(2));
        assert_eq!(c.max_deliver, Some(5));
        assert_eq!(c.batch, 4);
        assert_eq!(c.wait, Duration::from_millis(500));
        assert_eq!(c.dead_letter_subject.as_deref(), Some("dead.orders"));
        assert_eq!(c.duplicate_window, Some(Duration::from_secs(60)));
        assert!(c.create);
        assert_eq!(c.lag_interval, Duration::from_secs(5));
        let off = NatsConfig::from_url("nats://h/S/C?subject=a&lag_interval=0").unwrap();
        assert_eq!(off.lag_interval, Duration::ZERO);
        let every = NatsConfig::from_url("nats://h/S/C?subject=a&lag_interval=2").unwrap();
        assert_eq!(every.lag_interval, Duration::from_secs(2));

        let c = NatsConfig::from_url("nats://u:p@nats.local/S/C/?subject=a.%3E&max_deliver=-1")
            .unwrap();
        assert_eq!(c.server, "nats://u:p@nats.local");
        assert_eq!(c.subject.as_deref(), Some("a.>"));
        assert_eq!(c.max_deliver, None);
        assert_eq!(c.ack_wait, Duration::from_secs(30));
        assert!(!c.create);
        assert!(!format!("{c:?}").contains("u:p"));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://x/S/C",
            "nats://127.0.0.1:4222",
            "nats://127.0.0.1:4222/S",
            "nats://127.0.0.1:4222/S/C/D",
            "nats:///S/C",
            "nats://h/S.x/C",
            "nats://h/S/C?create=true",
            "nats://h/S/C?subject=a..b",
            "nats://h/S/C?subject=a.>.b",
            "nats://h/S/C?subject=a&ack_wait=500ms",
            "nats://h/S/C?subject=a&ack_wait=abc",
            "nats://h/S/C?subject=a&max_deliver=0",
            "nats://h/S/C?subject=a&batch=0",
            "nats://h/S/C?subject=a&wait=10ms",
            "nats://h/S/C?subject=a.>&dlq_subject=a.dead",
            "nats://h/S/C?subject=a&dlq_subject=dead.*",
            "nats://h/S/C?subject=a&duplicate_window=50ms",
            "nats://h/S/C?subject=a&bogus=1",
            "nats://h/S/C?subject=a&create=maybe",
            "nats://h/S/C?subject=a&lag_interval=500ms",
            "nats://h/S/C?subject=a&lag_interval=soon",
        ] {
            assert!(
                matches!(NatsConfig::from_url(url), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn durations() {
        // NATS durations: a bare number is seconds (the common rule).
        let parse_duration = |name, value| parse_duration(name, value, Bare::Seconds);
        assert_eq!(
            parse_duration("x", "250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_duration("x", "3").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("x", "2m").unwrap(), Duration::from_secs(120));
        assert_eq!(
            parse_duration("x", "1h").unwrap(),
            Duration::from_secs(3600)
        );
        assert_eq!(
            parse_duration("x", "1d").unwrap(),
            Duration::from_secs(86_400)
        );
        assert!(parse_duration("x", "1y").is_err());
        assert!(parse_duration("x", "s").is_err());
    }

    #[test]
    fn subjects_match() {
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(!subject_matches("a.b", "a"));
        assert!(subject_matches("a.b", "a.b"));
    }
}
