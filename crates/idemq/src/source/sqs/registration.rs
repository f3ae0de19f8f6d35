//! Amazon SQS in the broker registry ([`crate::source::registry`]).

use super::{SqsConfig, SqsPublisher, SqsSource};
use crate::error::SourceError;
use crate::source::health::{BrokerHealth, Horizon};
use crate::source::kit::{BrokerConfig, ConnectWith};
use crate::source::registry::Broker;

/// Amazon SQS: how `sqs://` URLs open.
pub const BROKER: Broker =
    Broker::of::<SqsConfig, SqsSource, SqsPublisher>("sqs", "Amazon SQS", &["sqs"]);

impl BrokerConfig for SqsConfig {
    fn parse(url: &str) -> Result<Self, SourceError> {
        Self::from_url(url)
    }

    /// Deletes the queue and its dead-letter queue, if they exist.
    async fn remove(self) -> Result<(), SourceError> {
        let client = self.client().await?;
        for name in std::iter::once(&self.queue).chain(&self.dead_letter_queue) {
            let queue = super::queue::resolve_queue(&client, name, false).await?;
            client
                .delete_queue()
                .queue_url(&queue.url)
                .send()
                .await
                .map_err(|e| super::queue::broker_error(&format!("DeleteQueue {name}"), e))?;
        }
        Ok(())
    }

    /// The queue's attributes (`GetQueueAttributes`): its loss risks and
    /// its `MessageRetentionPeriod` as the horizon. Creates nothing.
    async fn inspect(self) -> Result<BrokerHealth, SourceError> {
        let client = self.client().await?;
        let queue = super::queue::resolve_queue(&client, &self.queue, false).await?;
        match super::limits::try_read_attributes(&client, &queue).await {
            Ok(attributes) => {
                Ok(
                    BrokerHealth::new(super::limits::horizon(&queue.name, &attributes)).with_risks(
                        super::limits::risks(&queue.name, &attributes, self.min_retention),
                    ),
                )
            }
            Err(reason) => Ok(BrokerHealth::new(Horizon::Unknown {
                why: "the queue's attributes could not be read".into(),
            })
            .with_unchecked(format!("queue {}'s attributes: {reason}", queue.name))),
        }
    }
}

impl ConnectWith<SqsConfig> for SqsSource {
    async fn connect_with(config: SqsConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}

impl ConnectWith<SqsConfig> for SqsPublisher {
    async fn connect_with(config: SqsConfig) -> Result<Self, SourceError> {
        Self::connect(config).await
    }
}
