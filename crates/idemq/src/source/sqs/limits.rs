//! What of an SQS queue's attributes can take messages away before idemq
//! processed them ([`LossRisk`]s), read with `GetQueueAttributes` when the
//! source connects:
//!
//! - `MessageRetentionPeriod` under
//!   [`SqsConfig::min_retention`](super::SqsConfig::min_retention) (default
//!   1 day; `0` turns the check off): SQS deletes a message older than the
//!   retention period, received or not. SQS's default is 4 days, its
//!   maximum 14: a `min_retention` above 14 days refuses every queue.
//! - a `RedrivePolicy` whose `maxReceiveCount` is at most idemq's default
//!   retry attempts ([`RetryPolicy::default`]'s `max_attempts`, 5): SQS
//!   moves a message received more than `maxReceiveCount` times to the
//!   queue of its `deadLetterTargetArn`, outside idemq's ledger and its own
//!   dead letters. Each idemq attempt is one receive, so with the default
//!   5 attempts a `maxReceiveCount` of 5 leaves no room for a single
//!   redelivery after a crash or a lapsed visibility timeout: the policy
//!   must be above the attempts. The source does not know the consumer's
//!   own retry policy; a consumer run with a higher `--max-attempts` needs
//!   `maxReceiveCount` above that, which this check cannot see. A redrive
//!   policy above the floor is a last resort for messages idemq itself
//!   keeps failing, and no risk. A `RedrivePolicy` whose `maxReceiveCount`
//!   cannot be read is reported as a risk.
//!
//! Queues the source creates itself (`create=true`) get SQS's defaults
//! (4 days' retention, no redrive policy), which pass.
//!
//! [`RetryPolicy::default`]: crate::RetryPolicy::default

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;

use super::queue::QueueRef;
use crate::source::health::Horizon;
use crate::source::loss::LossRisk;

/// How long reading the queue's attributes may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The queue's `MessageRetentionPeriod` and `RedrivePolicy` (those it
/// has); `None` when they could not be read (refused by the IAM policy, no
/// answer within 10 s), which is logged at `warn` and is no risk: the
/// check is skipped, not failed.
pub(super) async fn read_attributes(
    client: &Client,
    queue: &QueueRef,
) -> Option<HashMap<QueueAttributeName, String>> {
    match try_read_attributes(client, queue).await {
        Ok(attributes) => Some(attributes),
        Err(reason) => {
            tracing::warn!(
                queue = %queue.name,
                %reason,
                "could not read the queue's attributes: whether SQS can remove messages before they are processed (MessageRetentionPeriod, RedrivePolicy) was not checked"
            );
            None
        }
    }
}

/// [`read_attributes`], with the reason when they could not be read.
pub(super) async fn try_read_attributes(
    client: &Client,
    queue: &QueueRef,
) -> Result<HashMap<QueueAttributeName, String>, String> {
    let request = client
        .get_queue_attributes()
        .queue_url(&queue.url)
        .attribute_names(QueueAttributeName::MessageRetentionPeriod)
        .attribute_names(QueueAttributeName::RedrivePolicy);
    match tokio::time::timeout(REQUEST_TIMEOUT, request.send()).await {
        Ok(Ok(answer)) => Ok(answer.attributes().cloned().unwrap_or_default()),
        Ok(Err(e)) => Err(DisplayErrorContext(&e).to_string()),
        Err(_) => Err(format!("no answer within {REQUEST_TIMEOUT:?}")),
    }
}

/// How long the queue keeps a message, received or not
/// ([`crate::source::health`]): its `MessageRetentionPeriod`.
pub(super) fn horizon(queue: &str, attributes: &HashMap<QueueAttributeName, String>) -> Horizon {
    match attributes
        .get(&QueueAttributeName::MessageRetentionPeriod)
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(secs) => Horizon::Bounded {
            limit: Duration::from_secs(secs),
            setting: format!("queue {queue} MessageRetentionPeriod={secs}"),
        },
        None => Horizon::Unknown {
            why: format!("queue {queue} reported no MessageRetentionPeriod (SQS's default is 4d)"),
        },
    }
}

