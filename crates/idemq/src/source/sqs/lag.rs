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

use super::queue::QueueRef;
use crate::source::lag::{self, LagGauge, Poller};

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
pub(super) struct LagPoller {
    /// The task, aborted on drop.
    _task: Poller,
}

impl LagPoller {
    /// Starts polling `queue` every `every`; `None` when `every` is zero
    /// (turned off).
    pub(super) fn start(client: Client, queue: QueueRef, every: Duration) -> Option<Self> {
        if every.is_zero() {
            return None;
        }
        Some(Self {
            _task: Poller::spawn(poll(client, queue, every)),
        })
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

/// Reads the backlog every `every` and sets the gauge; a failure leaves
/// the last value in place (logged as [`LagGauge::failed`] says).
async fn poll(client: Client, queue: QueueRef, every: Duration) {
    let mut gauge = LagGauge::new("sqs", "", queue.name.as_str());
    let mut ticks = lag::ticks(every);
    loop {
        ticks.tick().await;
        match read(&client, &queue).await {
            Ok(lag) => {
                gauge.set("", lag);
                gauge.worked();
            }
            Err(e) => gauge.failed(&e),
        }
    }
}
