//! The source: [`NatsSource`], its pull task and the in-progress acks of unsettled deliveries.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use async_trait::async_trait;
use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::acker::NatsAcker;
use super::config::{broker_error, NatsConfig};
use super::lag::LagPoller;
use super::mapping::to_message;
use crate::error::SourceError;
use crate::message::DeliveryMeta;
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

/// How long settling waits for an in-progress ack being sent.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// The pause after a pull request failed, before the next one.
const PULL_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Everything the source, its pull task and its acknowledgers share.
pub(super) struct Shared {
    pub(super) js: jetstream::Context,
    consumer: PullConsumer,
    pub(super) stream: String,
    ack_wait: Duration,
    batch: usize,
    wait: Duration,
    pub(super) dead_letter_subject: Option<String>,
    /// Messages pulled but not handed out yet, each kept in progress.
    buffer: Mutex<VecDeque<Received>>,
    /// Signalled when a pulled message was buffered.
    arrived: Notify,
}

impl Shared {
    fn buffer(&self) -> MutexGuard<'_, VecDeque<Received>> {
        crate::sync::lock(&self.buffer)
    }
}

/// A pulled message whose ack timer is kept restarted until it is settled.
struct Received {
    message: jetstream::Message,
    progress: Progress,
}

/// Sends `+WPI` for one message every third of `ack_wait` until stopped or dropped.
pub(super) struct Progress {
    stopped: Arc<tokio::sync::Mutex<bool>>,
    task: JoinHandle<()>,
}

impl Progress {
    fn start(message: jetstream::Message, ack_wait: Duration) -> Self {
        let stopped = Arc::new(tokio::sync::Mutex::new(false));
        let task = tokio::spawn(keep_in_progress(message, ack_wait, Arc::clone(&stopped)));
        Self { stopped, task }
    }

    /// Stops; once this returns no `+WPI` is sent any more (one being sent
    /// has been handed to the connection), so the settling ack comes after it.
    pub(super) async fn stop(&self) {
        match tokio::time::timeout(STOP_WAIT, self.stopped.lock()).await {
            Ok(mut stopped) => *stopped = true,
            Err(_) => tracing::warn!("an in-progress ack is still being sent; settling anyway"),
        }
        self.task.abort();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep_in_progress(
    message: jetstream::Message,
    ack_wait: Duration,
    stopped: Arc<tokio::sync::Mutex<bool>>,
) {
    let every = ack_wait / 3;
    loop {
        tokio::time::sleep(every).await;
        let guard = stopped.lock().await;
        if *guard {
            return;
        }
        match message.ack_with(AckKind::Progress).await {
            Ok(()) => tracing::trace!(subject = %message.subject, "in-progress ack sent"),
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "sending an in-progress ack failed")
            }
        }
        drop(guard);
    }
}

/// One pull request: buffers each message as it arrives, with its progress started.
async fn pull(shared: Arc<Shared>, room: usize) -> Result<(), SourceError> {
    let mut batch = shared
        .consumer
        .batch()
        .max_messages(room)
        .expires(shared.wait)
        .messages()
        .await
        .map_err(|e| broker_error(&format!("pull request on {}", shared.stream), e))?;
    while let Some(item) = batch.next().await {
        match item {
            Ok(message) => {
                let progress = Progress::start(message.clone(), shared.ack_wait);
                shared.buffer().push_back(Received { message, progress });
                shared.arrived.notify_one();
            }
            Err(e) => {
                // A status such as 409 (leadership change, limits): pull again shortly.
                tracing::warn!(stream = %shared.stream, error = %e, "the pull request ended with an error");
                tokio::time::sleep(PULL_RETRY_PAUSE).await;
                break;
            }
        }
    }
    Ok(())
}

/// Consumes a durable JetStream pull consumer (see the [module docs](super)).
pub struct NatsSource {
    shared: Arc<Shared>,
    pulling: Option<JoinHandle<Result<(), SourceError>>>,
    /// Reads the consumer's lag in the background (stopped with the source).
    _lag: Option<LagPoller>,
}

impl std::fmt::Debug for NatsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSource")
            .field("stream", &self.shared.stream)
            .field("ack_wait", &self.shared.ack_wait)
            .field("dead_letter_subject", &self.shared.dead_letter_subject)
            .finish_non_exhaustive()
    }
}

