//! [`AmqpSource`]: connecting, consuming the work queue, and mapping deliveries to messages.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use super::acker::{AmqpAcker, Held};
use super::channel::{broker, short};
use super::headers::{as_u64, value_bytes, DELIVERIES_HEADER, DELIVERY_COUNT_HEADER, KEY_HEADER};
use super::lag::LagPoller;
use super::AmqpConfig;
use crate::error::{InputError, SourceError};
use crate::message::{DeliveryMeta, Headers, Message};
use crate::source::kit::Unsettled;
use crate::source::{Delivery, Source};

/// What the acknowledgers of one source share.
pub(super) struct Shared {
    /// A channel in confirm mode for retry copies and dead letters.
    pub(super) publish: Channel,
    pub(super) config: AmqpConfig,
}

/// Consumes one RabbitMQ queue (see the [module docs](super)).
pub struct AmqpSource {
    shared: Arc<Shared>,
    consumer: lapin::Consumer,
    // Kept so the consumer channel lives as long as the source.
    _channel: Channel,
    connection: Connection,
    /// Reads the queue depth in the background, on a channel of its own
    /// (stopped with the source).
    _lag: Option<LagPoller>,
}

impl fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpSource")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// How long [`AmqpSource::connect`] may take: the connection, the topology,
/// the prefetch and the consumer.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

impl AmqpSource {
    /// Connects, declares the topology, sets the prefetch and starts consuming
    /// the work queue with manual acks.
    /// Gives up after 30 s (`SETUP_TIMEOUT`): a broker that accepts the TCP
    /// connection but never finishes the handshake (one shutting down or
    /// still booting) must not hang the consumer.
    pub async fn connect(config: AmqpConfig) -> Result<Self, SourceError> {
        tokio::time::timeout(SETUP_TIMEOUT, Self::set_up(config))
            .await
            .map_err(|_| {
                SourceError::broker(format!(
                    "connecting and setting up the queue took longer than {SETUP_TIMEOUT:?}"
                ))
            })?
    }

    async fn set_up(config: AmqpConfig) -> Result<Self, SourceError> {
        let connection = config.connect("idemq-consumer").await?;
        let publish = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker("enabling publisher confirms"))?;
        config.declare(&publish).await?;
        check_loss(&config).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("opening a channel"))?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions { global: false })
            .await
            .map_err(broker("setting the prefetch"))?;
        let consumer = channel
            .basic_consume(
                short(&config.queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("starting the consumer"))?;
        tracing::info!(queue = %config.queue, prefetch = config.prefetch, "consuming");
        let lag = lag_poller(&connection, &config).await;
        Ok(Self {
            shared: Arc::new(Shared { publish, config }),
            consumer,
            _channel: channel,
            connection,
            _lag: lag,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AmqpConfig {
        &self.shared.config
    }

    /// Closes the connection: every delivery not acked yet goes back to the queue.
    /// Gives up after `SETTLE_TIMEOUT` (30 s) on a connection that does not
    /// answer: the broker then requeues what was unacked when it notices.
    pub async fn close(self) -> Result<(), SourceError> {
        tokio::time::timeout(
            super::channel::SETTLE_TIMEOUT,
            self.connection.close(200, "closing".into()),
        )
        .await
        .map_err(|_| SourceError::broker("closing the connection: no answer"))?
        .map_err(broker("closing the connection"))
    }

    fn delivery(&self, d: lapin::message::Delivery) -> Delivery {
        let config = &self.shared.config;
        let lapin::message::Delivery {
            redelivered,
            properties,
            data,
            acker,
            ..
        } = d;
        let table = properties.headers().as_ref();
        let header = |name: &str| table.and_then(|t| t.inner().get(name));

        let earlier = header(DELIVERIES_HEADER).and_then(as_u64).unwrap_or(0);
        let this = match header(DELIVERY_COUNT_HEADER).and_then(as_u64) {
            Some(returned) => returned.saturating_add(1),
            None if redelivered => 2,
            None => 1,
        };
        let delivery_count = u32::try_from(earlier.saturating_add(this)).unwrap_or(u32::MAX);

        let mut defect = None;
        let mut message = Message::new(data.clone());
        message.id = properties.message_id().as_ref().map(|id| id.to_string());
        if let Some(value) = header(KEY_HEADER) {
            match String::from_utf8(value_bytes(value)) {
                Ok(key) => message.key = Some(key),
                Err(_) => defect = Some(InputError::HeaderNotUtf8(KEY_HEADER.into())),
            }
        }
        let mut headers = Headers::new();
        for (name, value) in table.into_iter().flat_map(|t| t.inner()) {
            if name.as_str() != KEY_HEADER && name.as_str() != DELIVERIES_HEADER {
                headers.insert(name.as_str(), value_bytes(value));
            }
        }
        message.headers = headers;

        let meta = DeliveryMeta {
            source: "amqp".into(),
            topic: Some(config.queue.clone()),
            partition: None,
            offset: None,
            delivery_count,
        };
        let acker = AmqpAcker {
            acker: Unsettled::new(Held(acker)),
            shared: Arc::clone(&self.shared),
            body: data,
            properties,
            delivery_count,
        };
        let delivery = Delivery::new(message, meta, Box::new(acker));
        match defect {
            Some(d) => delivery.with_defect(d),
            None => delivery,
        }
    }
}

/// Reads the work queue's and the dead-letter queue's arguments and
/// policies from the management API and applies `broker_loss=` to what can
/// drop a message there ([`super::limits`]).
async fn check_loss(config: &AmqpConfig) -> Result<(), SourceError> {
    let mut risks = Vec::new();
    for queue in [config.queue.clone(), config.dead_letter_queue()] {
        if let Some(settings) = super::management::read(config, &queue).await {
            risks.extend(super::limits::risks(&settings, config.min_retention));
        }
    }
    config.broker_loss.apply("RabbitMQ", &risks)
}

/// Starts reading the queue depth on a channel of its own, unless
/// `lag_interval` is zero. A channel that cannot be opened costs the lag
/// only (logged), never the consumer.
async fn lag_poller(connection: &Connection, config: &AmqpConfig) -> Option<LagPoller> {
    if config.lag_interval.is_zero() {
        return None;
    }
    match connection.create_channel().await {
        Ok(channel) => Some(LagPoller::start(
            channel,
            config.queue.clone(),
            config.lag_interval,
        )),
        Err(e) => {
            tracing::warn!(queue = %config.queue, error = %e, "opening the channel that reads the queue depth failed; no idemq_source_lag_messages");
            None
        }
    }
}

#[async_trait]
impl Source for AmqpSource {
    async fn next(&mut self) -> Result<Option<Delivery>, SourceError> {
        match self.consumer.next().await {
            Some(Ok(d)) => Ok(Some(self.delivery(d))),
            Some(Err(e)) => Err(SourceError::broker(format!("consuming: {e}"))),
            None => Err(SourceError::broker(format!(
                "the consumer of queue {:?} was cancelled (queue deleted?)",
                self.shared.config.queue
            ))),
        }
    }
}
