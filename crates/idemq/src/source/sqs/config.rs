//! The SQS configuration: [`SqsConfig`], its URL form, and the client it builds.

use std::time::Duration;

use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region, SharedCredentialsProvider};
use aws_sdk_sqs::Client;

/// Environment variables that name a credential source of the AWS chain.
const CHAIN_VARIABLES: [&str; 6] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_ROLE_ARN",
];

use crate::error::SourceError;
use crate::source::loss::LossPolicy;
use crate::source::url::{Bare, BrokerUrl};

/// The longest visibility timeout or delay SQS accepts, in seconds (12 hours).
pub const MAX_VISIBILITY_SECS: u64 = 43_200;

pub(super) const MAX_WAIT_SECS: u64 = 20;
const MAX_BATCH: i32 = 10;

/// Where and how to reach an SQS queue. Build it with [`SqsConfig::new`] and
/// the builder methods, or parse a URL with [`SqsConfig::from_url`].
#[derive(Clone)]
#[non_exhaustive]
pub struct SqsConfig {
    /// The queue name (not its URL); a name ending in `.fifo` is a FIFO queue.
    pub queue: String,
    /// The endpoint URL (e.g. `http://127.0.0.1:5000`); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// The AWS region. Without `region=` in the URL (or
    /// [`region`](Self::region)), the AWS chain's region is used when it
    /// has one (`AWS_REGION`, the profile's `region`), else `us-east-1`.
    pub region: String,
    /// The profile of the shared AWS config and credentials files to read
    /// (`profile=NAME`; else `AWS_PROFILE`, else `default`).
    pub profile: Option<String>,
    /// Whether `region` was chosen (URL or builder) rather than defaulted.
    region_chosen: bool,
    /// The visibility timeout requested on receive, and by which it is
    /// extended while a delivery is unsettled (1 s ..= 12 h, whole seconds).
    pub visibility: Duration,
    /// Long-polling wait per receive call (0 ..= 20 s, whole seconds).
    pub wait: Duration,
    /// Messages per receive call (1 ..= 10).
    pub batch: i32,
    /// The name of the dead-letter queue that dead-lettered messages are copied to.
    pub dead_letter_queue: Option<String>,
    /// Create the queue (and the dead-letter queue) if it does not exist.
    pub create_queue: bool,
    /// How often the queue's backlog is read into `idemq_source_lag_messages`
    /// (`lag_interval=`, default 5 s; zero turns it off, else at least 1 s).
    pub lag_interval: Duration,
    /// What to do when the queue's attributes can drop or move messages
    /// before they are processed (`broker_loss=refuse|warn`, default refuse;
    /// see [`LossPolicy`]).
    pub broker_loss: LossPolicy,
    /// The shortest `MessageRetentionPeriod` that is no risk
    /// (`min_retention=` in the URL, a duration such as `12h` or `7d`;
    /// default 1 day; zero turns the check off).
    pub min_retention: Duration,
    credentials: Option<(String, String)>,
}

