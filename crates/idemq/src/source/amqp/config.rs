//! [`AmqpConfig`]: parsing the URL into the AMQP URI and the queue settings, and connecting.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::{AMQPValue, FieldTable};
use lapin::uri::{AMQPAuthority, AMQPQueryString, AMQPScheme, AMQPUri, AMQPUserInfo};
use lapin::{Connect, Connection, ConnectionProperties};

use super::management::ManagementApi;
use crate::error::SourceError;
use crate::source::loss::{LossPolicy, DEFAULT_MIN_RETENTION};
use crate::source::url::{Bare, BrokerUrl};

/// Longest queue name accepted, so that the derived names stay under AMQP's 255 bytes.
const MAX_QUEUE_NAME: usize = 200;

/// The type of the work queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueueType {
    /// A classic queue (the default).
    #[default]
    Classic,
    /// A quorum queue (`x-queue-type = quorum`): replicated, and it counts
    /// returned deliveries in `x-delivery-count`.
    Quorum,
}

impl QueueType {
    pub(super) fn arguments(self) -> FieldTable {
        let mut args = FieldTable::default();
        if self == QueueType::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args
    }
}

/// Where to connect and which queue to consume.
#[derive(Clone)]
#[non_exhaustive]
pub struct AmqpConfig {
    pub(super) uri: AMQPUri,
    pub(super) queue: String,
    pub(super) prefetch: u16,
    pub(super) queue_type: QueueType,
    /// A PEM file of the CA that signed the broker's certificate
    /// (`amqps://…?cacert=PATH`); Mozilla's roots otherwise.
    pub(super) ca_file: Option<PathBuf>,
    /// PEM files of the client's certificate and its key, for a broker that
    /// asks for one (`cert=PATH&key=PATH`).
    pub(super) client_cert: Option<(PathBuf, PathBuf)>,
    /// How often the queue depth is read into `idemq_source_lag_messages`
    /// (`lag_interval=`, default 5 s; zero: never).
    pub(super) lag_interval: Duration,
    /// Where the queue's arguments and policies are read
    /// (`management_url=`; see [`super::management`]).
    pub(super) management: ManagementApi,
    /// What the source does when a queue's settings can drop messages
    /// (`broker_loss=refuse|warn`, default refuse).
    pub(super) broker_loss: LossPolicy,
    /// The shortest `message-ttl` and `expires` that are no risk
    /// (`min_retention=`, default 1 day; `0` turns those checks off).
    pub(super) min_retention: Duration,
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.uri.authority;
        f.debug_struct("AmqpConfig")
            .field("user", &a.userinfo.username)
            .field("host", &a.host)
            .field("port", &a.port)
            .field("vhost", &self.uri.vhost)
            .field("tls", &(self.uri.scheme == AMQPScheme::AMQPS))
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("queue_type", &self.queue_type)
            .field("lag_interval", &self.lag_interval)
            .field("management", &self.management)
            .field("broker_loss", &self.broker_loss)
            .field("min_retention", &self.min_retention)
            .finish_non_exhaustive()
    }
}

impl AmqpConfig {
    /// Parses `amqp://user:pass@host:port/vhost?queue=NAME&prefetch=N&queue_type=classic|quorum&lag_interval=5s`.
    ///
    /// User and password default to `guest`, the port to 5672, the vhost to
    /// `/`, `prefetch` to 32, `queue_type` to `classic` and `lag_interval`
    /// (how often the queue depth is read; `0` turns it off, else at least
    /// 1 s; a bare number is seconds) to 5 s; `queue` is required. Unknown
    /// parameters are an error.
    ///
    /// When the source connects, it reads the work queue's and the
    /// dead-letter queue's arguments and policies from RabbitMQ's management
    /// API (`management_url=URL|off`, by default the AMQP host on port
    /// 15672, or 15671 over TLS) and refuses to start when one can drop a
    /// message before it is processed (`broker_loss=warn` logs it and runs;
    /// `min_retention=`, default `1d`, is the shortest `message-ttl` and
    /// queue `expires` that is no risk). See [`crate::source::loss`].
    ///
    /// `amqps://` connects over TLS (port 5671 by default), verifying the
    /// broker against Mozilla's roots or the CA file in `cacert=PATH`, and
    /// shows the client certificate in `cert=PATH` with its key in
    /// `key=PATH` (PEM) to a broker that asks for one. The RabbitMQ URI
    /// spellings `cacertfile`, `certfile` and `keyfile` are taken too.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let tls = url.starts_with("amqps://");
        let u = BrokerUrl::parse("AMQP", if tls { "amqps" } else { "amqp" }, url)?;
        let mut user = AMQPUserInfo::default();
        if let Some((name, pass)) = &u.userinfo {
            user.username.clone_from(name);
            user.password.clone_from(pass);
        }
        let (host, port) = u.host_port(if tls { 5671 } else { 5672 })?;
        let mut vhost = u.decoded_path()?;
        if vhost.is_empty() {
            vhost = "/".into();
        }

