//! The queue's backlog: `GetQueueAttributes`, polled in the background into
//! the gauge `idemq_source_lag_messages`.
//!
//! The value is the messages not deleted (acknowledged) yet, as Kafka's lag
//! counts from the committed offset: `ApproximateNumberOfMessages`
//! (visible, waiting to be received) plus
//! `ApproximateNumberOfMessagesNotVisible` (received and not deleted yet,
//! or waiting out a retry delay). Messages sent with a delay that is not
//! over (`ApproximateNumberOfMessagesDelayed`) are not counted: idemq never
//! sends with one. SQS calls these numbers approximate, and the two are
//! not read at one instant: a message received while they are read can be
//! counted in both (a receive batch at most). Labels: `source="sqs"`,
//! `group` empty (a queue has no consumer group), `topic` the queue name,
//! `partition` empty.

use std::time::Duration;

use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;
use tokio::task::JoinHandle;

use super::queue::QueueRef;

/// How often the backlog is read unless the URL says otherwise (`lag_interval=`).
pub(super) const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How long one `GetQueueAttributes` may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);
/// The attributes that add up to the backlog.
const COUNTED: [QueueAttributeName; 2] = [
    QueueAttributeName::ApproximateNumberOfMessages,
    QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
];

/// The background task that reads the queue's backlog every interval; it
/// stops when this is dropped (with the source).
pub(super) struct LagPoller(JoinHandle<()>);

impl LagPoller {
    /// Starts polling `queue` every `every`; `None` when `every` is zero
    /// (turned off).
    pub(super) fn start(client: Client, queue: QueueRef, every: Duration) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self(tokio::spawn(poll(client, queue, every))))
    }
}

impl Drop for LagPoller {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One `GetQueueAttributes`: the sum of the [`COUNTED`] attributes.
async fn read(client: &Client, queue: &QueueRef) -> Result<u64, String> {
    let mut request = client.get_queue_attributes().queue_url(&queue.url);
    for name in COUNTED {
        request = request.attribute_names(name);
    }
    let answer = match tokio::time::timeout(REQUEST_TIMEOUT, request.send()).await {
        Ok(answer) => answer.map_err(|e| DisplayErrorContext(&e).to_string())?,
        Err(_) => return Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    };
    let attributes = answer
        .attributes()
        .ok_or_else(|| "the answer has no attributes".to_owned())?;
    // An attribute left out counts as 0 (an endpoint that does not know
    // it), but the visible messages must be there.
    if !attributes.contains_key(&COUNTED[0]) {
        return Err(format!("the answer has no {}", COUNTED[0].as_str()));
    }
    let mut total: u64 = 0;
    for name in COUNTED {
        let Some(value) = attributes.get(&name) else {
            continue;
        };
        let n: u64 = value
            .parse()
            .map_err(|_| format!("{} is {value:?}, not a count", name.as_str()))?;
        total = total.saturating_add(n);
    }
    Ok(total)
}

/// Reads the backlog every `every` and sets the gauge. A failure is logged
/// at `warn` once, then at `debug` until a reading succeeds again, and
/// leaves the last value in place.
async fn poll(client: Client, queue: QueueRef, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        ticks.tick().await;
        match read(&client, &queue).await {
            Ok(lag) => {
                // Looked up at each reading: a recorder installed after the
                // source connected still gets it.
                metrics::gauge!(
                    "idemq_source_lag_messages",
                    "source" => "sqs",
                    "group" => "",
                    "topic" => queue.name.clone(),
                    "partition" => ""
                )
                .set(lag as f64);
                if failing {
                    tracing::debug!(queue = %queue.name, "reading the SQS queue backlog works again");
                }
                failing = false;
            }
            Err(e) if failing => {
                tracing::debug!(queue = %queue.name, error = %e, "reading the SQS queue backlog failed");
            }
            Err(e) => {
                tracing::warn!(queue = %queue.name, error = %e, "reading the SQS queue backlog failed; idemq_source_lag_messages keeps its last value");
                failing = true;
            }
        }
    }
}
