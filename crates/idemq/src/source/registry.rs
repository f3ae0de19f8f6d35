//! One table of the brokers idemq speaks, which the CLI, the chaos runner
//! and the benchmarks read: a URL's scheme finds its [`Broker`], which says
//! how to open it as a [`Source`] or a [`Publisher`], which key identifies
//! its messages by default, and what it can do.
//!
//! Adding a broker is its folder under `source/` (which defines a
//! `pub const BROKER: Broker`) and one line in [`REGISTRY`]; see
//! `docs/extending.md`.
//!
//! ```
//! use idemq::source::registry;
//!
//! let found = registry::lookup("kafka://localhost:9092/orders?group=billing");
//! # #[cfg(feature = "kafka")]
//! assert_eq!(found.map(|b| b.map(|b| b.id)), Ok(Some("kafka")));
//! // A path is a JSON-lines file, no broker.
//! assert_eq!(registry::lookup("orders.jsonl").map(|b| b.is_some()), Ok(false));
//! assert!(registry::lookup("ftp://example.com/x").is_err());
//! ```

use futures_util::future::BoxFuture;

use super::health::Inspect;
use super::{Publisher, Source};
use crate::error::SourceError;
use crate::key::KeySpec;

/// Opens a URL as a source.
pub type OpenSource = for<'a> fn(&'a str) -> BoxFuture<'a, Result<Box<dyn Source>, SourceError>>;

/// Opens a URL as a publisher.
pub type OpenPublisher =
    for<'a> fn(&'a str) -> BoxFuture<'a, Result<Box<dyn Publisher>, SourceError>>;

/// Deletes what opening a URL created.
pub type Remove = for<'a> fn(&'a str) -> BoxFuture<'a, Result<(), SourceError>>;

/// What idemq knows of one broker it was built with.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct Broker {
    /// A short lowercase name (`kafka`): metrics, chaos tables, file names.
    pub id: &'static str,
    /// The product's name (`Apache Kafka`), for messages.
    pub name: &'static str,
    /// The URL schemes it answers to (`kafka`); the first is the canonical one.
    pub schemes: &'static [&'static str],
    /// Whether offset-watermark mode can consume it: a partitioned log whose
    /// records carry (topic, partition, offset).
    pub watermarks: bool,
    /// Whether a message published before any consumer subscribed is lost
    /// (MQTT: a broker keeps messages only for subscriptions that exist),
    /// so that consumers must subscribe before the first publish.
    pub subscribe_before_publish: bool,
    /// The key that identifies a message when the user names none.
    pub default_key: fn() -> KeySpec,
    /// Parses a URL without connecting (a usage error early, before any I/O).
    pub check: fn(&str) -> Result<(), SourceError>,
    /// The URL of the `n`-th of several consumers competing for the
    /// messages of one URL (MQTT needs a client id and Redis Streams a
    /// consumer name of each one's own; most brokers take the URL as is).
    pub competing_url: fn(&str, usize) -> String,
    /// Opens a URL as a source (connects).
    pub open_source: OpenSource,
    /// Opens a URL as a publisher for `idemq produce` and the relay
    /// (connects; parameters only a consumer needs may be left out).
    pub open_publisher: OpenPublisher,
    /// Deletes what opening a URL created on the broker (a queue, a stream,
    /// a topic) with its messages: tests and benchmarks clean up with it.
    /// Brokers whose objects expire on their own (MQTT sessions) or that
    /// need an operator to delete them (RocketMQ topics) do nothing.
    pub remove: Remove,
    /// Reads what the broker says of a URL without consuming: the settings
    /// that can drop unprocessed messages and how long it can still deliver
    /// one (`idemq doctor`; [`super::health`]).
    pub inspect: Inspect,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("id", &self.id)
            .field("schemes", &self.schemes)
            .field("watermarks", &self.watermarks)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Broker {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

impl Eq for Broker {}

/// The default key of most brokers: the transport key, else the message id.
pub fn transport_key_or_id() -> KeySpec {
    KeySpec::transport_key().or(KeySpec::id())
}

/// [`Broker::competing_url`] of brokers whose consumers share one URL.
pub fn same_url(url: &str, _n: usize) -> String {
    url.to_owned()
}

/// One row of [`REGISTRY`]: a broker idemq knows, compiled in or not.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// The URL schemes.
    pub schemes: &'static [&'static str],
    /// The product's name.
    pub name: &'static str,
    /// The cargo feature that compiles it in.
    pub feature: &'static str,
    /// The broker, if this build has its feature.
    pub broker: Option<&'static Broker>,
}