        let mut queue = None;
        let mut prefetch = 32u16;
        let mut queue_type = QueueType::Classic;
        let mut lag_interval = super::lag::DEFAULT_LAG_INTERVAL;
        let mut management = ManagementApi::Derived;
        let mut broker_loss = LossPolicy::Refuse;
        let mut min_retention = DEFAULT_MIN_RETENTION;
        let mut conn = AMQPQueryString::default();
        let mut ca_file = None;
        let (mut cert, mut key) = (None, None);
        for p in u.params() {
            match p.name.as_str() {
                "queue" => queue = Some(p.value),
                "prefetch" => {
                    prefetch = p.count()?;
                    if prefetch == 0 {
                        return Err(p.error("prefetch must be at least 1"));
                    }
                }
                "queue_type" => {
                    queue_type = match p.choice(&["classic", "quorum"])? {
                        "quorum" => QueueType::Quorum,
                        _ => QueueType::Classic,
                    }
                }
                "lag_interval" => {
                    lag_interval = p.duration(Bare::Seconds)?;
                    if !lag_interval.is_zero() && lag_interval < super::lag::MIN_LAG_INTERVAL {
                        return Err(p.error("lag_interval must be 0 (off) or at least 1s"));
                    }
                }
                "management_url" => management = ManagementApi::parse(&p.value)?,
                "broker_loss" => broker_loss = LossPolicy::parse(&p.value)?,
                "min_retention" => min_retention = p.duration(Bare::Seconds)?,
                "heartbeat" => conn.heartbeat = Some(p.count()?),
                "connection_timeout" => conn.connection_timeout = Some(p.count()?),
                "frame_max" => conn.frame_max = Some(p.count()?),
                "channel_max" => conn.channel_max = Some(p.count()?),
                "cacert" | "cacertfile" if tls => ca_file = p.non_empty().map(PathBuf::from),
                "cert" | "certfile" if tls => cert = p.non_empty().map(PathBuf::from),
                "key" | "keyfile" if tls => key = p.non_empty().map(PathBuf::from),
                "cacert" | "cacertfile" | "cert" | "certfile" | "key" | "keyfile" => {
                    return Err(p.error("TLS settings need an amqps:// URL"))
                }
                _ => return Err(p.unknown()),
            }
        }
        let queue = queue.ok_or_else(|| u.missing("queue"))?;
        let client_cert = u.client_cert(cert, key)?;
        let uri = AMQPUri {
            scheme: if tls {
                AMQPScheme::AMQPS
            } else {
                AMQPScheme::AMQP
            },
            authority: AMQPAuthority {
                userinfo: user,
                host,
                port,
            },
            vhost,
            query: conn,
        };
        AmqpConfig {
            uri,
            queue: String::new(),
            prefetch,
            queue_type,
            ca_file,
            client_cert,
            lag_interval,
            management,
            broker_loss,
            min_retention,
        }
        .queue(queue)
    }

    /// Sets the work queue (1 to 200 bytes, not starting with `amq.`).
    pub fn queue(mut self, queue: impl Into<String>) -> Result<Self, SourceError> {
        let queue = queue.into();
        if queue.is_empty() || queue.len() > MAX_QUEUE_NAME || queue.starts_with("amq.") {
            return Err(SourceError::config(format!(
                "invalid queue name {queue:?}: 1 to {MAX_QUEUE_NAME} bytes, not starting with amq."
            )));
        }
        self.queue = queue;
        Ok(self)
    }

    /// Sets the prefetch count (unacked deliveries per consumer; at least 1).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// Sets the type of the work queue.
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Sets how often the queue depth is read (zero: never; else at least 1 s,
    /// shorter intervals count as 1 s).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    /// What the source does when a queue's arguments or policies can drop
    /// a message before it is processed ([`LossPolicy::Refuse`] by default).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// The shortest `message-ttl` and queue `expires` that are no risk
    /// (default 1 day; zero turns those two checks off).
    pub fn min_retention(mut self, retention: Duration) -> Self {
        self.min_retention = retention;
        self
    }

    /// Reads the queues' arguments and policies from the management API at
    /// `url` (`http(s)://host:port`, no credentials: the AMQP user's are
    /// used), or not at all with `None`.
    pub fn management_url(mut self, url: Option<&str>) -> Result<Self, SourceError> {
        self.management = match url {
            Some(url) => ManagementApi::parse(url)?,
            None => ManagementApi::Off,
        };
        Ok(self)
    }

    /// Whether the connection uses TLS (`amqps://`).
    pub(super) fn is_tls(&self) -> bool {
        self.uri.scheme == AMQPScheme::AMQPS
    }

    /// How often the queue depth is read (zero: never).
    pub fn lag_poll_interval(&self) -> Duration {
        self.lag_interval
    }

    /// The work queue.
    pub fn queue_name(&self) -> &str {
        &self.queue
    }

    /// The prefetch count.
    pub fn prefetch_count(&self) -> u16 {
        self.prefetch
    }

    /// The type of the work queue.
    pub fn work_queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// The virtual host.
    pub fn vhost(&self) -> &str {
        &self.uri.vhost
    }

    pub(super) async fn connect(&self, name: &str) -> Result<Connection, SourceError> {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let mut tls = OwnedTLSConfig::default();
        let read = |what: &'static str, path: &PathBuf| {
            let path = path.clone();
            async move {
                tokio::fs::read(&path).await.map_err(|e| {
                    SourceError::config(format!("AMQP: reading the {what} {}: {e}", path.display()))
                })
            }
        };
        if let Some(path) = &self.ca_file {
            let pem = read("CA file", path).await?;
            tls.cert_chain = Some(String::from_utf8_lossy(&pem).into_owned());
        }
        if let Some((cert, key)) = &self.client_cert {
            tls.identity = Some(OwnedIdentity::PKCS8 {
                pem: read("client certificate", cert).await?,
                key: read("client key", key).await?,
            });
        }
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| SourceError::other(format!("AMQP: no runtime: {e}")))?;
        let a = &self.uri.authority;
        let at = format!("{}:{} vhost {:?}", a.host, a.port, self.uri.vhost);
        self.uri
            .clone()
            .connect_with_config(props, tls, runtime)
            .await
            .map_err(|e| connect_error(&at, e))
    }
}

