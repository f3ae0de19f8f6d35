//! NATS JetStream in the broker registry ([`crate::source::registry`]).

use super::{NatsConfig, NatsPublisher, NatsSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;

/// NATS JetStream: how `nats://` URLs open.
pub const BROKER: Broker =
    Broker::of::<NatsConfig, NatsSource, NatsPublisher>("nats", "NATS JetStream", &["nats"]);

impl BrokerConfig for NatsConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// Deletes the stream (and its consumers).
    async fn remove(self) -> Result<(), SourceError> {
        let stream = self.stream.clone();
        let publisher = NatsPublisher::connect(self).await?;
        match publisher.jetstream().delete_stream(&stream).await {
            Ok(_) => Ok(()),
            Err(e) => Err(super::config::broker_error(
                &format!("deleting stream {stream}"),
                e,
            )),
        }
    }

    /// The stream's configuration: its loss risks and its `max_age` as the
    /// horizon. Creates nothing.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let js = self.jetstream().await?;
        match js.get_stream(&self.stream).await {
            Ok(mut stream) => {
                let config = match stream.info().await {
                    Ok(info) => info.config.clone(),
                    Err(_) => stream.cached_info().config.clone(),
                };
                let mut health = BrokerHealth::new(super::limits::horizon(&config))
                    .with_risks(super::limits::risks(&config));
                match stream.consumer_info(&self.consumer).await {
                    Ok(info) => {
                        health = health.with_risks(super::limits::consumer_risks(
                            &self.consumer,
                            info.config.max_deliver,
                        ))
                    }
                    Err(e) => {
                        health = health.with_unchecked(format!("consumer {}: {e}", self.consumer))
                    }
                }
                Ok(health)
            }
            Err(e) => Ok(BrokerHealth::new(Horizon::Unknown {
                why: format!("stream {} could not be read", self.stream),
            })
            .with_unchecked(format!("stream {}: {e}", self.stream))),
        }
    }
}

impl ConnectWith<NatsConfig> for NatsSource {
    async fn connect_with(config: NatsConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<NatsConfig> for NatsPublisher {
    async fn connect_with(config: NatsConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}
