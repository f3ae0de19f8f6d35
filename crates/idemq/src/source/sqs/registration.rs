//! Amazon SQS in the broker registry ([`crate::source::registry`]).

use super::{SqsConfig, SqsPublisher, SqsSource};
use crate::error::SourceError;
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
