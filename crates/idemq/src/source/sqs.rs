//! Amazon SQS (and SQS-compatible endpoints): a [`Source`] and a [`Publisher`]
//! over `aws-sdk-sqs`.
//!
//! # How SQS redelivers, and how this source maps it
//!
//! SQS never pushes: a consumer *receives* a message, which makes it
//! invisible to everyone else for the queue's *visibility timeout*, and
//! *deletes* it when done. A message that is not deleted in time becomes
//! visible again and is received once more, with a higher
//! `ApproximateReceiveCount`. A consumer that crashes therefore loses nothing:
//! its messages come back after the timeout. That is at-least-once delivery,
//! and the inbox turns it into exactly-once effects.
//!
//! - **Receive**: long polling (`WaitTimeSeconds`, up to 10 messages per call),
//!   buffered; the receive runs in a background task so that
//!   [`Source::next`] is cancel-safe. `ApproximateReceiveCount` becomes
//!   [`DeliveryMeta::delivery_count`], which the engine uses for poison
//!   accounting (`RetryPolicy::max_deliveries`).
//! - **Ack** (after the inbox commit): `DeleteMessage` with the receipt handle.
//! - **Nack(delay)** (retry later): `ChangeMessageVisibility` to the delay,
//!   rounded *up* to whole seconds and clamped to 0..=43200 s, so the message
//!   comes back after the delay and not at once.
//! - **Visibility extension**: from the moment a message is received until it
//!   is settled (or its delivery is dropped), a background task extends its
//!   visibility by the configured timeout every third of that timeout, so a
//!   slow handler does not let a second consumer receive the same message.
//!   A delivery dropped unsettled (the consumer crashed or was cancelled)
//!   stops being extended and comes back after the visibility timeout.
//! - **Dead-letter**: with a dead-letter queue configured (`dlq=`), a copy is
//!   sent there with the original body and attributes plus the string
//!   attribute `dead_letter_reason` (the [`DeadLetterReason::code`]), then the
//!   original is deleted; without one it is just deleted (the inbox's
//!   dead-letter table keeps it). This is independent of an SQS redrive
//!   policy, which may still be configured on the queue as a last resort.
//! - **FIFO queues** (names ending in `.fifo`): messages of one
//!   `MessageGroupId` are handed out one at a time, in order; the next one of
//!   the group is handed out only when the previous one is settled. Groups
//!   run concurrently. When a message is nacked or dropped, the later
//!   messages of its group that this source holds are made visible again at
//!   once, so SQS delivers the group again in order.
//!
//! # Message mapping
//!
//! The payload is the message body. [`Message::id`] is the string message
//! attribute `message_id` if present, else the SQS `MessageId`;
//! [`Message::key`] is the attribute `key` if present (on FIFO queues, else
//! the `MessageGroupId`); every other message attribute becomes a header
//! (string and number attributes as their text, binary ones as their bytes).
//! [`DeliveryMeta`] has source `sqs` and the queue name as topic.
//! [`SqsPublisher`] writes the same attributes.
//!
//! # Configuration and credentials
//!
//! `sqs://queue-name?endpoint=http://127.0.0.1:5000&region=us-east-1&visibility=30&wait=20&dlq=queue-dead&create=true&batch=10`
//! (see [`SqsConfig::from_url`]). Credentials come from
//! [`SqsConfig::credentials`], else from the environment variables
//! `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`);
//! for a local endpoint (`localhost`, `127.0.0.1`, `::1`) without them the
//! placeholder pair `test`/`test` is used, which local emulators accept.
//! Other AWS credential sources (profiles, instance roles) are not read.
//!
//! ```no_run
//! use idemq::source::sqs::{SqsConfig, SqsPublisher, SqsSource};
//! use idemq::source::Publisher;
//! use idemq::{Consumer, KeySpec, Message};
//! use idemq::store::{sql::sqlite::SqliteStore, StoreAdmin};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let config = SqsConfig::from_url(
//!     "sqs://payments?endpoint=http://127.0.0.1:5000&region=us-east-1&visibility=30&create=true",
//! )?;
//! let publisher = SqsPublisher::connect(config.clone()).await?;
//! publisher
//!     .publish(&Message::new(r#"{"payment_id":"p-1","amount":5}"#).with_id("m-1"))
//!     .await?;
//!
//! let store = SqliteStore::connect("sqlite://ledger.db").await?;
//! store.migrate().await?;
//! let consumer = Consumer::builder("ledger", store)
//!     .key(KeySpec::json("/payment_id"))
//!     .handler_fn(|_ctx, _tx| Box::pin(async move { Ok(None) }))
//!     .build()?;
//! // SQS never ends: run until Ctrl-C.
//! let source = SqsSource::connect(config).await?;
//! let summary = consumer
//!     .run_until(source, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};
use aws_sdk_sqs::Client;
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::url::{Bare, BrokerUrl};
use super::{Acknowledger, Delivery, Publisher, Source};
use crate::error::SourceError;
use crate::message::{DeliveryMeta, Headers, Message};
use crate::store::DeadLetterReason;

