//! Loss the broker causes: settings that let a broker drop a message
//! before any consumer processed it (a stream's limits discarding its
//! oldest messages, a queue's overflow dropping its head…). idemq's
//! guarantee ends there, so a source reads what it can of them when it
//! connects and, by default, refuses to start on one
//! ([`LossPolicy::Refuse`]), naming the setting, its value and what to set
//! instead; `broker_loss=warn` in the source's URL logs the same at `warn`
//! and runs. What a broker does not let a client read is in
//! `docs/operations.md`, with the recommended value.

use std::fmt;
use std::time::Duration;

use crate::error::SourceError;

/// The shortest retention a source accepts by default (`min_retention=`):
/// a message the broker deletes after less than a day (Kafka `retention.ms`,
/// SQS `MessageRetentionPeriod`, RabbitMQ `message-ttl` and `expires`) is
/// lost to a consumer stopped over a weekend's first night.
pub const DEFAULT_MIN_RETENTION: Duration = Duration::from_secs(86_400);

/// A broker setting that can drop an unprocessed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LossRisk {
    /// Where it is set: `stream ORDERS`, `queue payments`.
    pub place: String,
    /// The setting and its value: `discard=old with max_msgs=1000`.
    pub setting: String,
    /// What it does to a message no consumer processed yet.
    pub effect: String,
    /// What to set instead.
    pub remedy: String,
}

impl fmt::Display for LossRisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {}; {}",
            self.place, self.setting, self.effect, self.remedy
        )
    }
}

/// What a source does when it finds a [`LossRisk`] (`broker_loss=` in its URL).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LossPolicy {
    /// Refuse to start (the default): the error names each risk.
    #[default]
    Refuse,
    /// Log each risk at `warn` and run.
    Warn,
}

impl LossPolicy {
    /// `refuse` or `warn`.
    pub fn parse(text: &str) -> Result<Self, SourceError> {
        match text {
            "refuse" => Ok(Self::Refuse),
            "warn" => Ok(Self::Warn),
            other => Err(SourceError::config(format!(
                "broker_loss must be refuse or warn, not {other:?}"
            ))),
        }
    }

    /// Applies the policy to what a source found: an error naming every
    /// risk (refuse), or a `warn` line per risk (warn).
    pub fn apply(self, source: &str, risks: &[LossRisk]) -> Result<(), SourceError> {
        if risks.is_empty() {
            return Ok(());
        }
        match self {
            Self::Refuse => {
                let list: Vec<String> = risks.iter().map(ToString::to_string).collect();
                Err(SourceError::config(format!(
                    "the {source} broker can drop messages before they are processed: {} (broker_loss=warn in the URL runs anyway)",
                    list.join("; ")
                )))
            }
            Self::Warn => {
                for risk in risks {
                    tracing::warn!(source, place = %risk.place, setting = %risk.setting, remedy = %risk.remedy, "the broker can drop messages before they are processed: {}", risk.effect);
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn risk() -> LossRisk {
        LossRisk {
            place: "stream ORDERS".into(),
            setting: "discard=old with max_msgs=50".into(),
            effect: "deletes the oldest messages, processed or not, once the stream is full".into(),
            remedy: "set discard=new, or no limits".into(),
        }
    }

    #[test]
    fn refusing_names_the_setting_and_the_remedy() {
        let err = LossPolicy::Refuse.apply("nats", &[risk()]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("stream ORDERS: discard=old with max_msgs=50"),
            "{text}"
        );
        assert!(text.contains("set discard=new"), "{text}");
        assert!(text.contains("broker_loss=warn"), "{text}");
        assert!(LossPolicy::Warn.apply("nats", &[risk()]).is_ok());
        assert!(LossPolicy::Refuse.apply("nats", &[]).is_ok());
    }

    #[test]
    fn the_policy_parses_its_two_words_only() {
        assert_eq!(LossPolicy::parse("warn").unwrap(), LossPolicy::Warn);
        assert_eq!(LossPolicy::parse("refuse").unwrap(), LossPolicy::Refuse);
        assert!(LossPolicy::parse("ignore").is_err());
    }
}