/// A failed connection: refused credentials and a TLS handshake that fails
/// (an unknown CA, a server without TLS) are configuration errors, which no
/// retry fixes; the rest are the broker's.
fn connect_error(at: &str, e: lapin::Error) -> SourceError {
    use lapin::ErrorKind;
    let refused_for_good = match e.kind() {
        ErrorKind::AuthProviderError(_) => true,
        ErrorKind::IOError(io) => io.kind() == std::io::ErrorKind::InvalidData,
        ErrorKind::ProtocolError(amqp) => amqp.get_id() == 403,
        _ => false,
    };
    let message = format!("connecting to {at}: {e}");
    if refused_for_good {
        SourceError::config(format!("AMQP: {message}"))
    } else {
        SourceError::broker(message)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::RETRY_DELAYS;
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn parses_urls() {
        let c = AmqpConfig::from_url(
            "amqp://guest:g%40st@127.0.0.1:5673/%2f?queue=orders&prefetch=4&queue_type=quorum&heartbeat=10",
        )
        .unwrap();
        assert_eq!(c.uri.authority.userinfo.password, "g@st");
        assert_eq!(c.uri.authority.host, "127.0.0.1");
        assert_eq!(c.uri.authority.port, 5673);
        assert_eq!(c.vhost(), "/");
        assert_eq!(c.queue_name(), "orders");
        assert_eq!(c.prefetch_count(), 4);
        assert_eq!(c.work_queue_type(), QueueType::Quorum);
        assert_eq!(c.uri.query.heartbeat, Some(10));
        assert_eq!(c.lag_poll_interval(), Duration::from_secs(5));
        let off = AmqpConfig::from_url("amqp://h/?queue=q&lag_interval=0").unwrap();
        assert_eq!(off.lag_poll_interval(), Duration::ZERO);
        let every = AmqpConfig::from_url("amqp://h/?queue=q&lag_interval=2").unwrap();
        assert_eq!(every.lag_poll_interval(), Duration::from_secs(2));
        assert!(!format!("{c:?}").contains("g@st"));

        let c = AmqpConfig::from_url("amqp://rabbit/prod?queue=q").unwrap();
        assert_eq!(
            (c.uri.authority.port, c.vhost(), c.prefetch_count()),
            (5672, "prod", 32)
        );
        assert_eq!(c.dead_letter_queue(), "q.dead-letter");
        assert_eq!(c.retry_queue(Duration::from_millis(120)), "q.retry.250ms");
        assert_eq!(
            c.retry_queue(Duration::from_secs(86_400)),
            "q.retry.3600000ms"
        );
        assert_eq!(c.queues().len(), RETRY_DELAYS.len() + 2);
        assert_eq!(
            AmqpConfig::from_url("amqp://h:1/?queue=q").unwrap().vhost(),
            "/"
        );
        let tls = AmqpConfig::from_url("amqps://h/?queue=q&cacert=/ca.pem").unwrap();
        assert_eq!(tls.uri.scheme, AMQPScheme::AMQPS);
        assert_eq!(tls.uri.authority.port, 5671);
        assert_eq!(tls.ca_file, Some(PathBuf::from("/ca.pem")));

        for bad in [
            "amqp://h/%2f",
            "http://h/?queue=q",
            "amqp://h/?queue=q&cacert=/ca.pem",
            "amqp://h:x/?queue=q",
            "amqp://h/?queue=q&prefetch=0",
            "amqp://h/?queue=q&queue_type=stream",
            "amqp://h/?queue=q&bogus=1",
            "amqp://h/?queue=q&lag_interval=500ms",
            "amqp://h/?queue=q&lag_interval=x",
            "amqp://h/%zz?queue=q",
            "amqp:///?queue=q",
            "amqp://h/?queue=amq.x",
        ] {
            assert!(
                matches!(AmqpConfig::from_url(bad), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{bad}"
            );
        }
    }
}
