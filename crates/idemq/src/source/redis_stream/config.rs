//! Configuration: [`RedisStreamConfig`] and its URL form.

use std::time::Duration;

use crate::error::SourceError;
use crate::source::loss::LossPolicy;
use crate::source::url::{Bare, BrokerUrl};

/// Where and how to consume one stream. Build it with [`RedisStreamConfig::new`]
/// and the public fields, or parse a URL with [`RedisStreamConfig::from_url`].
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisStreamConfig {
    /// The Redis URL, `redis://[user:password@]host:port[/db]`.
    pub redis_url: String,
    /// The stream key.
    pub stream: String,
    /// The consumer group.
    pub group: String,
    /// This consumer's name within the group. `None` (the default): a name
    /// unique to each connected source, `idemq-<pid>-<random>`. Set a stable
    /// one to re-read its own pending entries at once after a restart; two
    /// sources must never run under the same name at the same time (each
    /// would re-read what the other holds).
    pub consumer: Option<String>,
    /// Entries pending longer than this are claimed from their (dead)
    /// consumer with `XAUTOCLAIM` (default 30 s, at least 100 ms).
    pub claim_idle: Duration,
    /// How long one `XREADGROUP` blocks waiting for new entries (default 2 s).
    pub block: Duration,
    /// Entries per read or claim (default 10, 1 ..= 1000).
    pub count: usize,
    /// The stream that dead-lettered entries are copied to, if any.
    pub dead_letter_stream: Option<String>,
    /// Where a group created by this source starts: `0` (every entry the
    /// stream has, default) or `$` (only new entries).
    pub start: String,
    /// How often the group's lag is read into `idemq_source_lag_messages`
    /// (`lag_interval=`, default 5 s; zero turns it off, else at least 1 s).
    /// The same readings look for entries removed before the group read
    /// them; zero turns that off too.
    pub lag_interval: Duration,
    /// What to do when connecting finds entries above the group's last
    /// delivered id removed before the group read them
    /// (`broker_loss=refuse|warn`, default refuse).
    pub broker_loss: LossPolicy,
}

/// Shows the URL with its password hidden.
impl std::fmt::Debug for RedisStreamConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStreamConfig")
            .field("redis_url", &crate::redact::redact_url(&self.redis_url))
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .field("claim_idle", &self.claim_idle)
            .field("block", &self.block)
            .field("count", &self.count)
            .field("dead_letter_stream", &self.dead_letter_stream)
            .field("start", &self.start)
            .field("lag_interval", &self.lag_interval)
            .field("broker_loss", &self.broker_loss)
            .finish()
    }
}