/// The message attribute that carries [`Message::id`].
pub const ID_ATTRIBUTE: &str = "message_id";
/// The message attribute that carries [`Message::key`].
pub const KEY_ATTRIBUTE: &str = "key";
/// The message attribute added to copies sent to the dead-letter queue.
pub const REASON_ATTRIBUTE: &str = "dead_letter_reason";
/// SQS accepts at most this many message attributes per message.
pub const MAX_ATTRIBUTES: usize = 10;
/// The longest visibility timeout or delay SQS accepts, in seconds (12 hours).
pub const MAX_VISIBILITY_SECS: u64 = 43_200;

const MAX_WAIT_SECS: u64 = 20;
/// How long settling waits for a visibility extension in progress.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// How much longer than its long-polling wait a receive call may take.
const RECEIVE_GRACE: Duration = Duration::from_secs(15);
const MAX_BATCH: i32 = 10;

/// Where and how to reach an SQS queue. Build it with [`SqsConfig::new`] and
/// the builder methods, or parse a URL with [`SqsConfig::from_url`].
#[derive(Clone)]
pub struct SqsConfig {
    /// The queue name (not its URL); a name ending in `.fifo` is a FIFO queue.
    pub queue: String,
    /// The endpoint URL (e.g. `http://127.0.0.1:5000`); `None` for AWS itself.
    pub endpoint: Option<String>,
    /// The AWS region.
    pub region: String,
    /// The visibility timeout requested on receive, and by which it is
    /// extended while a delivery is unsettled (1 s ..= 12 h, whole seconds).
    pub visibility: Duration,
    /// Long-polling wait per receive call (0 ..= 20 s, whole seconds).
    pub wait: Duration,
    /// Messages per receive call (1 ..= 10).
    pub batch: i32,
    /// The name of the dead-letter queue that dead-lettered messages are copied to.
    pub dead_letter_queue: Option<String>,
    /// Create the queue (and the dead-letter queue) if it does not exist.
    pub create_queue: bool,
    credentials: Option<(String, String)>,
}

