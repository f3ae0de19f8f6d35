//! What of a queue's arguments and policies can drop messages before idemq
//! processed them ([`LossRisk`]s). The settings come from three places, all
//! read through RabbitMQ's management API when the source connects
//! ([`super::management`]): the queue's own `x-` arguments, the user policy
//! that applies to it (the matching one of highest priority) and the
//! operator policy that applies to it. Where a limit is set in more than
//! one place the lowest value counts, as RabbitMQ applies it; `overflow` and
//! `dead-letter-exchange` are taken from the argument first, then the
//! policy. The risks:
//!
//! - `max-length` or `max-length-bytes` with `overflow` `drop-head` (the
//!   default): a full queue discards its oldest messages, processed or not.
//!   `reject-publish` (or `reject-publish-dlx`) refuses the publish
//!   instead, which a publisher with confirms sees, and is no risk.
//! - `message-ttl` under `min_retention`: a message waiting that long is
//!   discarded (or dead-lettered to another exchange, outside idemq's
//!   ledger).
//! - `expires` under `min_retention`: the queue itself is deleted, with
//!   every message in it, once it has had no consumer that long.
//! - `delivery-limit` (quorum queues) not above idemq's default
//!   `max_attempts` (5): a message returned that many times (a consumer
//!   killed mid-message counts) is dropped or dead-lettered by the broker
//!   before idemq's own retries are done.
//!
//! idemq's own retry queues (`<queue>.retry.<ms>ms`) carry a
//! `message-ttl` with a dead-letter route back to the work queue by design
//! and are not checked; the work queue and `<queue>.dead-letter` are.

use std::time::Duration;

use serde_json::{Map, Value};

use crate::source::health::Horizon;
use crate::source::loss::LossRisk;

/// A policy as the management API lists it (`/api/policies/{vhost}`,
/// `/api/operator-policies/{vhost}`).
#[derive(Debug, Clone, serde::Deserialize)]
pub(super) struct Policy {
    pub(super) name: String,
    pub(super) pattern: String,
    #[serde(rename = "apply-to", default = "all")]
    pub(super) apply_to: String,
    #[serde(default)]
    pub(super) definition: Map<String, Value>,
    #[serde(default)]
    pub(super) priority: i64,
}

fn all() -> String {
    "all".into()
}

/// What the management API says of one queue and the policies of its vhost.
#[derive(Debug, Clone, Default)]
pub(super) struct QueueSettings {
    /// The queue's name.
    pub(super) name: String,
    /// `classic`, `quorum`, `stream`.
    pub(super) kind: String,
    /// The queue's `x-` arguments.
    pub(super) arguments: Map<String, Value>,
    /// The definition RabbitMQ reports as in effect for the queue (its
    /// statistics lag a few seconds behind a policy change).
    pub(super) effective: Map<String, Value>,
    /// The vhost's user policies, when the user may list them.
    pub(super) policies: Vec<Policy>,
    /// The vhost's operator policies, when the user may list them.
    pub(super) operator_policies: Vec<Policy>,
}

/// One setting's value and where it was set.
struct Found<T> {
    value: T,
    origin: String,
}

impl QueueSettings {
    /// The definitions that apply to the queue, argument first: (origin,
    /// definition with keys as policies spell them, without `x-`).
    fn layers(&self) -> Vec<(String, Map<String, Value>)> {
        let mut layers = Vec::new();
        let arguments: Map<String, Value> = self
            .arguments
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("x-").map(|k| (k.to_owned(), v.clone())))
            .collect();
        layers.push(("argument".to_owned(), arguments));
        for (what, policies) in [
            ("policy", &self.policies),
            ("operator policy", &self.operator_policies),
        ] {
            for policy in applying(policies, &self.name, &self.kind) {
                layers.push((
                    format!("{what} {:?}", policy.name),
                    policy.definition.clone(),
                ));
            }
        }
        layers.push(("effective policy".to_owned(), self.effective.clone()));
        layers
    }

    /// The lowest value of the numeric setting `key` over every layer.
    fn lowest(&self, key: &str) -> Option<Found<u64>> {
        self.layers()
            .into_iter()
            .filter_map(|(origin, def)| {
                let value = def.get(key).and_then(number)?;
                Some(Found { value, origin })
            })
            .min_by_key(|f| f.value)
    }

    /// The first layer's value of the text setting `key` (argument first).
    fn first(&self, key: &str) -> Option<Found<String>> {
        self.layers().into_iter().find_map(|(origin, def)| {
            let value = def.get(key)?.as_str()?.to_owned();
            Some(Found { value, origin })
        })
    }
}

