//! [`SqsSource`]: the receive loop, and handing out deliveries (one at a time per FIFO group).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::acker::SqsAcker;
use super::config::{SqsConfig, MAX_WAIT_SECS};
use super::lag::LagPoller;
use super::limits;
use super::mapping::to_message;
use super::queue::{broker_error, resolve_queue};
use super::shared::{release_now, Lease, Received, Shared};
use crate::error::SourceError;
use crate::message::DeliveryMeta;
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

/// How much longer than its long-polling wait a receive call may take.
const RECEIVE_GRACE: Duration = Duration::from_secs(15);

async fn receive(shared: Arc<Shared>, max: i32) -> Result<Vec<Received>, SourceError> {
    // The received messages' visibility timeout starts no earlier than this.
    let sent = tokio::time::Instant::now();
    let call = shared
        .client
        .receive_message()
        .queue_url(&shared.queue.url)
        .max_number_of_messages(max)
        .wait_time_seconds(i32::try_from(shared.wait.as_secs()).unwrap_or(MAX_WAIT_SECS as i32))
        .visibility_timeout(shared.visibility_secs())
        .message_system_attribute_names(MessageSystemAttributeName::All)
        .message_attribute_names("All")
        .send();
    let out = match tokio::time::timeout(shared.wait + RECEIVE_GRACE, call).await {
        Ok(out) => {
            out.map_err(|e| broker_error(&format!("ReceiveMessage {}", shared.queue.name), e))?
        }
        Err(_) => {
            // Whatever it received comes back after the visibility timeout.
            tracing::warn!(queue = %shared.queue.name, "ReceiveMessage timed out; polling again");
            return Ok(Vec::new());
        }
    };
    let messages = out.messages.unwrap_or_default();
    if messages.is_empty() && shared.wait.is_zero() {
        // Short polling on an empty queue: do not hammer the endpoint.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut received = Vec::new();
    for message in messages {
        let Some(receipt) = message.receipt_handle().map(str::to_owned) else {
            tracing::warn!(queue = %shared.queue.name, "received a message without a receipt handle");
            continue;
        };
        let lease = Lease::start(&shared, receipt, sent);
        received.push(Received { message, lease });
    }
    Ok(received)
}

/// Consumes one SQS queue (see the [module docs](super)).
pub struct SqsSource {
    shared: Arc<Shared>,
    receiving: Option<JoinHandle<Result<Vec<Received>, SourceError>>>,
    /// Reads the queue's backlog in the background (stopped with the source).
    _lag: Option<LagPoller>,
}

impl std::fmt::Debug for SqsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsSource")
            .field("queue", &self.shared.queue)
            .field("dead_letter", &self.shared.dead_letter)
            .finish_non_exhaustive()
    }
}

impl SqsSource {
    /// Resolves the queue (and the dead-letter queue) URLs, creating the
    /// queues first if [`SqsConfig::create_queue`] is set.
    ///
    /// Before receiving, reads the queue's `MessageRetentionPeriod` and
    /// `RedrivePolicy` (`GetQueueAttributes`) and refuses, by default, a
    /// queue that can delete or move messages before they are processed: a
    /// retention under [`SqsConfig::min_retention`], a redrive policy whose
    /// `maxReceiveCount` is not above idemq's default retry attempts — a
    /// [configuration error](crate::SourceErrorKind::Config) naming each
    /// attribute and what to set instead; with
    /// [`LossPolicy::Warn`](crate::source::loss::LossPolicy::Warn)
    /// (`broker_loss=warn`) each is logged at `warn` and the source runs.
    /// Attributes that cannot be read are logged at `warn` as not checked.
    pub async fn connect(config: SqsConfig) -> Result<Self, SourceError> {
        let client = config.client().await?;
        let queue = resolve_queue(&client, &config.queue, config.create_queue).await?;
        if let Some(attributes) = limits::read_attributes(&client, &queue).await {
            config.broker_loss.apply(
                "SQS",
                &limits::risks(&queue.name, &attributes, config.min_retention),
            )?;
        }
        let dead_letter = match &config.dead_letter_queue {
            Some(name) => Some(resolve_queue(&client, name, config.create_queue).await?),
            None => None,
        };
        tracing::debug!(queue = %queue.name, url = %queue.url, "SQS source connected");
        let lag = LagPoller::start(client.clone(), queue.clone(), config.lag_interval);
        Ok(Self {
            shared: Arc::new(Shared {
                client,
                queue,
                dead_letter,
                visibility: config.visibility,
                wait: config.wait,
                batch: config.batch,
                state: Mutex::default(),
                released: Notify::new(),
            }),
            receiving: None,
            _lag: lag,
        })
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.shared.queue.url
    }