impl std::fmt::Debug for SqsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsConfig")
            .field("queue", &self.queue)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("visibility", &self.visibility)
            .field("wait", &self.wait)
            .field("batch", &self.batch)
            .field("dead_letter_queue", &self.dead_letter_queue)
            .field("create_queue", &self.create_queue)
            .field("credentials", &self.credentials.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl SqsConfig {
    /// Defaults for `queue`: the region from `AWS_REGION` or
    /// `AWS_DEFAULT_REGION` (else `us-east-1`), AWS's own endpoint, a 30 s
    /// visibility timeout, 20 s long polls, 10 messages per receive, no
    /// dead-letter queue, queues not created.
    pub fn new(queue: impl Into<String>) -> Self {
        let region = std::env::var("AWS_REGION")
            .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
            .ok()
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "us-east-1".to_owned());
        Self {
            queue: queue.into(),
            endpoint: None,
            region,
            visibility: Duration::from_secs(30),
            wait: Duration::from_secs(MAX_WAIT_SECS),
            batch: MAX_BATCH,
            dead_letter_queue: None,
            create_queue: false,
            credentials: None,
        }
    }

    /// Parses `sqs://queue-name?endpoint=…&region=…&visibility=30&wait=20&dlq=name&create=true&batch=10`.
    ///
    /// Every parameter is optional. `visibility` and `wait` are durations
    /// (`30`, `30s`, `1m`; a bare number is seconds) that must come to whole
    /// seconds. Values may be percent-encoded. Unknown parameters and
    /// out-of-range values are a [`SourceError::Config`].
    pub fn from_url(url: &str) -> Result<Self, SourceError> {
        let u = BrokerUrl::parse("SQS", "sqs", url)?;
        if u.userinfo.is_some() || u.path.is_some_and(|p| !p.is_empty()) {
            return Err(
                u.error("expected sqs://QUEUE?…, with nothing but the queue name before the '?'")
            );
        }
        let queue = u.decoded_hosts()?;
        let mut config = SqsConfig::new(queue);
        for p in u.params() {
            match p.name.as_str() {
                "endpoint" => config.endpoint = p.non_empty(),
                "region" => config.region = p.value,
                "visibility" => config.visibility = p.duration(Bare::Seconds)?,
                "wait" => config.wait = p.duration(Bare::Seconds)?,
                "batch" => config.batch = p.count()?,
                "dlq" => config.dead_letter_queue = p.non_empty(),
                "create" => config.create_queue = p.flag()?,
                _ => return Err(p.unknown()),
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Sets the endpoint URL.
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// Sets the region.
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = region.into();
        self
    }

    /// Sets the visibility timeout (whole seconds).
    pub fn visibility(mut self, visibility: Duration) -> Self {
        self.visibility = visibility;
        self
    }

    /// Sets the long-polling wait (whole seconds, at most 20).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets the dead-letter queue name.
    pub fn dead_letter_queue(mut self, queue: impl Into<String>) -> Self {
        self.dead_letter_queue = Some(queue.into());
        self
    }

    /// Whether to create missing queues.
    pub fn create_queue(mut self, create: bool) -> Self {
        self.create_queue = create;
        self
    }

    /// Uses these static credentials instead of the environment.
    pub fn credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret: impl Into<String>,
    ) -> Self {
        self.credentials = Some((access_key_id.into(), secret.into()));
        self
    }

    /// Whether the queue is a FIFO queue (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.queue.ends_with(".fifo")
    }

    /// Checks names and ranges.
    pub fn validate(&self) -> Result<(), SourceError> {
        validate_queue_name(&self.queue)?;
        if let Some(dlq) = &self.dead_letter_queue {
            validate_queue_name(dlq)?;
            if dlq.ends_with(".fifo") != self.is_fifo() {
                return Err(config_error(format!(
                    "the dead-letter queue {dlq:?} must be of the same type (FIFO or standard) as {:?}",
                    self.queue
                )));
            }
        }
        if self.region.is_empty() {
            return Err(config_error("the region is empty"));
        }
        let visibility = self.visibility.as_secs();
        if visibility == 0
            || visibility > MAX_VISIBILITY_SECS
            || self.visibility.subsec_nanos() != 0
        {
            return Err(config_error(format!(
                "visibility must be whole seconds from 1 to {MAX_VISIBILITY_SECS}, not {:?}",
                self.visibility
            )));
        }
        if self.wait.as_secs() > MAX_WAIT_SECS || self.wait.subsec_nanos() != 0 {
            return Err(config_error(format!(
                "wait must be whole seconds from 0 to {MAX_WAIT_SECS}, not {:?}",
                self.wait
            )));
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(config_error(format!(
                "batch must be from 1 to {MAX_BATCH}, not {}",
                self.batch
            )));
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(config_error(format!(
                    "endpoint {endpoint:?} must start with http:// or https://"
                )));
            }
        }
        Ok(())
    }

    /// An `aws-sdk-sqs` client for this configuration (see the module docs for credentials).
    pub fn client(&self) -> Result<Client, SourceError> {
        self.validate()?;
        let credentials = match &self.credentials {
            Some((id, secret)) => Credentials::new(id, secret, None, None, "idemq-config"),
            None => match (
                std::env::var("AWS_ACCESS_KEY_ID"),
                std::env::var("AWS_SECRET_ACCESS_KEY"),
            ) {
                (Ok(id), Ok(secret)) if !id.is_empty() => Credentials::new(
                    id,
                    secret,
                    std::env::var("AWS_SESSION_TOKEN")
                        .ok()
                        .filter(|t| !t.is_empty()),
                    None,
                    "idemq-environment",
                ),
                _ if self.endpoint.as_deref().is_some_and(is_local_endpoint) => {
                    Credentials::new("test", "test", None, None, "idemq-local")
                }
                _ => {
                    return Err(config_error(
                        "no SQS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                    ))
                }
            },
        };
        let mut builder = aws_sdk_sqs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(self.region.clone()))
            .credentials_provider(credentials);
        if let Some(endpoint) = &self.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        Ok(Client::from_conf(builder.build()))
    }
}