/// One registration: `feature, module, name, [schemes]`. The module is
/// `source::<module>`, which defines `pub const BROKER: Broker` when the
/// feature is on.
macro_rules! entry {
    ($feature:literal, $module:ident, $name:literal, [$($scheme:literal),+]) => {
        Entry {
            schemes: &[$($scheme),+],
            name: $name,
            feature: $feature,
            broker: {
                #[cfg(feature = $feature)]
                {
                    Some(&super::$module::BROKER)
                }
                #[cfg(not(feature = $feature))]
                {
                    None
                }
            },
        }
    };
}

/// Every broker idemq knows, in the order help texts list them.
pub const REGISTRY: &[Entry] = &[
    entry!("kafka", kafka, "Apache Kafka", ["kafka"]),
    entry!("amqp", amqp, "RabbitMQ", ["amqp", "amqps"]),
    entry!("sqs", sqs, "Amazon SQS", ["sqs"]),
    entry!("nats", nats, "NATS JetStream", ["nats"]),
    entry!(
        "redis-streams",
        redis_stream,
        "Redis Streams",
        ["redis-stream"]
    ),
    entry!("mqtt", mqtt, "MQTT", ["mqtt", "mqtts"]),
    entry!("rocketmq", rocketmq, "Apache RocketMQ", ["rocketmq"]),
];

/// The brokers this build has.
pub fn brokers() -> impl Iterator<Item = &'static Broker> {
    REGISTRY.iter().filter_map(|entry| entry.broker)
}

/// Why a URL names no broker of this build.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// A broker idemq knows, left out of this build.
    #[error("this idemq was built without {name} support (cargo feature `{feature}`)")]
    CompiledOut {
        /// The broker.
        name: &'static str,
        /// Its cargo feature.
        feature: &'static str,
    },
    /// No broker answers to the scheme.
    #[error("unknown scheme {scheme:?}: expected a file path, `-`, {expected}")]
    UnknownScheme {
        /// The scheme as written.
        scheme: String,
        /// The schemes there are.
        expected: String,
    },
}

/// The broker of `url`'s scheme: `Ok(None)` for what is not a URL (a file
/// path) and for `file://`, an error for a scheme no broker of this build
/// answers to.
pub fn lookup(url: &str) -> Result<Option<&'static Broker>, LookupError> {
    let Some((scheme, _)) = url.split_once("://") else {
        return Ok(None);
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme == "file" {
        return Ok(None);
    }
    let entry = REGISTRY
        .iter()
        .find(|entry| entry.schemes.contains(&scheme.as_str()))
        .ok_or_else(|| LookupError::UnknownScheme {
            scheme: scheme.clone(),
            expected: REGISTRY
                .iter()
                .map(|entry| format!("{}://", entry.schemes[0]))
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    entry.broker.map(Some).ok_or(LookupError::CompiledOut {
        name: entry.name,
        feature: entry.feature,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_belongs_to_one_broker() {
        let mut seen = std::collections::HashSet::new();
        for entry in REGISTRY {
            assert!(!entry.schemes.is_empty(), "{}", entry.name);
            for scheme in entry.schemes {
                assert!(seen.insert(*scheme), "scheme {scheme} registered twice");
                assert_eq!(*scheme, scheme.to_ascii_lowercase());
            }
            if let Some(broker) = entry.broker {
                assert_eq!(broker.schemes, entry.schemes, "{}", entry.name);
            }
        }
    }

    #[test]
    fn files_are_no_broker_and_unknown_schemes_are_errors() {
        assert_eq!(lookup("in.jsonl"), Ok(None));
        assert_eq!(lookup("file:///tmp/in.jsonl"), Ok(None));
        let err = lookup("ftp://x/y").unwrap_err();
        assert!(err.to_string().contains("kafka://"), "{err}");
    }

    #[test]
    fn schemes_are_case_insensitive() {
        for entry in REGISTRY {
            let url = format!("{}://h/x", entry.schemes[0].to_ascii_uppercase());
            match (lookup(&url), entry.broker) {
                (Ok(Some(found)), Some(broker)) => assert_eq!(found, broker),
                (Err(LookupError::CompiledOut { feature, .. }), None) => {
                    assert_eq!(feature, entry.feature)
                }
                (other, _) => panic!("{url}: {other:?}"),
            }
        }
    }
}