impl RedisStreamConfig {
    /// Defaults for `stream` and `group` on the Redis at `redis_url`.
    pub fn new(
        redis_url: impl Into<String>,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            redis_url: redis_url.into(),
            stream: stream.into(),
            group: group.into(),
            consumer: None,
            claim_idle: Duration::from_secs(30),
            block: Duration::from_secs(2),
            count: 10,
            dead_letter_stream: None,
            start: "0".into(),
            lag_interval: super::lag::DEFAULT_LAG_INTERVAL,
            broker_loss: LossPolicy::Refuse,
        }
    }

    /// Parses
    /// `redis-stream://[user:password@]host:port/stream?group=NAME[&consumer=NAME][&claim_idle=30s][&block=2s][&count=10][&dead_letter_stream=NAME][&start=0|$][&lag_interval=5s][&broker_loss=refuse|warn][&db=N][&tls=true][&cacert=PATH][&cert=PATH&key=PATH]`.
    ///
    /// `tls=true` connects over TLS (as `rediss://`), verified against the
    /// system's and Mozilla's roots; `cacert` names a PEM file of the CA to
    /// verify against instead, and `cert` and `key` the PEM files of a client
    /// certificate and its key (each implies `tls`).
    ///
    /// `broker_loss=warn` runs a group that lost entries (removed before
    /// it read them) with a `warn` line instead of refusing it.
    ///
    /// `group` is required. Durations take a unit (`ms`, `s`, `m`, `h`);
    /// unlike the other sources' URLs, a bare number is **milliseconds**, as
    /// in Redis (`block=500` is 500 ms). The stream name and values may be
    /// percent-encoded.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("Redis Streams", "redis-stream", url)?;
        u.require_path("stream")?;
        u.host_list()?;
        let mut group = None;
        let mut db = None;
        let mut tls = false;
        let mut tls_files: Vec<(&str, String)> = Vec::new();
        let mut config = Self::new(String::new(), u.decoded_path()?, String::new());
        for p in u.params() {
            match p.name.as_str() {
                "group" => group = p.non_empty(),
                "consumer" => config.consumer = Some(p.value),
                "claim_idle" => config.claim_idle = p.duration(Bare::Millis)?,
                "block" => config.block = p.duration(Bare::Millis)?,
                "count" => config.count = p.count()?,
                "dead_letter_stream" => config.dead_letter_stream = Some(p.value),
                "start" => config.start = p.value,
                "lag_interval" => config.lag_interval = p.duration(Bare::Millis)?,
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                "db" => db = Some(p.count::<u32>()?),
                "tls" => tls = p.flag()?,
                name @ ("cacert" | "cert" | "key") => {
                    let param = match name {
                        "cacert" => crate::redis_client::CACERT_PARAM,
                        "cert" => crate::redis_client::CERT_PARAM,
                        _ => crate::redis_client::KEY_PARAM,
                    };
                    if let Some(path) = p.non_empty() {
                        tls_files.push((param, path));
                    }
                }
                _ => return Err(p.unknown()),
            }
        }
        config.group = group.ok_or_else(|| u.missing("group"))?;
        let scheme = if tls || !tls_files.is_empty() {
            "rediss"
        } else {
            "redis"
        };
        config.redis_url = match db {
            Some(db) => format!("{scheme}://{}/{db}", u.authority),
            None => format!("{scheme}://{}", u.authority),
        };
        if !tls_files.is_empty() {
            if db.is_none() {
                config.redis_url.push('/');
            }
            let query: Vec<String> = tls_files
                .iter()
                .map(|(param, path)| format!("{param}={}", crate::redis_client::encode_param(path)))
                .collect();
            config.redis_url.push('?');
            config.redis_url.push_str(&query.join("&"));
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the consumer name.
    pub fn consumer(mut self, consumer: impl Into<String>) -> Self {
        self.consumer = Some(consumer.into());
        self
    }

    /// Sets the idle time after which pending entries are claimed.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.claim_idle = idle;
        self
    }

    /// Sets the blocking time of one read.
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block;
        self
    }

    /// Sets the dead-letter stream.
    pub fn dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.dead_letter_stream = Some(stream.into());
        self
    }

    /// Sets how often the group's lag is read (zero: never).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    /// Sets what to do when entries were removed before the group read
    /// them ([`LossPolicy::Refuse`] by default).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        if self.stream.is_empty() {
            return Err(SourceError::config("the stream name is empty"));
        }
        if self.group.is_empty() {
            return Err(SourceError::config("the consumer group is empty"));
        }
        if self.consumer.as_deref() == Some("") {
            return Err(SourceError::config("the consumer name is empty"));
        }
        if self.dead_letter_stream.as_deref() == Some("") {
            return Err(SourceError::config("the dead-letter stream name is empty"));
        }
        if self.dead_letter_stream.as_deref() == Some(self.stream.as_str()) {
            return Err(SourceError::config(
                "the dead-letter stream must differ from the stream",
            ));
        }
        if self.claim_idle < Duration::from_millis(100) {
            return Err(SourceError::config(format!(
                "claim_idle must be at least 100ms, not {:?}",
                self.claim_idle
            )));
        }
        if self.block < Duration::from_millis(1) {
            return Err(SourceError::config(
                "block must be at least 1ms (0 would block forever)",
            ));
        }
        if !(1..=1000).contains(&self.count) {
            return Err(SourceError::config(format!(
                "count must be from 1 to 1000, not {}",
                self.count
            )));
        }
        if !self.lag_interval.is_zero() && self.lag_interval < Duration::from_secs(1) {
            return Err(SourceError::config(format!(
                "lag_interval must be 0 (off) or at least 1s, not {:?}",
                self.lag_interval
            )));
        }
        if !matches!(self.start.as_str(), "0" | "$") {
            return Err(SourceError::config(format!(
                "start must be 0 or $, not {:?}",
                self.start
            )));
        }
        Ok(())
    }
}