fn config_error(text: impl Into<String>) -> SourceError {
    SourceError::Config(text.into())
}

fn broker_error<E: std::error::Error>(what: &str, err: E) -> SourceError {
    SourceError::Broker(format!("SQS {what}: {}", DisplayErrorContext(err)))
}

fn validate_queue_name(name: &str) -> Result<(), SourceError> {
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    let ok = !base.is_empty()
        && name.len() <= 80
        && base
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(config_error(format!(
            "invalid SQS queue name {name:?}: 1 to 80 letters, digits, '-' or '_', optionally ending in .fifo"
        )))
    }
}

fn is_local_endpoint(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        authority.split(':').next().unwrap_or("")
    };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

/// A queue resolved to its URL.
#[derive(Debug, Clone)]
struct QueueRef {
    name: String,
    url: String,
    fifo: bool,
}

async fn resolve_queue(client: &Client, name: &str, create: bool) -> Result<QueueRef, SourceError> {
    let fifo = name.ends_with(".fifo");
    let url = match client.get_queue_url().queue_name(name).send().await {
        Ok(out) => out.queue_url().map(str::to_owned),
        Err(e) if create && e.as_service_error().is_some() => {
            tracing::info!(queue = name, fifo, "creating the SQS queue");
            let mut request = client.create_queue().queue_name(name);
            if fifo {
                request = request
                    .attributes(QueueAttributeName::FifoQueue, "true")
                    .attributes(QueueAttributeName::ContentBasedDeduplication, "false");
            }
            request
                .send()
                .await
                .map_err(|e| broker_error(&format!("CreateQueue {name}"), e))?
                .queue_url()
                .map(str::to_owned)
        }
        Err(e) => return Err(broker_error(&format!("GetQueueUrl {name}"), e)),
    };
    let url =
        url.ok_or_else(|| SourceError::Broker(format!("SQS returned no URL for queue {name}")))?;
    Ok(QueueRef {
        name: name.to_owned(),
        url,
        fifo,
    })
}

/// Everything the source, its receive task and its acknowledgers share.
struct Shared {
    client: Client,
    queue: QueueRef,
    dead_letter: Option<QueueRef>,
    visibility: Duration,
    wait: Duration,
    batch: i32,
    state: Mutex<State>,
    /// Signalled when a FIFO group is released.
    released: Notify,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn visibility_secs(&self) -> i32 {
        i32::try_from(self.visibility.as_secs()).unwrap_or(i32::MAX)
    }

    async fn change_visibility(&self, receipt: &str, secs: i32) -> Result<(), SourceError> {
        self.client
            .change_message_visibility()
            .queue_url(&self.queue.url)
            .receipt_handle(receipt)
            .visibility_timeout(secs)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error("ChangeMessageVisibility", e))
    }

    async fn delete(&self, receipt: &str) -> Result<(), SourceError> {
        self.client
            .delete_message()
            .queue_url(&self.queue.url)
            .receipt_handle(receipt)
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error("DeleteMessage", e))
    }
}

/// Received messages not handed out yet, and (FIFO) the groups with a
/// delivery handed out and unsettled.
#[derive(Default)]
struct State {
    buffer: VecDeque<Received>,
    busy_groups: HashSet<String>,
}

/// A received message whose visibility is kept extended until it is settled.
struct Received {
    message: aws_sdk_sqs::types::Message,
    lease: Lease,
}

impl Received {
    fn group(&self) -> Option<&str> {
        self.message
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .map(String::as_str)
    }
}

/// Keeps one receipt handle invisible: a task extends its visibility every
/// third of the timeout until the lease is stopped or dropped.
struct Lease {
    receipt: String,
    stopped: Arc<tokio::sync::Mutex<bool>>,
    task: JoinHandle<()>,
}

impl Lease {
    fn start(shared: &Arc<Shared>, receipt: String) -> Self {
        let stopped = Arc::new(tokio::sync::Mutex::new(false));
        let task = tokio::spawn(extend(
            Arc::downgrade(shared),
            receipt.clone(),
            Arc::clone(&stopped),
        ));
        Self {
            receipt,
            stopped,
            task,
        }
    }

