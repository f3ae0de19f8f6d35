//! What `idemq doctor` asks of a broker without consuming from it: the
//! settings that can drop an unprocessed message ([`LossRisk`]s, the same
//! checks a source makes when it connects) and the **redelivery horizon**,
//! how long after publication the broker can still deliver a message
//! again. A duplicate can arrive as long as that, so inbox rows must be
//! kept at least as long: pruning them sooner lets a late duplicate
//! through.
//!
//! ```
//! use std::time::Duration;
//! use idemq::source::health::Horizon;
//!
//! let kafka = Horizon::Bounded {
//!     limit: Duration::from_secs(7 * 86_400),
//!     setting: "topic payments retention.ms=604800000".into(),
//! };
//! assert!(kafka.outlived_by(Duration::from_secs(8 * 86_400)));
//! assert!(!kafka.outlived_by(Duration::from_secs(86_400)));
//! assert_eq!(kafka.to_string(), "7d (topic payments retention.ms=604800000)");
//! ```

use std::fmt;
use std::time::Duration;

use futures_util::future::BoxFuture;

use super::loss::LossRisk;
use crate::error::SourceError;

/// How long after publication a broker can still deliver a message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Horizon {
    /// The broker deletes messages older than `limit`, delivered or not
    /// (Kafka `retention.ms`, SQS `MessageRetentionPeriod`, NATS `max_age`,
    /// RabbitMQ `message-ttl`): no copy arrives later than that.
    Bounded {
        /// The age past which no copy is delivered.
        limit: Duration,
        /// Where that comes from (`topic payments retention.ms=604800000`).
        setting: String,
    },
    /// The broker keeps a message until it is acknowledged (or trimmed by
    /// count): a message processed and not acknowledged comes back whenever
    /// a consumer next runs, however late.
    Unbounded {
        /// Why (`queue payments has no message-ttl`).
        why: String,
    },
    /// Not read from the broker.
    Unknown {
        /// Why, and the usual default.
        why: String,
    },
}

impl Horizon {
    /// Whether inbox rows kept for `keep` outlive every copy the broker can
    /// still deliver (only a bounded horizon can be outlived).
    pub fn outlived_by(&self, keep: Duration) -> bool {
        matches!(self, Self::Bounded { limit, .. } if keep >= *limit)
    }
}

impl fmt::Display for Horizon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bounded { limit, setting } => {
                write!(f, "{} ({setting})", human(*limit))
            }
            Self::Unbounded { why } => write!(f, "unbounded ({why})"),
            Self::Unknown { why } => write!(f, "unknown ({why})"),
        }
    }
}

/// `7d`, `36h`, `90m`, `45s`, `1500ms`: the largest unit that divides it.
pub fn human(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// What a broker says of one source URL: its loss risks and horizon.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BrokerHealth {
    /// Settings that can drop an unprocessed message.
    pub risks: Vec<LossRisk>,
    /// How long the broker can still deliver a message.
    pub horizon: Horizon,
    /// What could not be checked, and why (a describe the ACLs refused, an
    /// API that did not answer).
    pub unchecked: Vec<String>,
}

impl BrokerHealth {
    /// A report with `horizon`, no risk and nothing unchecked.
    pub fn new(horizon: Horizon) -> Self {
        Self {
            risks: Vec::new(),
            horizon,
            unchecked: Vec::new(),
        }
    }

    /// Adds risks.
    pub fn with_risks(mut self, risks: Vec<LossRisk>) -> Self {
        self.risks.extend(risks);
        self
    }

    /// Adds what could not be checked.
    pub fn with_unchecked(mut self, what: impl Into<String>) -> Self {
        self.unchecked.push(what.into());
        self
    }
}

/// Reads a URL's [`BrokerHealth`] (connects, reads, consumes nothing and
/// creates nothing).
pub type Inspect = for<'a> fn(&'a str) -> BoxFuture<'a, Result<BrokerHealth, SourceError>>;