impl NatsSource {
    /// Connects and gets the stream and the durable consumer, creating them
    /// (explicit acks, `ack_wait`, `max_deliver`, the subject as filter) and
    /// a dead-letter stream if [`NatsConfig::create`] is set. An existing
    /// consumer is used with its own settings, except `ack_wait`, which must match.
    pub async fn connect(config: NatsConfig) -> Result<Self, SourceError> {
        let js = config.jetstream().await?;
        let stream = config.stream(&js).await?;
        config
            .broker_loss
            .apply("NATS", &super::limits::risks(&stream.cached_info().config))?;
        let consumer_config = pull::Config {
            durable_name: Some(config.consumer.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: config.max_deliver.unwrap_or(-1),
            filter_subject: config.subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        let consumer: PullConsumer = if config.create {
            stream
                .get_or_create_consumer(&config.consumer, consumer_config)
                .await
                .map_err(|e| {
                    broker_error(&format!("creating the consumer {}", config.consumer), e)
                })?
        } else {
            stream.get_consumer(&config.consumer).await.map_err(|e| {
                broker_error(&format!("getting the consumer {}", config.consumer), e)
            })?
        };
        config.broker_loss.apply(
            "NATS",
            &super::limits::consumer_risks(
                &config.consumer,
                consumer.cached_info().config.max_deliver,
            ),
        )?;
        let ack_wait = consumer.cached_info().config.ack_wait;
        if !ack_wait.is_zero() && ack_wait != config.ack_wait {
            return Err(SourceError::config(format!(
                "the consumer {} has ack_wait {ack_wait:?}, not the configured {:?}",
                config.consumer, config.ack_wait
            )));
        }
        config.dead_letter_stream(&js).await?;
        tracing::debug!(stream = %config.stream, consumer = %config.consumer, "NATS source connected");
        let lag = LagPoller::start(consumer.clone(), config.lag_interval);
        Ok(Self {
            shared: Arc::new(Shared {
                js,
                consumer,
                stream: config.stream,
                ack_wait: config.ack_wait,
                batch: config.batch,
                wait: config.wait,
                dead_letter_subject: config.dead_letter_subject,
                buffer: Mutex::default(),
                arrived: Notify::new(),
            }),
            pulling: None,
            _lag: lag,
        })
    }

    fn delivery(&self, received: Received) -> Delivery {
        let Received { message, progress } = received;
        let (delivery_count, offset) = match message.info() {
            Ok(info) => (
                u32::try_from(info.delivered).unwrap_or(u32::MAX).max(1),
                i64::try_from(info.stream_sequence).ok(),
            ),
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "no JetStream metadata");
                (1, None)
            }
        };
        let meta = DeliveryMeta {
            source: "nats".into(),
            topic: Some(message.subject.to_string()),
            partition: None,
            offset,
            delivery_count,
        };
        let acker = NatsAcker {
            shared: Arc::clone(&self.shared),
            progress: Unsettled::new(progress),
            message: message.clone(),
        };
        Delivery::new(to_message(&message), meta, Box::new(acker))
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        if let Some(task) = self.pulling.take() {
            task.abort();
        }
        // Messages pulled but never handed out go back at once.
        let buffered: Vec<Received> = self.shared.buffer().drain(..).collect();
        if buffered.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // they come back after ack_wait
        };
        runtime.spawn(async move {
            for received in buffered {
                received.progress.stop().await;
                if let Err(e) = received.message.ack_with(AckKind::Nak(None)).await {
                    tracing::debug!(error = %e, "releasing a buffered message failed");
                }
            }
        });
    }
}

#[async_trait]
impl Source for NatsSource {
    /// The next delivery; never `None` (a JetStream consumer does not end).
    /// Cancel-safe: a pull in progress continues and is picked up by the next call.
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        loop {
            let shared = Arc::clone(&self.shared);
            let arrived = shared.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            let received = shared.buffer().pop_front();
            if let Some(received) = received {
                return Ok(Some(self.delivery(received)));
            }
            let task = self
                .pulling
                .get_or_insert_with(|| tokio::spawn(pull(Arc::clone(&shared), shared.batch)));
            tokio::select! {
                done = task => {
                    self.pulling = None;
                    match done {
                        Ok(result) => result?,
                        Err(e) => return Err(SourceError::other(format!("the NATS pull task failed: {e}"))),
                    }
                }
                _ = &mut arrived => {}
            }
        }
    }
}