    /// Stops extending; once this returns, no extension request is sent any more
    /// (one in progress has finished), so a settling request comes after it.
    async fn stop(&self) {
        // An extension stuck on the network must not hold up the settlement.
        match tokio::time::timeout(STOP_WAIT, self.stopped.lock()).await {
            Ok(mut stopped) => *stopped = true,
            Err(_) => {
                tracing::warn!("a visibility extension is still in progress; settling anyway")
            }
        }
        self.task.abort();
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn extend(
    shared: std::sync::Weak<Shared>,
    receipt: String,
    stopped: Arc<tokio::sync::Mutex<bool>>,
) {
    let Some(visibility) = shared.upgrade().map(|s| s.visibility) else {
        return;
    };
    let every = visibility / 3;
    loop {
        tokio::time::sleep(every).await;
        let guard = stopped.lock().await;
        if *guard {
            return;
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        match shared
            .change_visibility(&receipt, shared.visibility_secs())
            .await
        {
            Ok(()) => tracing::trace!(queue = %shared.queue.name, "visibility extended"),
            Err(e) => {
                tracing::warn!(queue = %shared.queue.name, error = %e, "extending the visibility failed")
            }
        }
        drop(guard);
    }
}

/// Makes the given received messages visible again at once (best effort, in
/// the background): they were never handed out, or must be redelivered in order.
fn release_now(shared: &Arc<Shared>, released: Vec<Received>) {
    if released.is_empty() {
        return;
    }
    let receipts: Vec<String> = released.iter().map(|r| r.lease.receipt.clone()).collect();
    drop(released); // stops their extension
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return; // they come back after the visibility timeout
    };
    let shared = Arc::clone(shared);
    runtime.spawn(async move {
        for receipt in receipts {
            if let Err(e) = shared.change_visibility(&receipt, 0).await {
                tracing::debug!(queue = %shared.queue.name, error = %e, "releasing a buffered message failed");
            }
        }
    });
}

async fn receive(shared: Arc<Shared>, max: i32) -> Result<Vec<Received>, SourceError> {
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
        let lease = Lease::start(&shared, receipt);
        received.push(Received { message, lease });
    }
    Ok(received)
}

/// Consumes one SQS queue (see the [module docs](self)).
pub struct SqsSource {
    shared: Arc<Shared>,
    receiving: Option<JoinHandle<Result<Vec<Received>, SourceError>>>,
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
    pub async fn connect(config: SqsConfig) -> Result<Self, SourceError> {
        let client = config.client()?;
        let queue = resolve_queue(&client, &config.queue, config.create_queue).await?;
        let dead_letter = match &config.dead_letter_queue {
            Some(name) => Some(resolve_queue(&client, name, config.create_queue).await?),
            None => None,
        };
        tracing::debug!(queue = %queue.name, url = %queue.url, "SQS source connected");
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
            lease: Some(lease),
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
                        Err(e) => return Err(SourceError::Other(format!("the SQS receive task failed: {e}"))),
                    };
                    shared.state().buffer.extend(batch);
                }
                _ = &mut released => {}
            }
        }
    }
}

/// Maps an SQS message to a [`Message`] (see the module docs).
fn to_message(raw: &aws_sdk_sqs::types::Message, fifo: bool) -> Message {
    let attributes = raw.message_attributes();
    let string_attr = |name: &str| {
        attributes
            .and_then(|a| a.get(name))
            .and_then(|v| v.string_value())
            .map(str::to_owned)
    };
    let id = string_attr(ID_ATTRIBUTE).or_else(|| raw.message_id().map(str::to_owned));
    let mut key = string_attr(KEY_ATTRIBUTE);
    if key.is_none() && fifo {
        key = raw
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
            .cloned();
    }
    let mut headers = Headers::new();
    if let Some(attributes) = attributes {
        let mut names: Vec<&String> = attributes
            .keys()
            .filter(|n| n.as_str() != ID_ATTRIBUTE && n.as_str() != KEY_ATTRIBUTE)
            .collect();
        names.sort(); // SQS does not keep the order; make it deterministic
        for name in names {
            let value = &attributes[name];
            if let Some(s) = value.string_value() {
                headers.insert(name.clone(), s.as_bytes());
            } else if let Some(b) = value.binary_value() {
                headers.insert(name.clone(), b.as_ref());
            }
        }
    }
    Message {
        id,
        key,
        headers,
        payload: raw.body().unwrap_or_default().as_bytes().to_vec(),
    }
}

