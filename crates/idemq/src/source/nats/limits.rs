//! What of a JetStream stream's configuration can drop messages no
//! consumer processed ([`LossRisk`]s), read when the source connects.

use async_nats::jetstream::stream::{Config, DiscardPolicy};

use crate::source::health::Horizon;
use crate::source::loss::LossRisk;

/// The consumer's `max_deliver` from 1 to idemq's default retry attempts
/// ([`crate::RetryPolicy::default`]'s `max_attempts`, 5): after that many
/// deliveries JetStream stops delivering a message to the consumer (it
/// stays in the stream, never processed), before idemq's own retries are
/// done. `-1` (or `0`) is unlimited.
pub(super) fn consumer_risks(consumer: &str, max_deliver: i64) -> Vec<LossRisk> {
    let floor = i64::from(crate::RetryPolicy::default().max_attempts);
    if !(1..=floor).contains(&max_deliver) {
        return Vec::new();
    }
    vec![LossRisk {
        place: format!("consumer {consumer}"),
        setting: format!("max_deliver={max_deliver} (not above idemq's default max_attempts {floor})"),
        effect: "stops delivering a message after that many deliveries (a consumer killed mid-message counts), before idemq's retries are done: it stays in the stream, never processed".into(),
        remedy: "set max_deliver above idemq's --max-attempts (and the consumer's own max_attempts), or -1".into(),
    }]
}

/// How long the stream keeps a message, consumed or not
/// ([`crate::source::health`]): its `max_age`, unbounded without one.
pub(super) fn horizon(stream: &Config) -> Horizon {
    if stream.max_age.is_zero() {
        Horizon::Unbounded {
            why: format!("stream {} has no max_age", stream.name),
        }
    } else {
        Horizon::Bounded {
            limit: stream.max_age,
            setting: format!("stream {} max_age={:?}", stream.name, stream.max_age),
        }
    }
}

/// The stream's limits with `discard: old`: once one is reached, JetStream
/// deletes the oldest messages whether or not this consumer processed them.
/// (`discard: new` refuses the publish instead: the producer sees the
/// error, nothing is dropped silently.)
pub(super) fn risks(stream: &Config) -> Vec<LossRisk> {
    if stream.discard != DiscardPolicy::Old {
        return Vec::new();
    }
    let mut limits = Vec::new();
    if stream.max_messages > 0 {
        limits.push(format!("max_msgs={}", stream.max_messages));
    }
    if stream.max_bytes > 0 {
        limits.push(format!("max_bytes={}", stream.max_bytes));
    }
    if !stream.max_age.is_zero() {
        limits.push(format!("max_age={:?}", stream.max_age));
    }
    if stream.max_messages_per_subject > 0 {
        limits.push(format!(
            "max_msgs_per_subject={}",
            stream.max_messages_per_subject
        ));
    }
    if limits.is_empty() {
        return Vec::new();
    }
    vec![LossRisk {
        place: format!("stream {}", stream.name),
        setting: format!("discard=old with {}", limits.join(", ")),
        effect: "deletes the oldest messages once a limit is reached, processed or not".into(),
        remedy: "set discard=new (a full stream then refuses publishes, which producers see), or limits the consumer's lag can never reach".into(),
    }]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn stream() -> Config {
        Config {
            name: "ORDERS".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_low_max_deliver_is_a_risk_and_unlimited_is_not() {
        assert_eq!(
            consumer_risks("c", 3)[0].setting,
            "max_deliver=3 (not above idemq's default max_attempts 5)"
        );
        assert!(consumer_risks("c", 6).is_empty());
        assert!(consumer_risks("c", -1).is_empty());
        assert!(consumer_risks("c", 0).is_empty());
    }

    #[test]
    fn limits_with_discard_old_are_a_risk_and_without_limits_or_with_discard_new_are_not() {
        assert!(risks(&stream()).is_empty());
        let limited = Config {
            max_messages: 50,
            max_age: Duration::from_secs(60),
            ..stream()
        };
        let found = risks(&limited);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].place, "stream ORDERS");
        assert_eq!(
            found[0].setting,
            "discard=old with max_msgs=50, max_age=60s"
        );
        let refusing = Config {
            discard: DiscardPolicy::New,
            ..limited
        };
        assert!(risks(&refusing).is_empty());
    }
}
