//! The configuration: [`KafkaConfig`] and its URL, the header names, and the
//! default business key.

use std::time::Duration;

use rdkafka::config::ClientConfig;

use crate::error::SourceError;
use crate::key::KeySpec;
use crate::source::loss::LossPolicy;
use crate::source::url::{Bare, BrokerUrl};

/// The header that carries [`Message::id`] on Kafka.
///
/// [`Message::id`]: crate::message::Message::id
pub const MESSAGE_ID_HEADER: &str = "message_id";

/// The header that carries the dead-letter reason on the dead-letter topic.
pub const DEAD_LETTER_REASON_HEADER: &str = "idemq_dead_letter_reason";

/// The default business key for Kafka records: the header `event_id`, else
/// the record key.
pub fn default_key_spec() -> KeySpec {
    KeySpec::header("event_id").or(KeySpec::transport_key())
}

/// How to reach the broker, what to consume, and the consumer-group tuning.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port…]`.
    pub brokers: String,
    /// The topic to consume.
    pub topic: String,
    /// The consumer group id.
    pub group: String,
    /// Where a group without a committed offset starts: `earliest` (default) or `latest`.
    pub auto_offset_reset: String,
    /// The group session timeout (default 10 s).
    pub session_timeout: Duration,
    /// Where dead-lettered records are also published, if anywhere.
    pub dead_letter_topic: Option<String>,
    /// How long a revocation waits for in-flight deliveries of the revoked
    /// partitions to settle before it commits and lets them go (default 5 s).
    pub revoke_grace: Duration,
    /// Records buffered per partition before the partition is paused (default 1000).
    pub max_buffered: usize,
    /// Create the topic with this many partitions if it does not exist, for
    /// brokers that do not auto-create topics (`create_partitions=N` in the URL;
    /// see [`create_topic`]). `None` (default): the topic must exist.
    ///
    /// [`create_topic`]: super::create_topic
    pub create_partitions: Option<i32>,
    /// What to do when the topic's configuration, or the consumer's own, can
    /// lose records the group never processed (`broker_loss=refuse|warn`,
    /// default refuse; see [`KafkaSource::connect`]).
    ///
    /// [`KafkaSource::connect`]: super::KafkaSource::connect
    pub broker_loss: LossPolicy,
    /// The shortest `retention.ms` of the topic that is no risk
    /// (`min_retention=` in the URL, a duration such as `12h` or `7d`;
    /// default 1 day; `0` turns the check off): retention has to outlast
    /// the longest time a consumer can be down or behind.
    pub min_retention: Duration,
    /// Extra librdkafka settings, applied last (they override the above).
    pub settings: Vec<(String, String)>,
}

