//! What of a topic's configuration, and of the source's own, can lose
//! records the group never processed ([`LossRisk`]s), read when the source
//! connects: compaction, retention by size, retention by time under
//! [`KafkaConfig::min_retention`], and `auto.offset.reset=latest`.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;

use super::KafkaConfig;
use crate::source::health::Horizon;
use crate::source::loss::LossRisk;

/// How long reading the topic's configuration may take.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The topic's configuration (setting name → value) as the cluster
/// describes it; `None` when it could not be read (describing refused by
/// the ACLs, no answer within 10 s), which is logged at `warn` and is no
/// risk: the check is skipped, not failed.
pub(super) async fn describe_topic(config: &KafkaConfig) -> Option<BTreeMap<String, String>> {
    match try_describe(config).await {
        Ok(values) => Some(values),
        Err(reason) => {
            tracing::warn!(
                topic = %config.topic,
                %reason,
                "could not read the topic's configuration: whether the broker can delete records before they are processed (retention, compaction) was not checked"
            );
            None
        }
    }
}

/// [`describe_topic`], with the reason when the configuration could not be read.
pub(super) async fn try_describe(config: &KafkaConfig) -> Result<BTreeMap<String, String>, String> {
    let admin: AdminClient<DefaultClientContext> = config
        .connection()
        .create()
        .map_err(|e| format!("kafka admin client: {e}"))?;
    let options = AdminOptions::new().request_timeout(Some(DESCRIBE_TIMEOUT));
    let topic = ResourceSpecifier::Topic(&config.topic);
    let described = tokio::time::timeout(
        DESCRIBE_TIMEOUT + Duration::from_secs(1),
        admin.describe_configs([&topic], &options),
    )
    .await
    .map_err(|_| format!("no answer within {DESCRIBE_TIMEOUT:?}"))?
    .map_err(|e| e.to_string())?;
    match described.into_iter().next() {
        Some(Ok(resource)) => Ok(resource
            .entries
            .into_iter()
            .filter_map(|entry| Some((entry.name, entry.value?)))
            .collect()),
        Some(Err(code)) => Err(code.to_string()),
        None => Err("the cluster described no configuration".into()),
    }
}

/// The risks of consuming `config.topic`, whose configuration is
/// `described` (`None`: it could not be read; only the source's own
/// settings are checked then):
///
/// - `cleanup.policy` with `compact`: the log cleaner removes older records
///   of a key once a newer one is written, read or not;
/// - with `delete` in `cleanup.policy` (Kafka's default): `retention.bytes`
///   above 0, and `retention.ms` from 0 to under [`KafkaConfig::min_retention`]
///   (`-1` is unlimited; a `min_retention` of 0 turns this check off);
/// - the consumer's effective `auto.offset.reset` (a `auto.offset.reset`
///   setting overrides [`KafkaConfig::auto_offset_reset`]) being `latest`
///   (or librdkafka's synonyms `largest`, `end`).
pub(super) fn risks(
    config: &KafkaConfig,
    described: Option<&BTreeMap<String, String>>,
) -> Vec<LossRisk> {
    let mut found = match described {
        Some(values) => topic_risks(&config.topic, values, config.min_retention),
        None => Vec::new(),
    };
    found.extend(offset_reset_risk(config));
    found
}

/// How long the topic keeps a record, read or not (see
/// [`crate::source::health`]): `retention.ms` of a `delete` topic;
/// unbounded for `-1` and for a topic that is only compacted (the latest
/// record of each key stays).
pub(super) fn horizon(topic: &str, values: &BTreeMap<String, String>) -> Horizon {
    let policy = values
        .get("cleanup.policy")
        .map(String::as_str)
        .unwrap_or("delete");
    if !policy.split(',').any(|p| p.trim() == "delete") {
        return Horizon::Unbounded {
            why: format!("topic {topic} cleanup.policy={policy}: the latest record of a key stays"),
        };
    }
    match values
        .get("retention.ms")
        .and_then(|v| v.trim().parse::<i64>().ok())
    {
        Some(ms) if ms >= 0 => Horizon::Bounded {
            limit: Duration::from_millis(ms.unsigned_abs()),
            setting: format!("topic {topic} retention.ms={ms}"),
        },
        Some(ms) => Horizon::Unbounded {
            why: format!("topic {topic} retention.ms={ms}"),
        },
        None => Horizon::Unknown {
            why: format!("topic {topic} described no retention.ms (the broker's default is 7d)"),
        },
    }
}

/// The risks in a topic's configuration `values`.
fn topic_risks(
    topic: &str,
    values: &BTreeMap<String, String>,
    min_retention: Duration,
) -> Vec<LossRisk> {
    let place = format!("topic {topic}");
    let policy = values
        .get("cleanup.policy")
        .map(String::as_str)
        .unwrap_or("delete");
    let has = |word: &str| policy.split(',').any(|p| p.trim() == word);
    let number = |name: &str| values.get(name).and_then(|v| v.trim().parse::<i64>().ok());
    let mut found = Vec::new();
    if has("compact") {
        found.push(LossRisk {
            place: place.clone(),
            setting: format!("cleanup.policy={policy}"),
            effect: "removes older records of a key once a newer one is written, whether or not this group read them (a lagging consumer sees only the latest record of each key)".into(),
            remedy: "set cleanup.policy=delete for a topic consumed as a stream of events".into(),
        });
    }
    if !has("delete") {
        return found;
    }
    if let Some(bytes) = number("retention.bytes").filter(|b| *b > 0) {
        found.push(LossRisk {
            place: place.clone(),
            setting: format!("retention.bytes={bytes}"),
            effect: "deletes a partition's oldest segments once it holds more than that, whether or not this group read them".into(),
            remedy: "set retention.bytes=-1 and retain by time (retention.ms) above the longest outage plus catch-up".into(),
        });
    }
    let floor = i64::try_from(min_retention.as_millis()).unwrap_or(i64::MAX);
    if let Some(ms) = number("retention.ms").filter(|ms| (0..floor).contains(ms)) {
        found.push(LossRisk {
            place,
            setting: format!(
                "retention.ms={ms} (under min_retention {:?})",
                min_retention
            ),
            effect: "deletes records older than that whether or not this group read them".into(),
            remedy: "set retention.ms above the longest outage plus catch-up (-1: unlimited), or lower min_retention in the URL if a consumer can never lag that long".into(),
        });
    }
    found
}