/// Settles one SQS delivery.
struct SqsAcker {
    shared: Arc<Shared>,
    lease: Option<Lease>,
    /// The FIFO group this delivery keeps busy.
    group: Option<String>,
    raw: aws_sdk_sqs::types::Message,
}

impl SqsAcker {
    /// Stops the visibility extension and returns the receipt handle.
    async fn stop(&mut self) -> Option<String> {
        let lease = self.lease.take()?;
        lease.stop().await;
        Some(lease.receipt.clone())
    }

    /// Frees the FIFO group. With `redeliver`, the group's later messages that
    /// this source holds go back to the queue too, so SQS redelivers the group in order.
    fn release_group(&mut self, redeliver: bool) {
        let Some(group) = self.group.take() else {
            return;
        };
        let mut state = self.shared.state();
        let mut siblings = Vec::new();
        if redeliver {
            let mut i = 0;
            while i < state.buffer.len() {
                if state.buffer[i].group() == Some(group.as_str()) {
                    if let Some(r) = state.buffer.remove(i) {
                        siblings.push(r);
                    }
                } else {
                    i += 1;
                }
            }
        }
        state.busy_groups.remove(&group);
        drop(state);
        release_now(&self.shared, siblings);
        self.shared.released.notify_one();
    }

    async fn delete_and_release(&mut self, receipt: &str) -> Result<(), SourceError> {
        let result = self.shared.delete(receipt).await;
        self.release_group(result.is_err());
        result
    }

    /// Sends a copy of the message to the dead-letter queue.
    async fn copy_to_dead_letter_queue(
        &self,
        dlq: &QueueRef,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let mut attributes = self.raw.message_attributes().cloned().unwrap_or_default();
        if attributes.len() >= MAX_ATTRIBUTES {
            // Make room for the reason; the inbox's dead-letter row keeps everything.
            let mut droppable: Vec<String> = attributes
                .keys()
                .filter(|n| n.as_str() != ID_ATTRIBUTE && n.as_str() != KEY_ATTRIBUTE)
                .cloned()
                .collect();
            droppable.sort();
            while attributes.len() >= MAX_ATTRIBUTES {
                let Some(name) = droppable.pop() else { break };
                tracing::warn!(queue = %dlq.name, attribute = %name, "attribute not copied to the dead-letter queue (SQS allows 10)");
                attributes.remove(&name);
            }
        }
        attributes.insert(
            REASON_ATTRIBUTE.to_owned(),
            string_attribute(reason.code())?,
        );
        let mut request = self
            .shared
            .client
            .send_message()
            .queue_url(&dlq.url)
            .message_body(self.raw.body().unwrap_or_default())
            .set_message_attributes(Some(attributes));
        if dlq.fifo {
            let group = self
                .raw
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
                .cloned()
                .unwrap_or_else(|| "default".to_owned());
            let dedup = self
                .raw
                .message_id()
                .map(str::to_owned)
                .unwrap_or_else(|| sha256_hex(self.raw.body().unwrap_or_default().as_bytes()));
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup);
        }
        request.send().await.map(|_| ()).map_err(|e| {
            broker_error(
                &format!("SendMessage to the dead-letter queue {}", dlq.name),
                e,
            )
        })
    }
}

impl Drop for SqsAcker {
    /// Dropped unsettled: the extension stops (with the lease) and the message
    /// comes back after the visibility timeout; a FIFO group is freed.
    fn drop(&mut self) {
        self.release_group(true);
    }
}

#[async_trait]
impl Acknowledger for SqsAcker {
    async fn ack(mut self: Box<Self>) -> Result<(), SourceError> {
        let Some(receipt) = self.stop().await else {
            return Ok(());
        };
        self.delete_and_release(&receipt).await
    }

    async fn nack(mut self: Box<Self>, delay: Duration) -> Result<(), SourceError> {
        let Some(receipt) = self.stop().await else {
            return Ok(());
        };
        let secs = delay_secs(delay);
        let result = self.shared.change_visibility(&receipt, secs).await;
        self.release_group(true);
        result
    }