    /// The dead-letter queue URL, if one is configured.
    pub fn dead_letter_queue_url(&self) -> Option<&str> {
        self.shared.dead_letter.as_ref().map(|q| q.url.as_str())
    }

    /// The first buffered message that may be handed out now.
    fn take_ready(&mut self) -> Option<Delivery> {
        let shared = &self.shared;
        let mut state = shared.state();
        let index = if shared.queue.fifo {
            state
                .buffer
                .iter()
                .position(|r| r.group().is_none_or(|g| !state.busy_groups.contains(g)))?
        } else if state.buffer.is_empty() {
            return None;
        } else {
            0
        };
        let received = state.buffer.remove(index)?;
        let group = if shared.queue.fifo {
            received.group().map(str::to_owned)
        } else {
            None
        };
        if let Some(g) = &group {
            state.busy_groups.insert(g.clone());
        }
        drop(state);
        Some(self.delivery(received, group))
    }

    fn delivery(&self, received: Received, group: Option<String>) -> Delivery {
        let Received {
            message: raw,
            lease,
        } = received;
        let message = to_message(&raw, self.shared.queue.fifo);
        let delivery_count = raw
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|c| c.parse::<u32>().ok())
            .unwrap_or(1)
            .max(1);
        let meta = DeliveryMeta {
            source: "sqs".into(),
            topic: Some(self.shared.queue.name.clone()),
            partition: None,
            offset: None,
            delivery_count,
        };
        let acker = SqsAcker {
            shared: Arc::clone(&self.shared),
            lease: Unsettled::new(lease),
            group,
            raw,
        };
        Delivery::new(message, meta, Box::new(acker))
    }
}

impl Drop for SqsSource {
    fn drop(&mut self) {
        if let Some(task) = self.receiving.take() {
            task.abort();
        }
        // Messages received but never handed out go back to the queue at once.
        let buffered: Vec<Received> = self.shared.state().buffer.drain(..).collect();
        release_now(&self.shared, buffered);
    }
}

#[async_trait]
impl Source for SqsSource {
    /// The next delivery; never `None` (an SQS queue does not end). Cancel-safe:
    /// a receive in progress continues and is picked up by the next call.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let shared = Arc::clone(&self.shared);
            let released = shared.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            if let Some(delivery) = self.take_ready() {
                return Ok(Some(delivery));
            }
            if self.receiving.is_none() {
                let buffered = i32::try_from(shared.state().buffer.len()).unwrap_or(i32::MAX);
                let room = shared.batch.saturating_sub(buffered);
                if room > 0 {
                    self.receiving = Some(tokio::spawn(receive(Arc::clone(&shared), room)));
                }
            }
            let Some(task) = self.receiving.as_mut() else {
                // The buffer is full of messages of busy FIFO groups.
                released.await;
                continue;
            };
            tokio::select! {
                done = task => {
                    self.receiving = None;
                    let batch = match done {
                        Ok(result) => result?,
                        Err(e) => return Err(SourceError::other(format!("the SQS receive task failed: {e}"))),
                    };
                    shared.state().buffer.extend(batch);
                }
                _ = &mut released => {}
            }
        }
    }
}
