//! The RocketMQ client thread: its own runtime, the producer and the push
//! consumer, reached through channels.

use std::sync::Arc;
use std::time::Duration;

use rocketmq_client_rust::{
    AclClientRPCHook, ClientConfig, ClientRuntime, ClientRuntimeConfig, DefaultMQProducer,
    DefaultMQPushConsumer, MQPushConsumer, SessionCredentials, TelemetryHandle,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_single::Message as RmqMessage;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use tokio::sync::mpsc;

use super::config::{AclCredentials, RocketMqConfig, StartFrom};
use super::lag::LagReader;
use super::source::Listener;
use crate::error::SourceError;

/// How long a send waits for the broker.
const SEND_TIMEOUT_MS: u64 = 10_000;

fn broker(e: impl std::fmt::Display) -> SourceError {
    SourceError::broker(e.to_string())
}

/// Where a client connects, and as whom.
#[derive(Clone)]
pub(super) struct Connection {
    /// Name server addresses, `host:port[;host:port…]`.
    pub(super) name_server: String,
    /// The ACL credentials every request is signed with, if any.
    pub(super) credentials: Option<AclCredentials>,
}

impl Connection {
    /// Where `config` says to connect, and as whom.
    pub(super) fn of(config: &RocketMqConfig) -> Self {
        Self {
            name_server: config.name_server.clone(),
            credentials: config.credentials.clone(),
        }
    }

    /// The signing hook of the credentials, if any.
    fn signer(&self) -> Option<Arc<AclClientRPCHook>> {
        self.credentials.as_ref().map(|c| {
            Arc::new(AclClientRPCHook::new(SessionCredentials::with_keys(
                c.access_key.as_str(),
                c.secret_key(),
            )))
        })
    }
}

/// What the consumer side of a client thread needs.
pub(super) struct ConsumerSetup {
    pub(super) config: RocketMqConfig,
    pub(super) listener: Listener,
}

/// A request to the client thread.
struct SendRequest {
    message: RmqMessage,
    topic: String,
    reply: tokio::sync::oneshot::Sender<Result<(), SourceError>>,
}

/// A handle to a producer running on a client thread.
#[derive(Clone)]
pub(super) struct Producer {
    requests: mpsc::UnboundedSender<SendRequest>,
}

impl Producer {
    pub(super) async fn send(&self, topic: &str, message: RmqMessage) -> Result<(), SourceError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let gone = || SourceError::other("the RocketMQ client has shut down");
        self.requests
            .send(SendRequest {
                message,
                topic: topic.to_owned(),
                reply,
            })
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

/// The RocketMQ client: its own Tokio runtime (the crate insists on owning
/// one) on a thread of its own, with a producer and/or a push consumer.
///
/// The client's objects never leave that thread: their types are too deep
/// for the compiler to prove them `Send` inside `idemq`'s futures, and they
/// are only reached through channels. Dropping the client (or
/// [`Client::shutdown`]) shuts them down there.
pub(super) struct Client {
    close: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Client {
    /// Starts the client thread and waits until the producer (if
    /// `producer`) and the consumer (if `consumer`) have started.
    pub(super) async fn start(
        connection: Connection,
        producer: bool,
        consumer: Option<ConsumerSetup>,
    ) -> Result<(Self, Option<Producer>), SourceError> {
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let (close, close_rx) = tokio::sync::oneshot::channel();
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let (requests, requests_rx) = mpsc::unbounded_channel();
        let spawned = std::thread::Builder::new()
            .name("idemq-rocketmq".into())
            .spawn(move || {
                client_thread(
                    connection,
                    producer,
                    consumer,
                    ClientChannels {
                        ready: ready_tx,
                        close: close_rx,
                        requests: requests_rx,
                    },
                );
                let _ = done_tx.send(());
            });
        if let Err(e) = spawned {
            return Err(SourceError::other(format!(
                "could not start the RocketMQ client thread: {e}"
            )));
        }
        let client = Client {
            close: Some(close),
            done: Some(done),
        };
        match ready.await {
            Ok(Ok(())) => Ok((client, producer.then_some(Producer { requests }))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SourceError::other(
                "the RocketMQ client thread stopped while starting",
            )),
        }
    }

    /// Shuts the client down and waits until it has finished.
    pub(super) async fn shutdown(mut self) {
        self.close.take();
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }
}

struct ClientChannels {
    ready: tokio::sync::oneshot::Sender<Result<(), SourceError>>,
    close: tokio::sync::oneshot::Receiver<()>,
    requests: mpsc::UnboundedReceiver<SendRequest>,
}

/// The client thread's body.
fn client_thread(
    connection: Connection,
    want_producer: bool,
    consumer: Option<ConsumerSetup>,
    channels: ClientChannels,
) {
    let listeners = consumer
        .as_ref()
        .map_or(1, |c| c.config.consume_threads as usize);
    let listener_timeout = consumer
        .as_ref()
        .map_or(Duration::from_secs(60), |c| c.config.consume_timeout);
    let owner = match runtime_owner(listeners, listener_timeout) {
        Ok(owner) => owner,
        Err(e) => {
            let _ = channels.ready.send(Err(e));
            return;
        }
    };
    owner.block_on(drive(connection, want_producer, consumer, channels, &owner));
    if let Err(e) = owner.shutdown_runtime_blocking_with_timeout(Duration::from_secs(5)) {
        tracing::debug!(error = %e, "RocketMQ client runtime shutdown");
    }
}

/// Builds the client's Tokio runtime; `listeners` listener calls may block
/// at once (they run on the client's metadata blocking lane).
fn runtime_owner(
    listeners: usize,
    listener_timeout: Duration,
) -> Result<RuntimeOwner, SourceError> {
    let mut config = RuntimeConfig::for_parallelism("idemq-rocketmq", 2);
    let lanes = &mut config.blocking_lane_policies;
    // Listener calls block until their delivery is settled: make room for
    // all of them, and do not time them out before the listener's own timeout.
    lanes.metadata_io.max_concurrency = listeners + 4;
    lanes.metadata_io.max_queue_depth = listeners * 4 + 64;
    lanes.metadata_io.queue_timeout = listener_timeout + Duration::from_secs(60);
    lanes.metadata_io.task_timeout = listener_timeout + Duration::from_secs(60);
    let lane_total = lanes.storage_io.max_concurrency
        + lanes.metadata_io.max_concurrency
        + lanes.cpu_crypto.max_concurrency;
    config.max_blocking_threads = (lane_total + 8).min(512);
    RuntimeOwner::plan(config)
        .map_err(|e| SourceError::config(format!("RocketMQ client runtime: {e}")))?
        .build()
        .map_err(|e| SourceError::other(format!("RocketMQ client runtime: {e}")))
}

/// A client configuration with a unique instance name, so that every source
/// and publisher is a client (and group member) of its own.
fn client_config(name_server: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set_namesrv_addr(name_server.into());
    config.set_instance_name(
        format!(
            "idemq-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        )
        .into(),
    );
    config
}

async fn drive(
    connection: Connection,
    want_producer: bool,
    consumer: Option<ConsumerSetup>,
    channels: ClientChannels,
    owner: &RuntimeOwner,
) {
    let ClientChannels {
        ready,
        mut close,
        mut requests,
    } = channels;
    let client = match ClientRuntime::try_new(
        owner.root_context().component("idemq-rocketmq"),
        ClientRuntimeConfig {
            shutdown_timeout: Duration::from_secs(10),
            ..ClientRuntimeConfig::default()
        },
        TelemetryHandle::noop(),
    ) {
        Ok(client) => client,
        Err(e) => {
            let _ = ready.send(Err(SourceError::other(format!(
                "RocketMQ client runtime: {e}"
            ))));
            return;
        }
    };

    let mut producer = None;
    let mut push = None;
    // The topics whose consume offsets are committed at shutdown: the
    // subscribed topic and the group's retry topic.
    let mut offset_topics: Vec<String> = Vec::new();
    // The consumer's lag reader and how often it reads (none: not read).
    let mut lag: Option<(LagReader, tokio::time::Interval)> = None;
    let mut started: Result<(), SourceError> = Ok(());
    if want_producer {
        let mut builder = DefaultMQProducer::builder(Arc::clone(&client))
            .client_config(client_config(&connection.name_server))
            .producer_group(format!("idemq_producer_{}", uuid::Uuid::new_v4().simple()))
            .send_msg_timeout(SEND_TIMEOUT_MS as u32);
        if let Some(signer) = connection.signer() {
            builder = builder.rpc_hook(signer);
        }
        let mut p = builder.build();
        match p.start().await {
            Ok(()) => producer = Some(p),
            Err(e) => started = Err(broker(format!("starting the RocketMQ producer: {e}"))),
        }
    }
    if let (Ok(()), Some(setup)) = (&started, consumer) {
        let config = setup.config;
        let timeout_minutes = config.consume_timeout.as_secs().div_ceil(60).max(1) + 1;
        let mut c = DefaultMQPushConsumer::builder(Arc::clone(&client))
            .client_config(client_config(&connection.name_server))
            .rpc_hook(connection.signer().map(|s| s as _))
            .consumer_group(config.group.as_str())
            .consume_from_where(match config.start_from {
                StartFrom::Earliest => ConsumeFromWhere::ConsumeFromFirstOffset,
                StartFrom::Latest => ConsumeFromWhere::ConsumeFromLastOffset,
            })
            .consume_thread_min(config.consume_threads)
            .consume_thread_max(config.consume_threads)
            .consume_message_batch_max_size(1)
            .max_reconsume_times(config.max_reconsume_times)
            .consume_timeout(timeout_minutes)
            .await_termination_millis_when_shutdown(2_000)
            .build();
        let result = async {
            c.subscribe(config.topic.as_str(), config.tags.as_str())
                .await?;
            c.register_message_listener_concurrently(setup.listener);
            c.start().await?;
            probe(&mut c, &config.topic).await
        }
        .await;
        match result {
            Ok(()) => {
                push = Some(c);
                offset_topics = vec![config.topic.clone(), format!("%RETRY%{}", config.group)];
                if !config.lag_interval.is_zero() {
                    let mut ticks = tokio::time::interval(config.lag_interval);
                    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    lag = Some((LagReader::new(&config.topic, &config.group), ticks));
                }
            }
            Err(e) => {
                started = Err(client_error(
                    format!(
                        "starting the RocketMQ consumer of {:?} in group {:?}",
                        config.topic, config.group
                    ),
                    e,
                ));
                c.shutdown().await;
            }
        }
    }

    let ok = started.is_ok();
    if ready.send(started).is_ok() && ok {
        let mut requests_open = true;
        loop {
            tokio::select! {
                _ = &mut close => break,
                // The consumer's lag, read between requests (bounded in time).
                _ = next_tick(&mut lag), if lag.is_some() => {
                    if let (Some((reader, _)), Some(c)) = (lag.as_mut(), push.as_mut()) {
                        reader.read(c).await;
                    }
                }
                request = requests.recv(), if requests_open => {
                    let Some(request) = request else {
                        // No producer handle left (or none made): only the
                        // close (and the lag) from now on.
                        requests_open = false;
                        continue;
                    };
                    let result = match &producer {
                        Some(p) => match p.send_with_timeout(request.message, SEND_TIMEOUT_MS).await {
                            Ok(Some(_)) => Ok(()),
                            Ok(None) => Err(broker(format!(
                                "publishing to {:?}: the broker returned no send result",
                                request.topic
                            ))),
                            Err(e) => Err(client_error(format!("publishing to {:?}", request.topic), e)),
                        },
                        None => Err(SourceError::other("this RocketMQ client has no producer")),
                    };
                    let _ = request.reply.send(result);
                }
            }
        }
    }
    requests.close();
    if let Some(mut c) = push {
        commit_offsets(&c, &offset_topics).await;
        c.shutdown().await;
    }
    if let Some(mut p) = producer {
        p.shutdown().await;
    }
    let report = client.shutdown().await;
    if !report.is_healthy() {
        tracing::debug!(report = %report.to_json(), "RocketMQ client shutdown report");
    }
}

/// How long committing one queue's offset at shutdown may take.
const OFFSET_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Commits the consumer's offsets of `topics` to the broker and waits for
/// its answers, before the consumer shuts down.
///
/// The client's own shutdown sends them *one-way*: the process can exit (and
/// a consumer started right after can read the broker's offsets) before the
/// broker has applied them, so what was settled would be delivered again
/// (and answered "duplicate" by the inbox). The one-way send that follows in
/// the client's shutdown still covers a delivery settled after this snapshot.
async fn commit_offsets(consumer: &DefaultMQPushConsumer, topics: &[String]) {
    let Some(store) = consumer.offset_store() else {
        return;
    };
    for topic in topics {
        for (queue, offset) in store.clone_offset_table(topic).await {
            if offset < 0 {
                continue;
            }
            let committed = tokio::time::timeout(
                OFFSET_COMMIT_TIMEOUT,
                store.update_consume_offset_to_broker(&queue, offset, false),
            )
            .await;
            match committed {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(
                    topic = %topic,
                    queue = queue.queue_id(),
                    offset,
                    error = %e,
                    "RocketMQ: committing a consume offset at shutdown failed; what followed it is delivered again"
                ),
                Err(_) => tracing::warn!(
                    topic = %topic,
                    queue = queue.queue_id(),
                    offset,
                    "RocketMQ: no answer to a consume offset commit at shutdown within {OFFSET_COMMIT_TIMEOUT:?}; what followed it may be delivered again"
                ),
            }
        }
    }
}

/// The next tick of the lag reader's interval (never, without one).
async fn next_tick(lag: &mut Option<(LagReader, tokio::time::Interval)>) {
    match lag {
        Some((_, ticks)) => {
            ticks.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Asks the broker for the end of one of the topic's queues: a request the
/// broker authenticates, so that refused credentials show when the consumer
/// starts, not as pulls that fail forever after. A topic without a route
/// (not created yet) is not probed.
async fn probe(
    consumer: &mut DefaultMQPushConsumer,
    topic: &str,
) -> rocketmq_client_rust::ClientResult<()> {
    let queues = match consumer.fetch_subscribe_message_queues(topic).await {
        Ok(queues) => queues,
        Err(e) => {
            tracing::debug!(topic, error = %e, "no route to probe the RocketMQ broker with");
            return Ok(());
        }
    };
    if let Some(queue) = queues.first() {
        consumer.max_offset(queue).await?;
    }
    Ok(())
}

/// The broker's answer to a request it does not allow: unknown credentials,
/// a wrong signature, or a user without the permission.
const NO_PERMISSION: i64 = 16;

/// `error` of the client, in `doing`: a configuration error when the broker
/// refused the credentials, a broker error otherwise.
fn client_error(doing: String, error: rocketmq_client_rust::ClientError) -> SourceError {
    if broker_code(&error) == Some(NO_PERMISSION) {
        SourceError::config(format!(
            "{doing}: the broker refused this client (NO_PERMISSION): check the access key and secret key (rocketmq://ACCESS_KEY:SECRET_KEY@…) and the user's permissions"
        ))
    } else {
        broker(format!("{doing}: {error}"))
    }
}

/// The response code the broker answered `error` with, if it answered.
fn broker_code(error: &rocketmq_client_rust::ClientError) -> Option<i64> {
    let view = error.diagnostic_view().ok()?;
    let field = view.fields().find(|f| f.name() == "broker_code")?;
    match field.value() {
        rocketmq_error::ViewValueRef::I64(code) => Some(code),
        _ => None,
    }
}