    async fn dead_letter(
        mut self: Box<Self>,
        reason: &DeadLetterReason,
    ) -> Result<(), SourceError> {
        let Some(receipt) = self.stop().await else {
            return Ok(());
        };
        if let Some(dlq) = self.shared.dead_letter.clone() {
            if let Err(e) = self.copy_to_dead_letter_queue(&dlq, reason).await {
                // Not deleted: the message comes back after the visibility timeout.
                self.release_group(true);
                return Err(e);
            }
        }
        self.delete_and_release(&receipt).await
    }
}

/// The delay as SQS visibility seconds: rounded up, at most 12 hours.
fn delay_secs(delay: Duration) -> i32 {
    let mut secs = delay.as_secs();
    if delay.subsec_nanos() > 0 {
        secs += 1;
    }
    i32::try_from(secs.min(MAX_VISIBILITY_SECS)).unwrap_or(i32::MAX)
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn string_attribute(value: &str) -> Result<MessageAttributeValue, SourceError> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .map_err(|e| SourceError::Other(format!("building an SQS message attribute: {e}")))
}

fn binary_attribute(value: &[u8]) -> Result<MessageAttributeValue, SourceError> {
    MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(Blob::new(value))
        .build()
        .map_err(|e| SourceError::Other(format!("building an SQS message attribute: {e}")))
}

/// Whether `value` can be a FIFO `MessageGroupId` / `MessageDeduplicationId`
/// as it is: 1 to 128 ASCII letters, digits or punctuation.
fn fits_fifo_id(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 128
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c.is_ascii_punctuation())
}

/// Publishes to one SQS queue with `SendMessage`.
///
/// The body is the payload (which must be UTF-8: SQS bodies are text);
/// [`Message::id`] goes to the string attribute `message_id`, [`Message::key`]
/// to `key`, every header to an attribute of its name (UTF-8 values as
/// `String`, others as `Binary`). SQS allows at most [`MAX_ATTRIBUTES`]
/// attributes: a message needing more is refused with a
/// [`SourceError::Other`] before anything is sent. On a FIFO queue the
/// `MessageGroupId` is the key (else `default`) and the
/// `MessageDeduplicationId` is the id (else the SHA-256 of the body); a value
/// that SQS would not accept there is replaced by its SHA-256.
pub struct SqsPublisher {
    client: Client,
    queue: QueueRef,
}

