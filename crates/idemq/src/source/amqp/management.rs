//! Reading a queue's arguments and the policies that apply to it from
//! RabbitMQ's management HTTP API (the `rabbitmq_management` plugin): AMQP
//! itself tells a client neither. The API is at `management_url=` in the
//! source's URL; by default `http://HOST:15672` for `amqp://` and
//! `https://HOST:15671` for `amqps://` (the plugin's usual ports), with the
//! AMQP URL's user and password (the user needs the `monitoring` or
//! `management` tag; listing policies needs `policymaker` or more, without
//! which only the policy RabbitMQ reports as in effect is read).
//! `management_url=off` skips the check. An API that cannot be reached or
//! refuses the user is logged at `warn` and skips the check: it is never a
//! reason not to consume.

use std::time::Duration;

use reqwest::{StatusCode, Url};
use serde_json::{Map, Value};

use super::limits::{Policy, QueueSettings};
use super::AmqpConfig;
use crate::error::SourceError;

/// How long one request to the management API may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the management API is (`management_url=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ManagementApi {
    /// Derived from the AMQP URL's host (the default).
    Derived,
    /// At this base URL.
    At(Url),
    /// Not read (`management_url=off`).
    Off,
}

impl ManagementApi {
    /// Parses `management_url=`: `off`, or an `http(s)://host:port[/path]`
    /// without credentials (those of the AMQP URL are used).
    pub(super) fn parse(value: &str) -> Result<Self, SourceError> {
        if value == "off" {
            return Ok(Self::Off);
        }
        let url = Url::parse(value)
            .map_err(|e| SourceError::config(format!("AMQP: management_url is not a URL ({e})")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(SourceError::config(
                "AMQP: management_url must be http:// or https:// (or off)",
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(SourceError::config(
                "AMQP: management_url takes no credentials: the AMQP URL's user and password are used",
            ));
        }
        Ok(Self::At(url))
    }

    /// The base URL the API is read at, `None` when off.
    pub(super) fn base(&self, config: &AmqpConfig) -> Option<Url> {
        match self {
            Self::Off => None,
            Self::At(url) => Some(url.clone()),
            Self::Derived => {
                let (scheme, port) = if config.is_tls() {
                    ("https", 15671)
                } else {
                    ("http", 15672)
                };
                let host = &config.uri.authority.host;
                let host = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                Url::parse(&format!("{scheme}://{host}:{port}/")).ok()
            }
        }
    }
}

/// The work queue's settings and its vhost's policies, or `None` when the
/// API is off or could not be read (logged at `warn`: the check is
/// skipped, not failed).
pub(super) async fn read(config: &AmqpConfig, queue: &str) -> Option<QueueSettings> {
    let base = config.management.base(config)?;
    match read_from(config, &base, queue).await {
        Ok(settings) => Some(settings),
        Err(reason) => {
            tracing::warn!(
                queue,
                management = %base,
                %reason,
                "could not read the queue's arguments and policies from RabbitMQ's management API: whether the broker can drop messages before they are processed (max-length, message-ttl, expires, delivery-limit) was not checked (management_url=off in the URL skips this)"
            );
            None
        }
    }
}

pub(super) async fn read_from(
    config: &AmqpConfig,
    base: &Url,
    queue: &str,
) -> Result<QueueSettings, String> {
    let api = Api::new(config, base).await?;
    let vhost = config.uri.vhost.as_str();
    let info = match api.get(&["api", "queues", vhost, queue]).await? {
        Some(info) => info,
        None => return Err(format!("queue {queue:?} not found in vhost {vhost:?}")),
    };
    let object = |v: Option<&Value>| match v {
        Some(Value::Object(map)) => map.clone(),
        _ => Map::new(),
    };
    let policies = |listed: Option<Value>| -> Vec<Policy> {
        listed
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default()
    };
    Ok(QueueSettings {
        name: queue.to_owned(),
        kind: info
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("classic")
            .to_owned(),
        arguments: object(info.get("arguments")),
        effective: object(info.get("effective_policy_definition")),
        policies: policies(api.get_allowed(&["api", "policies", vhost]).await?),
        operator_policies: policies(
            api.get_allowed(&["api", "operator-policies", vhost])
                .await?,
        ),
    })
}

/// An HTTP client for the API, with the AMQP user's credentials.
struct Api<'a> {
    client: reqwest::Client,
    base: &'a Url,
    user: &'a str,
    password: &'a str,
}

impl<'a> Api<'a> {
    async fn new(config: &'a AmqpConfig, base: &'a Url) -> Result<Self, String> {
        let mut builder = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if let Some(path) = &config.ca_file {
            let pem = tokio::fs::read(path)
                .await
                .map_err(|e| format!("reading the CA file {}: {e}", path.display()))?;
            let ca = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| format!("the CA file {}: {e}", path.display()))?;
            builder = builder.add_root_certificate(ca);
        }
        let client = builder.build().map_err(|e| e.to_string())?;
        let user = &config.uri.authority.userinfo;
        Ok(Self {
            client,
            base,
            user: &user.username,
            password: &user.password,
        })
    }

    /// GETs the path of `segments` (each percent-encoded: the vhost `/`
    /// becomes `%2F`); `None` on 404.
    async fn get(&self, segments: &[&str]) -> Result<Option<Value>, String> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .map_err(|()| format!("{} cannot be a base URL", self.base))?
            .pop_if_empty()
            .extend(segments);
        let answer = self
            .client
            .get(url.clone())
            .basic_auth(self.user, Some(self.password))
            .send()
            .await
            .map_err(|e| e.without_url().to_string())?;
        match answer.status() {
            StatusCode::NOT_FOUND => Ok(None),
            status if status.is_success() => answer
                .json()
                .await
                .map(Some)
                .map_err(|e| format!("GET {}: {}", url.path(), e.without_url())),
            status => Err(format!("GET {}: {status}", url.path())),
        }
    }

    /// Like [`Api::get`], but a path the user may not read (401, 403) is
    /// `None` rather than an error.
    async fn get_allowed(&self, segments: &[&str]) -> Result<Option<Value>, String> {
        match self.get(segments).await {
            Err(e) if e.ends_with("401 Unauthorized") || e.ends_with("403 Forbidden") => {
                tracing::debug!(reason = %e, "the management API does not list these policies to this user; the policy in effect is read from the queue instead");
                Ok(None)
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn management_urls_parse_without_credentials() {
        assert_eq!(ManagementApi::parse("off").unwrap(), ManagementApi::Off);
        assert!(matches!(
            ManagementApi::parse("https://rabbit.internal:15671/").unwrap(),
            ManagementApi::At(_)
        ));
        for bad in ["ftp://h/", "nonsense", "http://admin:secret@h:15672/"] {
            let e = ManagementApi::parse(bad).unwrap_err().to_string();
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn the_default_is_derived_from_the_amqp_host() {
        let plain = AmqpConfig::from_url("amqp://u:p@rabbit.internal/?queue=q").unwrap();
        assert_eq!(
            plain.management.base(&plain).unwrap().as_str(),
            "http://rabbit.internal:15672/"
        );
        let tls = AmqpConfig::from_url("amqps://u:p@rabbit.internal/?queue=q").unwrap();
        assert_eq!(
            tls.management.base(&tls).unwrap().as_str(),
            "https://rabbit.internal:15671/"
        );
        let off = AmqpConfig::from_url("amqp://h/?queue=q&management_url=off").unwrap();
        assert!(off.management.base(&off).is_none());
    }
}
