//! What of the RocketMQ source's own settings can take a message away
//! before idemq processed it ([`LossRisk`]s), checked before it connects:
//!
//! - `max_reconsume_times` not above idemq's default retry attempts
//!   ([`RetryPolicy::default`]'s `max_attempts`, 5): after that many
//!   retries the broker moves a message to its `%DLQ%<group>` topic,
//!   outside idemq's ledger and its own dead letters, before idemq's own
//!   retries are done. The source does not see the consumer's retry
//!   policy; a consumer run with a higher `--max-attempts` needs
//!   `max_reconsume_times` above that.
//! - `start_from=latest`: a group without a committed offset (a new group,
//!   or one whose offsets the broker dropped) starts at the end of each
//!   queue, skipping every message published before.
//!
//! The broker's own retention (`fileReservedTime`, 72 h by default: commit
//! log files older than that are deleted at `deleteWhen`, or sooner when
//! the disk passes `diskMaxUsedSpaceRatio`) is the source's redelivery
//! horizon, read from the brokers (the `admin` module), not a risk here.
//!
//! [`RetryPolicy::default`]: crate::RetryPolicy::default

use super::config::{RocketMqConfig, StartFrom};
use crate::source::loss::LossRisk;

/// The risks in `config` (see the [module docs](self)).
pub(super) fn risks(config: &RocketMqConfig) -> Vec<LossRisk> {
    let place = format!("consumer group {} on topic {}", config.group, config.topic);
    let mut found = Vec::new();
    let floor = crate::RetryPolicy::default().max_attempts;
    if i64::from(config.max_reconsume_times) <= i64::from(floor) {
        found.push(LossRisk {
            place: place.clone(),
            setting: format!(
                "max_reconsume_times={} (not above idemq's default max_attempts {floor})",
                config.max_reconsume_times
            ),
            effect: format!(
                "moves a message retried that many times to %DLQ%{}, outside idemq's ledger and its own dead letters, before idemq's retries are done",
                config.group
            ),
            remedy: "raise max_reconsume_times above idemq's --max-attempts (the default, 16, is), or consume the %DLQ% topic too".into(),
        });
    }
    if config.start_from == StartFrom::Latest {
        found.push(LossRisk {
            place,
            setting: "start_from=latest".into(),
            effect: "starts a queue without a committed offset (a new group, offsets the broker dropped) at its end, skipping every message published before".into(),
            remedy: "set start_from=earliest (idemq's default)".into(),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(config: &RocketMqConfig) -> Vec<String> {
        risks(config).into_iter().map(|r| r.setting).collect()
    }

    #[test]
    fn the_defaults_are_no_risk() {
        let config = RocketMqConfig::new("127.0.0.1:9876", "payments", "billing");
        assert!(risks(&config).is_empty());
    }

    #[test]
    fn few_reconsumes_and_starting_at_the_end_are_risks() {
        let config = RocketMqConfig::new("127.0.0.1:9876", "payments", "billing")
            .max_reconsume_times(5)
            .start_from(StartFrom::Latest);
        assert_eq!(
            settings(&config),
            [
                "max_reconsume_times=5 (not above idemq's default max_attempts 5)",
                "start_from=latest"
            ]
        );
        let enough =
            RocketMqConfig::new("127.0.0.1:9876", "payments", "billing").max_reconsume_times(6);
        assert!(risks(&enough).is_empty());
    }
}
