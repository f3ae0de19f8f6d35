//! RabbitMQ in the broker registry ([`crate::source::registry`]).

use super::{AmqpConfig, AmqpPublisher, AmqpSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;

/// RabbitMQ: how `amqp://` URLs open.
pub const BROKER: Broker =
    Broker::of::<AmqpConfig, AmqpSource, AmqpPublisher>("amqp", "RabbitMQ", &["amqp", "amqps"]);

impl BrokerConfig for AmqpConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// Deletes every queue of the topology.
    async fn remove(self) -> Result<(), SourceError> {
        let publisher = AmqpPublisher::connect(self).await?;
        publisher.delete_topology().await?;
        publisher.close().await
    }

    /// The work queue's and the dead-letter queue's arguments and policies
    /// from the management API: their loss risks, and the work queue's
    /// `message-ttl` as the horizon. Declares nothing.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let Some(base) = self.management.base(&self) else {
            return Ok(BrokerHealth::new(Horizon::Unknown {
                why: "management_url=off".into(),
            })
            .with_unchecked("the queues' arguments and policies (management_url=off)"));
        };
        let mut health = BrokerHealth::new(Horizon::Unknown {
            why: "the queue's settings could not be read".into(),
        });
        for queue in [self.queue.clone(), self.dead_letter_queue()] {
            match super::management::read_from(&self, &base, &queue).await {
                Ok(settings) => {
                    if queue == self.queue {
                        health.horizon = super::limits::horizon(&settings);
                    }
                    health = health.with_risks(super::limits::risks(&settings, self.min_retention));
                }
                Err(reason) => {
                    health = health
                        .with_unchecked(format!("queue {queue} (management API {base}): {reason}"));
                }
            }
        }
        Ok(health)
    }
}

impl ConnectWith<AmqpConfig> for AmqpSource {
    async fn connect_with(config: AmqpConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<AmqpConfig> for AmqpPublisher {
    async fn connect_with(config: AmqpConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}