pub(super) fn default_consumer_name() -> String {
    format!("idemq-{}-{:08x}", std::process::id(), fastrand::u32(..))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;
    use crate::source::url::parse_duration;

    #[test]
    fn debug_hides_the_password() {
        let c =
            RedisStreamConfig::from_url("redis-stream://app:s3cret@127.0.0.1:6379/orders?group=g")
                .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("127.0.0.1:6379"), "{shown}");
    }

    #[test]
    fn parses_urls() {
        let c = RedisStreamConfig::from_url(
            "redis-stream://127.0.0.1:6379/orders?group=g&consumer=c1&claim_idle=30s&block=500&count=5&dead_letter_stream=orders-dead&start=%24&db=2",
        )
        .unwrap();
        assert_eq!(c.redis_url, "redis://127.0.0.1:6379/2");
        assert_eq!(c.stream, "orders");
        assert_eq!(c.group, "g");
        assert_eq!(c.consumer.as_deref(), Some("c1"));
        assert_eq!(c.claim_idle, Duration::from_secs(30));
        assert_eq!(c.block, Duration::from_millis(500));
        assert_eq!(c.count, 5);
        assert_eq!(c.dead_letter_stream.as_deref(), Some("orders-dead"));
        assert_eq!(c.start, "$");
        assert_eq!(c.lag_interval, Duration::from_secs(5));
        assert_eq!(c.broker_loss, LossPolicy::Refuse);
        let warn =
            RedisStreamConfig::from_url("redis-stream://h/s?group=g&broker_loss=warn").unwrap();
        assert_eq!(warn.broker_loss, LossPolicy::Warn);
        let off = RedisStreamConfig::from_url("redis-stream://h/s?group=g&lag_interval=0").unwrap();
        assert_eq!(off.lag_interval, Duration::ZERO);
        let every =
            RedisStreamConfig::from_url("redis-stream://h/s?group=g&lag_interval=2s").unwrap();
        assert_eq!(every.lag_interval, Duration::from_secs(2));

        let c =
            RedisStreamConfig::from_url("redis-stream://u:p@localhost:6379/a%3Ab?group=g").unwrap();
        assert_eq!(c.redis_url, "redis://u:p@localhost:6379");
        let tls = RedisStreamConfig::from_url("redis-stream://h:6380/s?group=g&tls=true").unwrap();
        assert_eq!(tls.redis_url, "rediss://h:6380");
        let ca = RedisStreamConfig::from_url(
            "redis-stream://h:6380/s?group=g&cacert=/etc/ca%20x.pem&db=1",
        )
        .unwrap();
        assert_eq!(ca.redis_url, "rediss://h:6380/1?cacert=/etc/ca%20x.pem");
        assert_eq!(c.stream, "a:b");
        assert_eq!(c.consumer, None);
        assert_eq!(c.claim_idle, Duration::from_secs(30));
        assert_ne!(default_consumer_name(), default_consumer_name());
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "redis://127.0.0.1/orders?group=g",
            "redis-stream://127.0.0.1:6379/orders",
            "redis-stream://127.0.0.1:6379/orders?group=",
            "redis-stream://127.0.0.1:6379?group=g",
            "redis-stream:///orders?group=g",
            "redis-stream://h/orders?group=g&claim_idle=10ms",
            "redis-stream://h/orders?group=g&claim_idle=3x",
            "redis-stream://h/orders?group=g&block=0",
            "redis-stream://h/orders?group=g&count=0",
            "redis-stream://h/orders?group=g&start=5",
            "redis-stream://h/orders?group=g&dead_letter_stream=orders",
            "redis-stream://h/orders?group=g&bogus=1",
            "redis-stream://h/orders?group=g&lag_interval=500",
            "redis-stream://h/orders?group=g&broker_loss=ignore",
        ] {
            assert!(
                matches!(
                    RedisStreamConfig::from_url(url),
                    Err(ref e) if e.kind() == SourceErrorKind::Config
                ),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn parses_durations() {
        // Redis Streams keeps its own rule: a bare number is milliseconds.
        let parse_duration = |name, value| parse_duration(name, value, Bare::Millis);
        assert_eq!(
            parse_duration("x", "250").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(parse_duration("x", "2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("x", "3m").unwrap(), Duration::from_secs(180));
        assert!(parse_duration("x", "s").is_err());
        assert!(parse_duration("x", "1.5s").is_err());
    }
}