impl std::fmt::Debug for SqsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsPublisher")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl SqsPublisher {
    /// Resolves the queue URL, creating the queue if [`SqsConfig::create_queue`] is set.
    pub async fn connect(config: SqsConfig) -> Result<Self, SourceError> {
        let client = config.client()?;
        let queue = resolve_queue(&client, &config.queue, config.create_queue).await?;
        Ok(Self { client, queue })
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue.url
    }

    fn attributes(
        message: &Message,
    ) -> Result<HashMap<String, MessageAttributeValue>, SourceError> {
        let mut attributes = HashMap::new();
        if let Some(id) = &message.id {
            attributes.insert(ID_ATTRIBUTE.to_owned(), string_attribute(id)?);
        }
        if let Some(key) = &message.key {
            attributes.insert(KEY_ATTRIBUTE.to_owned(), string_attribute(key)?);
        }
        for (name, value) in message.headers.iter() {
            if attributes.contains_key(name) {
                tracing::warn!(
                    header = name,
                    "header not sent: an attribute of that name is already set"
                );
                continue;
            }
            let value = match std::str::from_utf8(value) {
                Ok(s) => string_attribute(s)?,
                Err(_) => binary_attribute(value)?,
            };
            attributes.insert(name.to_owned(), value);
        }
        if attributes.len() > MAX_ATTRIBUTES {
            return Err(SourceError::Other(format!(
                "SQS allows at most {MAX_ATTRIBUTES} message attributes; this message needs {} (message_id, key and headers)",
                attributes.len()
            )));
        }
        Ok(attributes)
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    async fn publish(&self, message: &Message) -> Result<(), SourceError> {
        let body = std::str::from_utf8(&message.payload).map_err(|_| {
            SourceError::Other("SQS message bodies are text: the payload is not UTF-8".into())
        })?;
        let attributes = Self::attributes(message)?;
        let mut request = self
            .client
            .send_message()
            .queue_url(&self.queue.url)
            .message_body(body)
            .set_message_attributes(Some(attributes).filter(|a| !a.is_empty()));
        if self.queue.fifo {
            let group = match message.key.as_deref() {
                Some(k) if fits_fifo_id(k) => k.to_owned(),
                Some(k) => sha256_hex(k.as_bytes()),
                None => "default".to_owned(),
            };
            let dedup = match message.id.as_deref() {
                Some(id) if fits_fifo_id(id) => id.to_owned(),
                Some(id) => sha256_hex(id.as_bytes()),
                None => sha256_hex(&message.payload),
            };
            request = request
                .message_group_id(group)
                .message_deduplication_id(dedup);
        }
        request
            .send()
            .await
            .map(|_| ())
            .map_err(|e| broker_error(&format!("SendMessage to {}", self.queue.name), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = SqsConfig::from_url(
            "sqs://orders?endpoint=http://127.0.0.1:5000&region=eu-west-1&visibility=30&wait=5&dlq=orders-dead&create=true&batch=4",
        )
        .unwrap();
        assert_eq!(c.queue, "orders");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(c.region, "eu-west-1");
        assert_eq!(c.visibility, Duration::from_secs(30));
        assert_eq!(c.wait, Duration::from_secs(5));
        assert_eq!(c.dead_letter_queue.as_deref(), Some("orders-dead"));
        assert!(c.create_queue);
        assert_eq!(c.batch, 4);
        assert!(!c.is_fifo());

        let c =
            SqsConfig::from_url("sqs://jobs.fifo?endpoint=http%3A%2F%2Flocalhost%3A4566").unwrap();
        assert!(c.is_fifo());
        assert_eq!(c.endpoint.as_deref(), Some("http://localhost:4566"));
        assert_eq!(c.visibility, Duration::from_secs(30));
        assert!(!c.create_queue);
    }

    #[test]
    fn rejects_bad_urls() {
        for url in [
            "kafka://orders",
            "sqs://",
            "sqs://bad name",
            "sqs://orders?visibility=0",
            "sqs://orders?visibility=50000",
            "sqs://orders?wait=21",
            "sqs://orders?batch=11",
            "sqs://orders?bogus=1",
            "sqs://orders?create=maybe",
            "sqs://orders?endpoint=127.0.0.1:5000",
            "sqs://orders.fifo?dlq=dead",
            "sqs://orders?visibility=abc",
        ] {
            assert!(
                matches!(SqsConfig::from_url(url), Err(SourceError::Config(_))),
                "{url} should be rejected"
            );
        }
    }

    #[test]
    fn local_endpoints() {
        assert!(is_local_endpoint("http://127.0.0.1:5000"));
        assert!(is_local_endpoint("http://localhost:4566/"));
        assert!(is_local_endpoint("http://[::1]:5000"));
        assert!(!is_local_endpoint("https://sqs.us-east-1.amazonaws.com"));
    }

    #[test]
    fn delays_round_up() {
        assert_eq!(delay_secs(Duration::ZERO), 0);
        assert_eq!(delay_secs(Duration::from_millis(50)), 1);
        assert_eq!(delay_secs(Duration::from_secs(2)), 2);
        assert_eq!(delay_secs(Duration::from_secs(1_000_000)), 43_200);
    }

    #[test]
    fn too_many_attributes_are_refused() {
        let mut message = Message::new("{}").with_id("m").with_key("k");
        for i in 0..8 {
            message = message.with_header(format!("h{i}"), "v");
        }
        assert_eq!(SqsPublisher::attributes(&message).unwrap().len(), 10);
        let message = message.with_header("h8", "v");
        assert!(matches!(
            SqsPublisher::attributes(&message),
            Err(SourceError::Other(_))
        ));
    }

    #[test]
    fn maps_messages() {
        let raw = aws_sdk_sqs::types::Message::builder()
            .message_id("sqs-id")
            .body("{\"a\":1}")
            .attributes(MessageSystemAttributeName::MessageGroupId, "g1")
            .message_attributes("event_id", string_attribute("e-1").unwrap())
            .message_attributes("raw", binary_attribute(&[0xff, 0]).unwrap())
            .build();
        let m = to_message(&raw, true);
        assert_eq!(m.id.as_deref(), Some("sqs-id"));
        assert_eq!(m.key.as_deref(), Some("g1"));
        assert_eq!(m.headers.get("event_id"), Some(&b"e-1"[..]));
        assert_eq!(m.headers.get("raw"), Some(&[0xff, 0][..]));
        assert_eq!(to_message(&raw, false).key, None);
    }
}