/// The policies of highest priority among those that match `queue` (one
/// applies; on a tie every tied one is kept, the stricter counting).
fn applying<'a>(policies: &'a [Policy], queue: &str, kind: &str) -> Vec<&'a Policy> {
    let matching: Vec<&Policy> = policies
        .iter()
        .filter(|p| applies_to(&p.apply_to, kind) && matches(&p.pattern, queue))
        .collect();
    let Some(top) = matching.iter().map(|p| p.priority).max() else {
        return Vec::new();
    };
    matching.into_iter().filter(|p| p.priority == top).collect()
}

fn applies_to(apply_to: &str, kind: &str) -> bool {
    match apply_to {
        "all" | "queues" => true,
        "classic_queues" => kind == "classic",
        "quorum_queues" => kind == "quorum",
        "streams" => kind == "stream",
        _ => false,
    }
}

/// Whether the policy pattern (a regular expression, unanchored as
/// RabbitMQ's) matches `queue`. A pattern this crate's regex engine cannot
/// compile counts as matching: its policy is checked rather than ignored.
fn matches(pattern: &str, queue: &str) -> bool {
    match regex::Regex::new(pattern) {
        Ok(re) => re.is_match(queue),
        Err(_) => true,
    }
}

fn number(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

fn millis(ms: u64) -> String {
    format!("{:?}", Duration::from_millis(ms))
}

/// How long the queue keeps a message ([`crate::source::health`]): its
/// lowest `message-ttl`, unbounded without one (a message stays until it
/// is acknowledged).
pub(super) fn horizon(queue: &QueueSettings) -> Horizon {
    match queue.lowest("message-ttl") {
        Some(ttl) => Horizon::Bounded {
            limit: Duration::from_millis(ttl.value),
            setting: format!(
                "queue {} message-ttl={} ({})",
                queue.name, ttl.value, ttl.origin
            ),
        },
        None => Horizon::Unbounded {
            why: format!(
                "queue {} has no message-ttl: a message stays until it is acknowledged",
                queue.name
            ),
        },
    }
}

/// The risks of one queue (see the [module docs](self)).
pub(super) fn risks(queue: &QueueSettings, min_retention: Duration) -> Vec<LossRisk> {
    let place = format!("queue {}", queue.name);
    let mut found = Vec::new();
    let limits: Vec<Found<u64>> = ["max-length", "max-length-bytes"]
        .iter()
        .filter_map(|key| {
            queue.lowest(key).map(|f| Found {
                value: f.value,
                origin: format!("{key}={} ({})", f.value, f.origin),
            })
        })
        .collect();
    if !limits.is_empty() {
        let overflow = queue.first("overflow");
        let drops_head = overflow.as_ref().is_none_or(|o| o.value == "drop-head");
        if drops_head {
            let how = match &overflow {
                Some(o) => format!("overflow=drop-head ({})", o.origin),
                None => "overflow unset (drop-head)".to_owned(),
            };
            let limits: Vec<String> = limits.into_iter().map(|f| f.origin).collect();
            found.push(LossRisk {
                place: place.clone(),
                setting: format!("{} with {how}", limits.join(", ")),
                effect: "discards the oldest messages once the queue is full, processed or not"
                    .into(),
                remedy: "set overflow=reject-publish (a full queue then refuses publishes, which publishers with confirms see), or remove the limit".into(),
            });
        }
    }
    let floor_ms = u64::try_from(min_retention.as_millis()).unwrap_or(u64::MAX);
    if let Some(ttl) = queue.lowest("message-ttl").filter(|f| f.value < floor_ms) {
        let effect = match queue.first("dead-letter-exchange") {
            Some(dlx) => format!(
                "moves a message that waited that long to exchange {:?}, outside idemq's ledger and its own dead letters",
                dlx.value
            ),
            None => "discards a message that waited that long, processed or not".to_owned(),
        };
        found.push(LossRisk {
            place: place.clone(),
            setting: format!(
                "message-ttl={} ({}) under min_retention {min_retention:?}",
                millis(ttl.value),
                ttl.origin
            ),
            effect,
            remedy: "remove the message TTL, or set it above the longest outage plus catch-up (or lower min_retention in the URL if a consumer can never lag that long)".into(),
        });
    }
    if let Some(expires) = queue.lowest("expires").filter(|f| f.value < floor_ms) {
        found.push(LossRisk {
            place: place.clone(),
            setting: format!(
                "expires={} ({}) under min_retention {min_retention:?}",
                millis(expires.value),
                expires.origin
            ),
            effect:
                "deletes the queue, with every message in it, once it had no consumer that long"
                    .into(),
            remedy: "remove the queue expiry, or set it above the longest outage".into(),
        });
    }
    let floor = u64::from(crate::RetryPolicy::default().max_attempts);
    if let Some(limit) = queue.lowest("delivery-limit").filter(|f| f.value <= floor) {
        found.push(LossRisk {
            place,
            setting: format!(
                "delivery-limit={} ({}) not above idemq's default max_attempts {floor}",
                limit.value, limit.origin
            ),
            effect: "drops (or dead-letters elsewhere) a message returned that many times, a consumer killed mid-message included, before idemq's retries are done".into(),
            remedy: "raise delivery-limit above idemq's --max-attempts (and the consumer's own max_attempts), or remove it".into(),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }

    fn queue(arguments: Value) -> QueueSettings {
        QueueSettings {
            name: "payments".into(),
            kind: "classic".into(),
            arguments: object(arguments),
            ..QueueSettings::default()
        }
    }

    fn policy(name: &str, pattern: &str, priority: i64, definition: Value) -> Policy {
        Policy {
            name: name.into(),
            pattern: pattern.into(),
            apply_to: "queues".into(),
            definition: object(definition),
            priority,
        }
    }

    fn settings(found: &[LossRisk]) -> Vec<&str> {
        found.iter().map(|r| r.setting.as_str()).collect()
    }

    #[test]
    fn a_plain_queue_is_no_risk() {
        assert!(risks(&queue(json!({})), DAY).is_empty());
        let quorum = QueueSettings {
            kind: "quorum".into(),
            ..queue(json!({"x-queue-type": "quorum"}))
        };
        assert!(risks(&quorum, DAY).is_empty());
    }

    #[test]
    fn a_length_limit_drops_the_head_unless_it_rejects_publishes() {
        let limited = queue(json!({"x-max-length": 5}));
        assert_eq!(
            settings(&risks(&limited, DAY)),
            ["max-length=5 (argument) with overflow unset (drop-head)"]
        );
        let rejecting = queue(json!({"x-max-length-bytes": 1000, "x-overflow": "reject-publish"}));
        assert!(risks(&rejecting, DAY).is_empty());
        let mut by_policy = queue(json!({}));
        by_policy.policies = vec![policy(
            "cap",
            "^pay",
            0,
            json!({"max-length": 10, "overflow": "drop-head"}),
        )];
        assert_eq!(
            settings(&risks(&by_policy, DAY)),
            ["max-length=10 (policy \"cap\") with overflow=drop-head (policy \"cap\")"]
        );
    }

    #[test]
    fn the_lowest_limit_counts_and_the_argument_overflow_wins() {
        let mut q = queue(json!({"x-max-length": 100, "x-overflow": "reject-publish"}));
        q.policies = vec![policy("cap", ".*", 0, json!({"max-length": 10}))];
        assert!(risks(&q, DAY).is_empty(), "the argument's overflow applies");
        let mut q = queue(json!({"x-max-length": 100}));
        q.operator_policies = vec![policy("ops", ".*", 0, json!({"max-length": 7}))];
        assert_eq!(
            settings(&risks(&q, DAY)),
            ["max-length=7 (operator policy \"ops\") with overflow unset (drop-head)"]
        );
    }

    #[test]
    fn only_the_highest_priority_matching_policy_of_the_right_kind_applies() {
        let mut q = queue(json!({}));
        q.policies = vec![
            policy("low", ".*", 0, json!({"max-length": 3})),
            policy("high", "^payments$", 5, json!({"message-ttl": 604_800_000})),
            policy("other", "^orders$", 9, json!({"max-length": 1})),
        ];
        assert!(risks(&q, DAY).is_empty());
        q.policies[1].apply_to = "quorum_queues".into();
        assert_eq!(
            settings(&risks(&q, DAY)),
            ["max-length=3 (policy \"low\") with overflow unset (drop-head)"]
        );
    }

    #[test]
    fn short_ttls_and_expiry_are_risks_and_long_ones_are_not() {
        let q = queue(json!({"x-message-ttl": 60_000, "x-expires": 3_600_000}));
        let found = risks(&q, DAY);
        assert_eq!(
            settings(&found),
            [
                "message-ttl=60s (argument) under min_retention 86400s",
                "expires=3600s (argument) under min_retention 86400s"
            ]
        );
        assert!(found[0].effect.contains("discards"));
        let dlx = queue(json!({"x-message-ttl": 60_000, "x-dead-letter-exchange": "late"}));
        assert!(risks(&dlx, DAY)[0].effect.contains("\"late\""));
        let long = queue(json!({"x-message-ttl": 172_800_000, "x-expires": 172_800_000}));
        assert!(risks(&long, DAY).is_empty());
        assert!(risks(&q, Duration::from_secs(30)).is_empty());
    }

    #[test]
    fn a_low_delivery_limit_is_a_risk() {
        let mut q = queue(json!({"x-queue-type": "quorum"}));
        q.kind = "quorum".into();
        q.effective = object(json!({"delivery-limit": 3}));
        assert_eq!(
            settings(&risks(&q, DAY)),
            ["delivery-limit=3 (effective policy) not above idemq's default max_attempts 5"]
        );
        q.effective = object(json!({"delivery-limit": 20}));
        assert!(risks(&q, DAY).is_empty());
    }
}