impl std::fmt::Debug for SqsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsConfig")
            .field("queue", &self.queue)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("profile", &self.profile)
            .field("visibility", &self.visibility)
            .field("wait", &self.wait)
            .field("batch", &self.batch)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("create_queue", &self.create_queue)
            .field("lag_interval", &self.lag_interval)
            .field("broker_loss", &self.broker_loss)
            .field("min_retention", &self.min_retention)
            .field("credentials", &self.credentials.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl SqsConfig {
    /// Defaults for `queue`: the region from `AWS_REGION` or
    /// `AWS_DEFAULT_REGION` (else the profile's, else `us-east-1`), AWS's own endpoint, a 30 s
    /// visibility timeout, 20 s long polls, 10 messages per receive, no
    /// dead-letter queue, queues not created, the backlog read every 5 s,
    /// a queue that can lose messages refused, retention of at least 1 day.
    pub fn new(queue: impl Into<String>) -> Self {
        let region = std::env::var("AWS_REGION")
            .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
            .ok()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "us-east-1".to_owned());
        Self {
            queue: queue.into(),
            endpoint: None,
            region,
            profile: None,
            region_chosen: false,
            visibility: Duration::from_secs(30),
            wait: Duration::from_secs(MAX_WAIT_SECS),
            batch: MAX_BATCH,
            dead_letter_queue: None,
            create_queue: false,
            lag_interval: super::lag::DEFAULT_LAG_INTERVAL,
            broker_loss: LossPolicy::Refuse,
            min_retention: crate::source::loss::DEFAULT_MIN_RETENTION,
            credentials: None,
        }
    }

    /// Parses `sqs://queue-name?endpoint=…&region=…&profile=…&visibility=30&wait=20&dlq=name&create=true&batch=10&lag_interval=5s&broker_loss=refuse&min_retention=1d`.
    ///
    /// Every parameter is optional. `lag_interval` is how often the queue's
    /// backlog is read (`0` turns it off). `broker_loss` is `refuse` (the
    /// default) or `warn` (log the queue's risks of loss and run);
    /// `min_retention` is the shortest `MessageRetentionPeriod` that is no
    /// risk (a duration, default `1d`; `0` turns the check off). `visibility`, `wait` and
    /// `lag_interval` are durations
    /// (`30`, `30s`, `1m`; a bare number is seconds) that must come to whole
    /// seconds. Values may be percent-encoded. Unknown parameters and
    /// out-of-range values are a [`SourceErrorKind::Config`](crate::SourceErrorKind::Config).
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("SQS", "sqs", url)?;
        if u.userinfo.is_some() || u.path.is_some_and(|p| !p.is_empty()) {
            return Err(
                u.error("expected sqs://QUEUE?…, with nothing but the queue name before the '?'")
            );
        }
        let queue = u.decoded_hosts()?;
        let mut config = SqsConfig::new(queue);
        for p in u.params() {
            match p.name.as_str() {
                "endpoint" => config.endpoint = p.non_empty(),
                "region" => config = config.region(p.value),
                "profile" => config.profile = p.non_empty(),
                "visibility" => config.visibility = p.duration(Bare::Seconds)?,
                "wait" => config.wait = p.duration(Bare::Seconds)?,
                "batch" => config.batch = p.count()?,
                "dlq" => config.dead_letter_queue = p.non_empty(),
                "create" => config.create_queue = p.flag()?,
                "lag_interval" => config.lag_interval = p.duration(Bare::Seconds)?,
                "broker_loss" => config.broker_loss = LossPolicy::parse(&p.value)?,
                "min_retention" => config.min_retention = p.duration(Bare::Seconds)?,
                _ => return Err(p.unknown()),
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the endpoint URL.
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// Sets the region.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = region.into();
        self.region_chosen = true;
        self
    }

    /// Reads credentials (and the region) from this profile of the shared
    /// AWS config and credentials files.
    pub fn profile(mut self, profile: impl Into<String>) -> Self {
        self.profile = Some(profile.into());
        self
    }

    /// Sets the visibility timeout (whole seconds).
    pub fn visibility(mut self, visibility: Duration) -> Self {
        self.visibility = visibility;
        self
    }

    /// Sets the long-polling wait (whole seconds, at most 20).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the dead-letter queue name.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(queue.into());
        self
    }

    /// Whether to create missing queues.
    pub fn create_queue(mut self, create: bool) -> Self {
        self.create_queue = create;
        self
    }

    /// Sets how often the queue's backlog is read (zero: never).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    /// Sets what to do when the queue can lose messages
    /// ([`SqsConfig::broker_loss`]).
    pub fn broker_loss(mut self, policy: LossPolicy) -> Self {
        self.broker_loss = policy;
        self
    }

    /// Sets the shortest `MessageRetentionPeriod` that is no risk
    /// ([`SqsConfig::min_retention`]; zero: not checked).
    pub fn min_retention(mut self, retention: Duration) -> Self {
        self.min_retention = retention;
        self
    }

    /// Uses these static credentials instead of the AWS chain.
    pub fn credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret: impl Into<String>,
    ) -> Self {
        self.credentials = Some((access_key_id.into(), secret.into()));
        self
    }

    /// Whether the queue is a FIFO queue (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.queue.ends_with(".fifo")
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        validate_queue_name(&self.queue)?;
        if let Some(dlq) = &self.dead_letter_queue {
            validate_queue_name(dlq)?;
            if dlq.ends_with(".fifo") != self.is_fifo() {
                return Err(SourceError::config(format!(
                    "the dead-letter queue {dlq:?} must be of the same type (FIFO or standard) as {:?}",
                    self.queue
                )));
            }
        }
        if self.region.is_empty() {
            return Err(SourceError::config("the region is empty"));
        }
        let visibility = self.visibility.as_secs();
        if visibility == 0
            || visibility > MAX_VISIBILITY_SECS
            || self.visibility.subsec_nanos() != 0
        {
            return Err(SourceError::config(format!(
                "visibility must be whole seconds from 1 to {MAX_VISIBILITY_SECS}, not {:?}",
                self.visibility
            )));
        }
        if self.wait.as_secs() > MAX_WAIT_SECS || self.wait.subsec_nanos() != 0 {
            return Err(SourceError::config(format!(
                "wait must be whole seconds from 0 to {MAX_WAIT_SECS}, not {:?}",
                self.wait
            )));
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(SourceError::config(format!(
                "batch must be from 1 to {MAX_BATCH}, not {}",
                self.batch
            )));
        }
        if !self.lag_interval.is_zero() && self.lag_interval < Duration::from_secs(1) {
            return Err(SourceError::config(format!(
                "lag_interval must be 0 (off) or at least 1 s, not {:?}",
                self.lag_interval
            )));
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(SourceError::config(format!(
                    "endpoint {endpoint:?} must start with http:// or https://"
                )));
            }
        }
        Ok(())
    }

    /// An `aws-sdk-sqs` client for this configuration (see
    /// [`credentials_and_region`](Self::credentials_and_region)).
    pub async fn client(&self) -> Result<Client, SourceError> {
        Ok(Client::from_conf(self.sdk_config().await?))
    }

    /// The `aws-sdk-sqs` configuration [`client`](Self::client) uses: the
    /// credentials and region of
    /// [`credentials_and_region`](Self::credentials_and_region), the
    /// endpoint.
    pub async fn sdk_config(&self) -> Result<aws_sdk_sqs::Config, SourceError> {
        let (credentials, region) = self.credentials_and_region().await?;
        let mut builder = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .credentials_provider(credentials)
            .region(region);
        if let Some(endpoint) = &self.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        Ok(builder.build())
    }

    /// Where the client's credentials come from, and its region: static
    /// credentials if given; for a local endpoint with no credential source
    /// configured, the placeholder pair `test`/`test`; else the AWS SDK's
    /// standard chain — environment, the shared config and credentials
    /// files (`profile`), web identity (`AWS_ROLE_ARN` +
    /// `AWS_WEB_IDENTITY_TOKEN_FILE`), container and instance roles — with
    /// its region unless one was chosen.
    pub async fn credentials_and_region(
        &self,
    ) -> Result<(SharedCredentialsProvider, Region), SourceError> {
        self.validate()?;
        let chosen = || Region::new(self.region.clone());
        let fixed = |id: &str, secret: &str, source: &'static str| {
            SharedCredentialsProvider::new(Credentials::new(id, secret, None, None, source))
        };
        let local = self.endpoint.as_deref().is_some_and(is_local_endpoint);
        let configured = self.profile.is_some()
            || CHAIN_VARIABLES
                .iter()
                .any(|v| std::env::var_os(v).is_some_and(|value| !value.is_empty()));
        match &self.credentials {
            Some((id, secret)) => return Ok((fixed(id, secret, "idemq-config"), chosen())),
            None if local && !configured => {
                return Ok((fixed("test", "test", "idemq-local"), chosen()))
            }
            None => {}
        }
        let mut loader = aws_config::defaults(BehaviorVersion::latest());
        if let Some(profile) = &self.profile {
            loader = loader.profile_name(profile);
        }
        if self.region_chosen {
            loader = loader.region(chosen());
        }
        let shared = loader.load().await;
        let credentials = shared.credentials_provider().ok_or_else(|| {
            SourceError::config("no SQS credentials: the AWS credential chain found none")
        })?;
        let region = shared.region().cloned().unwrap_or_else(chosen);
        Ok((credentials, region))
    }
}