/// Shows secret settings (`sasl.password`, `ssl.key.password`, …) as `***`.
impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let settings: Vec<(&str, &str)> = self
            .settings
            .iter()
            .map(|(name, value)| {
                let shown = if crate::redact::is_secret_param(name) {
                    "***"
                } else {
                    value.as_str()
                };
                (name.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("group", &self.group)
            .field("auto_offset_reset", &self.auto_offset_reset)
            .field("session_timeout", &self.session_timeout)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("revoke_grace", &self.revoke_grace)
            .field("max_buffered", &self.max_buffered)
            .field("create_partitions", &self.create_partitions)
            .field("broker_loss", &self.broker_loss)
            .field("min_retention", &self.min_retention)
            .field("settings", &settings)
            .finish()
    }
}

impl KafkaConfig {
    /// A configuration with the defaults.
    pub fn new(
        brokers: impl Into<String>,
        topic: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            auto_offset_reset: "earliest".into(),
            session_timeout: Duration::from_secs(10),
            dead_letter_topic: None,
            revoke_grace: Duration::from_secs(5),
            max_buffered: 1000,
            create_partitions: None,
            broker_loss: LossPolicy::Refuse,
            min_retention: crate::source::loss::DEFAULT_MIN_RETENTION,
            settings: Vec::new(),
        }
    }

    /// Parses `kafka://host:port[,host:port]/topic?group=NAME[&…]`.
    ///
    /// Query parameters: `group` (required), `offset_reset` (`earliest` or
    /// `latest`), `session_timeout_ms`, `revoke_grace_ms` (whole
    /// milliseconds, as the names say), `max_buffered`, `create_partitions`,
    /// `dead_letter_topic`, `broker_loss` (`refuse`, the default, or `warn`:
    /// what to do when the topic can lose unprocessed records, see
    /// [`KafkaSource::connect`](super::KafkaSource::connect)),
    /// `min_retention` (the shortest `retention.ms` that is no risk, a
    /// duration such as `12h` or `7d`, a bare number being seconds; default
    /// `1d`); any parameter whose name contains a dot is passed
    /// to librdkafka as is (e.g. `heartbeat.interval.ms=500`). Values may be
    /// percent-encoded; the common URL rules are in `source::url`.
    ///
    /// TLS and authentication are librdkafka's own settings, as in any
    /// librdkafka client's properties; the connection settings among them
    /// (`security.protocol`, `ssl.*`, `sasl.*`) reach the consumer, the
    /// dead-letter producer and topic creation alike:
    ///
    /// ```
    /// # use idemq::source::kafka::KafkaConfig;
    /// let config = KafkaConfig::from_url(
    ///     "kafka://broker.example:9094/payments?group=billing\
    ///      &security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512\
    ///      &sasl.username=billing&sasl.password=s3cret\
    ///      &ssl.ca.location=/etc/kafka/ca.crt",
    /// )?;
    /// assert_eq!(config.group, "billing");
    /// # Ok::<(), idemq::SourceError>(())
    /// ```
    ///
    /// Mutual TLS: `security.protocol=SSL&ssl.certificate.location=…&ssl.key.location=…`.
    /// A refused password or a certificate that does not verify is a
    /// [configuration error](crate::SourceErrorKind::Config) when connecting.
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("Kafka", "kafka", url)?;
        let topic = u.require_path("topic")?;
        let brokers = u.host_list()?;
        validate_topic(topic).map_err(|why| u.error(why))?;
        let mut group = None;
        let mut config = KafkaConfig::new(brokers, topic, "");
        for p in u.params() {
            match p.name.as_str() {
                "group" => group = p.non_empty(),
                "offset_reset" | "auto.offset.reset" => {
                    config.auto_offset_reset = p.choice(&["earliest", "latest"])?.to_owned();
                }
                "session_timeout_ms" => config.session_timeout = Duration::from_millis(p.count()?),
                "revoke_grace_ms" => config.revoke_grace = Duration::from_millis(p.count()?),
                "create_partitions" => {
                    let n =
                        p.count::<i32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                            p.error("create_partitions must be between 1 and 2^31-1")
                        })?;
                    config.create_partitions = Some(n);
                }
                "max_buffered" => config.max_buffered = p.count()?,
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                "min_retention" => config.min_retention = p.duration(Bare::Seconds)?,
                "dead_letter_topic" => {
                    validate_topic(&p.value).map_err(|why| p.error(why))?;
                    config.dead_letter_topic = Some(p.value);
                }
                name if name.contains('.') => {
                    if p.value.is_empty() {
                        return Err(p.error(format!("parameter {name:?} has no value")));
                    }
                    config.settings.push((p.name, p.value))
                }
                _ => return Err(p.unknown()),
            }
        }
        config.group = group.ok_or_else(|| u.missing("group"))?;
        Ok(config)
    }

    /// Adds an extra librdkafka setting (applied last).
    pub fn set(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Sets the dead-letter topic.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// Sets the group session timeout.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Sets how long a revocation waits for in-flight deliveries.
    pub fn revoke_grace(mut self, grace: Duration) -> Self {
        self.revoke_grace = grace;
        self
    }

    /// Sets what to do when the topic can lose unprocessed records
    /// ([`KafkaConfig::broker_loss`]).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// Sets the shortest `retention.ms` that is no risk
    /// ([`KafkaConfig::min_retention`]).
    pub fn min_retention(mut self, retention: Duration) -> Self {
        self.min_retention = retention;
        self
    }

    /// How every client of this configuration — consumer, producer, admin —
    /// reaches the cluster: the bootstrap servers and the connection
    /// settings (`security.protocol`, `ssl.*`, `sasl.*`, `socket.*`,
    /// `client.*`); the consumer-only settings stay with the consumer.
    pub(super) fn connection(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers);
        for (name, value) in &self.settings {
            if is_connection_setting(name) {
                cc.set(name, value);
            }
        }
        cc
    }

    pub(super) fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", &self.auto_offset_reset)
            .set(
                "session.timeout.ms",
                self.session_timeout.as_millis().to_string(),
            )
            .set("enable.partition.eof", "false")
            // The consumer lag per partition (`idemq_source_lag_messages`);
            // `statistics.interval.ms=0` in the URL turns it off.
            .set("statistics.interval.ms", "5000");
        for (name, value) in &self.settings {
            cc.set(name, value);
        }
        cc
    }
}

