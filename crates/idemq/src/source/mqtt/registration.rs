//! MQTT in the broker registry ([`crate::source::registry`]).

use super::{MqttConfig, MqttPublisher, MqttSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;
use crate::source::url::{competing_with, set_param, with_default_param};

/// MQTT: how `mqtt://` and `mqtts://` URLs open.
pub const BROKER: Broker =
    Broker::of::<MqttConfig, MqttSource, MqttPublisher>("mqtt", "MQTT", &["mqtt", "mqtts"])
        .with_subscribe_before_publish()
        .with_competing_url(competing_url);

/// Each client needs an id of its own (a persistent session each); they
/// compete through a shared subscription (`$share/GROUP/TOPIC`).
fn competing_url(url: &str, n: usize) -> String {
    competing_with(url, "client_id", "idemq", n)
}

/// A shared subscription `$share/GROUP/TOPIC` is published to as TOPIC.
fn topic_url(url: &str) -> Option<String> {
    let at = url.find("/$share/")?;
    let rest = &url[at + "/$share/".len()..];
    let (_, topic) = rest.split_once('/')?;
    Some(format!("{}/{topic}", &url[..at]))
}

impl BrokerConfig for MqttConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// A publisher needs a client id of its own, unique per process; the
    /// client id of a consumer's URL (a shared subscription) is the
    /// consumer's, never the publisher's.
    fn publisher_url(url: &str) -> String {
        let client = format!("idemq-produce-{}", std::process::id());
        match topic_url(url) {
            Some(topic_url) => set_param(&topic_url, "client_id", &client),
            None => with_default_param(url, "client_id", &client),
        }
    }

    /// Nothing can be read: MQTT tells a client neither the broker's
    /// per-client queue limits nor how long it keeps a session's messages.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let risks = self.loss_risks();
        Ok(BrokerHealth::new(Horizon::Unknown {
            why: "MQTT tells a client neither the broker's queue limits nor its session expiry".into(),
        })
        .with_risks(risks)
        .with_unchecked("the broker's per-client queue limits (Mosquitto: max_queued_messages; see docs/operations.md)"))
    }
}

impl ConnectWith<MqttConfig> for MqttSource {
    async fn connect_with(config: MqttConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<MqttConfig> for MqttPublisher {
    async fn connect_with(config: MqttConfig) -> Result<Self, SourceError> {
        Self::connect(&config).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_subscription_is_published_to_as_its_topic() {
        assert_eq!(
            topic_url("mqtt://h:1883/$share/g/a/b?client_id=c").as_deref(),
            Some("mqtt://h:1883/a/b?client_id=c")
        );
        assert_eq!(topic_url("mqtt://h:1883/a/b"), None);
        assert_eq!(
            competing_url("mqtt://h:1883/$share/g/t?client_id=c", 1),
            "mqtt://h:1883/$share/g/t?client_id=c-w1"
        );
    }
}
