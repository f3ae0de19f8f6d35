//! MQTT in the broker registry ([`crate::source::registry`]).

use futures_util::future::BoxFuture;

use super::{MqttConfig, MqttPublisher, MqttSource};
use crate::error::SourceError;
use crate::source::registry::transport_key_or_id;
use crate::source::registry::Broker;
use crate::source::url::{competing_with, set_param, with_default_param};
use crate::source::{Publisher, Source};

/// MQTT: how `mqtt://` URLs open.
pub const BROKER: Broker = Broker {
    id: "mqtt",
    name: "MQTT",
    schemes: &["mqtt"],
    watermarks: false,
    subscribe_before_publish: true,
    default_key: transport_key_or_id,
    check,
    competing_url,
    open_source,
    open_publisher,
};

fn check(url: &str) -> Result<(), SourceError> {
    MqttConfig::from_url(url).map(|_| ())
}

/// Each client needs an id of its own (a persistent session each); they
/// compete through a shared subscription (`$share/GROUP/TOPIC`).
fn competing_url(url: &str, n: usize) -> String {
    competing_with(url, "client_id", "idemq", n)
}

/// A shared subscription `$share/GROUP/TOPIC` is published to as TOPIC.
fn publish_url(url: &str) -> Option<String> {
    let at = url.find("/$share/")?;
    let rest = &url[at + "/$share/".len()..];
    let (_, topic) = rest.split_once('/')?;
    Some(format!("{}/{topic}", &url[..at]))
}

fn open_source(url: &str) -> BoxFuture<'_, Result<Box<dyn Source>, SourceError>> {
    Box::pin(async move {
        let config = MqttConfig::from_url(url)?;
        Ok(Box::new(MqttSource::connect(config).await?) as Box<dyn Source>)
    })
}

fn open_publisher(url: &str) -> BoxFuture<'_, Result<Box<dyn Publisher>, SourceError>> {
    Box::pin(async move {
        // A publisher needs a client id of its own, unique per process;
        // the client id of a consumer's URL (a shared subscription) is the
        // consumer's, never the publisher's.
        let client = format!("idemq-produce-{}", std::process::id());
        let url = match publish_url(url) {
            Some(topic_url) => set_param(&topic_url, "client_id", &client),
            None => with_default_param(url, "client_id", &client),
        };
        let config = MqttConfig::from_url(&url)?;
        Ok(Box::new(MqttPublisher::connect(&config).await?) as Box<dyn Publisher>)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_subscription_is_published_to_as_its_topic() {
        assert_eq!(
            publish_url("mqtt://h:1883/$share/g/a/b?client_id=c").as_deref(),
            Some("mqtt://h:1883/a/b?client_id=c")
        );
        assert_eq!(publish_url("mqtt://h:1883/a/b"), None);
        assert_eq!(
            competing_url("mqtt://h:1883/$share/g/t?client_id=c", 1),
            "mqtt://h:1883/$share/g/t?client_id=c-w1"
        );
    }
}
