//! The source's configuration: [`RocketMqConfig`] and its URL form.

use std::time::Duration;

use crate::error::SourceError;
use crate::source::loss::LossPolicy;
use crate::source::url::{Bare, BrokerUrl};

/// Where a group without a consumer offset starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartFrom {
    /// The first message still stored (default): nothing published before the
    /// group first started is skipped.
    #[default]
    Earliest,
    /// The end of each queue.
    Latest,
}

/// The access key and secret key a RocketMQ cluster with authentication
/// (ACL) knows a client by; every request is signed with them. The secret
/// never shows in `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct AclCredentials {
    /// The access key (ACL 2.0: the user name).
    pub access_key: String,
    secret_key: String,
}

impl AclCredentials {
    /// Credentials of `access_key` with `secret_key` (ACL 2.0: the user's password).
    pub fn new(access_key: impl Into<String>, secret_key: impl Into<String>) -> Self {
        Self {
            access_key: access_key.into(),
            secret_key: secret_key.into(),
        }
    }

    pub(super) fn secret_key(&self) -> &str {
        &self.secret_key
    }
}

impl std::fmt::Debug for AclCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AclCredentials")
            .field("access_key", &self.access_key)
            .field("secret_key", &"***")
            .finish()
    }
}

/// How to reach the name server, what to consume, and the consumer tuning.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RocketMqConfig {
    /// Name server addresses, `host:port[;host:port…]`.
    pub name_server: String,
    /// The topic to consume.
    pub topic: String,
    /// The consumer group.
    pub group: String,
    /// The tag filter expression (default `*`, every tag).
    pub tags: String,
    /// Listener calls in flight at once, i.e. messages handed to the engine
    /// and not yet settled (default 16).
    pub consume_threads: u32,
    /// Retries before the broker moves a message to `%DLQ%<group>` (default
    /// 16). Keep it above the engine's `max_attempts`.
    pub max_reconsume_times: i32,
    /// How long a delivery may stay unsettled before the listener gives up
    /// and answers `ReconsumeLater` (default 15 min; whole minutes are used
    /// by the client's own expiry check).
    pub consume_timeout: Duration,
    /// Where a new group starts.
    pub start_from: StartFrom,
    /// Where dead-lettered messages are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
    /// The credentials every request is signed with, for a cluster with
    /// authentication (ACL); `None` (default): unsigned requests.
    pub credentials: Option<AclCredentials>,
    /// How often the consumer's lag is read into `idemq_source_lag_messages`
    /// (`lag_interval=`, default 5 s; zero turns it off, else at least 1 s).
    pub lag_interval: Duration,
    /// What the source does when its settings can take a message away
    /// before it is processed (`broker_loss=refuse|warn`, default refuse;
    /// see `limits.rs`: a `max_reconsume_times` not above the default
    /// retry attempts, `start_from=latest`).
    pub broker_loss: LossPolicy,
}