/// `auto.offset.reset=latest` (or a synonym) as the consumer applies it.
fn offset_reset_risk(config: &KafkaConfig) -> Option<LossRisk> {
    let reset = config
        .settings
        .iter()
        .rev()
        .find(|(name, _)| name == "auto.offset.reset")
        .map_or(config.auto_offset_reset.as_str(), |(_, value)| {
            value.as_str()
        });
    if !matches!(reset, "latest" | "largest" | "end") {
        return None;
    }
    Some(LossRisk {
        place: format!("consumer group {}", config.group),
        setting: format!("auto.offset.reset={reset}"),
        effect: "starts a partition without a committed offset (a new group, expired offsets, a committed offset retention deleted past) at its end, skipping every record published before".into(),
        remedy: "set offset_reset=earliest in the URL (idemq's default)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn config() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "payments", "billing")
    }

    fn settings(found: &[LossRisk]) -> Vec<&str> {
        found.iter().map(|r| r.setting.as_str()).collect()
    }

    #[test]
    fn kafkas_defaults_are_no_risk() {
        let defaults = values(&[
            ("cleanup.policy", "delete"),
            ("retention.ms", "604800000"),
            ("retention.bytes", "-1"),
            ("segment.ms", "604800000"),
        ]);
        assert!(risks(&config(), Some(&defaults)).is_empty());
        assert!(risks(&config(), Some(&values(&[("retention.ms", "-1")]))).is_empty());
        assert!(risks(&config(), None).is_empty());
    }

    #[test]
    fn short_retention_by_time_or_any_by_size_is_a_risk() {
        let found = risks(
            &config(),
            Some(&values(&[
                ("cleanup.policy", "delete"),
                ("retention.ms", "1000"),
                ("retention.bytes", "1048576"),
            ])),
        );
        assert_eq!(
            settings(&found),
            [
                "retention.bytes=1048576",
                "retention.ms=1000 (under min_retention 86400s)"
            ]
        );
        assert!(found.iter().all(|r| r.place == "topic payments"));
        // retention.ms=0 deletes at once: the worst of all.
        assert_eq!(
            risks(&config(), Some(&values(&[("retention.ms", "0")]))).len(),
            1
        );
        // Just at the floor is enough; min_retention=0 turns the check off.
        let day = values(&[("retention.ms", "86400000")]);
        assert!(risks(&config(), Some(&day)).is_empty());
        let hour = values(&[("retention.ms", "3600000")]);
        assert_eq!(risks(&config(), Some(&hour)).len(), 1);
        let relaxed = config().min_retention(Duration::from_secs(60));
        assert!(risks(&relaxed, Some(&hour)).is_empty());
        let off = config().min_retention(Duration::ZERO);
        assert!(risks(&off, Some(&values(&[("retention.ms", "0")]))).is_empty());
    }

    #[test]
    fn compaction_is_a_risk_and_retention_applies_only_with_delete() {
        let compact = values(&[
            ("cleanup.policy", "compact"),
            ("retention.ms", "1000"),
            ("retention.bytes", "10"),
        ]);
        assert_eq!(
            settings(&risks(&config(), Some(&compact))),
            ["cleanup.policy=compact"]
        );
        let both = values(&[
            ("cleanup.policy", "compact,delete"),
            ("retention.ms", "1000"),
        ]);
        assert_eq!(
            settings(&risks(&config(), Some(&both))),
            [
                "cleanup.policy=compact,delete",
                "retention.ms=1000 (under min_retention 86400s)"
            ]
        );
        // An empty policy removes nothing.
        let none = values(&[("cleanup.policy", ""), ("retention.ms", "1000")]);
        assert!(risks(&config(), Some(&none)).is_empty());
    }

    #[test]
    fn starting_new_groups_at_the_end_is_a_risk_whoever_sets_it() {
        let mut latest = config();
        latest.auto_offset_reset = "latest".into();
        let found = risks(&latest, None);
        assert_eq!(settings(&found), ["auto.offset.reset=latest"]);
        assert_eq!(found[0].place, "consumer group billing");
        // The librdkafka setting, applied last, is what the consumer uses.
        let overridden = config().set("auto.offset.reset", "largest");
        assert_eq!(
            settings(&risks(&overridden, None)),
            ["auto.offset.reset=largest"]
        );
        let back = latest.set("auto.offset.reset", "earliest");
        assert!(risks(&back, None).is_empty());
        let erroring = config().set("auto.offset.reset", "error");
        assert!(risks(&erroring, None).is_empty());
    }
}