fn validate_queue_name(name: &str) -> Result<(), SourceError> {
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    let ok = !base.is_empty()
        && name.len() <= 80
        && base
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(SourceError::config(format!(
            "invalid SQS queue name {name:?}: 1 to 80 letters, digits, '-' or '_', optionally ending in .fifo"
        )))
    }
}

fn is_local_endpoint(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        authority.split(':').next().unwrap_or("")
    };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::SourceErrorKind;

    #[test]
    fn parses_urls() {
        let c = SqsConfig::from_url(
            "sqs://orders?endpoint=http://127.0.0.1:5000&region=eu-west-1&visibility=30&wait=5&dlq=orders-dead&create=true&batch=4",
        )
        .unwrap();
        assert_eq!(c.queue, "orders");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(c.region, "eu-west-1");
        assert_eq!(c.visibility, Duration::from_secs(30));
        assert_eq!(c.wait, Duration::from_secs(5));
        assert_eq!(c.dead_letter_queue.as_deref(), Some("orders-dead"));
        assert!(c.create_queue);
        assert_eq!(c.batch, 4);
        assert!(!c.is_fifo());
        assert_eq!(c.lag_interval, Duration::from_secs(5));
        let off = SqsConfig::from_url("sqs://orders?lag_interval=0").unwrap();
        assert_eq!(off.lag_interval, Duration::ZERO);
        let every = SqsConfig::from_url("sqs://orders?lag_interval=1m").unwrap();
        assert_eq!(every.lag_interval, Duration::from_secs(60));

        let c =
            SqsConfig::from_url("sqs://jobs.fifo?endpoint=http%3A%2F%2Flocalhost%3A4566").unwrap();
        assert!(c.is_fifo());
        assert_eq!(c.endpoint.as_deref(), Some("http://localhost:4566"));
        assert_eq!(c.visibility, Duration::from_secs(30));
        assert!(!c.create_queue);
        assert_eq!(c.broker_loss, LossPolicy::Refuse);
        assert_eq!(c.min_retention, Duration::from_secs(86_400));
        let c = SqsConfig::from_url("sqs://orders?broker_loss=warn&min_retention=12h").unwrap();
        assert_eq!(c.broker_loss, LossPolicy::Warn);
        assert_eq!(c.min_retention, Duration::from_secs(12 * 3600));
        let text = format!("{c:?}");
        assert!(text.contains("broker_loss: Warn"), "{text}");
        assert!(text.contains("min_retention: 43200s"), "{text}");
        let off = SqsConfig::from_url("sqs://orders?min_retention=0").unwrap();
        assert_eq!(off.min_retention, Duration::ZERO);
        let secret = SqsConfig::new("orders").credentials("id", "hush");
        assert!(!format!("{secret:?}").contains("hush"));
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://orders",
            "sqs://",
            "sqs://bad name",
            "sqs://orders?visibility=0",
            "sqs://orders?visibility=50000",
            "sqs://orders?wait=21",
            "sqs://orders?batch=11",
            "sqs://orders?bogus=1",
            "sqs://orders?create=maybe",
            "sqs://orders?endpoint=127.0.0.1:5000",
            "sqs://orders.fifo?dlq=dead",
            "sqs://orders?visibility=abc",
            "sqs://orders?lag_interval=200ms",
            "sqs://orders?broker_loss=ignore",
            "sqs://orders?min_retention=soon",
        ] {
            assert!(
                matches!(SqsConfig::from_url(url), Err(ref e) if e.kind() == SourceErrorKind::Config),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn local_endpoints() {
        assert!(is_local_endpoint("http://127.0.0.1:5000"));
        assert!(is_local_endpoint("http://localhost:4566/"));
        assert!(is_local_endpoint("http://[::1]:5000"));
        assert!(!is_local_endpoint("https://sqs.us-east-1.amazonaws.com"));
    }
}