impl RocketMqConfig {
    /// A configuration with the defaults.
    pub fn new(
        name_server: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            name_server: name_server.into(),
            topic: topic.into(),
            group: group.into(),
            tags: "*".into(),
            consume_threads: 16,
            max_reconsume_times: 16,
            consume_timeout: Duration::from_secs(15 * 60),
            start_from: StartFrom::Earliest,
            dead_letter_topic: None,
            credentials: None,
            lag_interval: super::lag::DEFAULT_LAG_INTERVAL,
            broker_loss: LossPolicy::Refuse,
        }
    }

    /// Parses `rocketmq://host:port[;host:port…]/topic?group=NAME[&…]`, with
    /// the URL rules every source shares (percent-decoding, durations such
    /// as `90s` or `15m`, errors that hide credentials).
    ///
    /// Query parameters: `group` (required), `tags` (default `*`),
    /// `consume_threads`, `max_reconsume_times`, `consume_timeout` (a bare
    /// number is seconds; `consume_timeout_ms`, a bare number of
    /// milliseconds, is the older spelling), `start_from` (`earliest` or
    /// `latest`), `dead_letter_topic`, `lag_interval` (how often the
    /// consumer's lag is read, default 5 s; `0` turns it off) and
    /// `broker_loss` (`refuse`, the default, or `warn`: what the source does
    /// when `max_reconsume_times` is not above idemq's default retry
    /// attempts or `start_from` is `latest`). Name servers may also be
    /// separated by commas.
    ///
    /// A cluster with authentication (ACL): the access key and secret key
    /// as the URL's user and password,
    /// `rocketmq://ACCESS_KEY:SECRET_KEY@host:9876/topic?group=…` (ACL 2.0:
    /// the user name and password); every request is then signed with them,
    /// as the Java client's `AclClientRPCHook` does.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("RocketMQ", "rocketmq", url)?;
        let credentials = match &u.userinfo {
            Some((access_key, secret_key)) if !access_key.is_empty() && !secret_key.is_empty() => {
                Some(AclCredentials::new(access_key, secret_key))
            }
            Some(_) => {
                return Err(u.error(
                    "credentials need both an access key and a secret key (ACCESS_KEY:SECRET_KEY@)",
                ))
            }
            None => None,
        };
        let hosts = u.decoded_hosts()?;
        let servers: Vec<&str> = hosts.split([';', ',']).map(str::trim).collect();
        if servers.iter().any(|s| s.is_empty()) {
            return Err(u.error("no name server address"));
        }
        u.require_path("topic")?;
        let topic = match u.segments()?.as_slice() {
            [topic] => topic.clone(),
            _ => return Err(u.error("the path must be one topic name")),
        };
        validate_name("topic", &topic, 127).map_err(|why| u.error(why))?;
        let mut config = RocketMqConfig::new(servers.join(";"), topic, "");
        config.credentials = credentials;
        for p in u.params() {
            match p.name.as_str() {
                "group" => config.group = p.value.clone(),
                "tags" => {
                    if p.value.is_empty() {
                        return Err(p.error("tags must not be empty (use * for every tag)"));
                    }
                    config.tags = p.value.clone();
                }
                "consume_threads" => {
                    config.consume_threads = Some(p.count::<u32>()?)
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or_else(|| p.error("consume_threads must be between 1 and 1000"))?
                }
                "max_reconsume_times" => config.max_reconsume_times = p.count()?,
                "consume_timeout" => config.consume_timeout = p.duration(Bare::Seconds)?,
                "consume_timeout_ms" => config.consume_timeout = p.duration(Bare::Millis)?,
                "start_from" => {
                    config.start_from = match p.choice(&["earliest", "latest"])? {
                        "latest" => StartFrom::Latest,
                        _ => StartFrom::Earliest,
                    }
                }
                "dead_letter_topic" => {
                    validate_name("dead_letter_topic", &p.value, 127)
                        .map_err(|why| p.error(why))?;
                    config.dead_letter_topic = Some(p.value.clone());
                }
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                "lag_interval" => {
                    config.lag_interval = p.duration(Bare::Seconds)?;
                    if !config.lag_interval.is_zero()
                        && config.lag_interval < Duration::from_secs(1)
                    {
                        return Err(p.error("lag_interval must be 0 (off) or at least 1s"));
                    }
                }
                _ => return Err(p.unknown()),
            }
        }
        if config.group.is_empty() {
            return Err(u.missing("group"));
        }
        validate_name("group", &config.group, 255).map_err(|why| u.error(why))?;
        Ok(config)
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets how many retries the broker allows before its own `%DLQ%` topic.
    pub fn max_reconsume_times(mut self, times: i32) -> Self {
        self.max_reconsume_times = times;
        self
    }

    /// Signs every request with `credentials` (a cluster with ACL).
    pub fn credentials(mut self, credentials: AclCredentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Sets how many deliveries may be in flight at once.
    pub fn consume_threads(mut self, threads: u32) -> Self {
        self.consume_threads = threads;
        self
    }

    /// Sets where a group without a committed offset starts.
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.start_from = start;
        self
    }

    /// What the source does when its settings can take a message away
    /// before it is processed ([`LossPolicy::Refuse`] by default).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// Sets how often the consumer's lag is read (zero: never).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    pub(super) fn validate(&self) -> Result<(), SourceError> {
        let bad = |why: String| SourceError::config(format!("RocketMQ: {why}"));
        if self.name_server.split(';').any(|s| s.trim().is_empty()) {
            return Err(bad("no name server address".into()));
        }
        validate_name("topic", &self.topic, 127).map_err(bad)?;
        validate_name("group", &self.group, 255).map_err(bad)?;
        if let Some(dlq) = &self.dead_letter_topic {
            validate_name("dead_letter_topic", dlq, 127).map_err(bad)?;
        }
        if !(1..=1000).contains(&self.consume_threads) {
            return Err(bad("consume_threads must be between 1 and 1000".into()));
        }
        if self.consume_timeout.is_zero() {
            return Err(bad("consume_timeout must be above zero".into()));
        }
        if !self.lag_interval.is_zero() && self.lag_interval < Duration::from_secs(1) {
            return Err(bad(format!(
                "lag_interval must be 0 (off) or at least 1s, not {:?}",
                self.lag_interval
            )));
        }
        Ok(())
    }
}
pub(super) fn validate_name(what: &str, name: &str, max: usize) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= max
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '%' | '|' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {name:?} must be 1 to {max} characters of [a-zA-Z0-9%|_-]"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn parses_urls() {
        let c = RocketMqConfig::from_url(
            "rocketmq://127.0.0.1:9876/payments?group=billing&consume_threads=4&max_reconsume_times=3&dead_letter_topic=payments_dlq&start_from=latest&tags=a||b",
        )
        .unwrap();
        assert_eq!(c.name_server, "127.0.0.1:9876");
        assert_eq!(c.topic, "payments");
        assert_eq!(c.group, "billing");
        assert_eq!(c.consume_threads, 4);
        assert_eq!(c.max_reconsume_times, 3);
        assert_eq!(c.dead_letter_topic.as_deref(), Some("payments_dlq"));
        assert_eq!(c.start_from, StartFrom::Latest);
        assert_eq!(c.tags, "a||b");
        assert_eq!(c.lag_interval, Duration::from_secs(5));
        let off = RocketMqConfig::from_url("rocketmq://a:1/t?group=g&lag_interval=0").unwrap();
        assert_eq!(off.lag_interval, Duration::ZERO);
        let every = RocketMqConfig::from_url("rocketmq://a:1/t?group=g&lag_interval=3").unwrap();
        assert_eq!(every.lag_interval, Duration::from_secs(3));
        let c = RocketMqConfig::from_url("rocketmq://a:1,b:2/t?group=g").unwrap();
        assert_eq!(c.name_server, "a:1;b:2");
        assert_eq!(c.tags, "*");
        assert_eq!(c.start_from, StartFrom::Earliest);
        assert_eq!(c.consume_timeout, Duration::from_secs(15 * 60));
        // The shared URL rules: percent-decoding and the CLI's durations.
        let c =
            RocketMqConfig::from_url("rocketmq://a:1/%25DLQ%25g?group=g%7Cx&consume_timeout=1m30s")
                .unwrap();
        assert_eq!(c.topic, "%DLQ%g");
        assert_eq!(c.group, "g|x");
        assert_eq!(c.consume_timeout, Duration::from_secs(90));
        let c =
            RocketMqConfig::from_url("rocketmq://a:1/t?group=g&consume_timeout_ms=2500").unwrap();
        assert_eq!(c.consume_timeout, Duration::from_millis(2500));
        assert_eq!(c.credentials, None);
    }

    #[test]
    fn credentials_come_from_the_user_info_and_never_show() {
        let c =
            RocketMqConfig::from_url("rocketmq://idemq:s3cr%40t@127.0.0.1:9877/t?group=g").unwrap();
        let credentials = c.credentials.clone().unwrap();
        assert_eq!(credentials.access_key, "idemq");
        assert_eq!(credentials.secret_key(), "s3cr@t");
        assert!(!format!("{c:?}").contains("s3cr"), "{c:?}");
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "rocketmq://127.0.0.1:9876/payments",
            "rocketmq://127.0.0.1:9876/payments?group=",
            "rocketmq://127.0.0.1:9876?group=g",
            "rocketmq:///payments?group=g",
            "http://127.0.0.1:9876/payments?group=g",
            "rocketmq://127.0.0.1:9876/pay.ments?group=g",
            "rocketmq://127.0.0.1:9876/payments?group=g&bogus=1",
            "rocketmq://127.0.0.1:9876/payments?group=g&lag_interval=10ms",
            "rocketmq://127.0.0.1:9876/payments?group=g&consume_threads=0",
            "rocketmq://127.0.0.1:9876/payments?group=g&start_from=middle",
            "rocketmq://127.0.0.1:9876/payments?group=g g",
            "rocketmq://127.0.0.1:9876/a/b?group=g",
            "rocketmq://127.0.0.1:9876/payments?group=g&consume_timeout=soon",
            "rocketmq://127.0.0.1:9876/pay%zzments?group=g",
            "rocketmq://user@127.0.0.1:9876/payments?group=g",
            "rocketmq://:pw-s3cr3t@127.0.0.1:9876/payments?group=g",
        ] {
            assert!(
                matches!(RocketMqConfig::from_url(url), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{url} should be rejected"
            );
            if let Err(e) = RocketMqConfig::from_url(url) {
                assert!(!e.to_string().contains("s3cr3t"), "{e}");
            }
        }
    }
}