/// Whether librdkafka setting `name` says how to reach the cluster (and so
/// belongs to producers and admin clients as much as to the consumer).
fn is_connection_setting(name: &str) -> bool {
    const PREFIXES: [&str; 6] = [
        "security.",
        "ssl.",
        "sasl.",
        "socket.",
        "client.",
        "enable.ssl.",
    ];
    PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

pub(super) fn validate_topic(topic: &str) -> Result<(), String> {
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "topic {topic:?} must be 1 to 249 characters of [a-zA-Z0-9._-]"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_secret_settings() {
        let c = KafkaConfig::from_url(
            "kafka://h:9094/t?group=g&security.protocol=SASL_SSL&sasl.mechanism=PLAIN&sasl.username=u&sasl.password=s3cret",
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("sasl.username"), "{shown}");
    }
    use crate::error::SourceErrorKind;
    use crate::message::Message;

    #[test]
    fn parses_urls() {
        let c = KafkaConfig::from_url(
            "kafka://127.0.0.1:9092/payments?group=billing&session_timeout_ms=6000&heartbeat.interval.ms=500&dead_letter_topic=payments.dlq",
        )
        .unwrap();
        assert_eq!(c.brokers, "127.0.0.1:9092");
        assert_eq!(c.topic, "payments");
        assert_eq!(c.group, "billing");
        assert_eq!(c.session_timeout, Duration::from_secs(6));
        assert_eq!(c.dead_letter_topic.as_deref(), Some("payments.dlq"));
        assert_eq!(c.auto_offset_reset, "earliest");
        assert_eq!(
            c.settings,
            vec![("heartbeat.interval.ms".to_owned(), "500".to_owned())]
        );
        let c = KafkaConfig::from_url("kafka://a:1,b:2/t?group=g&offset_reset=latest").unwrap();
        assert_eq!(c.brokers, "a:1,b:2");
        assert_eq!(c.auto_offset_reset, "latest");
        assert_eq!(c.broker_loss, LossPolicy::Refuse);
        assert_eq!(c.min_retention, Duration::from_secs(86_400));
        let c = KafkaConfig::from_url("kafka://a:1/t?group=g&broker_loss=warn&min_retention=12h")
            .unwrap();
        assert_eq!(c.broker_loss, LossPolicy::Warn);
        assert_eq!(c.min_retention, Duration::from_secs(12 * 3600));
        assert!(format!("{c:?}").contains("broker_loss: Warn"));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://127.0.0.1:9092/payments",
            "kafka://127.0.0.1:9092/payments?group=",
            "kafka://127.0.0.1:9092?group=g",
            "kafka:///payments?group=g",
            "http://127.0.0.1:9092/payments?group=g",
            "kafka://127.0.0.1:9092/pay ments?group=g",
            "kafka://127.0.0.1:9092/payments?group=g&bogus=1",
            "kafka://127.0.0.1:9092/payments?group=g&session_timeout_ms=soon",
            "kafka://127.0.0.1:9092/payments?group=g&offset_reset=middle",
            "kafka://127.0.0.1:9092/payments?group=g&broker_loss=ignore",
            "kafka://127.0.0.1:9092/payments?group=g&min_retention=soon",
        ] {
            assert!(
                matches!(KafkaConfig::from_url(url), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn connection_settings_reach_every_client() {
        let c = KafkaConfig::from_url(
            "kafka://localhost:9094/t?group=g&security.protocol=SASL_SSL&sasl.mechanism=PLAIN&ssl.ca.location=/ca.crt&heartbeat.interval.ms=500",
        )
        .unwrap();
        let connection = c.connection();
        assert_eq!(connection.get("security.protocol"), Some("SASL_SSL"));
        assert_eq!(connection.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(connection.get("ssl.ca.location"), Some("/ca.crt"));
        assert_eq!(connection.get("heartbeat.interval.ms"), None);
        assert_eq!(connection.get("group.id"), None);
        assert_eq!(c.client_config().get("heartbeat.interval.ms"), Some("500"));
    }

    #[test]
    fn default_key_prefers_the_event_id_header() {
        let spec = default_key_spec();
        let m = Message::new("{}")
            .with_key("k")
            .with_header("event_id", "e");
        assert_eq!(spec.extract(&m).unwrap(), "e");
        assert_eq!(
            spec.extract(&Message::new("{}").with_key("k")).unwrap(),
            "k"
        );
    }
}