/// The risks in the attributes of `queue` (see the [module docs](self)).
pub(super) fn risks(
    queue: &str,
    attributes: &HashMap<QueueAttributeName, String>,
    min_retention: Duration,
) -> Vec<LossRisk> {
    let place = format!("queue {queue}");
    let mut found = Vec::new();
    let retention = attributes
        .get(&QueueAttributeName::MessageRetentionPeriod)
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(secs) = retention.filter(|s| Duration::from_secs(*s) < min_retention) {
        found.push(LossRisk {
            place: place.clone(),
            setting: format!(
                "MessageRetentionPeriod={secs} (under min_retention {min_retention:?})"
            ),
            effect: "deletes messages older than that, whether or not they were received or processed".into(),
            remedy: "set MessageRetentionPeriod above the longest outage plus catch-up (at most 1209600, 14 days), or lower min_retention in the URL if a consumer can never lag that long".into(),
        });
    }
    let redrive = attributes
        .get(&QueueAttributeName::RedrivePolicy)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    if let Some(policy) = redrive {
        let floor = crate::RetryPolicy::default().max_attempts;
        let parsed = serde_json::from_str::<serde_json::Value>(policy).ok();
        let count = parsed
            .as_ref()
            .and_then(|p| p.get("maxReceiveCount"))
            .and_then(|c| match c {
                serde_json::Value::Number(n) => n.as_u64(),
                serde_json::Value::String(s) => s.trim().parse().ok(),
                _ => None,
            });
        let target = parsed
            .as_ref()
            .and_then(|p| p.get("deadLetterTargetArn"))
            .and_then(serde_json::Value::as_str)
            .map(|arn| arn.rsplit(':').next().unwrap_or(arn).to_owned())
            .unwrap_or_else(|| "?".to_owned());
        let setting = match count {
            Some(n) if n > u64::from(floor) => None,
            Some(n) => Some(format!(
                "RedrivePolicy maxReceiveCount={n} to queue {target} (not above idemq's default max_attempts {floor})"
            )),
            None => Some(format!(
                "RedrivePolicy {policy} (maxReceiveCount unreadable)"
            )),
        };
        if let Some(setting) = setting {
            found.push(LossRisk {
                place,
                setting,
                effect: "moves a message received that many times to the redrive queue, outside idemq's ledger and its own dead letters, before idemq's retries are exhausted".into(),
                remedy: "consume the redrive queue too, or raise maxReceiveCount above idemq's --max-attempts (and above the consumer's own max_attempts if it sets one)".into(),
            });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn attributes(pairs: &[(QueueAttributeName, &str)]) -> HashMap<QueueAttributeName, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), (*v).to_owned()))
            .collect()
    }

    fn settings(found: &[LossRisk]) -> Vec<&str> {
        found.iter().map(|r| r.setting.as_str()).collect()
    }

    #[test]
    fn sqs_defaults_are_no_risk() {
        let defaults = attributes(&[(QueueAttributeName::MessageRetentionPeriod, "345600")]);
        assert!(risks("payments", &defaults, DAY).is_empty());
        assert!(risks("payments", &HashMap::new(), DAY).is_empty());
        let empty_redrive = attributes(&[(QueueAttributeName::RedrivePolicy, "")]);
        assert!(risks("payments", &empty_redrive, DAY).is_empty());
    }

    #[test]
    fn retention_under_min_retention_is_a_risk() {
        let minute = attributes(&[(QueueAttributeName::MessageRetentionPeriod, "60")]);
        let found = risks("payments", &minute, DAY);
        assert_eq!(
            settings(&found),
            ["MessageRetentionPeriod=60 (under min_retention 86400s)"]
        );
        assert_eq!(found[0].place, "queue payments");
        // Just at the floor is enough; min_retention=0 turns the check off.
        let day = attributes(&[(QueueAttributeName::MessageRetentionPeriod, "86400")]);
        assert!(risks("payments", &day, DAY).is_empty());
        assert!(risks("payments", &minute, Duration::from_secs(60)).is_empty());
        assert!(risks("payments", &minute, Duration::ZERO).is_empty());
        assert_eq!(
            risks("payments", &minute, Duration::from_millis(60_500)).len(),
            1
        );
    }

    #[test]
    fn a_redrive_policy_at_or_under_the_default_attempts_is_a_risk() {
        let arn = "arn:aws:sqs:us-east-1:123456789012:payments-redrive";
        let policy = |count: &str| {
            attributes(&[(
                QueueAttributeName::RedrivePolicy,
                &format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":{count}}}"#),
            )])
        };
        // AWS writes the count as a string, moto as a number.
        let found = risks("payments", &policy("\"1\""), DAY);
        assert_eq!(
            settings(&found),
            ["RedrivePolicy maxReceiveCount=1 to queue payments-redrive (not above idemq's default max_attempts 5)"]
        );
        assert!(found[0].remedy.contains("consume the redrive queue too"));
        assert_eq!(risks("payments", &policy("5"), DAY).len(), 1);
        assert!(risks("payments", &policy("6"), DAY).is_empty());
        assert!(risks("payments", &policy("\"10\""), DAY).is_empty());
        let garbled = attributes(&[(QueueAttributeName::RedrivePolicy, "{not json")]);
        assert_eq!(
            settings(&risks("payments", &garbled, DAY)),
            ["RedrivePolicy {not json (maxReceiveCount unreadable)"]
        );
        // Both at once.
        let mut both = policy("2");
        both.insert(QueueAttributeName::MessageRetentionPeriod, "3600".into());
        assert_eq!(risks("payments", &both, DAY).len(), 2);
    }
}
